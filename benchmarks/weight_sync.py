"""Weight sync to rollout servers: seconds per update by disk (save_pretrained + /update_weights_from_disk) and by
the distributed path (SGLang's /update_weights_from_distributed over a gloo group), to 1 and 2 `vlrl serve`
processes, for the 1M and 20M presets, run side by side on the same servers.

    PYTHONPATH=src python benchmarks/weight_sync.py [--updates 5] [--presets tiny-qwen2-vl,tiny-qwen2-vl-20m]

Each update nudges every parameter (so each is a real new version), then times `HTTPEngine.update_weights` from
the call to every server's checksum-verified confirmation; the two methods' updates alternate on the same
servers; the table shows the median over ``--updates`` after one warm-up update per method (the first distributed
update also forms the group; it is timed separately).
"Bytes" is one copy of the weights as sent (disk: the safetensors file written; distributed: the broadcast
payload). One torch thread per process; servers share the machine's cores with the trainer.

The floor: a bare ``torch.distributed.broadcast`` of the same number of bytes over gloo from rank 0 to 1 and to 2
receiver processes (no HTTP, no packing, no checksum, no load; median of 5 after a warm-up). Gloo broadcasts on
a binomial tree without pipelining: rank 0 sends the whole payload to ranks 1, 2, 4, ...; with 1 + 2 ranks that is
two copies from rank 0, so to 2 receivers the floor is twice the floor to 1.
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
from vlrl.rollout.http_settings import ClientSettings, SyncSettings

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


def measure(policy, urls: list[str], weights_dir: Path, updates: int) -> dict[str, dict]:
    """Both methods on the same servers, their updates interleaved (disk, distributed, disk, ...) so a load change
    on the shared machine hits both alike."""
    engines = {method: HTTPEngine(policy, urls, SyncSettings(weights_dir=weights_dir / method, method=method),
                                  ClientSettings(api_key=KEY, request_timeout=600)) for method in ("disk", "distributed")}
    times: dict[str, list[float]] = {method: [] for method in engines}
    version = 0
    try:
        for _ in range(updates + 1):
            for method, engine in engines.items():
                nudge(policy.model)
                version += 1
                start = time.perf_counter()
                engine.update_weights(version=version)
                times[method].append(time.perf_counter() - start)
                assert engine.last_sync is not None and engine.last_sync.method == method, engine.last_sync
        return {method: {"first": times[method][0], "median": statistics.median(times[method][1:]),
                         "bytes": engine.last_sync.bytes} for method, engine in engines.items()}
    finally:
        for engine in engines.values():
            engine.close()


def _raw_rank(rank: int, world: int, port: int, nbytes: int, repeats: int, out) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    payload = torch.full((nbytes,), 7, dtype=torch.uint8) if rank == 0 else torch.empty(nbytes, dtype=torch.uint8)
    times = []
    for _ in range(repeats + 1):
        dist.barrier()
        start = time.perf_counter()
        dist.broadcast(payload, src=0)
        dist.barrier()  # every receiver has it
        times.append(time.perf_counter() - start)
    assert int(payload[-1]) == 7
    if rank == 0:
        out.put(statistics.median(times[1:]))
    dist.destroy_process_group()


def raw_broadcast(nbytes: int, receivers: int, repeats: int = 5) -> float:
    """Median seconds of one gloo broadcast of ``nbytes`` from rank 0 to ``receivers`` processes."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_raw_rank, args=(1 + receivers, port, nbytes, repeats, out), nprocs=1 + receivers)
    return out.get()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--updates", type=int, default=5)
    parser.add_argument("--presets", default="tiny-qwen2-vl,tiny-qwen2-vl-20m")
    parser.add_argument("--servers", default="1,2")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows, floors = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for preset in args.presets.split(","):
            policy = load_policy(preset)
            model_dir = tmp / preset
            policy.save(model_dir)
            for n in [int(x) for x in args.servers.split(",")]:
                processes, urls = start_servers(str(model_dir), n, tmp)
                try:
                    for method, result in measure(policy, urls, tmp / "weights", args.updates).items():
                        rows.append((preset, n, method, result))
                        print(f"{preset} ×{n} {method}: {result}", flush=True)
                finally:
                    for process in processes:
                        process.terminate()
                        process.wait(60)
                floors[preset, n] = raw_broadcast(rows[-1][3]["bytes"], n)
                print(f"{preset} ×{n} raw gloo broadcast: {floors[preset, n]:.3f} s", flush=True)
    print(f"\n| preset | servers | method | s/update (median of {args.updates}) | first update (s) | MB sent |")
    print("| --- | --- | --- | --- | --- | --- |")
    for preset, n, method, r in rows:
        print(f"| {preset} | {n} | {method} | {r['median']:.3f} | {r['first']:.3f} | {r['bytes'] / 1e6:.1f} |")
    median = {(preset, n, method): r["median"] for preset, n, method, r in rows}
    print("\n| preset | servers | disk (s) | distributed (s) | distributed / disk | bare gloo broadcast (s) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for preset, n in floors:
        disk, distributed = median[preset, n, "disk"], median[preset, n, "distributed"]
        print(f"| {preset} | {n} | {disk:.3f} | {distributed:.3f} | {distributed / disk:.2f} | {floors[preset, n]:.3f} |")


if __name__ == "__main__":
    main()
