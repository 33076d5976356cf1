"""Weight sync to rollout servers: seconds per update by disk (save_pretrained + /update_weights_from_disk) and by
the distributed path (SGLang's /update_weights_from_distributed over a gloo group), to 1 and 2 `vlrl serve`
processes, for the 1M and 20M presets, run side by side on the same servers.

    PYTHONPATH=src python benchmarks/weight_sync.py [--updates 5] [--presets tiny-qwen2-vl,tiny-qwen2-vl-20m]

Each update nudges every parameter (so each is a real new version), then times `HTTPEngine.update_weights` from
the call to every server's checksum-verified confirmation; the table shows the median over ``--updates`` after
one warm-up update per method (the first distributed update also forms the group; it is timed separately).
"Bytes" is one copy of the weights as sent (disk: the safetensors file written; distributed: the broadcast
payload). With gloo the trainer sends that payload to each server in turn (N copies on the wire); NCCL
broadcasts on a ring/tree. One torch thread per process; servers share the machine's cores with the trainer.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from vlrl.models import load_policy
from vlrl.rollout.http_engine import HTTPEngine

KEY = "bench-key"


def start_servers(model: str, n: int, log_dir: Path) -> tuple[list[subprocess.Popen], list[str]]:
    processes, urls = [], []
    env = dict(os.environ, VLRL_API_KEY=KEY, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    logs = []
    for i in range(n):
        log = open(log_dir / f"serve{i}.log", "w+")
        logs.append(log)
        processes.append(subprocess.Popen([sys.executable, "-m", "vlrl.cli", "serve", "--model", model, "--port", "0",
                                           "--threads", "1"], stdout=log, stderr=subprocess.STDOUT, env=env))
    for process, log in zip(processes, logs, strict=True):
        deadline = time.time() + 300
        while True:
            log.seek(0)
            found = [line for line in log.read().splitlines() if "listening on " in line]
            if found:
                urls.append(found[0].split("listening on ")[1].split()[0])
                break
            if process.poll() is not None or time.time() > deadline:
                log.seek(0)
                raise RuntimeError(f"vlrl serve did not start: {log.read()[-2000:]}")
            time.sleep(0.2)
    return processes, urls


def nudge(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1e-4)


def measure(policy, urls: list[str], weights_dir: Path, method: str, updates: int, version: int) -> tuple[dict, int]:
    engine = HTTPEngine(policy, urls, weights_dir=weights_dir, api_key=KEY, weight_sync=method, request_timeout=600)
    try:
        first = None
        times = []
        for k in range(updates + 1):
            nudge(policy.model)
            version += 1
            start = time.perf_counter()
            engine.update_weights(version=version)
            seconds = time.perf_counter() - start
            assert engine.last_sync is not None and engine.last_sync.method == method, engine.last_sync
            if k == 0:
                first = seconds
            else:
                times.append(seconds)
        return {"first": first, "median": statistics.median(times), "bytes": engine.last_sync.bytes}, version
    finally:
        engine.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--updates", type=int, default=5)
    parser.add_argument("--presets", default="tiny-qwen2-vl,tiny-qwen2-vl-20m")
    parser.add_argument("--servers", default="1,2")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for preset in args.presets.split(","):
            policy = load_policy(preset)
            model_dir = tmp / preset
            policy.save(model_dir)
            for n in [int(x) for x in args.servers.split(",")]:
                processes, urls = start_servers(str(model_dir), n, tmp)
                try:
                    version = 0
                    for method in ("disk", "distributed"):
                        result, version = measure(policy, urls, tmp / "weights", method, args.updates, version)
                        rows.append((preset, n, method, result))
                        print(f"{preset} ×{n} {method}: {result}", flush=True)
                finally:
                    for process in processes:
                        process.terminate()
                        process.wait(60)
    print(f"\n| preset | servers | method | s/update (median of {args.updates}) | first update (s) | MB sent |")
    print("| --- | --- | --- | --- | --- | --- |")
    for preset, n, method, r in rows:
        print(f"| {preset} | {n} | {method} | {r['median']:.3f} | {r['first']:.3f} | {r['bytes'] / 1e6:.1f} |")


if __name__ == "__main__":
    main()
