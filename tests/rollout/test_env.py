"""The environment protocol (contract test over every registered environment), the registry with typed
kwargs, and the built-in environments: shapes_feedback, tool_zoom, judge."""

import numpy as np
import pytest
from PIL import Image

from vlrl.data import generate
from vlrl.data.sample import load_image
from vlrl.data.tasks.shapes import COLORS
from vlrl.models import load_policy
from vlrl.registry import RegistryError
from vlrl.rollout import HFEngine, SamplingParams
from vlrl.rollout.agent import AgentSettings, multi_turn
from vlrl.rollout.env import (
    BaseEnv,
    EnvConfigError,
    Environment,
    Observation,
    env_factory,
    observation_message,
)
from vlrl.rollout.envs import ENVIRONMENTS, get_env, register_env
from vlrl.rollout.envs.judge import JudgeEnv
from vlrl.rollout.envs.shapes_feedback import relevant_box
from vlrl.rollout.envs.tool_zoom import ToolZoomEnv
from vlrl.rollout.types import Request, Status, Trajectory


class ScriptedJudge:
    """A fake judge `Engine`: answers every prompt with ``verdict``; records the prompts it saw."""

    weight_version = 0

    def __init__(self, verdict: str) -> None:
        self.verdict, self.prompts = verdict, []

    def encode(self, sample):
        self.prompts.append(sample.messages[0]["content"])
        return Request(sample=sample, prompt_ids=[1])

    def generate(self, requests, sampling):
        import torch

        return [Trajectory(sample=r.sample, prompt_ids=torch.tensor([1]), response_ids=torch.tensor([2]),
                           loss_mask=torch.ones(1, dtype=torch.long), behaviour_logp=torch.zeros(1),
                           response_text=self.verdict) for r in requests]

    def update_weights(self, *, version, state_dict=None):
        self.weight_version = version


CONTRACT_KWARGS = {"judge": {"judge": ScriptedJudge("Try again. VERDICT: incorrect")}}


def _color_sample():
    return generate("shapes", 2, tasks=["color"], split="test")[1]


@pytest.mark.parametrize("name", ENVIRONMENTS.names() or ["shapes_feedback"])
def test_environment_contract(name):
    """Every registered environment: reset(sample) → observation or None; step(text) → (observation, done,
    info dict); a not-done observation formats to chat message(s) whose image parts carry PIL images."""
    env = env_factory(name, CONTRACT_KWARGS.get(name, {}))()
    assert isinstance(env, Environment)
    sample = _color_sample()
    first = env.reset(sample)
    if first is not None:
        _check_messages(env.format_observation(first))
    observation, done, info = env.step("<answer>Z</answer>")  # a wrong answer, no tool call
    assert isinstance(done, bool) and isinstance(info, dict)
    if not done:
        _check_messages(env.format_observation(observation))
    if "reward" in info:
        assert isinstance(info["reward"], float)


def _check_messages(messages):
    for message in messages if isinstance(messages, list) else [messages]:
        assert message["role"] in ("user", "tool", "system")
        assert isinstance(message["content"], (str, list))
        for part in message["content"] if isinstance(message["content"], list) else []:
            assert part["type"] in ("text", "image")
            if part["type"] == "image":
                assert isinstance(part["image"], Image.Image)


def test_builtin_names_registry_and_dotted_paths():
    get_env("shapes_feedback")  # imports the built-ins
    assert {"shapes_feedback", "tool_zoom", "judge"} <= set(ENVIRONMENTS.names())
    loaded = get_env("tests.rollout.test_env:CountingEnv")  # pytest may import this file under another name
    assert loaded.__qualname__ == "CountingEnv" and loaded.__module__.endswith("test_env")
    with pytest.raises(RegistryError, match="already registered"):
        register_env("tool_zoom")(CountingEnv)
    with pytest.raises(RegistryError, match="unknown environment 'nope'"):
        get_env("nope")


class CountingEnv(BaseEnv):
    def __init__(self, *, limit: int = 2, label: str = "n") -> None:
        self.limit, self.label, self.steps = limit, label, 0

    def step(self, response_text):
        self.steps += 1
        return f"{self.label}{self.steps}", self.steps >= self.limit, {}


