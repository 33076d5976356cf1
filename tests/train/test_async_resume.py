"""Resuming the asynchronous recipe (issue 6): a checkpoint keeps the buffer's undrained groups (with their weight
versions and draw tickets), the re-queued and in-flight draws, the ticket ledger and the data cursor, so a
resumed run continues the step counter and the optimizer, trains the restored groups first, never trains one
older than η, and accounts for every prompt ever drawn.

A resumed async run is not expected to equal the uninterrupted run bitwise: which prompts are in flight, and
with which weight version they finish, depends on thread timing (the synchronous recipe's exact-resume test is
tests/train/test_resume.py)."""

import asyncio
import shutil
import threading
import time

import pytest
import torch

import vlrl.train.learner as learner
import vlrl.train.update as update
from vlrl.config import CheckpointConfig, RLConfig, load_config
from vlrl.data.cursor import PromptCursor
from vlrl.feed.async_rollout import AsyncRollout, GroupBuffer
from vlrl.feed.records import AsyncFeedState, SyncFeedState
from vlrl.models import load_policy
from vlrl.report import MetricsLogger
from vlrl.rollout import SamplingParams
from vlrl.rollout.threaded_engine import ThreadedEngine
from vlrl.train.checkpoint import (
    Checkpointer,
    latest_checkpoint,
    read_checkpoint_carry_over,
    write_checkpoint_carry_over,
    write_manifest,
)
from vlrl.train.distributed import DistContext, check_scalable
from vlrl.train.runtime import Runtime
from vlrl.train.state import RLState

from .fakes import ScriptedEngine, scripted_samples, train_async
from .test_async_grpo import _samples, _stage

P, N, ETA = 4, 4, 1  # prompts per step, responses per prompt, staleness bound of every run here
PARAM = "lm_head.weight"  # the tensor whose AdamW moment is compared across the restart


pytestmark = pytest.mark.usefixtures("one_thread")


def _runtime(policy, root, *, resume_from=None):
    ctx = DistContext()
    return Runtime(ctx, policy.model, checkpointer=Checkpointer(root, CheckpointConfig(every=2), ctx,
                                                                resume_from=resume_from))


def _run(root, steps, *, resume_from=None, spy=None):
    """One async run of ``steps`` steps checkpointing every 2 steps under ``root``; optimizer steps are slowed
    down (0.3 s) so the rollout runs ahead and the buffer holds groups at the checkpoint. ``spy`` sees every
    batch (with the optimizer) before its update. Returns (policy, logger records, stats, state_out, optimizer)."""
    policy = load_policy("tiny-qwen2-vl")
    torch.manual_seed(0)
    engine = ThreadedEngine(policy)
    logger, state, made = MetricsLogger(None, quiet=True), {}, []
    real_make, real_update, real_step = learner.make_optimizer, learner.ppo_update, update.step_or_skip

    def make_optimizer(*args, **kwargs):
        made.append(real_make(*args, **kwargs))  # (optimizer, scheduler)
        return made[-1]

    def ppo_update(policy, batch, *args, **kwargs):
        if spy is not None:
            spy(policy, batch, made[0][0])
        return real_update(policy, batch, *args, **kwargs)

    def slow_step(*args, **kwargs):
        time.sleep(0.3)
        return real_step(*args, **kwargs)

    stage = _stage(train={"steps": steps, "prompts_per_step": P}, rollout={"n": N}, staleness={"eta": ETA})
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(learner, "make_optimizer", make_optimizer)  # the learner's set-up
        patch.setattr(learner, "ppo_update", ppo_update)
        patch.setattr(update, "step_or_skip", slow_step)
        try:
            stats = train_async(policy, engine, _samples(), stage, logger=logger, seed=0, state_out=state,
                                     runtime=_runtime(policy, root, resume_from=resume_from))
        finally:
            engine.close()
    return policy, logger.records, stats, state, made[0][0]


def accounted_for(state):
    """Every ticket 0..drawn-1 is in exactly one bucket: trained, discarded, filtered, buffered or pending."""
    buckets = state["trained"] + state["discarded"] + state["filtered"] + state["buffered"] + state["pending"]
    return sorted(buckets) == list(range(state["drawn"]))


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    """Two steps with a checkpoint at step 2 (the last): (checkpoint dir, its carry-over, the weights and the
    AdamW first moment of `PARAM` at that checkpoint)."""
    root = tmp_path_factory.mktemp("async_ckpt")
    policy, records, stats, _, optimizer = _run(root, 2)
    assert stats.steps == 2 and [r["step"] for r in records] == [1, 2]
    checkpoint = latest_checkpoint(root)
    assert checkpoint is not None and checkpoint.name == "step_00000002"
    carry = read_checkpoint_carry_over(checkpoint)
    param = dict(policy.model.named_parameters())[PARAM]
    weights = {k: v.detach().clone() for k, v in policy.model.state_dict().items()}
    return checkpoint, carry, weights, optimizer.state[param]["exp_avg"].clone()


