"""The demo's quick configuration end to end, through `vlrl demo` and the shipped demo.yaml: SFT → eval → RL → eval →
FLOP-matched control, summary.json complete, and the README's claims at two training seeds: RL improves held-out
*strict* accuracy (right, one ended `<answer>…</answer>` and nothing after it) over its SFT checkpoint **and** over
the SFT control trained with the RL stage's FLOPs, while keeping its answers well-formed.

The quick configuration keeps the demo's SFT stage and RL recipe (700 SFT steps on 200 labels — smaller SFT stages
leave the model on its chance plateau: docs/experiments/demo.md — then GRPO at 64 prompts x 8 samples, T = 2.0,
strict reward) and shortens the rest: 80 RL steps instead of 250, 100 held-out prompts x 16 samples.
Seeds 1 and 2: at 80 RL steps seed 0's RL ties its control (strict 0.515 vs 0.514; at 120 steps 0.533 vs 0.488, at
the full demo's 250 steps 0.573 vs 0.495 — the README's table, which `make demo-seeds` checks at seeds 0-2). The two
seeds run as two tests, one on each pytest worker (tests/conftest.py, PER_TEST).
`vlrl demo` runs as a user runs it, in a process of its own at one torch thread with demo.yaml's `numerics: auto`:
portable kernels (capped at AVX2, the same bits on any Intel CPU with AVX2) on an Intel CPU, the CPU's own kernels
elsewhere (MKL has its reproducible AVX2 branch only on Intel CPUs). The numbers below therefore differ by CPU
vendor; the margins are set well inside what was measured.
"""

import json
import os
import subprocess
import sys

import pytest

from vlrl.numerics import portable_obstacle

QUICK_RL_STEPS = 80
QUICK = ["data.n_test=100", f"rl.train.steps={QUICK_RL_STEPS}", "eval.samples=16", 'report.progress="off"']


# Measured, strict sampled / greedy (Intel Xeon, portable numerics, one thread, 2026-12-06/07, `vlrl demo
# data.n_test=100 rl.train.steps=80 eval.samples=16 seed=S`): RL − SFT, RL − control in points
#   seed 1: SFT 0.512 / 0.52 → RL 0.811 / 0.82, control 0.672 / 0.69 (240 steps): +29.9 / +30, +13.9 / +13
#   seed 2: SFT 0.427 / 0.48 → RL 0.583 / 0.58, control 0.438 / 0.45 (210 steps): +15.6 / +10, +14.5 / +13
# well-formed 1.00 after RL at both. AMD CPUs (native kernels): not measured with this recipe (no AMD machine in
# this round; the former recipe's quick runs on an AMD EPYC gave other numbers than Intel's, docs/experiments/demo.md).
RL_OVER_SFT = 0.05  # points of strict accuracy, sampled (measured +29.9 and +15.6)
RL_OVER_CONTROL = 0.05  # sampled and greedy (measured +13.9 / +13 and +14.5 / +13)


@pytest.mark.e2e
@pytest.mark.timeout(2400)  # ~8 CPU-min each; 14-20 min of wall time beside the rest of the suite
@pytest.mark.parametrize("seed", [1, 2])
def test_quick_demo_rl_beats_sft_and_its_control_strictly(tmp_path, seed):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([sys.executable, "-m", "vlrl.cli", "demo", "--out", str(tmp_path), f"seed={seed}", *QUICK],
                          env=env, capture_output=True, text=True, timeout=2300)
    assert done.returncode == 0, done.stderr[-4000:]
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["seed"] == seed and saved["wall_seconds"] > 0
    environment = saved["environment"]
    assert environment["torch_threads"] == 1 and environment["numerics_requested"] == "auto"
    assert environment["numerics"] == ("native" if portable_obstacle() else "portable"), environment
    for stage in ("base", "sft", "rl", "sft_control"):
        assert set(saved[stage]["accuracy"]) == {"shapes/count", "mean"}
    for name in ("sft", "rl", "sft_control"):
        assert (tmp_path / "checkpoints" / name / "model.safetensors").exists()
    # SFT taught the answer format and some counting: the untrained model almost never answers right (1 of 400 at
    # the full demo's test size, never well-formed), the SFT checkpoint strictly right a third of the time or more
    assert saved["base"]["strict"]["mean"] < 0.05
    assert saved["sft"]["strict"]["mean"] > 0.2
    # RL on the 4,000 unlabelled prompts improves held-out strict accuracy over its SFT checkpoint, and over the SFT
    # checkpoint trained further with the RL stage's FLOPs on the 200 labels (the control), sampled and greedy, and
    # keeps ≥ 95 % of its answers well-formed (sampled and greedy)
    sft, rl, control = saved["sft"], saved["rl"], saved["sft_control"]
    assert sft["well_formed"]["mean"] >= 0.95  # SFT taught the form
    assert rl["strict"]["mean"] >= sft["strict"]["mean"] + RL_OVER_SFT, (sft["strict"], rl["strict"])
    for key in ("strict", "strict_greedy"):
        assert rl[key]["mean"] >= control[key]["mean"] + RL_OVER_CONTROL, (key, control[key], rl[key])
    assert rl["well_formed"]["mean"] >= 0.95 and rl["well_formed_greedy"]["mean"] >= 0.95, rl["well_formed"]
    assert rl["strict"]["mean"] <= rl["accuracy"]["mean"]  # strict = right and well-formed
    # the control got the RL stage's FLOPs, not its wall time: it ran exactly the FLOP-matched step count
    # (round(RL FLOPs / the SFT stage's mean FLOPs per step)), and its counted FLOPs equal the RL stage's to within
    # 2 % (the rounding to whole steps and its batches' lengths against the SFT stage's mean: 0.2-0.8 % measured at
    # 79-194 control steps; the former quick recipe's 43-59 steps gave up to 2.4 %)
    budget = saved["budget"]
    assert budget["unit"] == "flops" and budget["max_seconds"] is None
    assert saved["sft_control_train"]["steps"] == budget["control_steps"] == budget["flops_matched_steps"]
    assert abs(budget["control_flops"] - budget["rl_flops"]["total"]) <= 0.02 * budget["rl_flops"]["total"]
