"""The agent loop on a scripted engine: termination, loss masks, retries, timeouts, budgets, metrics.

The scripted engine answers turn k of every episode with ``script[k]``: one token per lowercase letter (id 100 + letter index),
then EOS (id 0); each token's behaviour log-prob is −0.25. An observation of text T is encoded as the marker
9 followed by len(T) tokens 8, so an episode's turn index is the number of 9s in its context.
"""

import threading
import time

import pytest
import torch

from vlrl.check.options import (
    load_run_config as load_config,  # as the CLI loads a config: plug-in options checked
)
from vlrl.config import ConfigError, RLConfig
from vlrl.data import Sample
from vlrl.models.adapters import EncodedPrompt
from vlrl.rollout import Request, SamplingParams, Status, Trajectory
from vlrl.rollout.agent import (
    GENERATES,
    ROLLOUTS,
    AgentSettings,
    RolloutEngine,
    agent_metrics,
    build_rollout,
    call_with_timeout,
    multi_turn,
    per_sample,
    single_turn,
)
from vlrl.rollout.env import BaseEnv, EnvConfigError, Observation

EOS, OBS, OBS_TOKEN = 0, 9, 8
PROMPT = [1, 2, 3, 4, 5]


class ScriptedEngine:
    """A fake `Engine` (see the module docstring)."""

    def __init__(self, script: list[str]) -> None:
        self.script, self.weight_version, self.calls = script, 0, []

    def encode(self, sample: Sample) -> Request:
        return Request(sample=sample, prompt_ids=list(PROMPT))

    def generate(self, requests, sampling: SamplingParams) -> list[Trajectory]:
        self.calls.append(len(requests))
        out = []
        for group_index, request in enumerate(requests):
            text = self.script[min(request.prompt_ids.count(OBS), len(self.script) - 1)]
            ids = [100 + ord(c) - ord("a") for c in text] + [EOS]
            status = Status.COMPLETED
            if len(ids) > sampling.max_new_tokens:
                ids, status = ids[: sampling.max_new_tokens], Status.TRUNCATED
            for _ in range(sampling.n):
                out.append(Trajectory(sample=request.sample, prompt_ids=torch.tensor(request.prompt_ids),
                                      response_ids=torch.tensor(ids), loss_mask=torch.ones(len(ids), dtype=torch.long),
                                      behaviour_logp=torch.full((len(ids),), -0.25), status=status,
                                      response_text=self.decode(ids), group_index=group_index,
                                      weight_version=self.weight_version))
        return out

    def decode(self, ids) -> str:
        return "".join(chr(ord("a") + i - 100) for i in ids if i >= 100)

    def encode_observation(self, messages, *, last_token, tools=None) -> EncodedPrompt:
        text = "".join(p.get("text", "") for m in messages for p in m["content"])
        close = [EOS] if last_token != EOS else []
        return EncodedPrompt(close + [OBS] + [OBS_TOKEN] * len(text), None)

    def update_weights(self, *, version, state_dict=None) -> None:
        self.weight_version = version


def sample(i: int = 0) -> Sample:
    return Sample(id=f"s{i}", task="t", messages=[{"role": "user", "content": "q"}], answer="right", reward="number")


class RightEnv(BaseEnv):
    """Done when the answer contains "right"; otherwise "no" (2 observation tokens + marker)."""

    def step(self, response_text):
        if "right" in response_text:
            return None, True, {"reward": 1.0}
        return Observation(text="no"), False, {"reward": 0.0}


def settings(env=RightEnv, **kw) -> AgentSettings:
    return AgentSettings(env=env, **{"max_turns": 4, "env_timeout_seconds": 5.0, **kw})


def run(script, n=1, requests=1, max_new_tokens=32, **kw) -> tuple[list[Trajectory], ScriptedEngine]:
    engine = ScriptedEngine(script)
    reqs = [engine.encode(sample(i)) for i in range(requests)]
    return multi_turn(engine, reqs, SamplingParams(n=n, max_new_tokens=max_new_tokens), agent=settings(**kw)), engine


