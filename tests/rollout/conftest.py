"""Rollout-server fixtures: vlrl's server on a free loopback port, in this process, shut down after the test."""

import contextlib
import dataclasses
from pathlib import Path

import pytest

import forked_runs  # tests/ is on sys.path
from vlrl.rollout.batcher import ContinuousBatcher, private_copy
from vlrl.rollout.http_engine import HTTPEngine
from vlrl.rollout.http_settings import ClientSettings, SyncSettings
from vlrl.rollout.server import create_app
from vlrl.serving import ServerThread

API_KEY = "test-key"


@dataclasses.dataclass
class Served:
    url: str
    batcher: ContinuousBatcher
    thread: ServerThread



@contextlib.contextmanager
def running_server(policy, *, api_key=API_KEY, **batcher_options):
    """Serve a private copy of ``policy`` (same weights); yields a `Served`."""
    batcher = ContinuousBatcher(private_copy(policy), **batcher_options)
    server = ServerThread(create_app(batcher, api_key=api_key))
    try:
        yield Served(server.url, batcher, server)
    finally:
        server.stop()
        batcher.close()


@pytest.fixture
def http_engine_factory(tmp_path):
    """``make(policy, n_servers=1, sync_options=None, **client_options) -> (engine, [Served, ...])``: the engine's
    `SyncSettings` (weights under tmp_path) with ``sync_options``, its `ClientSettings` with ``client_options``."""
    stack = contextlib.ExitStack()
    engines = []

    def make(policy, n_servers=1, batcher_options=None, sync_options=None, **client_options):
        servers = [stack.enter_context(running_server(policy, **(batcher_options or {}))) for _ in range(n_servers)]
        client_options.setdefault("api_key", API_KEY)
        engine = HTTPEngine(policy, [s.url for s in servers], SyncSettings(tmp_path / "weights", **(sync_options or {})),
                            ClientSettings(**client_options))
        engines.append(engine)
        return engine, servers

    yield make
    for engine in engines:
        engine.close()
    stack.close()


@contextlib.contextmanager
def vlrl_serve(model: str, log_dir, n: int = 1, *, api_key: str = API_KEY, timeout: float = 120,
               keep_processes: bool = False, env: list[dict] | None = None, args: tuple[str, ...] = ()):
    """``n`` `vlrl serve` processes of ``model`` on free loopback ports; yields their URLs (with
    ``keep_processes``: (URLs, processes)), stops them after. ``env[i]``: extra environment of server i; ``args``: more
    options of every server."""
    import os
    import subprocess
    import sys
    import time

    started = []
    try:
        for i in range(n):
            path = Path(log_dir) / f"serve{i}.log"
            path.write_text("")
            process = forked_runs.popen(  # a process forked from an already-imported one: tests/forked_runs.py
                [sys.executable, "-m", "vlrl.cli", "serve", "--model", model, "--port", "0", "--threads", "1", *args],
                log=path, env={**os.environ, "VLRL_API_KEY": api_key, "OMP_NUM_THREADS": "1", **(env[i] if env else {})})
            started.append((process, open(path)))
        urls = []
        for process, log in started:
            deadline = time.time() + timeout
            while True:
                log.seek(0)
                lines = [line for line in log.read().splitlines() if "listening on " in line]
                if lines:
                    urls.append(lines[0].split("listening on ")[1].split()[0])
                    break
                if process.poll() is not None or time.time() > deadline:
                    log.seek(0)
                    raise RuntimeError(f"vlrl serve did not start: {log.read()[-3000:]}")
                time.sleep(0.2)
        yield (urls, [p for p, _ in started]) if keep_processes else urls
    finally:
        for process, log in started:
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(30)
                except subprocess.TimeoutExpired:
                    process.kill()
            log.close()
