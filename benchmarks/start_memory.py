"""Peak host memory per rank of an FSDP2 start-up on 2 gloo ranks, every rank loading the model
(``dist.rank0_load=false``, the start before issue 36) against rank 0 alone reading it (``true``, the default: the
other ranks build on the meta device and receive their shards from rank 0).

The model is Qwen2.5-VL-3B's published config (tests/fixtures/model_configs/qwen2_5_vl_3b.json) shortened to
``--layers`` decoder layers and ``--depth`` vision blocks — its real 151,936 × 2,048 embedding (tied head)
kept — with random weights in bfloat16, saved once in the transformers layout. Each rank then runs exactly the
recipes' start (`vlrl.train.recipes._load`, `make_runtime`: load → FSDP2 shards) and reports its peak resident
memory (``ru_maxrss``) and its resident memory after the start, both minus its resident memory before loading
(the imports). Expected: every rank's peak ≈ the whole model + its shards before; after, rank 0's ≈ the same and
rank 1's ≈ its shards + the largest tensor (`set_model_state_dict` broadcasts one full tensor at a time; here the
embedding).

    PYTHONPATH=src python benchmarks/start_memory.py [--layers 2] [--depth 2] [--dir /tmp/vlrl_start_model]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FIXTURE = REPO / "tests" / "fixtures" / "model_configs" / "qwen2_5_vl_3b.json"


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def worker(model_dir: str, rank0_load: str) -> None:
    """One rank: the recipes' start-up, then this rank's memory as JSON (rank 0 prints every rank's)."""
    import torch

    from vlrl.config import SFTConfig, load_config
    from vlrl.report import MetricsLogger
    from vlrl.train.distributed import init_distributed, shutdown_distributed
    from vlrl.train.recipes import _load
    from vlrl.train.runtime import make_runtime

    cfg = load_config(SFTConfig, None, [f"model.path={model_dir}", "model.dtype=bfloat16", "dist.strategy=fsdp",
                                        f"dist.rank0_load={rank0_load}", "out=/tmp/vlrl_start_memory_run"])
    ctx = init_distributed(cfg.dist)
    ctx.barrier()
    before = rss_bytes()
    policy = _load(cfg, MetricsLogger(None, quiet=True), ctx)
    runtime = make_runtime(cfg, ctx, policy, Path(cfg.out))
    ctx.barrier()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux
    shards = sum(p.to_local().numel() * p.element_size() for p in runtime.module.parameters())
    report = {"rank": ctx.rank, "before": before, "peak": peak, "after": rss_bytes(), "shards": shards,
              "model": sum(p.numel() * p.element_size() for p in runtime.module.parameters())}
    reports = ctx.gather_objects(report)
    if ctx.is_main:
        print("RESULT " + json.dumps(reports))
    del torch
    shutdown_distributed(ctx)


def build(model_dir: Path, layers: int, depth: int) -> None:
    import torch

    from vlrl.models.config_only import stand_in_policy

    if (model_dir / "config.json").is_file():
        return
    policy = stand_in_policy(FIXTURE, device="cpu", dtype=torch.bfloat16, overrides={"num_hidden_layers": layers},
                             vision_overrides={"depth": depth, "fullatt_block_indexes": list(range(depth))})
    policy.save(model_dir)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--dir", default="/tmp/vlrl_start_model")
    parser.add_argument("--worker", nargs=2, metavar=("MODEL_DIR", "RANK0_LOAD"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    model_dir = Path(args.dir)
    build(model_dir, args.layers, args.depth)
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    results = {}
    for rank0_load in ("false", "true"):
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                               __file__, "--worker", str(model_dir), rank0_load], env=env, capture_output=True,
                              text=True, timeout=1800)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            raise SystemExit(f"rank0_load={rank0_load} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        results[rank0_load] = json.loads(line.removeprefix("RESULT "))
    model = results["false"][0]["model"]
    print(f"model: Qwen2.5-VL-3B config, {args.layers} decoder layers, {args.depth} vision blocks, bf16: "
          f"{model / 2**20:.0f} MiB; 2 gloo ranks")
    print(f"{'start':28s} {'rank':>4s} {'peak − before MiB':>18s} {'after − before MiB':>19s} {'own shards MiB':>15s}")
    for rank0_load, label in (("false", "every rank loads (before)"), ("true", "rank 0 loads (dist.rank0_load)")):
        for r in results[rank0_load]:
            print(f"{label:28s} {r['rank']:4d} {(r['peak'] - r['before']) / 2**20:18.0f} "
                  f"{(r['after'] - r['before']) / 2**20:19.0f} {r['shards'] / 2**20:15.0f}")


if __name__ == "__main__":
    main()