def test_done_on_the_second_turn_masks_and_spans():
    (t,), engine = run(["wrong", "right"])
    # turn 1: "wrong" = 5 tokens + EOS (mask 1); observation: marker + 2 tokens for "no" (mask 0);
    # turn 2: "right" + EOS (mask 1); done → no trailing observation.
    assert t.loss_mask.tolist() == [1] * 6 + [0] * 3 + [1] * 6
    assert t.response_ids[6:9].tolist() == [OBS, OBS_TOKEN, OBS_TOKEN]
    assert t.behaviour_logp.tolist() == [-0.25] * 6 + [0.0] * 3 + [-0.25] * 6
    assert [(u.action_start, u.action_end, u.observation_end) for u in t.turns] == [(0, 6, 9), (9, 15, 15)]
    assert [u.reward for u in t.turns] == [0.0, 1.0]
    assert (t.status, t.stop_reason, t.num_turns, t.response_text) == (Status.COMPLETED, "done", 2, "right")
    assert t.prompt_ids.tolist() == PROMPT and engine.calls == [1, 1]


def test_max_turns_stops_without_a_trailing_observation():
    (t,), _ = run(["wrong"], max_turns=3)
    assert (t.num_turns, t.stop_reason, t.status) == (3, "max_turns", Status.COMPLETED)
    assert t.loss_mask.tolist() == ([1] * 6 + [0] * 3) * 2 + [1] * 6  # ends on the model's tokens


def test_a_turn_cut_by_max_new_tokens_is_closed_and_the_last_one_marks_truncated():
    (t,), _ = run(["wrongwrong"], max_turns=2, max_new_tokens=4)
    # each turn: 4 tokens, no EOS → the observation starts with the closing EOS (mask 0)
    assert t.loss_mask.tolist() == [1] * 4 + [0] * 4 + [1] * 4
    assert t.response_ids[4:6].tolist() == [EOS, OBS]
    assert (t.status, t.stop_reason) == (Status.TRUNCATED, "max_turns")


def test_token_budget_truncates_and_is_never_exceeded():
    # prompt 5 + turn 1 (6) + observation (3) = 14; budget 17 leaves 3 tokens for turn 2 → cut, TRUNCATED.
    (t,), _ = run(["wrong"], max_total_tokens=17)
    assert len(t.prompt_ids) + len(t.response_ids) == 17
    assert t.loss_mask.tolist() == [1] * 6 + [0] * 3 + [1] * 3
    assert (t.status, t.stop_reason, t.response_text) == (Status.TRUNCATED, "token_budget", "wro")
    # an observation that does not fit (with room for one more model token) is not appended
    (t,), _ = run(["wrong"], max_total_tokens=13)
    assert t.loss_mask.tolist() == [1] * 6 and (t.status, t.stop_reason) == (Status.TRUNCATED, "token_budget")


def test_groups_order_and_one_engine_call_per_turn():
    trajectories, engine = run(["wrong", "right"], n=3, requests=2)
    assert [t.group_index for t in trajectories] == [0, 0, 0, 1, 1, 1]
    assert [t.sample.id for t in trajectories] == ["s0"] * 3 + ["s1"] * 3
    assert engine.calls == [6, 6]  # all six episodes batched in each turn


def test_per_sample_and_a_custom_generate_match_the_batched_loop():
    engine = ScriptedEngine(["wrong", "right"])
    reqs = [engine.encode(sample(i)) for i in range(2)]
    sampling = SamplingParams(n=2, max_new_tokens=32)
    batched = multi_turn(engine, reqs, sampling, agent=settings())
    one_by_one = per_sample(engine, reqs, sampling, agent=settings())
    assert [t.response_ids.tolist() for t in batched] == [t.response_ids.tolist() for t in one_by_one]
    assert [t.group_index for t in one_by_one] == [0, 0, 1, 1]
    custom = per_sample(engine, reqs, sampling, agent=settings(generate="tests.rollout.test_agent:first_turn_only"))
    assert all(t.stop_reason == "custom" and t.num_turns == 1 for t in custom)


