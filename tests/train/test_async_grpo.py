"""The asynchronous recipe: η = 0 equals the synchronous recipe; nothing older than η reaches a loss; aborted
requests are re-queued; every drawn prompt is accounted for."""

import threading
import time

import pytest
import torch

import vlrl.train.async_grpo as async_grpo
import vlrl.train.update as update
from vlrl.config import RLStage
from vlrl.data import generate
from vlrl.models import load_policy
from vlrl.report import MetricsLogger
from vlrl.rewards import register_reward
from vlrl.rollout import HFEngine, Status
from vlrl.rollout.threaded_engine import ThreadedEngine
from vlrl.train.async_grpo import train_async_grpo
from vlrl.train.grpo import train_grpo
from vlrl.train.state import GroupRecord

pytestmark = pytest.mark.usefixtures("one_thread")


@register_reward("test_async_length_reward")
def _length_reward(response, answer, **meta):
    """Dense: shorter responses score higher, so every group has mixed rewards and non-zero advantages."""
    return 1.0 / (1.0 + len(response))


def _samples(n=12):
    samples = generate("shapes", n, tasks=["count"])
    for s in samples:
        s.reward = "test_async_length_reward"
    return samples


def _stage(**sections):
    raw = {"optim": {"lr": 3e-3}, "rollout": {"n": 4, "max_new_tokens": 6},
           "train": {"steps": 4, "prompts_per_step": 4, "micro_batch_size": 8}, "staleness": {"eta": 0}}
    for key, value in sections.items():
        raw.setdefault(key, {}).update(value)
    return RLStage.model_validate(raw)


def accounted_for(state):
    """Every draw ticket 0..drawn-1 is in exactly one bucket: trained, discarded, buffered or pending."""
    buckets = state["trained"] + state["discarded"] + state["buffered"] + state["pending"]
    return sorted(buckets) == list(range(state["drawn"]))


def _run_async(stage, samples, *, engine_options=None, seed=0):
    policy = load_policy("tiny-qwen2-vl")
    torch.manual_seed(seed)
    engine = ThreadedEngine(policy, **(engine_options or {}))
    logger, state = MetricsLogger(None, quiet=True), {}
    try:
        stats = train_async_grpo(policy, engine, samples, stage, logger=logger, seed=seed, state_out=state)
    finally:
        engine.close()
    return policy, logger.records, stats, state


# Metrics computed from the behaviour log-probs the sampler recorded (HFEngine in the sync run, ThreadedEngine's
# private copy in the async run): same tokens, same weights, but float noise of ~1e-7 between the two samplers.
SAMPLER_NUMERICS = ("policy/logp_drift", "policy/behaviour_weight_mean", "policy/behaviour_weight_max",
                    "rollout/gen_prob", "rollout/logprob_diff_mean", "rollout/logprob_diff_max")