def test_typed_kwargs_are_validated_and_coerced():
    build = env_factory("tests.rollout.test_env:CountingEnv", {"limit": "3"})
    env = build()
    assert env.limit == 3 and build() is not env  # a fresh instance per call
    with pytest.raises(EnvConfigError, match=r"rollout.agent.env_kwargs.limt: unknown option"):
        env_factory("tests.rollout.test_env:CountingEnv", {"limt": 3})
    with pytest.raises(EnvConfigError, match=r"rollout.agent.env_kwargs.limit: Input should be a valid integer"):
        env_factory("tests.rollout.test_env:CountingEnv", {"limit": "many"})


def test_observation_message_forms():
    image = Image.new("RGB", (8, 8))
    assert observation_message("hi") == {"role": "user", "content": [{"type": "text", "text": "hi"}]}
    assert observation_message(Observation("t", [image], role="tool")) == {
        "role": "tool", "content": [{"type": "image", "image": image}, {"type": "text", "text": "t"}]}
    with pytest.raises(TypeError, match="cannot format an observation of type int"):
        observation_message(3)


# ----------------------------------------------------------------------------------------------- shapes_feedback
def test_shapes_feedback_right_wrong_and_the_zoomed_crop():
    sample = _color_sample()
    letter = sample.answer  # the right option letter
    env = env_factory("shapes_feedback", {"zoom": True, "zoom_size": 64})()
    env.reset(sample)
    observation, done, info = env.step(f"<answer>{'A' if letter != 'A' else 'B'}</answer>")
    assert not done and info == {"reward": 0.0, "correct": False}
    assert observation.text == "Incorrect, try again." and observation.images[0].size == (64, 64)
    # the crop shows the shape the question names: its colour is the most frequent non-white colour
    colour = sample.metadata["options"][letter]
    pixels = [tuple(p) for p in np.asarray(observation.images[0]).reshape(-1, 3).tolist() if tuple(p) != (255, 255, 255)]
    nearest = [min(COLORS, key=lambda c: sum((a - b) ** 2 for a, b in zip(COLORS[c], p, strict=True))) for p in pixels]
    assert max(set(nearest), key=nearest.count) == colour
    assert env.step(f"<answer>{letter}</answer>") == (None, True, {"reward": 1.0, "correct": True})


def test_relevant_box():
    sample = _color_sample()
    named = next(k for k in ("circle", "square", "triangle") if k in sample.prompt_text())
    assert relevant_box(sample, (112, 112)) == next(o["box"] for o in sample.metadata["objects"] if o["kind"] == named)
    count = generate("shapes", 1, tasks=["count"])[0]
    boxes = [o["box"] for o in count.metadata["objects"]]
    assert relevant_box(count, (112, 112)) == [min(b[0] for b in boxes), min(b[1] for b in boxes),
                                              max(b[2] for b in boxes), max(b[3] for b in boxes)]
    assert relevant_box(generate("shapes", 1, tasks=["ocr"])[0], (112, 112)) == [0, 0, 112, 112]


# ----------------------------------------------------------------------------------------------- tool_zoom
def test_tool_zoom_calls_errors_and_final_answer():
    sample = _color_sample()
    env = ToolZoomEnv(zoom_size=56, max_calls=1)
    instructions = env.reset(sample)
    assert "zoom(x1, y1, x2, y2)" in instructions.text
    observation, done, info = env.step("let me look: zoom(0, 0, 56, 28)")
    assert not done and observation.images[0].size == (56, 56) and observation.text == "zoom(0, 0, 56, 28):"
    assert info == {"zoom_call": 1}  # counted per episode as agent/env/zoom_call
    # the crop is the top-left quarter of the image, enlarged: same top-left pixel
    assert observation.images[0].getpixel((0, 0)) == load_image(sample.images[0]).getpixel((0, 0))
    observation, done, _ = env.step("zoom(0, 0, 56, 28)")
    assert not done and "No more zoom calls" in observation.text and not observation.images
    env.reset(sample)
    observation, done, info = env.step("zoom(50, 0, 10, 300)")
    assert not done and info == {"zoom_error": True} and "need 0 <= x1 < x2 <= 112" in observation.text
    assert env.step("<answer>B</answer>") == (None, True, {"zoom_calls": 0})
    with pytest.raises(ValueError, match="has no image to zoom into"):
        env.reset(generate("arith", 1)[0])


