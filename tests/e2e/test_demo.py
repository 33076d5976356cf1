"""The demo's quick configuration end to end, through `vlrl demo` and the shipped demo.yaml, at two training seeds:
SFT → eval → RL → eval → FLOP-matched control, summary.json complete, and RL improves held-out reward over SFT at
both seeds.

The quick configuration keeps the demo's SFT stage and RL recipe (700 SFT steps on 200 labels — smaller SFT stages
leave the model on its chance plateau, where RL lowered held-out reward at every size tried: docs/experiments/demo.md
— then GRPO at 64 prompts x 8 samples, T = 1.3) and shortens the rest: 80 RL steps instead of 250, 100
held-out prompts x 16 samples. `vlrl demo` runs as a user runs it, in a process of its own at one torch thread with
demo.yaml's `numerics: auto`: portable kernels (capped at AVX2, the same bits on any Intel CPU with AVX2) on an
Intel CPU, the CPU's own kernels elsewhere (MKL has its reproducible AVX2 branch only on Intel CPUs). The numbers
below therefore differ by CPU vendor; the margins are those both vendors' runs clear.
"""

import json
import os
import subprocess
import sys

import pytest

from vlrl.numerics import portable_obstacle

QUICK_RL_STEPS = 80
QUICK = ["data.n_test=100", f"rl.train.steps={QUICK_RL_STEPS}", "eval.samples=16", 'report.progress="off"']


@pytest.mark.e2e
@pytest.mark.timeout(2400)  # ~4 min per seed on a quiet core; several times that beside the rest of the suite
@pytest.mark.parametrize("seed", [0, 1])
def test_quick_demo_rl_beats_sft(tmp_path, seed):
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
    # the full demo's test size), the SFT checkpoint a third of the time or more (0.34-0.51 at seeds 0-2)
    assert saved["base"]["reward"]["mean"] < 0.05
    assert saved["sft"]["reward"]["mean"] > 0.2
    # RL on the 4,000 unlabelled prompts improves held-out reward over its SFT checkpoint by ≥ 3 points. Measured
    # (one thread), SFT → RL: Intel Xeon, portable (2026-11-27) 0.421 → 0.570 at seed 0, 0.512 → 0.764 at seed 1;
    # AMD EPYC (Zen 3, AVX2), native (2026-11-28) 0.471 → 0.566 and 0.524 → 0.711 — +9.5 the least of the four;
    # Intel, portable, at seeds 2 and 3 +11.1 and −2.7 points (seed 3's SFT checkpoint samples one answer per prompt: pass@16
    # 0.69 vs pass@1 0.66, 98 % of the RL groups scored alike — nothing for RL to sharpen); with an AVX-512 CPU's
    # own kernels (numerics=native) +13.4 / +8.4 / +23.2 / +9.6 at seeds 0-3. The former quick recipe (32 × 4 at
    # T = 1) gained −1.3 at seed 1 there.
    assert saved["rl"]["reward"]["mean"] >= saved["sft"]["reward"]["mean"] + 0.03
    # the control got the RL stage's FLOPs, not its wall time: it ran exactly the FLOP-matched step count
    # (round(RL FLOPs / the SFT stage's mean FLOPs per step)), and its counted FLOPs equal the RL stage's to within
    # 2 % (the rounding to whole steps and its batches' lengths against the SFT stage's mean: 0.2-0.8 % measured at
    # 79-194 control steps; the former quick recipe's 43-59 steps gave up to 2.4 %)
    budget = saved["budget"]
    assert budget["unit"] == "flops" and budget["max_seconds"] is None
    assert saved["sft_control_train"]["steps"] == budget["control_steps"] == budget["flops_matched_steps"]
    assert abs(budget["control_flops"] - budget["rl_flops"]["total"]) <= 0.02 * budget["rl_flops"]["total"]
