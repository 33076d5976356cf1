"""The layouts users bring (`vlrl.data.schemas`, `vlrl.data.sources`): EasyR1, verl and TRL datasets built as those
projects write them (tests/data/foreign.py says which of their files each follows), read through HF `datasets`."""

from __future__ import annotations

import json
import pickle
import re
import sys
from pathlib import Path

import pytest
from PIL import Image, ImageFile

from vlrl.data import DataError, read_samples
from vlrl.data.sample import load_image
from vlrl.data.schemas import Schema, detect_format
from vlrl.data.sources import ArrowImage

sys.path.insert(0, str(Path(__file__).parent))
import foreign  # noqa: E402

pytest.importorskip("datasets")


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    return foreign.write_all(tmp_path_factory.mktemp("foreign"))


# ----------------------------------------------------------------------------------------------- detection
@pytest.mark.parametrize(("source", "expected"), [("easyr1", "easyr1"), ("verl", "verl"), ("trl", "trl"),
                                                  ("trl_sft", "trl")])
def test_auto_detects_each_layout(fixtures, source, expected):
    """``data.format: auto`` names the layout of each fixture (a misdetection — verl read as TRL, EasyR1 as verl —
    fails here) and says why."""
    path = fixtures[source] if source == "easyr1" else fixtures[source] / f"test.{'arrow' if source == 'trl' else 'parquet'}"
    report = read_samples(path)
    assert {fmt for _, fmt, _ in report.formats} == {expected}
    assert all(why.startswith("auto:") for _, _, why in report.formats)
    assert f"({expected} layout)" in report.summary()


def test_detection_refuses_an_unknown_layout_and_names_the_columns():
    with pytest.raises(ValueError, match=r"cannot tell the layout .*\[label, question\].*data.format"):
        detect_format(["question", "label"], Schema())
    assert detect_format(["question", "label"], Schema(columns={"prompt": "question", "answer": "label"}))[0] == "columns"
    assert detect_format(["problem", "answer"], Schema(format="trl")) == ("trl", "data.format")


# ----------------------------------------------------------------------------------------------- each layout
def test_easyr1_rows(fixtures):
    """geometry3k as EasyR1 reads it: ``<image>`` in ``problem`` becomes the image part where it stands, ``answer`` the
    ground truth, the images stay in the memory-mapped table (`ArrowImage`) and decode to the photographs."""
    report = read_samples(fixtures["easyr1"])  # the DatasetDict's "train" split (data.split)
    assert len(report.samples) == 8
    s = report.samples[0]
    assert s.id == "easyr1-train-0" and s.task == "easyr1" and s.answer == "7" and s.reward == "math"
    assert s.messages == [{"role": "user", "content": [{"type": "image"}, {"type": "text",
                           "text": "Find x in the figure 0. Use the measures shown."}]}]
    assert isinstance(s.images[0], ArrowImage)
    assert load_image(s.images[0]).size == foreign.images(1)[0].size  # skimage's astronaut, thumbnailed
    test = read_samples(str(fixtures["easyr1"]) + "@test").samples
    assert [t.id for t in test] == ["easyr1-test-0", "easyr1-test-1"]
    assert "figure 8" in test[0].prompt_text()


def test_verl_rows(fixtures):
    """geo3k.py's output: the chat prompt's ``<image>`` split into parts, ``reward_model.ground_truth`` the answer,
    ``data_source`` the task and the verifier's key, ``ability`` and ``extra_info`` the verifier's metadata."""
    s = read_samples(fixtures["verl"] / "train.parquet").samples[1]
    assert s.id == "verl-train-1" and s.task == "hiyouga/geometry3k" and s.answer == "7" and s.reward == "math"
    user = s.messages[0]["content"]
    assert user[0] == {"type": "image"} and user[1]["text"].endswith(r"MUST BE put in \boxed{}.")
    assert s.metadata["ability"] == "math"
    assert s.metadata["extra_info"] == {"split": "train", "index": 1, "answer": "7",
                                        "question": "<image>Find x in the figure 1. Use the measures shown."}
    assert "data_source" not in s.metadata and "reward_model" not in s.metadata  # consumed as task and answer
    by_source = read_samples(fixtures["verl"] / "train.parquet",
                             schema=Schema(reward_by_source={"hiyouga/geometry3k": {"math": 0.9, "format": 0.1}}))
    assert by_source.samples[0].reward == {"math": 0.9, "format": 0.1}


