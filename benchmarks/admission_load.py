"""The p99 of a normal client of `vlrl serve` under issue 47's three hostile loads, and the server's memory.

Starts `vlrl serve` (the tiny Qwen2-VL preset, one torch thread, its limits at their defaults) as a subprocess on a
free loopback port — a fresh one per scenario, warmed up by two requests — then for each scenario runs ``--clients`` client threads that each send ``--requests`` normal
requests (alternately a text prompt and a prompt with one 56² image, ``--max-new-tokens`` sampled tokens) while one
hostile load runs beside them, from a process of its own (another client):

- ``baseline``: none;
- ``poison`` (item 3): a loop of ``{"text": "hi <|video_pad|> x"}`` without a video and two adjacent
  ``<|image_pad|>`` with two images (before: each failed its whole decode batch — normal clients got 500);
- ``queued_images`` (item 6): rounds of 8 concurrent requests of one 4096² image each, abandoned after 3 s
  (before: they kept their decoded images while queued, 1.0 → 4.4 GB, 4.06 GB still held after the cancel);
- ``idle_declarations`` (item 7): 8 connections that each declare ``Content-Length: 33554432`` and send nothing,
  reopened as soon as the server closes one (before: the declarations reserved the whole 256 MB in-flight cap and
  every other client got 503 for 60 s, renewable).

Prints, per scenario: the normal requests' count, errors (by status), p50 and p99 latency, and the server's RSS
(before the scenario, its peak during it, and 3 s after it ended). The same script runs against an older tree
(``PYTHONPATH=old/src``): it passes no option that tree lacks.

    python benchmarks/admission_load.py                  # 4 clients × 20 requests, 8 new tokens
    python benchmarks/admission_load.py --quick          # 2 clients × 6 requests
    python benchmarks/admission_load.py --only poison    # one scenario (after the baseline)
"""

from __future__ import annotations

import argparse
import base64
import io
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

KEY = "bench-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