def first_turn_only(engine, request, sampling, *, agent):
    """A per-sample generate plugged in by dotted path: the plain single-turn response."""
    trajectory = engine.generate([request], sampling)[0]
    trajectory.stop_reason = "custom"
    return trajectory


def test_single_turn_is_exactly_engine_generate():
    engine = ScriptedEngine(["abc"])
    reqs = [engine.encode(sample())]
    a = single_turn(engine, reqs, SamplingParams(n=2))
    b = engine.generate(reqs, SamplingParams(n=2))
    assert [t.response_ids.tolist() for t in a] == [t.response_ids.tolist() for t in b]
    assert set(ROLLOUTS.names()) >= {"single_turn", "multi_turn", "per_sample"} and "agent" in GENERATES


@pytest.mark.parametrize("name", ["single_turn", "multi_turn", "per_sample"])
def test_rollout_registry_contract(name):
    """Every registered rollout: fn(engine, requests, sampling, *, agent) → len(requests)·n trajectories in
    request order, aligned tensors, behaviour log-probs only under the loss mask."""
    engine = ScriptedEngine(["wrong", "right"])
    reqs = [engine.encode(sample(i)) for i in range(3)]
    out = ROLLOUTS.get(name)(engine, reqs, SamplingParams(n=2, max_new_tokens=16), agent=settings())
    assert [t.group_index for t in out] == [0, 0, 1, 1, 2, 2]
    for t in out:
        assert len(t.response_ids) == len(t.loss_mask) == len(t.behaviour_logp) > 0
        assert torch.all(t.behaviour_logp[t.loss_mask == 0] == 0)
        assert isinstance(t.status, Status)


# ----------------------------------------------------------------------------------------------- faults
class FlakyEnv(RightEnv):
    """Raises on every other step call (the 2nd, 4th, ... of this instance)."""

    def __init__(self):
        self.calls = 0

    def step(self, response_text):
        self.calls += 1
        if self.calls % 2 == 0:
            raise ConnectionError("tool server hiccup")
        return super().step(response_text)


class BrokenEnv(RightEnv):
    def step(self, response_text):
        raise RuntimeError("tool crashed")


def test_env_failing_every_other_step_is_retried_and_counted():
    (t,), _ = run(["wrong", "wrong", "right"], max_env_retries_per_turn=1)
    assert t.status is Status.COMPLETED  # sanity: the plain env
    (t,), _ = run(["wrong", "wrong", "right"], env=FlakyEnv, max_env_retries_per_turn=1)
    # step calls: 1 ok (turn 1), 2 fails → 3 ok (turn 2), 4 fails → 5 ok (turn 3, done)
    assert (t.status, t.stop_reason, t.num_turns) == (Status.COMPLETED, "done", 3)
    assert [u.env_retries for u in t.turns] == [0, 1, 1] and t.env_retries == 2


def test_env_exhausting_its_retries_fails_the_trajectory_not_the_run():
    trajectories, _ = run(["wrong"], n=2, env=BrokenEnv, max_env_retries_per_turn=2)
    for t in trajectories:
        assert (t.status, t.stop_reason) == (Status.FAILED, "env_failed")
        assert t.turns[0].env_retries == 3 and "RuntimeError: tool crashed" in t.error
    metrics = agent_metrics(trajectories)
    assert metrics["agent/failed"] == 2 and metrics["agent/env_retries"] == 6
    assert metrics["agent/stop/env_failed"] == 1.0


class HangingEnv(RightEnv):
    """Hangs (until released) on the first step of the run's first instance; records resets and steps."""

    release = threading.Event()
    instances: list = []

    def __init__(self):
        self.seen = []
        HangingEnv.instances.append(self)

    def reset(self, sample):
        self.seen.append("reset")
        return None

    def step(self, response_text):
        self.seen.append(response_text)
        if self is HangingEnv.instances[0] and len(self.seen) == 3:  # reset, turn 1, turn 2 → hang
            HangingEnv.release.wait(30)
        return super().step(response_text)