def test_trl_rows(fixtures):
    """multimodal-open-r1 after grpo_vlm.py: the system turn kept, the single ``image`` put before the user's text
    (TRL's prepare_multimodal_messages), the answer read out of ``<answer>…</answer>``, every other column metadata."""
    s = read_samples(fixtures["trl"] / "train.arrow").samples[2]
    assert [m["role"] for m in s.messages] == ["system", "user"]
    assert s.messages[1]["content"] == [{"type": "image"}, {"type": "text", "text": "What is the value of x in picture 2?"}]
    assert s.answer == "7" and s.reward == "math" and s.response is None and len(s.images) == 1
    assert s.metadata == {"problem": "What is the value of x in picture 2?", "original_question": "picture 2: solve for x",
                          "original_answer": "7"}
    sft = read_samples(fixtures["trl_sft"] / "train.parquet").samples[0]
    assert sft.response == r"\boxed{7}"  # the conversational completion: SFT's reference


# ----------------------------------------------------------------------------------------------- settings
def test_prompt_template_has_easyr1_format_prompt_semantics(fixtures, tmp_path):
    """EasyR1 renders ``Template(format_prompt.strip()).render(content=problem)``; here the other columns are
    variables too, and the image marker keeps its place."""
    template = "{{ content | trim }} Answer for figure {{ answer }} in \\boxed{}.\n"
    s = read_samples(fixtures["easyr1"], schema=Schema(prompt_template=template, system_prompt="Be brief.")).samples[0]
    assert s.messages[0] == {"role": "system", "content": "Be brief."}
    assert s.messages[1]["content"] == [{"type": "image"}, {"type": "text", "text": "Find x in the figure 0. Use the "
                                        "measures shown. Answer for figure 7 in \\boxed{}."}]
    with pytest.raises(DataError, match=r"easyr1\[train\]:row 0: data.prompt_template: 'nope' is undefined"):
        read_samples(fixtures["easyr1"], schema=Schema(prompt_template="{{ nope }} {{ content }}"))
    with pytest.raises(ValueError, match="data.prompt_template: line 1"):
        Schema(prompt_template="{{ content ")


