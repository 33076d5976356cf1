"""`vlrl.safe_yaml`: every config file and override value is bounded while it is composed — aliases, recursion,
depth, duplicate keys, tags — with one line naming the source and the place (issue 38, finding 8)."""

import resource
import time

import pytest
from typer.testing import CliRunner

from vlrl.cli import app
from vlrl.safe_yaml import MAX_BYTES, YamlRefused, load, load_file


def laughs(levels: int, indent: str = "") -> str:
    """A "billion laughs": level k repeats level k − 1 ten times (10^levels values, a few hundred bytes)."""
    lines = [f"{indent}l0: &l0 [{', '.join(['lol'] * 10)}]"]
    lines += [f"{indent}l{k}: &l{k} [{', '.join([f'*l{k - 1}'] * 10)}]" for k in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


def test_plain_yaml_with_anchors_and_merges_loads():
    text = "base: &b {x: 1, y: 2}\nc:\n  <<: *b\n  y: 3\nd: [*b, *b]\ne: '!!not a tag'\n"
    assert load(text, "c.yaml") == {"base": {"x": 1, "y": 2}, "c": {"x": 1, "y": 3}, "d": [{"x": 1, "y": 2}] * 2,
                                    "e": "!!not a tag"}
    assert load(laughs(3), "c.yaml")["l3"][9][9][9][9] == "lol"  # 11,111 values: well within the bound


@pytest.mark.parametrize(("text", "message"), [
    (laughs(9), "c.yaml: line 5, column 5: expands to more than 100,000 values"),
    ("a: &a [1, *a]\n", "c.yaml: line 1, column 11: recursive anchor: the alias *a is inside the node &a"),
    ("a: &a {b: {c: *a}}\n", "c.yaml: line 1, column 15: recursive anchor"),
    ("x: " + "[" * 50_000 + "]" * 50_000 + "\n", "c.yaml: line 1, column 67: nested more than 64 levels deep"),
    ("optim: {lr: 1}\ntrain: {}\noptim: {lr: 2}\n", "c.yaml: line 3, column 1: duplicate key 'optim' (first at line 1"),
    ("model: {path: !!binary aGVsbG8=}\n", "c.yaml: line 1, column 15: the tag !!binary is refused"),
    ("a: !!python/object/apply:os.system [ls]\n", "the tag !!python/object/apply:os.system is refused"),
    ("a: !!str 1\n", "the tag !!str is refused"),
    ("a: !custom 1\n", "the tag !custom is refused"),
    ("a: [1,\n", "c.yaml: invalid YAML: expected the node content, but found '<stream end>' at line 2, column 1, "
                 "while parsing a flow node"),
])
def test_refused_documents_are_one_line_naming_the_place(text, message):
    start = time.perf_counter()
    with pytest.raises(YamlRefused) as err:
        load(text, "c.yaml")
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)
    assert time.perf_counter() - start < 5


def test_a_file_over_the_size_bound_is_refused_before_it_is_read(tmp_path):
    big = tmp_path / "big.yaml"
    with open(big, "wb") as f:
        f.truncate(MAX_BYTES + 1)  # sparse: nothing is written, the size alone refuses it
    with pytest.raises(YamlRefused, match=r"big.yaml: 8,388,609 bytes, more than a config may hold"):
        load_file(big)


CASES = {
    "laughs": ("data:\n  suite_options:\n" + laughs(6, "    "), "line 7, column 9: expands to more than 100,000 values"),
    "recursive": ("data:\n  suite_options: &o {again: *o}\n", "line 2, column 29: recursive anchor"),
    "deep": ("data:\n  suite_options: {x: " + "[" * 50_000 + "]" * 50_000 + "}\n", "nested more than 64 levels deep"),
    "duplicate": ("optim: {lr: 0.1}\noptim: {lr: 0.2}\n", "line 2, column 1: duplicate key 'optim'"),
    "binary": ("model: {path: !!binary aGVsbG8=}\n", "line 1, column 15: the tag !!binary is refused"),
    # issue 47: a 1 MB string repeated by 200 aliases is ~200 nodes, and a 200 MB config.yaml once dumped
    "wide": ("data:\n  suite_options:\n    pad: &s " + "x" * (1 << 20) + "\n    more: [" + ", ".join(["*s"] * 200)
             + "]\n", "line 4, column 11: expands to more than 16,777,216 bytes of values (aliases counted as the "
             "text they repeat)"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_cli_refuses_each_with_one_line_and_exit_2(case, tmp_path):
    """Issue 38, finding 8, through `vlrl rl --config`: a billion laughs under data.suite_options (5.76 GB before),
    a recursive anchor and 50,000-deep nesting (raw tracebacks before), a duplicate key (silently taken) and a
    !!binary model path (taken as a hub id) — and (issue 47) a long string repeated by aliases, bounded in bytes
    (counted in nodes before) — each ends with exit 2 and one line naming the file, at once and without memory
    growth. (model.path names nothing: a config that loaded would stop at the preflight, exit 1.)"""
    text, message = CASES[case]
    config = tmp_path / "hostile.yaml"
    config.write_text(text)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = CliRunner().invoke(app, ["rl", "--config", str(config), f"out={tmp_path / 'run'}",
                                      "model.path=/nonexistent/model"])
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines() == [f"{config}: {result.output.strip().split(': ', 1)[1]}"]
    assert message in result.output, result.output
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200_000  # KiB: no expansion happened
    assert not (tmp_path / "run").exists()


def test_an_override_value_is_bounded_too(tmp_path):
    result = CliRunner().invoke(app, ["rl", f"out={tmp_path / 'run'}", "data.suite_options={a: &a [1, *a]}"])
    assert result.exit_code == 2
    assert result.output.strip() == ("override 'data.suite_options={a: &a [1, *a]}': the value is not valid YAML "
                                     "(line 1, column 12: recursive anchor: the alias *a is inside the node &a it "
                                     "repeats)")
