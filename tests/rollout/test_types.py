"""The engine protocols of `vlrl.rollout.types` and `capability`: a recipe asks an engine for what it can do besides
generating through a protocol — through the rollout function's wrapper too, which passes on everything but the
inner engine's ``agenerate`` (that would bypass the rollout function)."""

import ast
import asyncio
import concurrent.futures
from pathlib import Path

import vlrl
from vlrl.rollout import SamplingParams
from vlrl.rollout.agent import AsyncRolloutEngine, RolloutEngine, single_turn
from vlrl.rollout.build import close_engine
from vlrl.rollout.types import AgentEngine, AsyncEngine, Closable, Engine, WeightPublisher, capability

from .test_agent import ScriptedEngine, sample


class ServerEngine(ScriptedEngine):
    """A fake engine on rollout servers: asynchronous, publishing weights, closable."""

    world_size = 1
    closed = False

    async def agenerate(self, requests, sampling):
        return self.generate(requests, sampling)

    def publish(self, *, version, state_dict=None):
        self.update_weights(version=version)
        done = concurrent.futures.Future()
        done.set_result(version)
        return done

    def join_trainer_ranks(self, rank, world_size):
        self.world_size = world_size

    def close(self):
        self.closed = True


def test_each_capability_is_its_own_protocol():
    plain, server = ScriptedEngine(["x"]), ServerEngine(["x"])
    assert isinstance(plain, Engine) and isinstance(plain, AgentEngine)
    assert capability(plain, AsyncEngine) is None and capability(plain, WeightPublisher) is None
    assert capability(server, AsyncEngine) is server and capability(server, WeightPublisher) is server


def test_the_rollout_wrapper_passes_on_publishing_but_never_the_inner_agenerate():
    server = ServerEngine(["x"])
    sync = RolloutEngine(server, single_turn)  # (built directly: `wrap` would make it asynchronous)
    assert capability(sync, WeightPublisher) is server
    assert capability(sync, AsyncEngine) is None and not hasattr(sync, "agenerate") and not hasattr(sync, "publish")
    wrapped = RolloutEngine.wrap(server, single_turn)
    try:
        assert isinstance(wrapped, AsyncRolloutEngine) and capability(wrapped, AsyncEngine) is wrapped
        assert capability(wrapped, WeightPublisher).publish(version=3).result() == 3 and wrapped.weight_version == 3
        out = asyncio.run(wrapped.agenerate([wrapped.encode(sample())], SamplingParams(n=1)))
        assert [t.response_text for t in out] == ["x"]
    finally:
        close_engine(wrapped)
    assert server.closed and isinstance(wrapped, Closable)


def _modules(package: str) -> list[Path]:
    return sorted((Path(vlrl.__file__).parent / package).rglob("*.py"))


def test_the_rollout_room_imports_nothing_of_the_report_and_no_engine_forwards_by_getattr():
    """The recipe adds the report's watcher (`vlrl.report.watch.watch`), not `build_engine`; every engine wrapper
    (`RolloutEngine`, `WatchedEngine`) says what it passes on (`offer`) instead of forwarding any attribute."""
    imports, forwarding = [], []
    for path in _modules("rollout") + [Path(vlrl.__file__).parent / "report" / "watch.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vlrl.report") \
                    and "rollout" in path.parts:
                imports.append(f"{path.name}: {node.module}")
            if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
                forwarding.append(f"{path.name}:{node.lineno}")
    assert imports == [] and forwarding == []
