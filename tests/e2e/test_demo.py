"""The demo's quick configuration end to end, through `vlrl demo` and the shipped demo.yaml: SFT → eval → RL → eval →
FLOP-matched control, summary.json complete, and RL improves held-out *strict* accuracy over SFT (right, one ended
`<answer>…</answer>` and nothing after it) while keeping its answers well-formed.

The quick configuration keeps the demo's SFT stage and RL recipe (700 SFT steps on 200 labels — smaller SFT stages
leave the model on its chance plateau: docs/experiments/demo.md — then GRPO at 64 prompts x 8 samples, T = 2.0,
strict reward) and shortens the rest: 80 RL steps instead of 250, 100 held-out prompts x 16 samples. One training
seed, seed 0: the seed at which the former recipe (T = 1.3, lenient verifier) ended no held-out answer after RL on an
AMD CPU; the claims at seeds 0-2 and against the control are the full demo's (benchmarks/demo_seeds.py, README).
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


@pytest.mark.e2e
@pytest.mark.timeout(2400)  # ~4 min on a quiet core; several times that beside the rest of the suite
@pytest.mark.parametrize("seed", [0])
def test_quick_demo_rl_beats_sft_strictly(tmp_path, seed):
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
    # RL on the 4,000 unlabelled prompts improves held-out strict accuracy over its SFT checkpoint by ≥ 5 points, and
    # keeps ≥ 95 % of its answers well-formed (sampled and greedy). Measured (Intel Xeon, portable, one thread,
    # 2026-12-06), strict SFT → RL: 0.421 → 0.515 at seed 0 (+9.4; greedy 0.46 → 0.51), 0.512 → 0.811 at seed 1;
    # well-formed 1.0 after RL at both. Not measured on an AMD CPU with this recipe (no AMD machine this round).
    # The FLOP-matched control is not asserted here: at 80 steps seed 0's RL and control tie (0.515 vs 0.514
    # strict); at the full demo's 250 steps RL leads it by 7.8 points (README).
    sft, rl = saved["sft"], saved["rl"]
    assert sft["well_formed"]["mean"] >= 0.95  # SFT taught the form
    assert rl["strict"]["mean"] >= sft["strict"]["mean"] + 0.05, (sft["strict"], rl["strict"])
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