def start_server(log_path: str) -> tuple[subprocess.Popen, str]:
    log = open(log_path, "w+")  # noqa: SIM115  (kept open for the server's lifetime)
    process = subprocess.Popen([sys.executable, "-m", "vlrl.cli", "serve", "--model", "tiny-qwen2-vl", "--port", "0",
                                "--threads", "1"], stdout=log, stderr=subprocess.STDOUT,
                               env={**os.environ, "VLRL_API_KEY": KEY, "OMP_NUM_THREADS": "1"})
    deadline = time.time() + 180
    while time.time() < deadline:
        log.seek(0)
        for line in log.read().splitlines():
            if "listening on " in line:
                return process, line.split("listening on ")[1].split()[0]
        if process.poll() is not None:
            log.seek(0)
            raise SystemExit(f"vlrl serve exited:\n{log.read()[-3000:]}")
        time.sleep(0.2)
    process.kill()
    raise SystemExit("vlrl serve did not start within 180 s")


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def png_url(width: int, height: int, noise: bool = False) -> str:
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8) if noise else \
        np.full((height, width, 3), 128, np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


IMAGE_PROMPT = "<|vision_start|><|image_pad|><|vision_end|> What is it?"


def normal_load(url: str, clients: int, requests: int, max_new_tokens: int) -> tuple[list[float], dict[int, int]]:
    import httpx

    small = png_url(56, 56)
    latencies: list[float] = []
    errors: dict[int, int] = {}
    lock = threading.Lock()

    def client(k: int) -> None:
        with httpx.Client(base_url=url, headers=AUTH, timeout=120) as own:
            for i in range(requests):
                body = {"text": "What is 2+2?", "sampling_params": {"max_new_tokens": max_new_tokens}} if (k + i) % 2 \
                    else {"text": IMAGE_PROMPT, "image_data": small, "sampling_params": {"max_new_tokens": max_new_tokens}}
                start = time.perf_counter()
                try:
                    status = own.post("/generate", json=body).status_code
                except httpx.HTTPError:
                    status = -1
                with lock:
                    latencies.append(time.perf_counter() - start)
                    if status != 200:
                        errors[status] = errors.get(status, 0) + 1

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return latencies, errors


def hostile_poison(url: str, stop: threading.Event) -> None:
    import httpx

    image = png_url(56, 56)
    bodies = [{"text": "hi <|video_pad|> x"}, {"text": "<|image_pad|><|image_pad|>", "image_data": [image, image]}]
    with httpx.Client(base_url=url, headers=AUTH, timeout=120) as client:
        k = 0
        while not stop.is_set():
            client.post("/generate", json={**bodies[k % 2], "sampling_params": {"max_new_tokens": 8}})
            k += 1


def _raw(url: str, payload: bytes, declared: int | None = None) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    length = len(payload) if declared is None else declared
    sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Authorization: Bearer {KEY}\r\nContent-Length: {length}\r\n\r\n".encode() + payload)
    return sock


def hostile_queued_images(url: str, stop: threading.Event) -> None:
    import json

    payload = json.dumps({"text": IMAGE_PROMPT, "image_data": png_url(4096, 4096),
                          "sampling_params": {"max_new_tokens": 512}}).encode()
    while not stop.is_set():
        socks = [_raw(url, payload) for _ in range(8)]
        stop.wait(3.0)
        for sock in socks:  # abandoned: the server cancels them
            sock.close()


def hostile_idle_declarations(url: str, stop: threading.Event) -> None:
    import selectors

    selector = selectors.DefaultSelector()
    for _ in range(8):
        selector.register(_raw(url, b"", declared=32 << 20), selectors.EVENT_READ)
    while not stop.is_set():
        for key, _ in selector.select(timeout=0.2):  # the server answered one (408): open another
            selector.unregister(key.fileobj)
            key.fileobj.close()
            selector.register(_raw(url, b"", declared=32 << 20), selectors.EVENT_READ)
    for key in list(selector.get_map().values()):
        key.fileobj.close()


SCENARIOS = {"baseline": None, "poison": hostile_poison, "queued_images": hostile_queued_images,
             "idle_declarations": hostile_idle_declarations}


def run(url: str, pid: int, name: str, args: argparse.Namespace) -> None:
    stop, peak = threading.Event(), [0.0]
    before = rss_mb(pid)

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], rss_mb(pid))
            time.sleep(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    attacker = None
    if SCENARIOS[name] is not None:  # another client: a process of its own
        attacker = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--hostile", name, "--url", url])
        time.sleep(2.0)  # the hostile load is on before the normal one starts
    latencies, errors = normal_load(url, args.clients, args.requests, args.max_new_tokens)
    stop.set()
    if attacker is not None:
        attacker.terminate()
        attacker.wait(timeout=30)
    time.sleep(3.0)
    after = rss_mb(pid)
    ordered = sorted(latencies)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    print(f"{name:18s} requests {len(latencies):3d}  errors {dict(sorted(errors.items())) or 0}  "
          f"p50 {statistics.median(latencies):6.2f} s  p99 {p99:6.2f} s  server RSS {before:6.0f} → peak "
          f"{peak[0]:6.0f} → after {after:6.0f} MB", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", choices=[n for n in SCENARIOS if n != "baseline"])
    parser.add_argument("--hostile", choices=[n for n in SCENARIOS if n != "baseline"], help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.hostile:  # (the hostile client's own process, until it is terminated)
        signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
        SCENARIOS[args.hostile](args.url, threading.Event())
        return
    if args.quick:
        args.clients, args.requests = 2, 6
    import vlrl

    print(f"vlrl from {os.path.dirname(vlrl.__file__)}; load average {os.getloadavg()[0]:.2f} "
          f"on {os.cpu_count()} CPUs", flush=True)
    names = ["baseline", args.only] if args.only else list(SCENARIOS)
    for name in names:  # a fresh server for each: nothing one load left behind counts against the next
        process, url = start_server(f"/tmp/vlrl-admission-{os.getpid()}-{name}.log")
        try:
            warm = normal_load(url, 1, 2, args.max_new_tokens)  # (first requests: lazy set-up)
            assert not warm[1], warm
            run(url, process.pid, name, args)
        finally:
            process.terminate()
            process.wait(timeout=60)
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
