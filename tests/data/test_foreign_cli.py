"""The datasets users bring, through the commands they type: `vlrl check`, `vlrl sft`, `vlrl rl` and `vlrl data import`
on EasyR1 (a `save_to_disk` DatasetDict), verl (geo3k.py's parquet files) and TRL (Arrow files; parquet for the
prompt-completion variant) datasets built from real images (tests/data/foreign.py).

The RL runs start from a checkpoint `vlrl sft` trained on the TRL prompt-completion data to answer "\\boxed{7}", the
answer of every row: a run scores reward 1 exactly where the verifier received the mapped answer column, so a layout
whose answer is missed (or read from the wrong column) trains with reward 0 everywhere and fails here."""

from __future__ import annotations

import json
import subprocess
import sys
import traceback
from pathlib import Path

import pytest

from cli_runner import invoke  # tests/ is on sys.path (the test packages' root)

sys.path.insert(0, str(Path(__file__).parent))
import foreign  # noqa: E402

pytest.importorskip("datasets")

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "src" / "vlrl" / "configs"
RL_TINY = ("train.steps=2", "train.prompts_per_step=2", "rollout.n=4", "eval.samples=1", "train.log_every=1",
           "report.html=false")


def cli(*args: str, ok: bool = True) -> subprocess.CompletedProcess:
    """``vlrl ARGS`` through the ``vlrl`` app in this process (typer's runner; stdout and stderr kept apart), at one
    torch thread, offline, from the repository: the imports of torch, transformers and vlrl (~5 CPU-s a process)
    paid once for the module instead of once per command."""
    result = invoke(*args)
    done = subprocess.CompletedProcess(["vlrl", *args], result.exit_code, result.stdout, result.stderr)
    if ok:
        trace = "".join(traceback.format_exception(result.exception)) if result.exit_code and result.exception else ""
        assert done.returncode == 0, f"vlrl {' '.join(args)} failed ({done.returncode}):\n{done.stderr[-4000:]}{trace}"
    return done


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return foreign.write_all(tmp_path_factory.mktemp("foreign"))


@pytest.fixture(scope="module")
def warm(tmp_path_factory, data, tiny_vlm_dir) -> Path:
    """``vlrl sft`` on TRL's prompt-completion layout (its ``completion`` column is the reference), validated every
    10 steps: the run the RL tests start from."""
    out = tmp_path_factory.mktemp("runs") / "sft"
    cli("sft", "--config", str(CONFIGS / "shapes_sft.yaml"), "--data", str(data["trl_sft"] / "train.parquet"),
        "--test", str(data["trl_sft"] / "test.parquet"), f"model.path={tiny_vlm_dir}", "train.steps=20",
        "train.batch_size=8", "train.micro_batch_size=8", "optim.lr=3e-3", "train.log_every=10", "eval.samples=2",
        "eval.every=10", "report.html=false", f"out={out}")
    return out


@pytest.mark.e2e
def test_sft_on_trl_prompt_completion_data_validates_on_the_users_split(warm):
    logged = records(warm)
    assert [r["step"] for r in logged if r["stage"] == "sft"] == [10, 20]
    validation = [r for r in logged if r["stage"] == "val/sft"]
    assert [r["step"] for r in validation] == [10, 20] and all(r["eval/prompts"] == 2 for r in validation)
    summary = json.loads((warm / "summary.json").read_text())["sft"]
    assert summary["n_prompts"] == 2 and summary["greedy"]["mean"] == 1.0  # it answers \boxed{7}, scored by math
    evaluated = {json.loads(line)["sample_id"] for line in (warm / "samples.jsonl").read_text().splitlines()}
    assert evaluated == {"trl_sft-test-0", "trl_sft-test-1"}  # the user's test split, not a procedural suite