@pytest.mark.parametrize("apply_behaviour_weight", [False, True])
def test_eta_zero_with_one_batch_in_flight_equals_the_sync_recipe(apply_behaviour_weight):
    """Same seed, same tiny preset: the async run at η = 0 draws the same prompts, samples the same tokens
    from the same weights and logs the same metrics as the synchronous recipe. Without the behaviour weight
    the runs are bitwise identical. With it, w = π_prox / π_behave differs from 1 only by the sampler's
    numerical drift (~1e-7, logged as policy/logp_drift), so the sampled tokens and rewards stay identical
    and losses agree to ~1e-4; weights differ by a fraction of one Adam step (Adam amplifies the ~1e-7 gradient
    difference on near-zero gradients: measured 2e-4 with lr 3e-3)."""
    stage = _stage(staleness={"eta": 0, "apply_behaviour_weight": apply_behaviour_weight})
    samples = _samples()
    sync_policy = load_policy("tiny-qwen2-vl")
    torch.manual_seed(0)
    sync_logger = MetricsLogger(None, quiet=True)
    train_grpo(sync_policy, HFEngine(sync_policy), samples, stage, logger=sync_logger, seed=0)
    async_policy, records, _, state = _run_async(stage, samples)

    assert len(records) == len(sync_logger.records) == 4
    for sync, asynchronous in zip(sync_logger.records, records, strict=True):
        assert asynchronous["staleness/max"] == 0.0
        for key, value in sync.items():
            if key.startswith("perf/") or key == "time":
                continue
            exact = not apply_behaviour_weight or key.split("/")[0] in ("reward", "accuracy", "response", "data")
            if key in SAMPLER_NUMERICS:  # measures of π_behave itself: the two engines' samplers differ by ~1e-7
                assert asynchronous[key] == pytest.approx(value, abs=1e-6), (sync["step"], key)
            elif exact or key in ("stage", "step"):
                assert asynchronous[key] == value, (sync["step"], key)
            else:
                assert asynchronous[key] == pytest.approx(value, rel=1e-4, abs=1e-6), (sync["step"], key)
    for (name, a), b in zip(sync_policy.model.named_parameters(), async_policy.model.parameters(), strict=True):
        if apply_behaviour_weight:
            # a fraction of one Adam step (lr = 3e-3): measured max 2.0e-4, on embedding rows whose gradients are ~0
            assert torch.allclose(a, b, atol=1e-3), name
        else:
            assert torch.equal(a, b), name
    initial = load_policy("tiny-qwen2-vl").model.parameters()
    moved = max(float((a - b).abs().max().detach()) for a, b in zip(sync_policy.model.parameters(), initial, strict=True))
    assert moved > 1e-3  # the weights really trained (so equality above means something)
    assert accounted_for(state) and state["trained"] == list(range(16))


def test_no_sample_older_than_eta_reaches_a_loss_with_slow_training(monkeypatch):
    """Training is slowed down (0.25 s per optimizer step) so the rollout runs ahead; with η = 1 every
    batch that reaches the loss holds samples at most one version old, and some really are one version old."""
    seen = []
    real_update, real_step = async_grpo.ppo_update, update.step_or_skip

    def spy_update(policy, batch, *args, step, **kwargs):
        seen.append([step - t.weight_version for t in batch.trajectories])
        return real_update(policy, batch, *args, step=step, **kwargs)

    def slow_step(*args, **kwargs):
        time.sleep(0.25)
        return real_step(*args, **kwargs)

    monkeypatch.setattr(async_grpo, "ppo_update", spy_update)
    monkeypatch.setattr(update, "step_or_skip", slow_step)
    _, records, stats, state = _run_async(_stage(train={"steps": 6}, staleness={"eta": 1}), _samples())
    assert len(seen) == 6
    assert all(0 <= s <= 1 for batch in seen for s in batch)
    assert any(s == 1 for batch in seen for s in batch)  # the rollout did run ahead of the trainer
    assert [r["staleness/max"] for r in records] == [max(batch) for batch in seen]
    assert accounted_for(state)


def test_abort_mode_requeues_in_flight_prompts_and_never_trains_on_them(monkeypatch):
    """Generation is slowed down so a batch is decoding at each weight update; with on_weight_update=abort
    it is answered as aborted, its prompts are re-queued (same tickets) and generated again."""
    seen_statuses = []
    real_update = async_grpo.ppo_update

    def spy_update(policy, batch, *args, **kwargs):
        seen_statuses.extend(t.status for t in batch.trajectories)
        return real_update(policy, batch, *args, **kwargs)

    monkeypatch.setattr(async_grpo, "ppo_update", spy_update)
    updated = threading.Event()
    real_generate, real_update_weights = HFEngine.generate, ThreadedEngine.update_weights

    def update_weights(self, **kwargs):
        real_update_weights(self, **kwargs)
        updated.set()

    def slow_generate(self, requests, sampling, **kwargs):  # decode until the next weight update (at most 1 s)
        updated.clear()
        updated.wait(1.0)
        return real_generate(self, requests, sampling, **kwargs)

    monkeypatch.setattr(ThreadedEngine, "update_weights", update_weights)
    monkeypatch.setattr(HFEngine, "generate", slow_generate)
    stage = _stage(train={"steps": 4}, staleness={"eta": 1}, rollout={"servers": {"on_weight_update": "abort"}})
    _, records, stats, state = _run_async(stage, _samples(), engine_options={"abort_on_update": True})
    aborted = records[-1]["rollout/requeued_total"]  # re-queued by weight updates (stop() re-queues the rest)
    assert 0 < aborted <= state["requeued"]
    assert Status.ABORTED not in seen_statuses
    assert accounted_for(state)
    assert len(set(state["trained"])) == len(state["trained"]) == 16  # a re-queued prompt is trained once


