"""Rollout-server fixtures: vlrl's server on a free loopback port, in this process, shut down after the test."""

import contextlib
import dataclasses

import pytest

from vlrl.rollout.http_engine import HTTPEngine
from vlrl.rollout.server import ContinuousBatcher, ServerThread, create_app, private_copy

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
    """``make(policy, n_servers=1, **engine_options) -> (engine, [Served, ...])``."""
    stack = contextlib.ExitStack()
    engines = []

    def make(policy, n_servers=1, batcher_options=None, **options):
        servers = [stack.enter_context(running_server(policy, **(batcher_options or {}))) for _ in range(n_servers)]
        options.setdefault("api_key", API_KEY)
        engine = HTTPEngine(policy, [s.url for s in servers], weights_dir=tmp_path / "weights", **options)
        engines.append(engine)
        return engine, servers

    yield make
    for engine in engines:
        engine.close()
    stack.close()