@pytest.mark.e2e
@pytest.mark.parametrize(("layout", "train", "test"), [
    ("easyr1", "easyr1@train", "easyr1@test"),
    ("verl", "verl/train.parquet", "verl/test.parquet"),
    ("trl", "trl/train.arrow", "trl/test.arrow"),
])
def test_rl_on_each_layout_scores_the_mapped_answer(layout, train, test, data, warm, tmp_path):
    root = data["easyr1"].parent
    out = tmp_path / "run"
    done = cli("rl", "--config", str(CONFIGS / "shapes_grpo.yaml"), "--data", str(root / train), "--test",
               str(root / test), f"model.path={warm / 'checkpoints' / 'final'}", *RL_TINY, f"out={out}")
    assert f"{layout} layout (auto:" in " ".join(done.stderr.split())  # auto says what it chose (lines wrap)
    logged = records(out)
    rl = [r for r in logged if r["stage"] == "rl"]
    assert [r["step"] for r in rl] == [1, 2]
    assert max(r["reward/mean"] for r in rl) > 0  # the verifier got the answer column (every answer is 7)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rl"]["n_prompts"] == 2 and summary["rl"]["greedy"]["mean"] > 0
    evaluated = {json.loads(line)["sample_id"] for line in (out / "samples.jsonl").read_text().splitlines()
                 if json.loads(line)["stage"] == "eval/final"}
    assert evaluated and all("test" in sample_id for sample_id in evaluated)  # the user's held-out split


@pytest.mark.e2e
def test_check_lists_every_bad_row_of_every_layout(tmp_path):
    """`vlrl check` on a glob holding one bad file of each layout: each file's layout is detected on its own, and
    every bad row is listed as ``file:row N: reason``."""
    import datasets

    bad = tmp_path / "bad"
    bad.mkdir()
    easyr1 = foreign.geometry3k(2).cast_column("images", datasets.List(datasets.Image(decode=False))).to_list()
    easyr1[1]["images"] = [{"bytes": b"not an image", "path": None}]
    datasets.Dataset.from_list(easyr1).to_parquet(str(bad / "geo.parquet"))
    verl = foreign.verl_geo3k(foreign.geometry3k(2), "train").to_list()
    verl[0]["prompt"] = [{"role": "user", "content": "<image><image>two markers, one image"}]
    datasets.Dataset.from_list(verl).to_parquet(str(bad / "geo3k_verl.parquet"))
    trl = foreign.open_r1(2).to_list()
    trl[1]["solution"] = ""
    datasets.Dataset.from_list(trl, features=foreign.open_r1(1).features).save_to_disk(str(tmp_path / "saved"))
    next((tmp_path / "saved").glob("*.arrow")).rename(bad / "open_r1.arrow")
    done = cli("check", str(CONFIGS / "shapes_grpo.yaml"), "--data", str(bad / "*"), ok=False)
    assert done.returncode == 1
    text = " ".join(done.stdout.split())
    for name, layout in (("geo.parquet", "easyr1"), ("geo3k_verl.parquet", "verl"), ("open_r1.arrow", "trl")):
        assert f"{bad / name}: {layout} layout (auto:" in text
    assert f"✗ {bad / 'geo.parquet'}:row 1: field 'images[0]': cannot decode image" in text
    assert f"✗ {bad / 'geo3k_verl.parquet'}:row 0: field 'images': 1 image(s) given but the messages hold 2" in text
    assert f"✗ {bad / 'open_r1.arrow'}:row 1: column 'solution': empty" in text


@pytest.mark.e2e
def test_data_import_writes_vlrl_jsonl_that_reads_back(data, tmp_path):
    """`vlrl data import` of verl's parquet: vlrl jsonl + the images as they were encoded; read back as vlrl's
    layout with the same ids, answers, verifier and metadata."""
    from vlrl.data import read_samples

    done = cli("data", "import", str(data["verl"] / "test.parquet"), "--out", str(tmp_path / "out"),
               "--system-prompt", "Answer briefly.")
    assert "verl layout (auto:" in done.stdout and "wrote 2 samples" in done.stdout
    back = read_samples(tmp_path / "out" / "train.jsonl")
    assert {fmt for _, fmt, _ in back.formats} == {"vlrl"}
    original = read_samples(data["verl"] / "test.parquet").samples
    assert [s.id for s in back.samples] == [s.id for s in original] == ["verl-test-0", "verl-test-1"]
    first = back.samples[0]
    assert first.answer == "7" and first.reward == "math" and first.task == "hiyouga/geometry3k"
    assert first.messages[0] == {"role": "system", "content": "Answer briefly."}
    assert first.metadata["extra_info"]["question"].startswith("<image>Find x")
    assert Path(first.images[0]).read_bytes() == original[0].images[0].image_source()  # bytes as stored
    done = cli("data", "import", f"{data['easyr1']}@test", "--out", str(tmp_path / "geo"))
    assert "easyr1 layout (auto:" in done.stdout and (tmp_path / "geo" / "test.jsonl").is_file()  # named by its split