def test_a_resumed_run_continues_steps_optimizer_buffer_and_ledger(first_run, tmp_path):
    checkpoint, carry, weights, exp_avg = first_run
    assert isinstance(carry, RLState) and isinstance(carry.feed, AsyncFeedState)  # typed records, not magic keys
    cut = carry.feed.rollout
    assert carry.feed.ledger.trained == list(range(2 * P))  # steps 0 and 1 trained the first 8 draws
    assert len(cut.buffer) >= 1  # the rollout ran ahead: the checkpoint holds undrained groups
    first_batch = []

    def spy(policy, batch, optimizer):
        if first_batch:
            return
        params = dict(policy.model.named_parameters())
        assert all(torch.equal(p, weights[name]) for name, p in params.items())  # the checkpoint's weights
        assert torch.equal(optimizer.state[params[PARAM]]["exp_avg"], exp_avg)  # and its AdamW moments
        first_batch.extend(batch.trajectories)

    shutil.copytree(checkpoint, tmp_path / checkpoint.name)
    _, records, stats, state, _ = _run(tmp_path, 4, resume_from=tmp_path / checkpoint.name, spy=spy)

    assert stats.steps == 4 and [r["step"] for r in records] == [3, 4]
    assert state["version"] == 4
    # the restored groups are trained first (FIFO), with the versions and tokens they were generated with
    restored = cut.buffer[:P]
    assert state["trained"][: 2 * P + len(restored)] == carry.feed.ledger.trained + [g.ticket for g in restored]
    saved = [r for g in restored for r in g.responses]
    assert [t.weight_version for t in first_batch[: len(saved)]] == [r.weight_version for r in saved]
    assert all(torch.equal(a.response_ids, b.response_ids) for a, b in zip(first_batch, saved, strict=False))
    # nothing drawn before or after the restart is lost or counted twice
    held = {d.ticket for d in cut.requeue + cut.in_flight}
    assert state["drawn"] >= cut.drawn and accounted_for(state)
    assert held <= set(state["trained"] + state["buffered"] + state["pending"])  # re-queued draws came back
    assert len(state["trained"]) == 4 * P


def test_a_restored_group_older_than_eta_is_discarded_not_trained(first_run, tmp_path):
    """The checkpoint's first undrained group is made version 0; the run resumes at step 2, so its staleness
    2 > η = 1: the resumed run drops it, counts it, and trains only fresh groups."""
    checkpoint, carry, _, _ = first_run
    target = tmp_path / checkpoint.name
    shutil.copytree(checkpoint, target)
    old = carry.feed.rollout.buffer[0]
    for r in old.responses:
        r.weight_version = 0  # staleness 2 at step 2
    write_checkpoint_carry_over(target, carry)
    write_manifest(target)  # an edit on purpose: re-seal it
    seen = []
    _, records, stats, state, _ = _run(tmp_path, 3, resume_from=target,
                                       spy=lambda policy, batch, _: seen.extend(t.weight_version for t in batch.trajectories))

    assert stats.steps == 3 and len(seen) == P * N
    assert all(2 - v <= ETA for v in seen)  # every trained sample at most η versions old
    assert old.ticket in state["discarded"] and old.ticket not in state["trained"]
    assert records[0]["staleness/discarded"] >= 1
    assert accounted_for(state)


def test_the_two_recipes_refuse_each_others_checkpoints(first_run, tmp_path):
    """An async checkpoint holds buffered groups and in-flight prompts the synchronous loop has no place for
    (and a sync checkpoint lacks the rollout state): resuming across recipes stops, naming the field."""
    from vlrl.rollout import HFEngine
    from vlrl.train.loop import train_rl

    checkpoint, carry, _, _ = first_run
    policy = load_policy("tiny-qwen2-vl")
    with pytest.raises(ValueError, match="checkpoint.resume: .* asynchronous recipe; resume it with rollout.mode=async"):
        train_rl(policy, HFEngine(policy), _samples(), _stage(), logger=MetricsLogger(None, quiet=True), seed=0,
                   runtime=_runtime(policy, tmp_path, resume_from=checkpoint))
    synchronous = tmp_path / checkpoint.name
    shutil.copytree(checkpoint, synchronous)
    write_checkpoint_carry_over(synchronous, RLState(carry.algorithm, SyncFeedState(drawn=0, carry=[])))
    write_manifest(synchronous)
    with pytest.raises(ValueError, match="checkpoint.resume: .* synchronous recipe"):
        _run(tmp_path, 3, resume_from=synchronous)


class GatedEngine(ScriptedEngine):
    """A scripted `AsyncEngine` whose requests stay in flight until ``gate`` is set."""

    def __init__(self):
        super().__init__()
        self.gate = threading.Event()

    async def agenerate(self, requests, sampling):
        while not self.gate.is_set():
            await asyncio.sleep(0.005)
        return self.generate(requests, sampling)

    def close(self):
        pass