def test_a_hanging_env_is_cut_by_the_timeout_and_resumed_on_a_fresh_instance():
    HangingEnv.instances.clear()
    try:
        start = time.time()
        (t,), _ = run(["wrong", "wrong", "right"], env=HangingEnv, env_timeout_seconds=0.3)
        assert time.time() - start < 10
    finally:
        HangingEnv.release.set()
    # build_rollout's probe is not used here: instance 0 hung on turn 2; instance 1 was reset, replayed
    # turn 1's action and then took turn 2 and turn 3.
    assert (t.status, t.stop_reason, t.num_turns) == (Status.COMPLETED, "done", 3)
    assert t.turns[1].env_retries == 1
    assert HangingEnv.instances[1].seen == ["reset", "wrong", "wrong", "right"]


class ForeverEnv(RightEnv):
    def step(self, response_text):
        time.sleep(5)
        return super().step(response_text)


def test_an_env_that_always_hangs_fails_after_its_retries():
    start = time.time()
    (t,), _ = run(["wrong"], env=ForeverEnv, env_timeout_seconds=0.2, max_env_retries_per_turn=1)
    assert time.time() - start < 2  # 2 attempts × 0.2 s, not 2 × 5 s
    assert (t.status, t.stop_reason) == (Status.FAILED, "env_timeout") and "exceeded" in t.error


class ReplayEnv(RightEnv):
    """A stateful env that asks for reset + replay on retry; fails once, on its first instance's 2nd step."""

    retry_mode = "reset_replay"
    built: list = []

    def __init__(self):
        self.state = []
        ReplayEnv.built.append(self)

    def reset(self, sample):
        self.state = []

    def step(self, response_text):
        self.state.append(response_text)
        if self is ReplayEnv.built[0] and len(self.state) == 2:
            raise ValueError("corrupted state")
        return Observation(text="no" * len(self.state)), "right" in response_text, {}


def test_reset_replay_retry_rebuilds_the_state():
    ReplayEnv.built.clear()
    (t,), _ = run(["wrong", "wrong", "right"], env=ReplayEnv)
    assert len(ReplayEnv.built) == 2 and ReplayEnv.built[1].state == ["wrong", "wrong", "right"]
    # the observation after turn 2 comes from the rebuilt state: "no" × 2 → 4 observation tokens + marker
    assert t.turns[1].observation_end - t.turns[1].action_end == 5 and t.turns[1].env_retries == 1


class FailingReset(RightEnv):
    def reset(self, sample):
        raise OSError("no sandbox available")


def test_a_failing_reset_fails_the_episode_before_any_generation():
    (t,), engine = run(["wrong"], env=FailingReset, max_env_retries_per_turn=1)
    assert (t.status, t.stop_reason, len(t.response_ids)) == (Status.FAILED, "env_failed", 0)
    assert engine.calls == []


def test_call_with_timeout():
    assert call_with_timeout(lambda: 7, 1.0) == 7
    with pytest.raises(KeyError):
        call_with_timeout(lambda: {}["x"], 1.0)
    with pytest.raises(TimeoutError):
        call_with_timeout(lambda: time.sleep(2), 0.05)