def test_columns_map_any_layout_and_a_row_reward_wins(tmp_path):
    """``data.columns`` names the columns of a dataset in no known layout; ``data.reward`` is the default verifier and
    a row's own ``reward`` column wins over it."""
    image = foreign.images(1)[0]
    image.save(tmp_path / "a.png")
    rows = [{"question": "<image>How many?", "label": "3", "picture": ["a.png"], "source": "mine"},
            {"question": "<image>How many?", "label": "4", "picture": ["a.png"], "source": "mine", "reward": "number"}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    schema = Schema(columns={"prompt": "question", "answer": "label", "images": "picture", "task": "source"},
                    reward="math")
    first, second = read_samples(tmp_path / "d.jsonl", schema=schema).samples
    assert first.task == "mine" and first.answer == "3" and first.reward == "math"
    assert first.images == [str(tmp_path / "a.png")] and first.messages[0]["content"][0] == {"type": "image"}
    assert second.reward == "number" and "reward" not in second.metadata
    with pytest.raises(DataError, match=r"d\.jsonl:1: data\.columns\.answer: no column 'solution'"):
        read_samples(tmp_path / "d.jsonl", schema=Schema(columns={**schema.columns, "answer": "solution"}))


def test_vlrl_records_take_the_default_verifier(tmp_path):
    """vlrl's own jsonl without a ``reward``: ``data.reward`` fills it (before: refused); with one, the row's wins."""
    lines = [{"id": "a", "task": "t", "prompt": "2+2?", "answer": "4"},
             {"id": "b", "task": "t", "prompt": "2+3?", "answer": "5", "reward": "math"}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    with pytest.raises(DataError, match="field 'reward'"):
        read_samples(tmp_path / "d.jsonl")
    samples = read_samples(tmp_path / "d.jsonl", schema=Schema(reward="number")).samples
    assert [s.reward for s in samples] == ["number", "math"]


# ----------------------------------------------------------------------------------------------- errors
def test_bad_rows_of_each_layout_name_source_and_row(fixtures, tmp_path):
    """A broken image, a missing answer, a wrong image count: each layout's bad rows come back as
    ``source:row N: reason`` (parquet / arrow) with the good rows read."""
    import datasets

    bad_easyr1 = foreign.geometry3k(3)
    bad_easyr1 = bad_easyr1.cast_column("images", datasets.List(datasets.Image(decode=False)))
    rows = bad_easyr1.to_list()
    rows[1]["images"] = [{"bytes": b"not an image", "path": None}]
    rows[2]["problem"] = "<image><image>Two markers, one image."
    datasets.Dataset.from_list(rows, features=bad_easyr1.features).to_parquet(str(tmp_path / "easyr1.parquet"))
    report = read_samples(tmp_path / "easyr1.parquet", on_error="skip")
    assert [s.id for s in report.samples] == ["easyr1-0"]
    assert report.skipped[0][0] == f"{tmp_path / 'easyr1.parquet'}:row 1" and "images[0]" in report.skipped[0][1] \
        and "cannot decode image" in report.skipped[0][1]
    assert report.skipped[1][0].endswith(":row 2") and "2 image placeholder(s)" in report.skipped[1][1]

    verl = foreign.verl_geo3k(foreign.geometry3k(2), "train").to_list()
    verl[0]["reward_model"] = {"style": "rule"}  # no ground_truth
    datasets.Dataset.from_list(verl).to_parquet(str(tmp_path / "verl.parquet"))
    report = read_samples(tmp_path / "verl.parquet", on_error="skip")
    assert report.skipped == [(f"{tmp_path / 'verl.parquet'}:row 0",  # (Arrow gave the struct ground_truth: None)
                               "column 'reward_model.ground_truth': empty (the verifier needs the ground truth)")]

    rows = foreign.open_r1(2).cast_column("image", datasets.Image(decode=False)).to_list()
    rows[1]["image"] = {"bytes": None, "path": str(tmp_path / "missing.png")}
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "trl_saved"))
    report = read_samples(tmp_path / "trl_saved", on_error="skip")
    assert report.skipped[0][0] == f"{tmp_path / 'trl_saved'}:row 1" and "not found" in report.skipped[0][1]


# ----------------------------------------------------------------------------------------------- sources
def test_reading_decodes_no_image(fixtures, monkeypatch):
    """Large datasets: the reader checks each image from its header (nothing decoded); a sample's image is decoded
    when it is encoded."""
    decoded = []
    real = ImageFile.ImageFile.load
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: (decoded.append(1), real(self))[1])
    samples = read_samples(fixtures["verl"] / "train.parquet").samples
    assert decoded == [] and len(samples) == 8
    load_image(samples[0].images[0])
    assert decoded


def test_a_lazy_image_pickles_as_its_bytes(fixtures):
    """Sent to another process (packing workers, a rank), a row's image travels as its encoded bytes."""
    image = read_samples(fixtures["trl"] / "train.arrow").samples[0].images[0]
    back = pickle.loads(pickle.dumps(image))
    assert isinstance(back, bytes) and Image.open(__import__("io").BytesIO(back)).size == load_image(image).size


def test_globs_and_folders(fixtures):
    both = read_samples(str(fixtures["verl"] / "*.parquet")).samples
    assert sorted(s.id for s in both)[:2] == ["verl-test-0", "verl-test-1"] and len(both) == 10
    assert len(read_samples(fixtures["trl"]).samples) == 10  # a folder of .arrow files


def test_a_hub_id_goes_to_load_dataset_with_split_subset_and_revision(fixtures, monkeypatch):
    """No hub is reachable here: ``datasets.load_dataset`` is replaced by a recorder returning the local EasyR1
    fixture, to show the call a hub id makes (split from ``@test`` over data.split, name = data.subset, revision)."""
    import datasets

    calls = []
    local = datasets.load_from_disk(str(fixtures["easyr1"]))

    def load_dataset(path, name=None, split=None, revision=None, **kwargs):
        calls.append((path, name, split, revision, kwargs))
        return local[split]

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    report = read_samples("hiyouga/geometry3k@test", schema=Schema(split="train", subset="default", revision="v1.0"))
    assert calls == [("hiyouga/geometry3k", "default", "test", "v1.0", {})]
    assert [s.id for s in report.samples] == ["geometry3k-test-0", "geometry3k-test-1"]
    assert report.formats[0][0] == "hiyouga/geometry3k[test]" and report.samples[0].task == "geometry3k"