# ----------------------------------------------------------------------------------------------- judge
def test_judge_feedback_and_acceptance_through_the_engine_protocol():
    sample = _color_sample()
    judge = ScriptedJudge("The circle is red. VERDICT: incorrect")
    env = JudgeEnv(judge=judge)
    env.reset(sample)
    observation, done, info = env.step("<answer>A</answer>")
    assert not done and observation.text == "Feedback: The circle is red. VERDICT: incorrect"
    assert info["reward"] == 0.0
    assert "Student answer: <answer>A</answer>" in judge.prompts[0] and f"Reference answer: {sample.answer}" in judge.prompts[0]
    judge.verdict = "Well done. VERDICT: correct"
    assert env.step("<answer>B</answer>")[1:] == (True, {"judge_text": "Well done. VERDICT: correct", "reward": 1.0})


def test_a_tiny_preset_is_the_judge_of_a_multi_turn_rollout():
    """The judge is a real in-process engine (tiny-qwen2, greedy); its text becomes the observation tokens."""
    policy = load_policy("tiny-qwen2-vl")
    engine = HFEngine(policy)
    build = env_factory("judge", {"judge": "tiny-qwen2", "max_new_tokens": 6})
    judge_engine = build().engine
    assert isinstance(judge_engine, HFEngine) and build().engine is judge_engine  # loaded once
    agent = AgentSettings(env=build, max_turns=2)
    (t,) = multi_turn(engine, [engine.encode(_color_sample())], SamplingParams(max_new_tokens=4), agent=agent)
    assert t.status in (Status.COMPLETED, Status.TRUNCATED) and t.num_turns == 2 and t.stop_reason == "max_turns"
    # the judge's greedy verdict on the first answer, as the judge env would produce it again
    replay = build()
    replay.reset(t.sample)
    observation, _, _ = replay.step(t.turns[0].text)
    expected = policy.adapter.encode_observation(
        [observation_message(observation)], close_turn=int(t.response_ids[t.turns[0].action_end - 1]) not in policy.eos_token_ids
    ).input_ids
    assert t.response_ids[t.turns[0].action_end : t.turns[0].observation_end].tolist() == expected


class ScriptedVLMEngine(HFEngine):
    """The tiny VLM's real encoders, but turn k's text is ``script[k]`` (k = index of the generate call)."""

    def __init__(self, policy, script):
        super().__init__(policy)
        self.script, self.turn = script, 0

    def generate(self, requests, sampling):
        import torch

        text = self.script[min(self.turn, len(self.script) - 1)]
        self.turn += 1
        ids = self.policy.adapter.encode_text(text) + [self.policy.eos_token_ids[0]]
        return [Trajectory(sample=r.sample, prompt_ids=torch.tensor(r.prompt_ids), response_ids=torch.tensor(ids),
                           loss_mask=torch.ones(len(ids), dtype=torch.long), behaviour_logp=torch.full((len(ids),), -1.0),
                           response_text=text, group_index=i) for i, r in enumerate(requests)]


def test_tool_zoom_through_the_agent_loop():
    """Instructions join the prompt once; the zoom call's crop becomes image 2 with its 16 vision tokens in the
    observation; the answer ends the episode and is what gets scored."""
    policy = load_policy("tiny-qwen2-vl")
    engine = ScriptedVLMEngine(policy, ["zoom(0, 0, 56, 56)", "<answer>B</answer>"])
    agent = AgentSettings(env=env_factory("tool_zoom", {"zoom_size": 112}), max_turns=3)
    (t,) = multi_turn(engine, [engine.encode(_color_sample())], SamplingParams(), agent=agent)
    prompt = policy.tokenizer.decode(t.prompt_ids)
    assert prompt.count("You may call zoom(x1, y1, x2, y2)") == 1 and prompt.endswith("<|im_start|>assistant\n")
    assert (t.stop_reason, t.num_turns, t.response_text, len(t.images)) == ("done", 2, "<answer>B</answer>", 2)
    assert t.vision.image_grid_thw.tolist() == [[1, 8, 8], [1, 8, 8]]
    observation = t.response_ids[t.turns[0].action_end : t.turns[0].observation_end]
    assert int((observation == policy.model.config.image_token_id).sum()) == 16
    assert "zoom(0, 0, 56, 56):" in policy.tokenizer.decode(observation)
    assert t.turns[0].num_images == 1 and t.loss_mask.sum() == len(t.response_ids) - len(observation)