def test_state_exposes_cursor_requeue_and_buffer():
    _, _, stats, state = _run_async(_stage(train={"steps": 2}, staleness={"eta": 2}), _samples())
    assert stats["steps"] == 2
    assert set(state) >= {"cursor", "requeue", "buffer", "version", "trained", "discarded", "buffered", "pending", "drawn"}
    assert state["version"] == 2 and state["cursor"]["position"] == state["drawn"] % 12
    for group in state["buffer"]:  # undrained groups as typed plain data (`GroupRecord`), ready for a checkpoint
        assert isinstance(group, GroupRecord) and len(group.responses) == 4 and group.ticket in state["buffered"]
        assert all(isinstance(r.response_ids, torch.Tensor) and r.weight_version <= 2 for r in group.responses)
    assert accounted_for(state)


def test_a_plain_engine_is_refused():
    policy = load_policy("tiny-qwen2-vl")
    with pytest.raises(TypeError, match="agenerate"):
        train_async_grpo(policy, HFEngine(policy), _samples(4), _stage(), logger=MetricsLogger(None, quiet=True), seed=0)


def test_config_fields_and_the_demo_refusing_async():
    from vlrl.config import ConfigError, DemoConfig, RLConfig, load_config

    cfg = load_config(RLConfig, None, ["rollout.mode=async", "rollout.servers.urls=[http://127.0.0.1:30000]",
                                       "staleness.eta=2", "rollout.servers.on_weight_update=abort"])
    assert cfg.rollout.servers.urls == ["http://127.0.0.1:30000"] and cfg.staleness.eta == 2
    with pytest.raises(ConfigError, match="staleness.eta"):
        load_config(RLConfig, None, ["staleness.eta=-1"])
    with pytest.raises(ConfigError, match="rollout.servers.on_weight_update"):
        load_config(RLConfig, None, ["rollout.servers.on_weight_update=later"])
    with pytest.raises(ConfigError, match="use `vlrl rl`"):
        load_config(DemoConfig, None, ["rl.rollout.mode=async"])


def test_run_rl_dispatches_to_the_async_loop(tmp_path):
    from vlrl.config import RLConfig, load_config
    from vlrl.train.recipes import run_rl

    cfg = load_config(RLConfig, None, [
        "rollout.mode=async", "rollout.n=2", "rollout.max_new_tokens=4", "staleness.eta=1", "train.steps=2",
        "train.prompts_per_step=2", "data.n_train=8", "data.n_test=2", "eval.samples=1", "eval.max_new_tokens=4",
        f"out={tmp_path}"])
    summary = run_rl(cfg)
    assert summary["train"]["steps"] == 2 and "staleness/mean" in summary["train"]
    assert (tmp_path / "checkpoints" / "final" / "model.safetensors").is_file()


def test_a_rollout_error_stops_the_run_naming_it():
    samples = _samples(4)
    samples[2].images = ["/nonexistent/image.png"]  # undecodable: encoding it fails on the rollout thread
    with pytest.raises(RuntimeError, match="rollout failed: .*image file not found"):
        _run_async(_stage(train={"steps": 3}), samples)


