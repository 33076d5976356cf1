"""The demo's quick configuration end to end, through `vlrl demo` and the shipped demo.yaml, at two training seeds:
SFT → eval → RL → eval → FLOP-matched control, summary.json complete, and RL improves held-out reward over SFT at
both seeds.

The quick configuration keeps the demo's SFT stage (700 steps on 200 labels — smaller SFT stages leave the model on
its chance plateau, where RL lowered held-out reward at every size tried: docs/experiments/demo.md) and shortens
the rest: 80 RL steps instead of 250, 100 held-out prompts × 4 samples.
"""

import json

import pytest
import torch
from typer.testing import CliRunner

from vlrl.cli import app

QUICK = ["data.n_test=100", "rl.train.steps=80", "eval.samples=4", 'report.progress="off"']


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
    # this test (pytest, one thread): 0.388 → 0.450 at seed 0, 0.320 → 0.455 at seed 1; the same overrides through
    # run_demo in a plain process gave 0.448 → 0.583 and 0.275 → 0.468 (the two environments' runs differ from the
    # SFT stage on; not yet explained)
    assert saved["rl"]["reward"]["mean"] >= saved["sft"]["reward"]["mean"] + 0.03
    # the control got the RL stage's FLOPs, not its wall time: it ran exactly the FLOP-matched step count
    # (round(RL FLOPs / the SFT stage's mean FLOPs per step)), and its counted FLOPs equal the RL stage's to within
    # 2 % (its batches' lengths differ a little from the SFT stage's mean: 0.003-0.6 % measured)
    budget = saved["budget"]
    assert budget["unit"] == "flops" and budget["max_seconds"] is None
    assert saved["sft_control_train"]["steps"] == budget["control_steps"] == budget["flops_matched_steps"]
    assert abs(budget["control_flops"] - budget["rl_flops"]["total"]) <= 0.02 * budget["rl_flops"]["total"]
