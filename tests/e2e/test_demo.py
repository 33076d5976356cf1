"""The demo's quick configuration end to end, through `vlrl demo` and the shipped demo.yaml, at two training seeds:
SFT → eval → RL → eval → FLOP-matched control, summary.json complete, and RL improves held-out reward over SFT at
both seeds.

The quick configuration keeps the demo's SFT stage (700 steps on 200 labels — smaller SFT stages leave the model on
its chance plateau, where RL lowered held-out reward at every size tried: docs/experiments/demo.md) and shortens
the rest: 80 RL steps instead of 250, 100 held-out prompts × 16 samples (with 4, the sampled accuracy of the same
two checkpoints moved the RL − SFT gap between +2.5 and +6.3 points over four evaluation seeds; with 16, +3.1 and
+3.4 at two).
"""

import json

import pytest
import torch
from typer.testing import CliRunner

from vlrl.cli import app

# RL with the demo's former recipe — 32 prompts x 4 samples per step at T = 1 (a quarter of the shipped 64 x 8's
# rollouts) — for 80 steps: the margins below were measured with it; the shipped recipe's own gains are
# docs/experiments/demo.md's tables.
QUICK = ["data.n_test=100", "rl.train.steps=80", "rl.train.prompts_per_step=32", "rl.rollout.n=4",
         "rl.rollout.temperature=1.0", "eval.samples=16", 'report.progress="off"']


@pytest.fixture
def one_thread():
    """The run is deterministic for a torch thread count, not across counts: the margins below were measured at one."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.e2e
@pytest.mark.timeout(2400)  # ~5-6 min per seed on a quiet core (the demo's whole SFT stage); 32-34 min seen under load
@pytest.mark.parametrize("seed", [0, 1])
def test_quick_demo_rl_beats_sft(tmp_path, seed, one_thread):
    result = CliRunner().invoke(app, ["demo", "--out", str(tmp_path), f"seed={seed}", *QUICK])
    assert result.exit_code == 0, result.output
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["seed"] == seed and saved["wall_seconds"] > 0
    for stage in ("base", "sft", "rl", "sft_control"):
        assert set(saved[stage]["accuracy"]) == {"shapes/count", "mean"}
    for name in ("sft", "rl", "sft_control"):
        assert (tmp_path / "checkpoints" / name / "model.safetensors").exists()
    # SFT taught the answer format and some counting: the untrained model almost never answers right (1 of 400 at
    # the full demo's test size), the SFT checkpoint a third of the time or more (0.34-0.51 at seeds 0-2)
    assert saved["base"]["reward"]["mean"] < 0.05
    assert saved["sft"]["reward"]["mean"] > 0.2
    # RL on the 4,000 unlabelled prompts improves held-out reward over its SFT checkpoint by ≥ 3 points. Measured in
    # this test (pytest, one thread, the engine's own sampling loop at the config's top-k 50, 16 eval samples):
    # 0.401 → 0.460 at seed 0, 0.319 → 0.416 at seed 1; with 4 eval samples (whose draws also shift the RL stage's random stream)
    # seed 0 gave 0.4025 → 0.4275 (greedy 0.42 → 0.45), and with `generate` 0.388 → 0.450: 80 RL steps leave a
    # gain of ~3-6 points that the random stream moves by a few points. A plain process differs from pytest from the
    # SFT stage on (not yet explained).
    assert saved["rl"]["reward"]["mean"] >= saved["sft"]["reward"]["mean"] + 0.03
    # the control got the RL stage's FLOPs, not its wall time: it ran exactly the FLOP-matched step count
    # (round(RL FLOPs / the SFT stage's mean FLOPs per step)), and its counted FLOPs equal the RL stage's to within
    # 2 % (its batches' lengths differ a little from the SFT stage's mean: 0.003-0.6 % measured)
    budget = saved["budget"]
    assert budget["unit"] == "flops" and budget["max_seconds"] is None
    assert saved["sft_control_train"]["steps"] == budget["control_steps"] == budget["flops_matched_steps"]
    assert abs(budget["control_flops"] - budget["rl_flops"]["total"]) <= 0.02 * budget["rl_flops"]["total"]
