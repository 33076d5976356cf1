"""Scale-out on CPU: step time of 1 process vs 2 gloo ranks (DDP and FSDP2) for SFT and GRPO on the tiny
Qwen2-VL, same global batch, run side by side; then the planner's estimate vs measured peak memory of one
training step for the tiny presets.

    PYTHONPATH=src python benchmarks/scale_out.py [--quick] [--sft-steps 30] [--rl-steps 12]

Every run is a real `vlrl sft|rl` command (torchrun for 2 ranks, one torch thread per process). Step time is
the median of ``perf/step_seconds`` over the steps after the first (warm-up).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SFT = ["data.n_train=512", "data.tasks=[count,color]", "train.batch_size=32", "train.micro_batch_size=32"]
RL = ["train.prompts_per_step=8", "rollout.n=8", "rollout.max_new_tokens=16", "train.micro_batch_size=64"]
COMMON = ["data.n_test=2", "train.log_every=1", "report.html=false", "check.enabled=false", "eval.samples=1",
          "eval.max_new_tokens=2"]


def run(recipe: str, setup: str, model: Path, out: Path, steps: int) -> list[float]:
    args = [f"model.path={model}", *(SFT if recipe == "sft" else RL), *COMMON, f"train.steps={steps}", f"out={out}"]
    if setup == "1 process":
        cmd = [sys.executable, "-m", "vlrl.cli", recipe, *args]
    else:
        strategy = setup.split()[-1].lower().replace("fsdp2", "fsdp")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "vlrl.cli",
               recipe, *args, f"dist.strategy={strategy}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["perf/step_seconds"] for r in records if r["stage"] == recipe]


def step_times(model: Path, root: Path, sft_steps: int, rl_steps: int) -> None:
    print("step time, same global batch (SFT: 32 samples; GRPO: 8 prompts × 8 responses ≤ 16 tokens), "
          "median over steps 2..N:")
    for recipe, steps in (("sft", sft_steps), ("rl", rl_steps)):
        base = None
        for setup in ("1 process", "2 ranks DDP", "2 ranks FSDP2"):
            times = run(recipe, setup, model, root / f"{recipe}-{setup.replace(' ', '_')}", steps)[1:]
            median = statistics.median(times)
            base = base or median
            print(f"  {recipe:3s}  {setup:14s}  {median:.3f} s/step   speed-up vs 1 process ×{base / median:.2f}"
                  f"   ({len(times)} steps)")


def memory(model_vl: Path, root: Path) -> None:
    import torch

    from vlrl.config import SFTConfig, load_config
    from vlrl.launch.planner import estimate_train_step, measure_train_step, meta_model, model_shape, workload
    from vlrl.models import load_policy

    torch.set_num_threads(1)
    print("\nplanner estimate vs measured peak of one training step (batch 8, micro-batch 4, torch MemTracker, CPU):")
    for preset in ("tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-qwen2"):
        path = model_vl if preset == "tiny-qwen2-vl" else load_policy(preset).save(root / preset)
        data = ["data.suite=arith", "data.tasks=[add]"] if preset == "tiny-qwen2" else []
        cfg = load_config(SFTConfig, None, [f"model.path={path}", *data, "train.batch_size=8", "train.micro_batch_size=4"])
        meta, adapter = meta_model(str(path))
        shape, w = model_shape(meta), workload(cfg, adapter)
        estimate = estimate_train_step(shape, w)
        measured = measure_train_step(cfg, load_policy(str(path)), w)
        est, got = sum(estimate.values()), measured["total"]
        print(f"  {preset:16s} activations est {estimate['act'] / 2**20:7.2f} MiB / measured {measured['act'] / 2**20:7.2f} MiB"
              f" ({(estimate['act'] - measured['act']) / measured['act'] * 100:+.1f} %)   peak est {est / 2**20:7.2f} MiB"
              f" / measured {got / 2**20:7.2f} MiB ({(est - got) / got * 100:+.1f} %)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: few steps")
    parser.add_argument("--sft-steps", type=int, default=30)
    parser.add_argument("--rl-steps", type=int, default=12)
    args = parser.parse_args()
    sft_steps, rl_steps = (4, 3) if args.quick else (args.sft_steps, args.rl_steps)
    from vlrl.models import load_policy

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = load_policy("tiny-qwen2-vl").save(root / "tiny-qwen2-vl")
        step_times(model, root, sft_steps, rl_steps)
        memory(model, root)


if __name__ == "__main__":
    main()