# ----------------------------------------------------------------------------------------------- metrics, config
def test_agent_metrics_hand_computed():
    trajectories, _ = run(["wrong", "right"], n=2)  # 2 turns each, done
    (three,), _ = run(["wrong"], max_turns=3)  # 3 turns, max_turns
    batch = trajectories + [three]
    for t, r in zip(batch, [1.0, 0.0, 0.5], strict=True):
        t.reward = r
    m = agent_metrics(batch)
    assert m["agent/turns_mean"] == pytest.approx((2 + 2 + 3) / 3)
    assert not any(k.startswith("agent/env/") for k in m)  # RightEnv reports no numbers besides the reward
    assert m["agent/turns=2"] == pytest.approx(2 / 3) and m["agent/turns=3"] == pytest.approx(1 / 3)
    assert m["agent/stop/done"] == pytest.approx(2 / 3) and m["agent/stop/max_turns"] == pytest.approx(1 / 3)
    # action tokens: 12, 12, 18 → 14; observation tokens: 3, 3, 6 → 4
    assert m["agent/action_tokens_mean"] == 14 and m["agent/observation_tokens_mean"] == 4
    assert m["agent/reward_turns=2"] == 0.5 and m["agent/reward_turns=3"] == 0.5
    # step rewards: (0, 1), (0, 1), (0, 0, 0) → 2 / 7
    assert m["agent/step_reward_mean"] == pytest.approx(2 / 7)


class CallCountingEnv(RightEnv):
    """RightEnv that also reports a tool call (a number) and a note (text, not a metric) for every wrong answer."""

    def step(self, response_text):
        observation, done, info = super().step(response_text)
        return observation, done, info if done else {**info, "calls": 1, "note": "wrong"}


def test_numbers_an_environment_reports_become_per_episode_metrics():
    (two,), _ = run(["wrong", "right"], env=CallCountingEnv)  # 1 wrong turn → 1 call
    (three,), _ = run(["wrong"], env=CallCountingEnv, max_turns=3)  # 3 wrong turns (the last one stepped too)
    assert [turn.info for turn in two.turns] == [{"calls": 1.0}, {}]
    m = agent_metrics([two, three])
    assert m["agent/env/calls"] == pytest.approx((1 + 3) / 2) and "agent/env/note" not in m


def test_build_rollout_from_config_and_the_engine_wrapper():
    cfg = load_config(RLConfig, None, ["rollout.agent.function=multi_turn", "rollout.agent.env=tests.rollout.test_agent:RightEnv",
                                       "rollout.agent.max_turns=3"])
    engine = RolloutEngine(ScriptedEngine(["wrong", "right"]), build_rollout(cfg.rollout))
    out = engine.generate([engine.encode(sample())], SamplingParams(n=2))
    assert [t.num_turns for t in out] == [2, 2]
    engine.update_weights(version=4)
    assert engine.weight_version == 4 and engine.engine.weight_version == 4
    plain = build_rollout(load_config(RLConfig, None, []).rollout)
    assert plain(ScriptedEngine(["x"]), [Request(sample(), PROMPT)], SamplingParams())[0].num_turns == 1


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="rollout.agent.env must name an environment"):
        load_config(RLConfig, None, ["rollout.agent.function=multi_turn"])
    with pytest.raises(ConfigError, match="config field 'rollout.agent.max_turns'"):
        load_config(RLConfig, None, ["rollout.agent.max_turns=0"])
    # an environment or rollout-function option is checked against its signature when the config loads
    with pytest.raises(ConfigError, match=r"'rollout.agent.env_kwargs.zom': unknown option of shapes_feedback; known: "
                                          r"feedback, margin, zoom, zoom_size"):
        load_config(RLConfig, None, ["rollout.agent.function=multi_turn", "rollout.agent.env=shapes_feedback",
                                     "rollout.agent.env_kwargs={zom: true}"])
    with pytest.raises(ConfigError, match=r"'rollout.agent.options.turns': unknown option of multi_turn; known: none"):
        load_config(RLConfig, None, ["rollout.agent.function=multi_turn", "rollout.agent.env=shapes_feedback",
                                     "rollout.agent.options={turns: 2}"])
    # and again where the rollout is built (a config made in code skips load_config)
    cfg = load_config(RLConfig, None, ["rollout.agent.function=multi_turn", "rollout.agent.env=shapes_feedback"])
    with pytest.raises(EnvConfigError, match=r"rollout.agent.env_kwargs.zom: unknown option"):
        build_rollout(cfg.rollout.model_copy(update={"agent": cfg.rollout.agent.model_copy(update={"env_kwargs": {"zom": True}})}))


