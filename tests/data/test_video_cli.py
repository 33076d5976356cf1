"""Video through the doors a user takes: the shipped `configs/shapes_video_grpo.yaml` under `vlrl rl` (procedural
clips given as frame lists), and `vlrl sft`, `vlrl data pack` and async `vlrl rl` on a jsonl of .mp4 files written
with PyAV. The
feature's own signature in each run's output: ``data/train_videos`` and ``data/train_frames_per_video`` in
metrics.jsonl, the prompts holding one image per frame in samples.jsonl, and on-policy exactness
(``policy/logp_drift`` < 1e-3 at every step) with the frames in the prompt.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from vlrl.cli import app
from vlrl.data import generate
from vlrl.data.sample import sample_to_json

from .test_video import write_mp4

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("one_thread")]
runner = CliRunner()
CONFIG = str(Path(__file__).parents[2] / "configs" / "shapes_video_grpo.yaml")
SMALL = ["data.n_train=8", "data.n_test=2", "eval.samples=1", "eval.max_new_tokens=3", "report.html=false",
         "train.log_every=1"]
RL_SMALL = ["train.steps=2", "train.prompts_per_step=2", "rollout.n=4", "rollout.max_new_tokens=4"]


def _records(run: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (run / name).read_text().splitlines()]


def _assert_video_run(run: Path, *, videos: int, frames: int, stage: str) -> None:
    data = {k: v for r in _records(run, "metrics.jsonl") if r["stage"] == "data" for k, v in r.items()}
    assert data["data/train_videos"] == videos and data["data/train_frames_per_video"] == frames
    trained = [r for r in _records(run, "samples.jsonl") if r["stage"] == stage]
    assert trained and all(len(r["images"]) == frames and r["prompt"].startswith("<image>" * frames) for r in trained)


def test_shipped_video_config_runs_grpo_on_frames(tmp_path):
    run = tmp_path / "run"
    result = runner.invoke(app, ["rl", "--config", CONFIG, f"out={run}", *SMALL, *RL_SMALL])
    assert result.exit_code == 0, result.output
    assert "data train: 8 video(s) fed as sampled frames, 4.0 per video" in result.output
    steps = [r for r in _records(run, "metrics.jsonl") if r["stage"] == "rl"]
    assert len(steps) == 2 and all(r["policy/logp_drift"] < 1e-3 for r in steps)
    assert all("accuracy/shapes/video_count" in r for r in steps)
    _assert_video_run(run, videos=8, frames=4, stage="rl")


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> Path:
    """10 shapes clips as .mp4 files (4 frames at 2 fps = 2 s each) in a jsonl with ``"videos": ["clip.mp4"]``."""
    out = tmp_path_factory.mktemp("clips")
    lines = []
    for k, sample in enumerate(generate("shapes", 10, tasks=["video_count"], frames=4, image_size=64)):
        write_mp4(out / f"clip{k}.mp4", sample.videos[0], fps=2)
        lines.append(json.dumps(sample_to_json(sample, [], [f"clip{k}.mp4"])))
    (out / "clips.jsonl").write_text("\n".join(lines) + "\n")
    return out / "clips.jsonl"


def test_sft_and_async_rl_on_mp4_files(tmp_path, clips):
    # 2 s at data.video_fps 1 → frames at t = 0, 1 s: 2 frames per clip (the config's 2 fps would give all 4)
    sft = tmp_path / "sft"
    result = runner.invoke(app, ["sft", f"out={sft}", f"data.train={clips}", "data.video_fps=1",
                                 *SMALL, "train.steps=2", "train.batch_size=4", "train.micro_batch_size=4",
                                 "train.padding_free=true"])
    assert result.exit_code == 0, result.output
    assert json.loads((sft / "summary.json").read_text())["train"]["steps"] == 2
    # data.test unset: 1 of the 10 clips is held out (test_fraction 0.1), 10 are read and become 2 frames each
    _assert_video_run(sft, videos=10, frames=2, stage="eval/final")

    # `vlrl data pack` samples the same frames, so its token counts equal what SFT encodes
    plan = tmp_path / "plan.npz"
    result = runner.invoke(app, ["data", "pack", "--data", str(clips), "--capacity", "400", "--out", str(plan),
                                 "--video-fps", "1"])
    assert result.exit_code == 0, result.output
    from vlrl.data import MediaLimits, read_samples
    from vlrl.data.packing import PackingPlan
    from vlrl.models import load_policy
    from vlrl.train.sft import encode_sft

    policy = load_policy("tiny-qwen2-vl")
    read = read_samples(clips, media=MediaLimits(video_fps=1)).samples
    assert all(len(s.images) == 2 for s in read)
    assert PackingPlan.load(plan).lengths.tolist() == [encode_sft(policy, s).length for s in read]

    rl = tmp_path / "rl"
    result = runner.invoke(app, ["rl", "--config", CONFIG, f"model.path={sft / 'checkpoints' / 'final'}", f"out={rl}",
                                 f"data.train={clips}", *SMALL, *RL_SMALL, "rollout.mode=async", "staleness.eta=0"])
    assert result.exit_code == 0, result.output
    steps = [r for r in _records(rl, "metrics.jsonl") if r["stage"] == "rl"]
    assert len(steps) == 2 and all(r["policy/logp_drift"] < 1e-3 for r in steps)
    _assert_video_run(rl, videos=10, frames=4, stage="eval/final")  # (async runs log no training rollouts)
