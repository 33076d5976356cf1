"""GPU check of the distributed weight-sync path (issue 35, fix 2). NOT RUN ON A GPU YET: written on a CPU-only
machine (2026-11-28), where only a dry run passed — check 2 on the CPU with gloo, and check 1 with the CPU standing
in for the GPU, gloo for NCCL and its CUDA assertions removed. `benchmarks/gpu_check.py` (or a person) is meant to
call `run_all()` on a lent GPU machine.

What it checks, each step printing one JSON line (``check``, ``ok``, numbers, the error if any):

1. ``nccl_bucket_path`` — one GPU, one process: the tiny Qwen2-VL preset (or ``--model``) on ``cuda``, its buckets
   planned as `HTTPEngine` plans them (`dist_sync.plan_entries` / `buckets`, bfloat16 send dtype), each gathered
   with `dist_sync.full_tensors` onto `dist_sync.group_device("nccl")` and packed with `dist_sync.pack` — the
   buffer must be a CUDA tensor, every bucket aligned (`dist_sync.unaligned_entry` None) — then broadcast over a
   one-rank NCCL group (`dist_sync.open_group(world_size=1, backend="nccl")`: NCCL needs one GPU per rank, so one
   process can only broadcast to itself, which still runs NCCL's collective on the buffer). The streamed checksum
   of the bytes sent must equal `weight_checksum` of the model cast to bfloat16. Before the fix the buffer was
   built on the CPU and NCCL refused it.
2. ``gloo_cuda_sync`` — one GPU, two processes: `vlrl serve --device cuda` and an `HTTPEngine` over the CUDA policy
   with ``weight_sync="distributed"`` and ``sync_backend="gloo"`` (two NCCL ranks cannot share one GPU): two updates
   (the second reuses the group), each server's checksum equal to the trainer's, ``last_sync.method ==
   "distributed"``, nothing written under the weights directory; the servers are paused and continued around each
   update. Gloo moves the CUDA tensors through host copies.
3. ``nccl_two_gpus`` — only when ``torch.cuda.device_count() >= 2``: the same with `vlrl serve --device cuda:1`,
   the trainer on ``cuda:0`` and the default backend (NCCL).
4. ``nccl_unanswered_broadcast`` (issue 46) — only with two GPUs: what gloo cannot show. A group is formed with
   `vlrl serve --device cuda:1` over NCCL, then the trainer broadcasts a bucket the server was never told of (as if it
   had refused it): NCCL creates the communicator inside that first collective and waits there for the server.
   Reported: whether the call blocked the thread that made it (``call_blocked``), that `dist_sync.broadcast` still
   gave up at its timeout (``abandoned_after_s``), whether tearing the group down released the blocked thread
   (``released_by_teardown``), and that the next update then goes over a new group with the trainer's checksum.

Checks 2–4 run `vlrl serve` in the session SGLang requires (``/begin_weight_update`` … ``/end_weight_update``) with the
cache flushed first; every update must go by the group (``fallbacks`` empty). `vlrl serve` needs fastapi, starlette
and uvicorn, which the device image lacks: `benchmarks/gpu_wheels.sh` gathers them with the other wheels.

    PYTHONPATH=src python benchmarks/gpu_weight_sync.py [--model tiny-qwen2-vl] [--timeout 300]
    PYTHONPATH=src python benchmarks/gpu_weight_sync.py --dry-run   # no GPU: checks 2 and 4 on the CPU over gloo

Exit status 0 only if every check that ran passed. Nothing here downloads anything (the presets build offline).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

KEY = "gpu-check-key"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _report(check: str, fn, *args) -> dict:
    started = time.monotonic()
    try:
        out = {"check": check, "ok": True, **(fn(*args) or {})}
    except Exception as err:  # noqa: BLE001 — reported, the next check still runs
        out = {"check": check, "ok": False, "error": f"{type(err).__name__}: {err}",
               "traceback": traceback.format_exc()[-3000:]}
    out["seconds"] = round(time.monotonic() - started, 2)
    print(json.dumps(out), flush=True)
    return out


def nccl_bucket_path(model: str) -> dict:
    from vlrl.models import load_policy
    from vlrl.rollout import dist_sync
    from vlrl.rollout.weights import weight_checksum

    policy = load_policy(model, device="cuda")
    state = policy.model.state_dict()
    device = dist_sync.group_device("nccl")
    assert device.type == "cuda", device
    entries = dist_sync.plan_entries(state, None)
    planned = dist_sync.buckets(entries, send_dtype=torch.bfloat16, bucket_bytes=1 << 20)
    group = dist_sync.open_group("127.0.0.1", _free_port(), rank=0, world_size=1, group_name="gpu_check",
                                 backend="nccl", timeout=60)
    checksum = dist_sync.StreamingChecksum([torch.bfloat16])
    buffer, sent = dist_sync.ByteBuffer(), 0
    try:
        for bucket in planned:
            gathered = dist_sync.full_tensors(state, bucket, device)
            dtypes = [e.send_dtype(torch.bfloat16) for e in bucket]
            assert dist_sync.unaligned_entry(dtypes, [e.shape for e in bucket]) is None
            flat, raw = dist_sync.pack(gathered, dtypes, buffer, device)
            assert flat.is_cuda, flat.device
            torch.distributed.broadcast(flat, src=0, group=group)
            for entry, tensor, piece, dtype in zip(bucket, gathered, raw, dtypes, strict=True):
                checksum.add(entry, tensor, sent=piece, sent_dtype=dtype)
            sent += flat.numel()
        torch.cuda.synchronize()
    finally:
        dist_sync.close_group(group)
    expected = weight_checksum(policy.model, dtype=torch.bfloat16)
    assert checksum.digest(torch.bfloat16) == expected, "the bytes broadcast are not the model's"
    return {"buckets": len(planned), "bytes": sent, "device": str(device)}


def _serve(model: str, device: str, log: Path, timeout: float) -> tuple[subprocess.Popen, str]:
    out = open(log, "w+")
    process = subprocess.Popen([sys.executable, "-m", "vlrl.cli", "serve", "--model", model, "--port", "0",
                                "--device", device, "--dtype", "float32"], stdout=out, stderr=subprocess.STDOUT,
                               env=dict(os.environ, VLRL_API_KEY=KEY))
    deadline = time.time() + timeout
    while time.time() < deadline:
        out.seek(0)
        found = [line for line in out.read().splitlines() if "listening on " in line]
        if found:
            return process, found[0].split("listening on ")[1].split()[0]
        if process.poll() is not None:
            break
        time.sleep(0.5)
    process.kill()
    out.seek(0)
    raise RuntimeError(f"vlrl serve --device {device} did not start: {out.read()[-2000:]}")


def _sync_to_server(model: str, trainer_device: str, server_device: str, backend: str | None, timeout: float) -> dict:
    import httpx

    from vlrl.models import load_policy
    from vlrl.rollout.http_engine import HTTPEngine
    from vlrl.rollout.http_settings import ClientSettings, SyncSettings
    from vlrl.rollout.weights import weight_checksum

    with tempfile.TemporaryDirectory() as tmp:
        process, url = _serve(model, server_device, Path(tmp) / "serve.log", timeout)
        try:
            policy = load_policy(model, device=trainer_device)
            engine = HTTPEngine(policy, [url], SyncSettings(
                weights_dir=Path(tmp) / "weights", method="distributed", backend=backend, timeout=timeout,
                on_weight_update="retract", bucket_mb=1.0), ClientSettings(api_key=KEY))
            try:
                for version in (1, 2):
                    with torch.no_grad():
                        for p in policy.model.parameters():
                            p.add_(0.01)
                    engine.update_weights(version=version)
                    info = httpx.get(f"{url}/server_info", headers={"Authorization": f"Bearer {KEY}"}, timeout=60).json()
                    assert engine.last_sync.method == "distributed", engine.last_sync
                    assert info["weight_version"] == str(version) and info["paused"] is None, info
                    assert info["weight_checksum"] == weight_checksum(policy.model), "checksum mismatch"
                assert not (Path(tmp) / "weights").exists(), "an update went through the disk"
                assert engine.weights.fallbacks == [], engine.weights.fallbacks
                return {"buckets": engine.last_sync.buckets, "bytes": engine.last_sync.bytes,
                        "update_seconds": round(engine.last_sync.seconds, 3), "backend": engine.weights.group.backend}
            finally:
                engine.close()
        finally:
            process.terminate()
            process.wait(60)


def unanswered_broadcast(model: str, trainer_device: str, server_device: str, backend: str | None,
                         timeout: float) -> dict:
    """Check 4: a bucket broadcast no server receives, on a freshly formed group (see the module docstring)."""
    import threading

    from vlrl.models import load_policy
    from vlrl.rollout import dist_sync
    from vlrl.rollout.http_engine import HTTPEngine
    from vlrl.rollout.http_settings import ClientSettings, SyncSettings

    with tempfile.TemporaryDirectory() as tmp:
        process, url = _serve(model, server_device, Path(tmp) / "serve.log", timeout)
        try:
            policy = load_policy(model, device=trainer_device)
            engine = HTTPEngine(policy, [url], SyncSettings(
                weights_dir=Path(tmp) / "weights", method="distributed", backend=backend, timeout=30, deadline=120,
                bucket_mb=1.0), ClientSettings(api_key=KEY))
            try:
                group = engine.weights.group
                group.form(engine.live_servers())
                flat = torch.zeros(1 << 20, dtype=torch.uint8, device=group.device)
                callers = set(threading.enumerate())
                started = time.monotonic()
                try:
                    dist_sync.broadcast(group.group, flat, settled=threading.Event(), timeout=10)
                    abandoned = None
                except dist_sync.Abandoned:
                    abandoned = round(time.monotonic() - started, 2)
                stuck = [t for t in threading.enumerate() if t not in callers and t.name == "vlrl-broadcast"]
                blocked = any(t.is_alive() for t in stuck)
                group.destroy(timeout=30)
                time.sleep(5)
                released = not any(t.is_alive() for t in stuck)
                engine.update_weights(version=1)  # the next update: a new group, the trainer's checksum
                assert engine.last_sync.method == "distributed" and engine.weights.fallbacks == []
                return {"call_blocked": blocked, "abandoned_after_s": abandoned, "released_by_teardown": released,
                        "backend": group.backend, "next_update_seconds": round(engine.last_sync.seconds, 3)}
            finally:
                engine.close()
        finally:
            process.terminate()
            process.wait(60)


def run_all(model: str = "tiny-qwen2-vl", timeout: float = 300.0, *, dry_run: bool = False) -> list[dict]:
    """Every check this machine can run; one dict per check (also printed as JSON lines). ``dry_run``: no GPU —
    checks 2 and 4 on the CPU over gloo (what they assert on the protocol, not what they measure on a GPU)."""
    if dry_run:
        return [_report("gloo_cuda_sync (CPU dry run)", _sync_to_server, model, "cpu", "cpu", "gloo", timeout),
                _report("nccl_unanswered_broadcast (CPU dry run, gloo)", unanswered_broadcast, model, "cpu", "cpu",
                        "gloo", timeout)]
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device: this script checks the GPU path (--dry-run: its CPU rehearsal)")
    results = [_report("nccl_bucket_path", nccl_bucket_path, model),
               _report("gloo_cuda_sync", _sync_to_server, model, "cuda", "cuda", "gloo", timeout)]
    if torch.cuda.device_count() >= 2:
        results.append(_report("nccl_two_gpus", _sync_to_server, model, "cuda:0", "cuda:1", None, timeout))
        results.append(_report("nccl_unanswered_broadcast", unanswered_broadcast, model, "cuda:0", "cuda:1", None,
                               timeout))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-qwen2-vl")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--dry-run", action="store_true", help="no GPU: checks 2 and 4 on the CPU over gloo")
    args = parser.parse_args()
    results = run_all(args.model, args.timeout, dry_run=args.dry_run)
    sys.exit(0 if all(r["ok"] for r in results) else 1)


if __name__ == "__main__":
    main()
