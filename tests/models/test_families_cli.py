"""Every family preset, saved to a directory, through the doors a user takes: ``vlrl check``, ``vlrl sft``
(padding-free), ``vlrl rl`` (sync and async) and ``vlrl eval`` with ``model.path=DIR`` — the code a real
checkpoint of the family goes through. On-policy exactness is read from the run's own output: the trainer's
``policy/logp_drift`` (mean |behaviour − teacher-forced log-prob| over same-version tokens) stays < 1e-3 at
every step.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import forked_runs  # tests/ is on sys.path
from vlrl.cli import app
from vlrl.models import load_policy
from vlrl.models.presets import FAMILY_PRESETS

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("one_thread")]
runner = CliRunner()
SMALL = ["data.suite=shapes", "data.tasks=[count]", "data.n_train=8", "data.n_test=2", "eval.samples=1",
         "eval.max_new_tokens=3", "report.html=false"]


@pytest.fixture(scope="module")
def shapes_file(tmp_path_factory):
    """8 shapes samples written by ``vlrl data gen`` (jsonl + PNG files): the data `vlrl data pack` reads."""
    out = tmp_path_factory.mktemp("shapes")
    result = runner.invoke(app, ["data", "gen", "shapes", "--n", "8", "--split", "train", "--out", str(out),
                                 "--tasks", "count,color"])
    assert result.exit_code == 0, result.output
    # held-out samples beside it: a packing plan covers the whole training file, so none can be held out of it
    result = runner.invoke(app, ["data", "gen", "shapes", "--n", "2", "--split", "test", "--out", str(out),
                                 "--tasks", "count"])
    assert result.exit_code == 0, result.output
    return out / "train.jsonl"


def _records(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("name", FAMILY_PRESETS)
def test_check_sft_rl_and_eval_of_a_saved_family_directory(name, tmp_path, shapes_file):
    model = tmp_path / "model"
    load_policy(name).save(model)

    result = runner.invoke(app, ["check", "src/vlrl/configs/shapes_grpo.yaml", f"model.path={model}", *SMALL[:4]])
    assert result.exit_code == 0, result.output
    assert f"family {load_policy(str(model)).adapter.family}" in result.output

    # `vlrl data pack` counts tokens from image headers; the counts equal what SFT encodes, and SFT trains on the plan
    plan = tmp_path / "plan.npz"
    result = runner.invoke(app, ["data", "pack", "--data", str(shapes_file), "--model", str(model), "--capacity", "400",
                                 "--out", str(plan)])
    assert result.exit_code == 0, result.output
    from vlrl.data import read_samples
    from vlrl.data.packing import PackingPlan
    from vlrl.train.sft import encode_sft

    policy = load_policy(str(model))
    lengths = [encode_sft(policy, s).length for s in read_samples(shapes_file).samples]
    assert PackingPlan.load(plan).lengths.tolist() == lengths
    sft = tmp_path / "sft"
    result = runner.invoke(app, ["sft", f"model.path={model}", f"out={sft}", *SMALL, f"data.train={shapes_file}",
                                 f"data.test={shapes_file.parent / 'test.jsonl'}", f"data.packing_plan={plan}", "train.steps=2", "train.batch_size=4",
                                 "train.micro_batch_size=4"])
    assert result.exit_code == 0, result.output
    assert json.loads((sft / "summary.json").read_text())["train"]["steps"] == 2

    # async with η = 0: every trained sample comes from the trainer's current weights, so the drift is measured
    # at every step (with η > 0 a step may hold only stale samples, whose gap is the off-policy correction's job)
    for mode in ("sync", "async"):
        rl = tmp_path / f"rl_{mode}"
        result = runner.invoke(app, ["rl", f"model.path={sft / 'checkpoints' / 'final'}", f"out={rl}", *SMALL,
                                     f"rollout.mode={mode}", "staleness.eta=0", "train.steps=2", "train.prompts_per_step=2", "rollout.n=4",
                                     "rollout.max_new_tokens=4", "train.log_every=1", "train.padding_free=true"])
        assert result.exit_code == 0, result.output
        steps = [r for r in _records(rl) if r.get("stage") == "rl"]
        assert len(steps) == 2
        for record in steps:
            assert record["policy/logp_drift"] < 1e-3, (mode, record["step"], record["policy/logp_drift"])

    result = runner.invoke(app, ["eval", "--model", str(rl / "checkpoints" / "final"), "--n", "2", "--samples", "2",
                                 "--max-new-tokens", "3"])
    assert result.exit_code == 0, result.output
    assert "pass@" in result.output


def test_fsdp2_shards_every_family_exactly(tmp_path):
    """One 2-rank torchrun job (tests/models/fsdp_families_worker.py): each family sharded by `wrap_model` (its
    vision tower a unit of its own) gives the unsharded model's log-probs and full gradients on the same batch
    (rows sharing an image included), and greedy generation — which encodes images before the decoder's first
    forward — gives the same tokens."""
    import sys
    from pathlib import Path

    dirs = []
    for name in FAMILY_PRESETS:
        dirs.append(str(load_policy(name).save(tmp_path / name)))
    out = tmp_path / "fsdp.json"
    worker = Path(__file__).with_name("fsdp_families_worker.py")
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = forked_runs.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                            str(worker), str(out), *dirs], timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-6000:]
    results = json.loads(out.read_text())
    assert sorted(results) == sorted(dirs)
    for path, r in results.items():
        assert r["logp_gap"] < 1e-5 and r["grad_gap"] < 1e-5 * max(1.0, r["grad_scale"]), (path, r)
        assert r["same_tokens"], path
