"""The documentation: the site under docs/ builds strictly (a broken link, a missing anchor, a page outside the
nav or a nav entry without a page fails), its reference tables are generated from the code, and the README and
ARCHITECTURE.md stay the short maps issue 37 asked for."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
README = ROOT / "README.md"


def _hooks():
    spec = importlib.util.spec_from_file_location("vlrl_docs_hooks", ROOT / "docs" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_site_builds_strictly(tmp_path):
    site = tmp_path / "site"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
           "NO_MKDOCS_2_WARNING": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    pages = {p.relative_to(ROOT / "docs").with_suffix("").as_posix() for p in (ROOT / "docs").rglob("*.md")}
    for page in pages:  # every page was written (mkdocs' directory URLs: guides/agents.md → guides/agents/)
        index = site / ("index.html" if page == "index" else f"{page.removesuffix('/index')}/index.html")
        assert index.is_file(), page
    config = (site / "reference" / "config" / "index.html").read_text()
    assert "generated:" not in config and "RolloutConfig" in config and "max_new_tokens" in config
    cli = (site / "reference" / "cli" / "index.html").read_text()
    assert "vlrl rl" in cli and "--config" in cli


def test_the_config_reference_is_every_field_of_config_py():
    """The page holds the generator's marker, not a hand-written table, and the generator writes every field of
    every section reachable from the three run configs, with its description."""
    from pydantic import BaseModel

    from vlrl.config import DemoConfig, RLConfig, SFTConfig

    page = (ROOT / "docs" / "reference" / "config.md").read_text()
    assert "<!-- generated: config -->" in page
    assert not re.search(r"^\| `(model|rollout|algo|train)\.", page, re.M), "a hand-written field table"
    text = _hooks().config_reference()
    seen: set[type] = set()

    def walk(cls: type) -> None:
        if cls in seen:
            return
        seen.add(cls)
        assert f"### {cls.__name__}" in text
        for name, field in cls.model_fields.items():
            assert f"| `{name}` |" in text, f"{cls.__name__}.{name}"
            description = " ".join((field.description or "").split()).replace("|", "\\|")
            assert description and description in text, f"{cls.__name__}.{name} has no description on the page"
            for arg in [field.annotation, *_args(field.annotation)]:
                if isinstance(arg, type) and issubclass(arg, BaseModel):
                    walk(arg)

    for root in (SFTConfig, RLConfig, DemoConfig):
        walk(root)
    assert len(seen) > 10


def _args(annotation):
    import typing

    out = []
    for arg in typing.get_args(annotation):
        out += [arg, *_args(arg)]
    return out


@pytest.mark.parametrize("name", ["config", "cli", "registries", "metrics", "presets", "rollout_moves", "gpu_plan",
                                  "memory_plan"])
def test_every_generator_is_used_by_a_page(name):
    pages = "".join(p.read_text() for p in (ROOT / "docs").rglob("*.md"))
    assert f"<!-- generated: {name} -->" in pages


def test_the_readme_is_short_opens_with_the_two_commands_and_its_links_resolve():
    text = README.read_text()
    assert len(text.splitlines()) <= 350
    first_block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    assert [line.split()[:2] for line in first_block.splitlines()] == [["make", "demo"], ["make", "test"]]
    assert text.index("```bash") < text.index("\n## "), "the two commands come before the first section"
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if not re.match(r"[a-z]+://", target):
            assert (ROOT / target).exists(), f"README links to a missing {target}"
    for section in ("verl", "AReaL", "slime", "TRL", "EasyR1"):
        assert f"| {section} |" in text or f" {section} |" in text


def test_architecture_is_short_and_names_existing_places():
    text = (ROOT / "ARCHITECTURE.md").read_text()
    assert len(text.splitlines()) <= 150
    for path in re.findall(r"`(src/vlrl/[A-Za-z0-9_/.]+|tests/[A-Za-z0-9_/.]+)`", text):
        assert (ROOT / path.rstrip("/")).exists(), f"ARCHITECTURE.md names a missing {path}"


# ------------------------------------------------------------------------------------------------ figures (issue 50)
# The generators whose output is figures computed from the code (the planner's); their tables are rendered at build
# time and must never be typed into a page.
FIGURE_GENERATORS = ("gpu_plan", "memory_plan")
_DECIMAL = re.compile(r"(?<![\w.])\d+\.\d+(?![\w.])")


def _rows(text: str) -> list[tuple[int, str]]:
    return [(k, line) for k, line in enumerate(text.splitlines(), 1) if line.startswith("|")]


def typed_generated_rows(generated: dict[str, str], pages: dict[str, str]) -> list[str]:
    """Table rows of the pages' sources that hold every figure of a generated row (3 or more decimals): a generated
    table typed by hand (``page:line (generator)``)."""
    from collections import Counter

    figures = [(name, Counter(_DECIMAL.findall(line))) for name, text in generated.items() for _, line in _rows(text)]
    figures = [(name, row) for name, row in figures if sum(row.values()) >= 3]
    found = []
    for page, text in pages.items():
        for k, line in _rows(text):
            numbers = Counter(_DECIMAL.findall(line))
            found += [f"{page}:{k} ({name})" for name, row in figures if not row - numbers]
    return found


def test_a_generated_figure_is_never_typed_by_hand():
    """The planner's tables (docs/gpu.md's, the memory guide's) are `<!-- generated: NAME -->` markers rendered at build
    time; a row of figures the generator writes, found typed in a page, fails — with the place and the marker to use.
    The check itself catches a pasted row (the memory guide's table as it was typed before issue 50)."""
    hooks = _hooks()
    hooks.on_startup("", False)
    generated = {name: hooks.GENERATORS[name]() for name in FIGURE_GENERATORS}
    pages = {str(p.relative_to(ROOT)): p.read_text() for p in [README, *(ROOT / "docs").rglob("*.md")]}
    for name in FIGURE_GENERATORS:
        assert any(f"<!-- generated: {name} -->" in text for text in pages.values()), name
    typed = typed_generated_rows(generated, pages)
    assert not typed, f"generated figures typed by hand (put the generator's marker line there instead): {typed}"
    pasted = {"docs/guides/memory.md": generated["memory_plan"].splitlines()[3]}  # one generated row, typed
    assert typed_generated_rows(generated, pasted) == ["docs/guides/memory.md:1 (memory_plan)"]


# The pages of measurements: every table of measured figures names, in its section, how it was measured.
MEASUREMENT_PAGES = ("docs/benchmarks/*.md", "docs/experiments/*.md", "docs/gpu.md")
_PROVENANCE = {
    "date": re.compile(r"\b20\d\d-\d\d-\d\d\b"),
    "machine": re.compile(r"AMD|Intel|EPYC|Xeon|H100|H200|vendor not recorded"),
    "commit": re.compile(r"\bcommits? `?[0-9a-f]{7,40}\b"),
    "command": re.compile(r"`(?:[A-Z_]+=\S+ )*(?:python3?|vlrl|bash|make) |the (?:`vlrl serve` and `vlrl rl` )?commands? "
                          r"(?:below|above)|the command of the section above"),
}


def _sections(text: str) -> list[tuple[str, str]]:
    """(heading, the text up to the next heading) of a markdown page, code blocks included."""
    out, heading, body, fenced = [], "", [], False
    for line in text.splitlines():
        fenced ^= line.startswith("```")
        if line.startswith("#") and not fenced:
            out.append((heading, "\n".join(body)))
            heading, body = line, []
        else:
            body.append(line)
    return [*out, (heading, "\n".join(body))]


def missing_provenance(page: str, text: str) -> list[str]:
    """Sections of a measurement page with a table of measured figures (3 or more decimals; a set-up table of the
    run's settings is not one) whose **Provenance:** line lacks a date, the machine, the commit or the command."""
    problems = []
    for heading, body in _sections(text):
        table = "\n".join(line for line in body.splitlines() if line.startswith("|"))
        if len(_DECIMAL.findall(table)) < 3 or re.search(r"set-?up|^#+ setting\b", heading, re.I):
            continue
        lines = [line for line in re.split(r"\n\s*\n", body) if "**Provenance" in line]
        if not lines:
            problems.append(f"{page} {heading or '(top)'}: no **Provenance:** line")
            continue
        lacking = [what for what, pattern in _PROVENANCE.items() if not any(pattern.search(" ".join(line.split()))
                                                                          for line in lines)]
        if lacking:
            problems.append(f"{page} {heading}: its provenance names no {', '.join(lacking)}")
    return problems


def test_every_measured_table_names_its_command_date_machine_and_commit():
    """Issue 50, item 3: each table of measured figures in docs/benchmarks, docs/experiments and docs/gpu.md says,
    in its section, the command that produced it, the date, the CPU or GPU, and the commit that recorded it (a commit
    this repository holds, where its history is there to ask)."""
    pages = sorted({p for pattern in MEASUREMENT_PAGES for p in ROOT.glob(pattern)})
    problems, commits = [], set()
    for path in pages:
        page = str(path.relative_to(ROOT))
        text = path.read_text()
        problems += missing_provenance(page, text)
        commits |= {c for line in text.splitlines() if "**Provenance" in line or "commit" in line
                    for c in re.findall(r"\bcommits? `?([0-9a-f]{7,40})\b", line)}
    assert not problems, problems
    assert missing_provenance("x.md", "## Results\n\n| a | b |\n| 1.5 | 2.5 |\n| 3.5 | 4.5 |\n") == \
        ["x.md ## Results: no **Provenance:** line"]
    history = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=ROOT, capture_output=True, text=True)
    if history.returncode == 0 and history.stdout.strip() == "false":  # a full clone: every named commit exists
        unknown = [c for c in sorted(commits) if subprocess.run(["git", "cat-file", "-e", f"{c}^{{commit}}"], cwd=ROOT,
                                                                 capture_output=True).returncode != 0]
        assert not unknown, f"commits the measurement pages name that this repository does not hold: {unknown}"