def hinted(engine, requests, sampling, *, agent, hint: str = "", repeat: int = 1):
    """A custom rollout function with options: every response's text gets ``hint`` ``repeat`` times."""
    out = single_turn(engine, requests, sampling, agent=agent)
    for t in out:
        t.response_text += hint * repeat
    return out


def test_function_options_are_bound_to_a_custom_rollout_and_checked():
    cfg = load_config(RLConfig, None, ["rollout.agent.function=tests.rollout.test_agent:hinted",
                                       "rollout.agent.options={hint: '!', repeat: 2}"])
    engine = RolloutEngine(ScriptedEngine(["ab"]), build_rollout(cfg.rollout))
    assert [t.response_text for t in engine.generate([engine.encode(sample())], SamplingParams(n=2))] == ["ab!!"] * 2
    with pytest.raises(ConfigError, match=r"'rollout.agent.options.repeat': Input should be a valid integer"):
        load_config(RLConfig, None, ["rollout.agent.function=tests.rollout.test_agent:hinted",
                                     "rollout.agent.options={repeat: many}"])
    with pytest.raises(ConfigError, match=r"'rollout.agent.options.agent': set by the rollout.agent.\* fields"):
        load_config(RLConfig, None, ["rollout.agent.function=tests.rollout.test_agent:hinted",
                                     "rollout.agent.options={agent: 1}"])


def test_a_prompt_longer_than_the_budget_is_truncated_before_generating():
    (t,), engine = run(["wrong"], max_total_tokens=5)  # the prompt alone is 5 tokens
    assert (t.status, t.stop_reason, len(t.response_ids)) == (Status.TRUNCATED, "token_budget", 0)
    assert engine.calls == []


def test_an_engine_without_observation_encoding_is_refused_clearly():
    class PlainEngine(ScriptedEngine):
        encode_observation = None

    engine = PlainEngine(["x"])
    with pytest.raises(TypeError, match="PlainEngine cannot run multi-turn episodes"):
        multi_turn(engine, [engine.encode(sample())], SamplingParams(), agent=settings())


class MalformedEnv(RightEnv):
    """Returns a 2-tuple from step (a bug), or an observation that cannot be formatted."""

    def __init__(self, *, bad: str = "shape"):
        self.bad = bad

    def step(self, response_text):
        if self.bad == "shape":
            return Observation(text="no"), False
        return 12345, False, {}


def test_malformed_env_output_fails_the_episode_not_the_run():
    (t,), _ = run(["wrong"], env=MalformedEnv, max_env_retries_per_turn=1)
    assert (t.status, t.stop_reason) == (Status.FAILED, "env_failed") and "(observation, done, info)" in t.error
    (t,), _ = run(["wrong"], env=lambda: MalformedEnv(bad="observation"))
    assert (t.status, t.stop_reason) == (Status.FAILED, "observation_error") and "type int" in t.error


def test_an_episode_spanning_a_weight_update_carries_each_tokens_version():
    """The engine moves to version 1 after the first turn: the first turn's tokens (and the observation after it) are
    version 0's, the second turn's version 1's; the episode is tagged with its oldest token's version. An episode of
    one version carries no per-token tensor (`Trajectory.versions` fills it)."""
    engine = ScriptedEngine(["wrong", "right"])
    real = engine.generate

    def generate_then_update(requests, sampling):
        out = real(requests, sampling)
        engine.update_weights(version=engine.weight_version + 1)
        return out

    engine.generate = generate_then_update
    (t,) = multi_turn(engine, [engine.encode(sample())], SamplingParams(max_new_tokens=32), agent=settings())
    assert t.token_versions.tolist() == [0] * 6 + [0] * 3 + [1] * 6 and t.weight_version == 0
    (same,), _ = run(["wrong", "right"])
    assert same.token_versions is None and same.versions.tolist() == [0] * 15