def test_config_paths_keep_hub_ids_and_resolve_local_data(tmp_path):
    """In a config file, ``data.train`` relative to the file when it is local (a file, a folder, a glob, with an
    ``@split``), left as written when it is a hub id."""
    from vlrl.config import RLConfig, load_config

    (tmp_path / "saved").mkdir()
    config = tmp_path / "c.yaml"
    config.write_text("data: {train: hiyouga/geometry3k@train, test: saved@test, packing_plan: null}\n")
    cfg = load_config(RLConfig, config)
    assert cfg.data.train == "hiyouga/geometry3k@train" and cfg.data.test == f"{tmp_path / 'saved'}@test"
    config.write_text("data: {train: 'shards/*.parquet', test: test.jsonl}\n")
    cfg = load_config(RLConfig, config)
    assert cfg.data.train == str(tmp_path / "shards" / "*.parquet") and cfg.data.test == str(tmp_path / "test.jsonl")


def test_a_json_array_and_a_template_file(tmp_path):
    """A ``.json`` file holding one array (rows named ``file:row N``), TRL's layout with image paths beside it, and
    ``data.prompt_template`` given as a ``.jinja`` file (EasyR1's format_prompt is a file path)."""
    from vlrl.config import DataConfig
    from vlrl.data.splits import schema_for

    foreign.images(1)[0].save(tmp_path / "cat.jpg")
    rows = [{"image": "cat.jpg", "problem": "What animal?", "solution": "$cat$"}, {"image": "cat.jpg", "problem": 3}]
    (tmp_path / "d.json").write_text(json.dumps(rows))
    (tmp_path / "fmt.jinja").write_text("{{ content }} Answer in \\boxed{}.\n")
    schema = schema_for(DataConfig(prompt_template=str(tmp_path / "fmt.jinja"), reward="string_match"))
    report = read_samples(tmp_path / "d.json", schema=schema, on_error="skip")
    (sample,) = report.samples
    assert sample.id == "d-0" and sample.images == [str(tmp_path / "cat.jpg")] and sample.reward == "string_match"
    assert sample.messages[0]["content"] == [{"type": "image"}, {"type": "text", "text": "What animal? Answer in \\boxed{}."}]
    assert report.skipped[0][0] == f"{tmp_path / 'd.json'}:row 1" and "solution" in report.skipped[0][1]


def test_a_mistyped_local_path_is_an_error_not_a_hub_lookup(tmp_path, monkeypatch):
    """Issue 47: ``mydata/train`` (meaning mydata/train.jsonl) was looked up on the Hub. A path whose first part is
    a folder here is local: it names nothing, and the error says so, with the files it may have meant — through a
    config file too (resolved against the config's folder)."""
    import datasets
    from typer.testing import CliRunner

    from vlrl.cli import app

    def no_hub(*args, **kwargs):
        raise AssertionError(f"looked up on the hub: {args}")

    monkeypatch.setattr(datasets, "load_dataset", no_hub)
    (tmp_path / "mydata").mkdir()
    (tmp_path / "mydata" / "train.jsonl").write_text('{"id": "a", "prompt": "hi", "answer": "1", "reward": "number"}\n')
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError, match=r"^mydata/train: no such file or directory \(in mydata: train.jsonl\)$"):
        read_samples("mydata/train")
    config = tmp_path / "rl.yaml"
    config.write_text("model: {path: tiny-qwen2}\ndata: {train: mydata/train, test: mydata/train}\n"
                      "check: {samples_per_task: 1}\n")
    monkeypatch.chdir(tmp_path.parent)
    result = CliRunner().invoke(app, ["check", str(config), "--recipe", "rl"])
    problems = [line for line in result.output.splitlines() if line.startswith("  ✗")]
    assert result.exit_code == 1 and len(problems) == 2 and all(
        re.fullmatch(rf"  ✗ data.{split}: \S*{tmp_path.name}/mydata/train: no such file or directory \(in "
                     rf"\S*{tmp_path.name}/mydata: train.jsonl\)", line)
        for split, line in zip(("train", "test"), problems, strict=True)), result.output
