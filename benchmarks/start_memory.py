"""Peak host memory per rank of an FSDP2 start-up on 2 gloo ranks: every rank loading the model
(``dist.rank0_load=false``, the start before issue 36) against rank 0 alone reading it (``true``, the default: the
other ranks build on the meta device and get each unit's tensors from rank 0 just before it is sharded).

The model: Qwen2.5-VL-3B's published config (tests/fixtures/model_configs/qwen2_5_vl_3b.json) made smaller —
``--layers`` decoder layers of width ``--width``, ``--depth`` vision blocks, a vocabulary of ``--vocab`` — so that, as
in a real model, one unit is a small part of the whole (with a few wide layers, or the real 151,936-token embedding
in the root unit, the first forward's all-gathers would be as large as the model). Random weights, saved once in
bf16 as published checkpoints are, loaded as ``--dtype``: vlrl's default ``model.dtype`` float32 (fp32 master
weights) converts at load, so every rank that loads holds a converted copy of its own; loaded as bf16, transformers
maps the file, and the ranks share its pages through the page cache.

Each rank runs exactly the recipes' start (`vlrl.recipes.run.load_run_policy`, `make_runtime`: load → FSDP2 shards → the
root's first forward) and reports the peak of its anonymous resident memory (its own allocations, sampled every
millisecond) at the end of sharding and after the first forward, the peak of its file-backed resident memory
(mapped safetensors pages), and its anonymous memory after the start — all above its resident memory before the
load (the imports).

    PYTHONPATH=src python benchmarks/start_memory.py [--layers 24] [--width 1024] [--depth 2] [--vocab 32768]
        [--dtype float32] [--dir /tmp/vlrl_start_model]
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


def memory() -> dict[str, int]:
    """This process's resident memory, bytes: anonymous (its own allocations) and file-backed (mapped files — the
    safetensors pages a load maps, shared with every process that maps the same file)."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024
    return out


class PeakSampler:
    """The largest anonymous and file-backed resident memory seen, sampled every millisecond in a thread."""

    def __init__(self) -> None:
        import threading

        self.peak = memory()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.001):
            now = memory()
            self.peak = {k: max(v, now[k]) for k, v in self.peak.items()}

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def worker(model_dir: str, rank0_load: str, dtype: str) -> None:
    """One rank: the recipes' start-up, then this rank's memory as JSON (rank 0 prints every rank's)."""
    import torch

    from vlrl.config import SFTConfig, load_config
    from vlrl.recipes.run import load_run_policy
    from vlrl.report import MetricsLogger
    from vlrl.train.distributed import init_distributed, shutdown_distributed
    from vlrl.train.runtime import make_runtime

    cfg = load_config(SFTConfig, None, [f"model.path={model_dir}", f"model.dtype={dtype}", "dist.strategy=fsdp",
                                        f"dist.rank0_load={rank0_load}", "out=/tmp/vlrl_start_memory_run"])
    ctx = init_distributed(cfg.dist)
    ctx.barrier()
    from vlrl.train import distributed

    before, sharded = memory(), {}
    keep = distributed._keep_output_capturing  # called right after sharding, before the root's first forward

    def mark(model):
        sharded.update(sampler.peak)
        keep(model)

    distributed._keep_output_capturing = mark
    with PeakSampler() as sampler:
        policy = load_run_policy(cfg, MetricsLogger(None, quiet=True), ctx)
        runtime = make_runtime(cfg, ctx, policy, Path(cfg.out))
        ctx.barrier()
    shards = sum(p.to_local().numel() * p.element_size() for p in runtime.module.parameters())
    report = {"rank": ctx.rank, "before": before, "sharded": sharded, "peak": sampler.peak, "after": memory(),
              "shards": shards,
              "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
              "model": sum(p.numel() * p.element_size() for p in runtime.module.parameters())}
    reports = ctx.gather_objects(report)
    if ctx.is_main:
        print("RESULT " + json.dumps(reports))
    del torch
    shutdown_distributed(ctx)


def build(model_dir: Path, layers: int, depth: int, vocab: int, width: int) -> None:
    import torch

    from vlrl.models.config_only import stand_in_policy

    if (model_dir / "config.json").is_file():
        return
    policy = stand_in_policy(FIXTURE, device="cpu", dtype=torch.bfloat16,
                             overrides={"num_hidden_layers": layers, "vocab_size": vocab, "hidden_size": width,
                                        "intermediate_size": width * 11008 // 2048, "num_attention_heads": width // 128},
                             vision_overrides={"depth": depth, "fullatt_block_indexes": list(range(depth)),
                                               "out_hidden_size": width})
    policy.save(model_dir)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=1024, help="hidden size (the 3B's is 2048)")
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--dir", default="/tmp/vlrl_start_model", help="where the model is saved (built once)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="model.dtype of the run (the checkpoint is bf16, as published ones are)")
    parser.add_argument("--worker", nargs=3, metavar=("MODEL_DIR", "RANK0_LOAD", "DTYPE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    model_dir = Path(args.dir)
    build(model_dir, args.layers, args.depth, args.vocab, args.width)
    # glibc keeps freed heap memory for reuse; with allocations of 128 KiB and more served by mmap, freed tensors
    # leave the process at once and the resident memory is the memory in use (the same setting for both starts)
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", MALLOC_MMAP_THRESHOLD_="131072")
    results = {}
    for rank0_load in ("false", "true"):
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                               __file__, "--worker", str(model_dir), rank0_load, args.dtype], env=env,
                              capture_output=True,
                              text=True, timeout=1800)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            raise SystemExit(f"rank0_load={rank0_load} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        results[rank0_load] = json.loads(line.removeprefix("RESULT "))
    model = results["false"][0]["model"]
    print(f"model: Qwen2.5-VL-3B config, {args.layers} decoder layers of width {args.width}, {args.depth} vision "
          f"blocks, vocabulary {args.vocab}; a bf16 checkpoint loaded as model.dtype={args.dtype}: {model / 2**20:.0f} MiB; 2 gloo ranks")
    print("MiB above each rank's resident memory before the load (anonymous: its own allocations; file: mapped "
          "safetensors pages, shared between the ranks through the page cache)")
    print(f"{'start':32s} {'rank':>4s} {'peak anon, load + shard':>24s} {'… + 1st forward':>16s} "
          f"{'peak file':>10s} {'after anon':>11s} {'own shards':>11s}")
    for rank0_load, label in (("false", "every rank loads (before)"), ("true", "rank 0 loads (dist.rank0_load)")):
        for r in results[rank0_load]:
            mib = {k: (r["peak"][k] - r["before"][k]) / 2**20 for k in ("RssAnon", "RssFile")}
            print(f"{label:32s} {r['rank']:4d} {(r['sharded']['RssAnon'] - r['before']['RssAnon']) / 2**20:24.0f} "
                  f"{mib['RssAnon']:16.0f} {mib['RssFile']:10.0f} "
                  f"{(r['after']['RssAnon'] - r['before']['RssAnon']) / 2**20:11.0f} {r['shards'] / 2**20:11.0f}")


if __name__ == "__main__":
    main()