def _wait_for(condition, timeout=10.0):
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, "timed out"
        time.sleep(0.005)


def _rollout(engine, samples, cursor_state=None):
    cursor = PromptCursor(samples, seed=0)
    if cursor_state is not None:
        cursor.load_state(cursor_state)
    return AsyncRollout(engine, cursor, SamplingParams(n=2, max_new_tokens=4), GroupBuffer(capacity=8),
                        prompts_per_step=2, eta=0, max_concurrent=4)


def test_in_flight_prompts_at_a_checkpoint_are_generated_again_after_resume():
    """η = 0, 2 prompts per step: version 0 admits exactly 2 draws. The cut while both are in flight holds them
    (tickets 0, 1) and the cursor after them; restored, the rollout draws those two again before anything new."""
    samples = scripted_samples([("a", ["a", "b"], "a"), ("b", ["b", "c"], "b"), ("c", ["c", "a"], "c")])
    engine = GatedEngine()
    rollout = _rollout(engine, samples).start()
    try:
        _wait_for(lambda: len(rollout.accounting()["in_flight"]) == 2)
        cursor, cut = rollout.checkpoint_state()
        engine.gate.set()
        _wait_for(lambda: len(rollout.buffer) == 2)
        _, later = rollout.checkpoint_state()
    finally:
        rollout.stop()
    first_ids = [d.sample.id for d in cut.in_flight]
    assert [d.ticket for d in cut.in_flight] == [0, 1] and cut.buffer == [] and cut.requeue == []
    assert cut.drawn == 2 and cut.started == 0 and cursor.state() == {"epoch": 0, "position": 2}
    assert [g.ticket for g in later.buffer] == [0, 1] and later.in_flight == [] and later.started == 2

    resumed = _rollout(GatedEngine(), samples, cursor.state())
    resumed.load_state(cut)
    assert [d.ticket for d in resumed.state_dict()["requeue"]] == [0, 1] and resumed.requeued == 2
    resumed.engine.gate.set()
    resumed.start()
    try:
        _wait_for(lambda: len(resumed.buffer) == 2)
        with pytest.raises(RuntimeError, match="before start"):
            resumed.load_state(cut)
    finally:
        resumed.stop()
    groups = resumed.buffer.groups()
    assert [g.draw.ticket for g in groups] == [0, 1] and [g.draw.sample.id for g in groups] == first_ids
    assert resumed.drawn == 2 and resumed.cursor.state() == {"epoch": 0, "position": 2}  # nothing new drawn


def test_check_scalable_allows_async_checkpoints_and_several_ranks():
    for override in ("checkpoint.every=2", "checkpoint.resume=auto"):
        cfg = load_config(RLConfig, None, ["rollout.mode=async", override])
        check_scalable(cfg, 1)  # resumable in one process
        check_scalable(cfg, 2)  # and under torchrun: rank 0 drives the rollout (tests/train/test_async_ranks.py)
    many_ranks = Runtime(DistContext(world_size=2), torch.nn.Linear(1, 1))  # refused before any collective:
    with pytest.raises(ValueError, match="train.prompts_per_step: 3 does not split evenly over 2 ranks"):
        train_async(None, GatedEngine(), [], _stage(train={"prompts_per_step": 3}), logger=None, seed=0,
                         runtime=many_ranks)
    with pytest.raises(ValueError, match="synth.enabled: Syn-GRPO with rollout.mode=async runs in one process"):
        train_async(None, GatedEngine(), [], _stage(synth={"enabled": True}), logger=None, seed=0,
                         runtime=many_ranks)


def test_vlrl_rl_async_with_checkpoints_resumes_through_the_recipe(tmp_path):
    """`vlrl rl rollout.mode=async checkpoint.every=1`, stopped after 1 step, then `--resume auto` with 2
    steps: metrics.jsonl holds steps 1 and 2 once each and the summary counts 2 steps."""
    import json

    from vlrl.recipes import run_rl

    args = ["rollout.mode=async", "rollout.n=2", "rollout.max_new_tokens=4", "staleness.eta=1", "train.prompts_per_step=2",
            "data.n_train=8", "data.n_test=2", "eval.samples=1", "eval.max_new_tokens=4", "checkpoint.every=1",
            f"out={tmp_path}"]
    run_rl(load_config(RLConfig, None, [*args, "train.steps=1"]))
    assert latest_checkpoint(tmp_path / "checkpoints").name == "step_00000001"
    summary = run_rl(load_config(RLConfig, None, [*args, "train.steps=2", "checkpoint.resume=auto"]))
    steps = [r["step"] for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
             if r["stage"] == "rl"]
    assert steps == [1, 2] and summary["train"]["steps"] == 2
    assert latest_checkpoint(tmp_path / "checkpoints").name == "step_00000002"
