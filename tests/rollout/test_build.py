"""`build_engine`: one place builds every engine, and the configured rollout function is always applied — in the
synchronous engine, behind the asynchronous engine's ``agenerate``, and under the report's watcher (which the recipe
adds: `vlrl.report.watch.watch`)."""

import asyncio

import pytest

from vlrl.config import RLConfig, load_config
from vlrl.data import generate
from vlrl.report import MetricsLogger
from vlrl.report.watch import WatchedEngine, watch
from vlrl.rollout import HFEngine, SamplingParams, build_engine, close_engine
from vlrl.rollout.agent import AsyncRolloutEngine, RolloutEngine
from vlrl.rollout.types import AsyncEngine, capability

MULTI_TURN = ["rollout.agent.function=multi_turn", "rollout.agent.env=shapes_feedback", "rollout.agent.max_turns=3"]


def _rollout(*overrides):
    return load_config(RLConfig, None, list(overrides)).rollout


def test_single_turn_in_process_is_the_plain_engine(tiny_vlm):
    engine = build_engine(_rollout("rollout.engine.max_batch_size=7"), tiny_vlm)
    assert type(engine) is HFEngine and engine.max_batch_size == 7
    watched = watch(build_engine(_rollout(), tiny_vlm), MetricsLogger(None, quiet=True))
    assert isinstance(watched, WatchedEngine) and type(watched.engine) is HFEngine
    assert not hasattr(watched, "agenerate")  # the synchronous engine stays synchronous behind the watcher
    assert capability(watched, AsyncEngine) is None


def test_a_multi_turn_rollout_wraps_the_synchronous_engine(tiny_vlm):
    """A random tiny model never answers a count question right: every episode takes all 3 turns."""
    engine = watch(build_engine(_rollout(*MULTI_TURN, "rollout.max_new_tokens=4"), tiny_vlm),
                   MetricsLogger(None, quiet=True))
    assert type(engine.engine) is RolloutEngine and not hasattr(engine, "agenerate")
    samples = generate("shapes", 2, tasks=["count"])
    out = engine.generate([engine.encode(s) for s in samples], SamplingParams(n=2, max_new_tokens=4))
    assert len(out) == 4 and [t.group_index for t in out] == [0, 0, 1, 1]
    assert all(t.num_turns == 3 and t.stop_reason == "max_turns" for t in out)
    assert all((t.loss_mask == 0).any() for t in out)  # the feedback observations are in the sequence, not trained


@pytest.mark.usefixtures("one_thread")
def test_a_multi_turn_rollout_runs_behind_the_asynchronous_engines_agenerate(tiny_vlm):
    """rollout.mode=async: a ThreadedEngine (a private copy of the policy) under the rollout function; its
    `agenerate` runs whole episodes (what the asynchronous recipe awaits per prompt)."""
    engine = watch(build_engine(_rollout(*MULTI_TURN, "rollout.mode=async", "rollout.max_new_tokens=4"), tiny_vlm),
                   MetricsLogger(None, quiet=True))
    try:
        generator = capability(engine, AsyncEngine)  # what the asynchronous recipe awaits, behind the watcher
        assert isinstance(engine.engine, AsyncRolloutEngine) and generator is engine.engine
        samples = generate("shapes", 2, tasks=["count"])
        requests = [engine.encode(s) for s in samples]

        async def two_prompts_at_once():
            return await asyncio.gather(*(generator.agenerate([r], SamplingParams(n=2, max_new_tokens=4))
                                          for r in requests))

        groups = asyncio.run(two_prompts_at_once())
        assert [len(g) for g in groups] == [2, 2]
        assert all(t.num_turns == 3 and t.group_index == 0 for g in groups for t in g)
        assert groups[0][0].sample.id == samples[0].id and groups[1][0].sample.id == samples[1].id
    finally:
        close_engine(engine)


@pytest.mark.usefixtures("one_thread")
def test_single_turn_async_keeps_the_engines_own_batched_agenerate(tiny_vlm):
    from vlrl.rollout.threaded_engine import ThreadedEngine

    engine = build_engine(_rollout("rollout.mode=async"), tiny_vlm)
    try:
        assert type(engine) is ThreadedEngine  # no wrapper: one batch per loop iteration, as before
    finally:
        close_engine(engine)


def test_servers_need_a_place_for_the_weights(tiny_vlm):
    with pytest.raises(ValueError, match="rollout.weight_sync.dir"):
        build_engine(_rollout("rollout.servers.urls=[http://127.0.0.1:1]"), tiny_vlm)


def test_recipes_and_commands_build_engines_only_through_build_engine():
    """No recipe, command or evaluation constructs an engine class itself (the class of defect where a capability
    is wired in one place and forgotten in another)."""
    import re
    from pathlib import Path

    import vlrl

    root = Path(vlrl.__file__).parent
    pattern = re.compile(r"\b(HFEngine|ThreadedEngine|HTTPEngine|RolloutEngine|WatchedEngine)\(")
    users = [*sorted(p.relative_to(root).as_posix() for p in (root / "recipes").glob("*.py")), "train/loop.py",
             "train/learner.py", *sorted(p.relative_to(root).as_posix() for p in (root / "feed").glob("*.py")),
             *sorted(p.relative_to(root).as_posix() for p in (root / "cli").glob("*.py")), "eval/evaluate.py",
             "eval/select.py"]
    found = {name: pattern.findall((root / name).read_text()) for name in users}
    assert found == {name: [] for name in users}