def test_stale_groups_give_their_quota_back_while_the_trainer_waits():
    """The buffer holds only groups older than η. `prepare_batch` must hand them to ``on_stale`` (which returns
    their admission quota) before it waits: the workers generate the replacement only then. Before this, the
    quota came back after the batch was complete — which it never was (a hang seen with a slow server)."""
    from vlrl.train.async_rollout import GroupBuffer
    from vlrl.train.sampling import Draw, Group

    from .fakes import fake_trajectories

    def group(ticket, version):
        trajectories = fake_trajectories([1.0, 0.0], [0, 0], [2, 2])
        for t in trajectories:
            t.weight_version = version
        return Group(trajectories, Draw(ticket, trajectories[0].sample, 0))

    buffer = GroupBuffer(capacity=8)
    buffer.put(group(0, version=0))
    buffer.put(group(1, version=0))
    returned = []

    def on_stale(found):  # the rollout: quota back → it draws, generates and pushes a fresh group
        returned.extend(g.draw.ticket for g in found)
        threading.Timer(0.05, buffer.put, args=(group(2 + len(returned), version=3),)).start()

    result = {}
    worker = threading.Thread(target=lambda: result.update(zip(("batch", "stale"), buffer.prepare_batch(
        1, version=3, eta=1, check=lambda: None, on_stale=on_stale), strict=True)), daemon=True)
    worker.start()
    worker.join(timeout=10)
    assert not worker.is_alive(), "prepare_batch waited for a group whose quota it still held"
    assert returned[:2] == [0, 1]  # both stale groups reported before the wait
    assert [g.draw.ticket for g in result["stale"]] == [0, 1]
    assert [g.weight_version for g in result["batch"]] == [3]


def test_dropped_groups_give_their_quota_back_before_the_wait_and_a_starved_step_keeps_its_last_batch():
    """DAPO on the async path (`GroupBuffer.take_batch` with the informative filter, its cap 2 × P = 4 dropped
    groups): the buffer holds 2 all-equal groups. They are dropped and their quota returned *before* the trainer waits
    — the rollout (``check``, called while waiting) only then pushes 2 replacements, all-equal again. The cap is
    spent with nothing informative: the step is starved and trains that last batch, whose quota stays taken and
    which is not counted as dropped."""
    from vlrl.config import DynamicSamplingConfig
    from vlrl.train.async_rollout import GroupBuffer
    from vlrl.train.informative import informative_filter
    from vlrl.train.sampling import Draw, Group

    from .fakes import fake_trajectories

    def group(ticket):
        trajectories = fake_trajectories([1.0, 1.0], [0, 0], [2, 2])
        return Group(trajectories, Draw(ticket, trajectories[0].sample, 0))

    buffer = GroupBuffer(capacity=8)
    buffer.put(group(0))
    buffer.put(group(1))
    released = []

    def check():  # the trainer waits: the rollout generates replacements for the quota it got back, if any
        if sum(released) == 2 and len(buffer) == 0 and not check.pushed:
            check.pushed = True
            buffer.put(group(2))
            buffer.put(group(3))

    check.pushed = False
    informative = informative_filter(DynamicSamplingConfig(enabled=True, max_extra_rounds=1), "dropped",
                                     prompts_per_step=2)
    result = {}
    worker = threading.Thread(target=lambda: result.update(zip(("taken", "stale"), buffer.take_batch(
        2, version=0, eta=0, check=check, release=released.append, informative=informative), strict=True)),
        daemon=True)
    worker.start()
    worker.join(timeout=10)
    assert not worker.is_alive(), "the trainer waited for replacements of groups whose quota it still held"
    taken, stale = result["taken"], result["stale"]
    assert [g.draw.ticket for g in taken.groups] == [2, 3] and [g.draw.ticket for g in taken.dropped] == [0, 1]
    assert sum(released) == 2 and stale == [] and len(buffer) == 0
    assert taken.metrics == {"sampling/groups_dropped": 2, "sampling/prompts_used": 2, "sampling/starved": 1.0}
