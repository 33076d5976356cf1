"""A bounded mixed load against `vlrl serve`: normal requests from several clients, and one hostile request of
each kind issue 22 found, sent while the normal load runs.

Starts `vlrl serve` (the tiny Qwen2-VL preset, one torch thread, ``--max-queued-requests 64``, the other limits at
their defaults) as a subprocess on a free loopback port, warms it up, then runs ``--clients`` client threads that each send ``--requests`` normal requests (a shapes
prompt with its image, ``--max-new-tokens`` sampled tokens). Once the load is running, one hostile request of each
kind is sent from another thread:

- ``max_new_tokens_1e9``: ``max_new_tokens`` = 10⁹ (accepted and decoded forever before)
- ``batch_200x4``: 200 prompts × n = 4 = 800 samples against a queue of 64 (bypassed the queue bound before)
- ``temperature_1e308`` / ``lone_surrogate``: a bare 500 before
- ``body_50mb_chunked``: a 50 MB body sent chunked (no Content-Length; parsed on the event loop before)
- ``image_9000x9000``: a 10 KB PNG of 9000² (decoded on the event loop before)
- ``eps_image``: an EPS image (decoded with Ghostscript before)
- ``server_path``: ``image_data`` naming /etc/hostname (a file-existence oracle before)
- ``disconnect``: a 1,500-token request whose client goes away after 0.3 s (decoded on before)

    python benchmarks/server_load.py                 # 4 clients × 25 requests, 16 new tokens
    python benchmarks/server_load.py --quick         # 2 clients × 5 requests
    python benchmarks/server_load.py --no-hostile    # the same normal load alone: the baseline to compare with

Prints requests/s, p50/p99 latency and errors of the normal requests, the status and first words of the answer to
each hostile request, and the server's counters (decode steps, cancelled jobs, early stops: a job stopped while
decoding). Goal (issue 22): 0 errors for the
normal requests, each hostile one refused (4xx) or capped, the disconnected one stopped early. The machine's load
average is printed: other processes on the same cores distort the timings.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

KEY = "bench-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


def start_server(log_path: str) -> tuple[subprocess.Popen, str]:
    log = open(log_path, "w+")  # noqa: SIM115  (kept open for the server's lifetime)
    process = subprocess.Popen([sys.executable, "-m", "vlrl.cli", "serve", "--model", "tiny-qwen2-vl", "--port", "0",
                                "--threads", "1", "--max-queued-requests", "64"], stdout=log, stderr=subprocess.STDOUT,
                               env={**os.environ, "VLRL_API_KEY": KEY, "OMP_NUM_THREADS": "1"})
    deadline = time.time() + 180
    while time.time() < deadline:
        log.seek(0)
        for line in log.read().splitlines():
            if "listening on " in line:
                return process, line.split("listening on ")[1].split()[0]
        if process.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"vlrl serve exited: {log.read()}")
        time.sleep(0.2)
    raise TimeoutError("vlrl serve did not start")


def png(width: int, height: int, mode: str = "RGB") -> str:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new(mode, (width, height)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def eps() -> str:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buffer, format="EPS")
    return "data:image/eps;base64," + base64.b64encode(buffer.getvalue()).decode()


def normal_body(max_new_tokens: int) -> dict:
    from vlrl.data import generate
    from vlrl.data.sample import load_image
    from vlrl.models import load_policy

    sample = generate("shapes", 1, tasks=["count"])[0]
    policy = load_policy("tiny-qwen2-vl")
    text = policy.adapter.render(sample.messages)  # one <|image_pad|> per image: the server expands it
    images = []
    for source in sample.images:
        buffer = io.BytesIO()
        load_image(source).save(buffer, format="PNG")
        images.append("data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode())
    return {"text": text, "image_data": images, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 1.0}}


def hostile_requests(url: str, client) -> dict[str, str]:
    """Send one hostile request of each kind; (kind → outcome)."""
    out: dict[str, str] = {}
    plain = {
        "max_new_tokens_1e9": {"text": "hi", "sampling_params": {"max_new_tokens": 1_000_000_000, "temperature": 0}},
        "batch_200x4": {"text": ["hi"] * 200, "sampling_params": {"n": 4, "max_new_tokens": 2}},
        "temperature_1e308": {"text": "hi", "sampling_params": {"temperature": 1e308}},
        "image_9000x9000": {"text": "<|image_pad|>", "image_data": png(9000, 9000, "1")},
        "eps_image": {"text": "<|image_pad|>", "image_data": eps()},
        "server_path": {"text": "<|image_pad|>", "image_data": "/etc/hostname"},
    }
    for kind, body in plain.items():
        response = client.post(f"{url}/generate", json=body, headers=AUTH)
        out[kind] = f"{response.status_code} {response.text[:110]}"
    response = client.post(f"{url}/generate", content=b'{"text": "hi \\ud800"}',
                           headers={**AUTH, "content-type": "application/json"})
    out["lone_surrogate"] = f"{response.status_code} {response.text[:110]}"
    big = json.dumps({"text": "hello world " * (50_000_000 // 12)}).encode()

    def chunks():
        for start in range(0, len(big), 1 << 16):
            yield big[start : start + (1 << 16)]

    try:
        response = client.post(f"{url}/generate", content=chunks(), headers={**AUTH, "content-type": "application/json"})
        out["body_50mb_chunked"] = f"{response.status_code} {response.text[:110]}"
    except Exception as err:  # noqa: BLE001  (the server may close the connection while the body is still sent)
        out["body_50mb_chunked"] = f"connection closed by the server while sending ({type(err).__name__})"
    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps({"text": "hi", "sampling_params": {"max_new_tokens": 1500, "temperature": 1.0}}).encode()
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(payload)}\r\n\r\n".encode() + payload)
        time.sleep(0.3)
    out["disconnect"] = "client went away after 0.3 s (see early_stops below)"
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--requests", type=int, default=25, help="normal requests per client")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="2 clients × 5 requests")
    parser.add_argument("--no-hostile", action="store_true", help="the normal load alone (a baseline)")
    args = parser.parse_args()
    if args.quick:
        args.clients, args.requests = 2, 5
    import httpx

    with tempfile.TemporaryDirectory() as tmp:
        process, url = start_server(os.path.join(tmp, "serve.log"))
        try:
            body = normal_body(args.max_new_tokens)
            with httpx.Client(timeout=120) as warm:
                for _ in range(3):
                    warm.post(f"{url}/generate", json=body, headers=AUTH).raise_for_status()
            latencies: list[float] = []
            errors: list[str] = []
            started = threading.Event()

            def client_loop() -> None:
                with httpx.Client(timeout=120) as client:
                    started.set()
                    for _ in range(args.requests):
                        t0 = time.perf_counter()
                        try:
                            response = client.post(f"{url}/generate", json=body, headers=AUTH)
                            ok = response.status_code == 200
                            if not ok:
                                errors.append(f"{response.status_code} {response.text[:200]}")
                        except Exception as err:  # noqa: BLE001
                            errors.append(f"{type(err).__name__}: {err}")
                        latencies.append(time.perf_counter() - t0)

            hostile: dict[str, str] = {}
            threads = [threading.Thread(target=client_loop) for _ in range(args.clients)]
            t0 = time.perf_counter()
            for thread in threads:
                thread.start()
            started.wait()
            if not args.no_hostile:
                with httpx.Client(timeout=120) as client:
                    hostile = hostile_requests(url, client)
            for thread in threads:
                thread.join()
            wall = time.perf_counter() - t0
            with httpx.Client(timeout=30) as client:
                info = client.get(f"{url}/get_model_info", headers=AUTH).json()
        finally:
            process.terminate()
            process.wait(timeout=60)
    ordered = sorted(latencies)
    n = len(ordered)
    print(f"normal requests: {n} from {args.clients} clients, {args.max_new_tokens} new tokens each, "
          f"while {len(hostile)} hostile requests arrived")
    print(f"  requests/s {n / wall:.2f}   p50 {statistics.median(ordered) * 1000:.0f} ms   "
          f"p99 {ordered[min(n - 1, int(0.99 * n))] * 1000:.0f} ms   errors {len(errors)}")
    for error in errors[:5]:
        print(f"    error: {error}")
    print("hostile requests:")
    for kind, outcome in hostile.items():
        print(f"  {kind:<20} {outcome}")
    if hostile:
        refused = sum(outcome.startswith(("400", "413")) for outcome in hostile.values())
        print(f"  refused {refused} of {len(hostile) - 1}; the disconnected one cancelled: {info['cancelled'] == 1} "
              f"({'stopped while decoding' if info['early_stops'] else 'before it decoded'})")
    print(f"server: decode_steps {info['decode_steps']}, cancelled {info['cancelled']}, early_stops {info['early_stops']}, "
          f"rows {info['rows']}, batches {info['batches']}, exit code after SIGTERM {process.returncode}")
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
