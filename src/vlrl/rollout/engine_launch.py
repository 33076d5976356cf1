"""`launch_servers`: rollout servers started by vlrl itself (``rollout.servers.launch``) — `vlrl serve`, vLLM or SGLang
— on loopback, each on a free port with a generated key, waited for, and stopped with the run.

    1. the model        ``launch.model``; else ``model.path`` when it is a directory; else the trainer's policy saved
                        under ``RUN_DIR/rollout_model`` (a preset or a hub id: the servers load what the trainer holds)
    2. the command      ``launch.command`` if given (``{model}``, ``{host}``, ``{port}``, ``{dtype}``, ``{i}`` filled in),
                        else the engine's own (`engine_command`) run by ``launch.python`` — the interpreter of the
                        environment that has the engine (vLLM lives in its own: ``.venv-vllm/bin/python``) — then
                        ``launch.args``
    3. the environment  this process's, + the key (``VLRL_API_KEY`` for vlrl serve; vLLM and SGLang take
                        ``--api-key``), + vLLM's ``VLLM_SERVER_DEV_MODE=1`` (its RL routes), + ``launch.env``
    4. readiness        ``GET /health`` answers 200 within ``launch.timeout`` seconds; a server that exits first, or
                        is still not ready then, stops every server and raises `ServerLaunchError` naming the engine,
                        the command and the server's last log lines (each server logs to
                        ``RUN_DIR/rollout_servers/server-I.log``)
    5. stop             `LaunchedServers.stop`: SIGTERM, then SIGKILL after a grace period; on Linux a server also gets
                        SIGKILL when the process that started it dies (``PR_SET_PDEATHSIG``), however it dies

vLLM's RL routes (pause, weights, versions) are not behind its ``--api-key``: the servers bind loopback (``launch.host``).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

log = logging.getLogger(__name__)

ENGINE_MODULES = {"vlrl": ["-m", "vlrl.cli", "serve"], "vllm": ["-m", "vllm.entrypoints.openai.api_server"],
                  "sglang": ["-m", "sglang.launch_server"]}
VLLM_VENV_PYTHON = ".venv-vllm/bin/python"  # where `make .venv-vllm` puts vLLM (relative to the working directory)


class ServerLaunchError(RuntimeError):
    """A launched rollout server exited or did not become ready (the message names it and ends with its last lines)."""


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def engine_python(engine: str, python: str | None) -> str:
    """The interpreter that runs the engine: ``python`` if given; for vLLM ``.venv-vllm/bin/python`` where it exists
    (`make .venv-vllm`), else this interpreter."""
    if python:
        return python
    if engine == "vllm" and Path(VLLM_VENV_PYTHON).is_file():
        return str(Path(VLLM_VENV_PYTHON).absolute())
    return sys.executable


def engine_command(engine: str, python: str, *, model: str, host: str, port: int, dtype: str, api_key: str,
                   device: str = "cpu") -> list[str]:
    """The engine's own server command (before ``launch.args``). The key goes as ``--api-key=KEY``: a generated key
    may begin with "-" (token_urlsafe), which argparse takes for an option after a bare ``--api-key`` (a vLLM
    server of the suite's run of 2026-12-07 exited with "argument --api-key: expected at least one argument")."""
    base = [python, *ENGINE_MODULES[engine]]
    if engine == "vlrl":
        return [*base, "--model", model, "--host", host, "--port", str(port), "--dtype", dtype, "--device", device]
    if engine == "vllm":  # --enable-scale-out: /inference/v1/generate (token ids in and out)
        return [*base, "--model", model, "--host", host, "--port", str(port), "--dtype", dtype, f"--api-key={api_key}",
                "--enable-scale-out"]
    return [*base, "--model-path", model, "--host", host, "--port", str(port), "--dtype", dtype, f"--api-key={api_key}"]


def _fill(part: str, values: Mapping[str, str]) -> str:
    """``part`` with ``{name}`` replaced for each of ``values`` (not str.format: an argument may hold JSON)."""
    for name, value in values.items():
        part = part.replace("{" + name + "}", value)
    return part


def _death_signal():
    """Linux: a ``preexec_fn`` giving the child SIGKILL when its parent dies; None elsewhere."""
    try:
        import ctypes

        prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@dataclasses.dataclass
class LaunchedServer:
    index: int
    url: str
    command: list[str]
    process: subprocess.Popen
    log_path: Path

    def tail(self, lines: int = 15) -> str:
        """The last ``lines`` lines of its log."""
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                kept = collections.deque((line.rstrip() for line in f if line.strip()), maxlen=lines)
        except OSError:
            return "(no log)"
        return "\n".join(kept) or "(no output)"


@dataclasses.dataclass
class LaunchedServers:
    """Servers vlrl started: their URLs and key; `stop` ends them (idempotent)."""

    engine: str
    api_key: str
    servers: list[LaunchedServer]

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    def close(self) -> None:
        self.stop()

    def stop(self, grace: float = 20.0) -> None:
        """SIGTERM every server, SIGKILL what is left after ``grace`` seconds."""
        for server in self.servers:
            if server.process.poll() is None:
                server.process.terminate()
        deadline = time.monotonic() + grace
        for server in self.servers:
            try:
                server.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                server.process.kill()
                server.process.wait()

    def wait_ready(self, timeout: float) -> None:
        """Every server answers ``/health`` with 200; `ServerLaunchError` (after stopping all) if one exits or the
        timeout passes."""
        import httpx

        deadline = time.monotonic() + timeout
        pending = list(self.servers)
        while pending:
            server = pending[0]
            code = server.process.poll()
            if code is not None:
                self.stop()
                raise ServerLaunchError(f"{self.engine} rollout server {server.index} ({server.url}) exited with code "
                                        f"{code} before it was ready.\ncommand: {' '.join(server.command)}\n"
                                        f"its last lines ({server.log_path}):\n{server.tail()}")
            try:
                if httpx.get(f"{server.url}/health", timeout=5).status_code == 200:
                    pending.pop(0)
                    continue
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise ServerLaunchError(f"{self.engine} rollout server {server.index} ({server.url}) did not answer "
                                        f"/health within rollout.servers.launch.timeout={timeout:g} s.\ncommand: "
                                        f"{' '.join(server.command)}\nits last lines ({server.log_path}):\n{server.tail()}")
            time.sleep(0.5)


def launch_servers(engine: str, count: int, *, model: str, dtype: str, log_dir: str | Path, python: str | None = None,
                   command: Sequence[str] | None = None, args: Sequence[str] = (), env: Mapping[str, str] | None = None,
                   host: str = "127.0.0.1", device: str = "cpu", timeout: float = 600.0) -> LaunchedServers:
    """Start ``count`` ``engine`` servers on ``host`` and wait until they are ready (module docstring)."""
    if engine not in ENGINE_MODULES:
        raise ValueError(f"rollout.servers.launch: the engine must be one of {sorted(ENGINE_MODULES)}, got {engine!r}")
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    key = secrets.token_urlsafe(24)
    python = engine_python(engine, python)
    base_env = {**os.environ, "VLRL_API_KEY": key, "VLRL_ADMIN_API_KEY": key}
    if engine == "vllm":
        base_env["VLLM_SERVER_DEV_MODE"] = "1"
    base_env.update(env or {})
    launched = LaunchedServers(engine, key, [])
    try:
        for i in range(count):
            port = free_port(host)
            fill = {"model": model, "host": host, "port": str(port), "dtype": dtype, "i": str(i), "python": python}
            cmd = ([_fill(part, fill) for part in command] if command else
                   engine_command(engine, python, model=model, host=host, port=port, dtype=dtype, api_key=key,
                                  device=device))
            cmd += [arg.replace("{i}", str(i)) for arg in args]
            log_path = log_dir / f"server-{i}.log"
            with open(log_path, "w", encoding="utf-8") as out:
                process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                           env=base_env, preexec_fn=_death_signal())
            log.info("rollout server %d (%s): %s (log: %s)", i, engine, " ".join(cmd), log_path)
            launched.servers.append(LaunchedServer(i, f"http://{host}:{port}", cmd, process, log_path))
        launched.wait_ready(timeout)
    except BaseException:
        launched.stop()
        raise
    return launched
