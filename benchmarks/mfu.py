"""The GRPO update phase's model-FLOPs utilisation on this CPU (issue 36 item 4): the share of the CPU's measured
matmul peak that vlrl's update reaches, and where the rest of the time goes.

The update phase is what `vlrl rl` runs after generation — `prepare_batch` (advantages; π_old / π_ref passes when
configured) and `ppo_update` (forward, backward, AdamW) — on fixed trajectories (the prompts of ``--shape``,
random ordinary response tokens of the full length, rewards that differ in every group), counted by `PhaseMeter`
(`perf/mfu`, the metric every run logs) and divided by `measured_cpu_peak` at the same thread count. One warm-up
update, then ``--repeats`` timed ones (median). ``--profile`` runs one more under ``torch.profiler`` and prints
where its time goes: the matmuls (what the peak measures) against everything else.

    PYTHONPATH=src python benchmarks/mfu.py [--preset tiny-qwen2-vl-20m] [--shape realistic] [--threads 1]
        [--repeats 3] [--profile] [--set train.shared_prefix=false ...]

Shapes (as benchmarks/vs_trl.py): ``today`` 8 prompts × n 4 × 32 tokens, 112² images; ``realistic`` 4 prompts ×
n 8 × 64 tokens, 448² images (256 vision tokens).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch

from vlrl.config import RLStage, apply_overrides
from vlrl.data import generate
from vlrl.models import load_policy
from vlrl.report.perf import measured_cpu_peak
from vlrl.rollout import HFEngine
from vlrl.rollout.types import Status, Trajectory
from vlrl.train.batch import build_algorithm, prepare_batch
from vlrl.train.budget import PhaseMeter
from vlrl.train.common import make_optimizer
from vlrl.train.modules import stage_modules
from vlrl.train.update import ppo_update

SHAPES = {"today": dict(prompts=8, n=4, new=32, side=112), "realistic": dict(prompts=4, n=8, new=64, side=448)}
MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear",
           "aten::_scaled_dot_product", "aten::scaled_dot_product", "aten::convolution", "aten::_convolution",
           "aten::mkldnn_convolution")


def trajectories(policy, shape: dict) -> list[Trajectory]:
    engine = HFEngine(policy)
    samples = generate("shapes", shape["prompts"], tasks=["count"], image_size=shape["side"])
    requests = [engine.encode(s) for s in samples]
    special = set(policy.adapter.special_token_ids())
    ordinary = torch.tensor([t for t in range(len(policy.tokenizer)) if t not in special])
    generator = torch.Generator().manual_seed(0)
    out = []
    for g, request in enumerate(requests):
        for k in range(shape["n"]):
            response = ordinary[torch.randint(len(ordinary), (shape["new"],), generator=generator)]
            out.append(Trajectory(sample=request.sample, prompt_ids=torch.as_tensor(request.prompt_ids),
                                  response_ids=response, loss_mask=torch.ones(len(response), dtype=torch.long),
                                  behaviour_logp=torch.full((len(response),), -7.0), vision=request.vision,
                                  images=request.images, weight_version=0, status=Status.TRUNCATED,
                                  response_text="", group_index=g, reward=0.1 * k))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="tiny-qwen2-vl-20m")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="realistic")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--set", nargs="*", default=[], help="RL stage overrides, e.g. train.shared_prefix=false")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    shape = SHAPES[args.shape]
    raw: dict = {"rollout": {"n": shape["n"], "max_new_tokens": shape["new"]},
                 "train": {"prompts_per_step": shape["prompts"], "micro_batch_size": shape["prompts"] * shape["n"]},
                 "optim": {"lr": 1e-5}}
    apply_overrides(raw, args.set, cls=RLStage)
    stage = RLStage.model_validate(raw)
    policy = load_policy(args.preset, max_pixels=shape["side"] ** 2)
    rows = trajectories(policy, shape)
    peak = measured_cpu_peak(torch.float32, args.threads)
    P = len(rows[0].prompt_ids)
    print(f"{args.preset} ({policy.num_parameters() / 1e6:.1f}M), shape {args.shape}: {shape['prompts']} prompts × n "
          f"{shape['n']}, prompt {P} tokens, {shape['new']} response tokens, {args.threads} thread(s); "
          f"measured fp32 matmul peak {peak / 1e9:.1f} GFLOP/s; overrides {args.set or 'none'}")
    algorithm = build_algorithm(stage, policy, apply_behaviour_weight=False)
    with stage_modules(policy, stage.train):
        optimizer, scheduler = make_optimizer(policy.model, stage.optim, policy.adapter.module_groups)

        def update(step: int) -> dict[str, float]:
            with PhaseMeter(policy.model, "cpu", torch.float32) as perf:
                perf.begin()
                batch = prepare_batch(algorithm, policy, rows, step=step, max_new_tokens=shape["new"])
                ppo_update(policy, batch, algorithm.settings, optimizer, scheduler, seed=0, step=step)
                perf.phase("")
                flops, seconds = perf._phases[""]
                return {**perf.metrics(), "seconds": seconds, "gflop": flops / 1e9}

        update(0)  # warm-up
        runs = [update(k + 1) for k in range(args.repeats)]
        seconds = statistics.median(r["seconds"] for r in runs)
        mfu = statistics.median(r["perf/mfu"] for r in runs)
        each = ", ".join(f"{r['perf/mfu']:.1%}" for r in runs)
        print(f"update: {runs[0]['gflop']:.1f} GFLOP (model FLOPs) in {seconds:.2f} s (median of {args.repeats}) = "
              f"{runs[0]['gflop'] / seconds:.1f} GFLOP/s; perf/mfu {mfu:.1%} of the measured peak (runs: {each})")
        if args.profile:
            profile(update, args.repeats + 1)


def profile(update, step: int) -> None:
    """One update under torch.profiler: self CPU time of the matmul-like ops against the rest, and the top ops."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        update(step)
        wall = time.perf_counter() - start
    by_op: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        by_op[event.key] += event.self_cpu_time_total / 1e6
    total = sum(by_op.values())
    matmul = sum(v for k, v in by_op.items() if k.startswith(MATMULS))
    print(f"\nprofiled update: {wall:.2f} s wall, {total:.2f} s of op self time; matmuls, attention and convolutions "
          f"{matmul:.2f} s ({matmul / total:.0%}), everything else {total - matmul:.2f} s ({1 - matmul / total:.0%})")
    print(f"{'op':48s} {'self s':>8s} {'share':>6s}")
    for name, value in sorted(by_op.items(), key=lambda kv: -kv[1])[:18]:
        print(f"{name[:48]:48s} {value:8.2f} {value / total:6.1%}")


if __name__ == "__main__":
    main()
