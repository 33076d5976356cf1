"""`vlrl.rollout.engine_launch`: servers started on loopback with a generated key, waited for, stopped; a server that
exits or never becomes ready is a clear error naming the engine, the command and its last log lines. The servers here
are small Python programs (the real engines' start-up is minutes: tests/rollout/test_vllm_live.py starts vLLM)."""

import sys
import time
from pathlib import Path

import httpx
import pytest

import forked_runs  # tests/ is on sys.path
from vlrl.rollout.engine_launch import ServerLaunchError, engine_command, engine_python, launch_servers

HEALTHY = """
import http.server, os, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        key_ok = os.environ["VLRL_API_KEY"] == os.environ["VLRL_ADMIN_API_KEY"] != ""
        self.send_response(200 if self.path == "/health" and key_ok else 404); self.end_headers()
        self.wfile.write(os.environ.get("VLLM_SERVER_DEV_MODE", "-").encode())
    def log_message(self, *a): pass
print("serving", sys.argv[1], flush=True)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_servers_start_answer_and_stop(tmp_path):
    servers = launch_servers("vllm", 2, model="m", dtype="float32", log_dir=tmp_path,
                             command=[sys.executable, "-c", HEALTHY, "{port}"], timeout=30)
    try:
        assert len(set(servers.urls)) == 2 and all(u.startswith("http://127.0.0.1:") for u in servers.urls)
        assert len(servers.api_key) >= 24
        answer = httpx.get(f"{servers.urls[0]}/health", timeout=5)
        assert answer.status_code == 200 and answer.text == "1"  # vLLM's RL routes switched on
        assert "serving" in (tmp_path / "server-1.log").read_text()
    finally:
        servers.stop()
    assert all(s.process.poll() is not None for s in servers.servers)
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{servers.urls[0]}/health", timeout=2)


def test_a_server_that_exits_is_named_with_its_last_lines(tmp_path):
    crash = "import sys; print('loading weights'); print('PackageNotFoundError: vllm', flush=True); sys.exit(3)"
    started = time.monotonic()
    with pytest.raises(ServerLaunchError) as error:
        launch_servers("vllm", 1, model="m", dtype="float32", log_dir=tmp_path, command=[sys.executable, "-c", crash],
                       timeout=60)
    message = str(error.value)
    assert "vllm rollout server 0" in message and "exited with code 3" in message
    assert "PackageNotFoundError: vllm" in message and "loading weights" in message
    assert time.monotonic() - started < 30  # not the timeout: the exit is seen at once


def test_a_server_never_ready_times_out_and_is_stopped(tmp_path):
    silent = "import time; print('compiling', flush=True); time.sleep(60)"
    with pytest.raises(ServerLaunchError, match="did not answer /health within rollout.servers.launch.timeout=1 s"):
        launch_servers("sglang", 1, model="m", dtype="float32", log_dir=tmp_path,
                       command=[sys.executable, "-c", silent], timeout=1)


def test_engine_commands():
    vllm = engine_command("vllm", "/v/python", model="/m", host="127.0.0.1", port=9, dtype="float32", api_key="k")
    assert vllm[:3] == ["/v/python", "-m", "vllm.entrypoints.openai.api_server"]  # (the `vllm` command crashes)
    assert "--enable-scale-out" in vllm and "--api-key=k" in vllm
    # a generated key may begin with "-": as "--api-key KEY" argparse (vLLM's and SGLang's parsers; vLLM's takes one
    # or more keys) took it for an option and the server exited with code 2 — one run of the suite on 2026-12-07
    import argparse

    parser = argparse.ArgumentParser(exit_on_error=False)
    parser.add_argument("--api-key", nargs="+")
    for engine in ("vllm", "sglang"):
        command = engine_command(engine, "/v/python", model="/m", host="h", port=9, dtype="float32", api_key="-wp5w")
        key = next(part for part in command if part.startswith("--api-key"))
        assert parser.parse_args([key]).api_key == ["-wp5w"]
    vlrl = engine_command("vlrl", "/p", model="tiny", host="127.0.0.1", port=9, dtype="float32", api_key="k")
    assert vlrl[1:4] == ["-m", "vlrl.cli", "serve"] and "--api-key" not in vlrl  # vlrl serve reads $VLRL_API_KEY
    assert engine_python("vlrl", None) == sys.executable and engine_python("vllm", "/x/python") == "/x/python"


@pytest.mark.e2e
def test_vlrl_rl_launches_its_servers_and_stops_them(tmp_path):
    """``vlrl rl`` with rollout.servers.launch: one `vlrl serve` started on loopback (the trainer's preset saved for
    it), generating and loading each version, stopped when the run ends."""
    import json
    import os
    import re

    out = tmp_path / "run"
    done = forked_runs.run([sys.executable, "-m", "vlrl.cli", "rl", "--config", "configs/arith_grpo.yaml",
                           "rollout.servers.launch.count=1", "rollout.servers.engine=auto", "train.steps=2",
                           "train.prompts_per_step=2", "rollout.n=4", "data.n_train=8", "data.n_test=2", "eval.samples=1",
                           "train.log_every=1", "report.html=false", "checkpoint.every=0", f"out={out}"],
                           timeout=600, cwd=Path(__file__).resolve().parents[2], env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert (out / "rollout_model" / "config.json").is_file()  # the preset, saved for the server to load
    log = (out / "rollout_servers" / "server-0.log").read_text()
    url = re.search(r"listening on (http://127\.0\.0\.1:\d+)", log).group(1)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("rollout/logprob_diff_max", 1) < 1e-4 for r in records)
    with pytest.raises(httpx.HTTPError):  # stopped with the run
        httpx.get(f"{url}/health", timeout=2)
