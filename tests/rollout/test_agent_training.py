"""Training on multi-turn trajectories of a real tiny model: images of later turns land at their tokens,
the loss mask covers exactly the model's tokens, and teacher-forced log-probs of the model's tokens equal
the behaviour log-probs recorded turn by turn (the proof that positions / M-RoPE indices are right across
turns)."""

import pytest
import torch
from PIL import Image

from vlrl.data import generate
from vlrl.data.sample import load_image
from vlrl.models import collate, load_policy, response_logprobs
from vlrl.rollout import HFEngine, SamplingParams, Status
from vlrl.rollout.agent import AgentSettings, multi_turn
from vlrl.rollout.env import BaseEnv, Observation, observation_message


class ImageOnTurnThree(BaseEnv):
    """Turn 1 sees the prompt image; after turn 1 a text observation; after turn 2 a crop (seen in turn 3; a text
    observation for a prompt without images). Also tests/rollout/test_decode.py's episode."""

    def step(self, response_text):
        self.steps = getattr(self, "steps", 0) + 1
        if self.steps == 1:
            return Observation(text="Not yet."), False, {}
        if self.steps == 2:
            if not self.sample.images:
                return Observation(text="Look again."), False, {}
            crop = load_image(self.sample.images[0]).crop((0, 0, 56, 56)).resize((84, 84))
            return Observation(text="Zoomed:", images=[crop]), False, {}
        return None, True, {}


@pytest.fixture(scope="module")
def vlm():
    torch.manual_seed(0)
    return load_policy("tiny-qwen2-vl")


@pytest.fixture(scope="module")
def vlm_rollout(vlm):
    engine = HFEngine(vlm)
    samples = generate("shapes", 2, tasks=["count", "locate"])
    agent = AgentSettings(env=ImageOnTurnThree, max_turns=3)
    trajectories = multi_turn(engine, [engine.encode(s) for s in samples],
                              SamplingParams(n=2, temperature=0.7, max_new_tokens=6), agent=agent)
    return engine, trajectories


def _rescore(policy, trajectories, temperature):
    batch = collate([t.prompt_ids for t in trajectories], [t.response_ids for t in trajectories],
                    [t.vision for t in trajectories], pad_token_id=policy.pad_token_id)
    with torch.no_grad():
        logp, _ = response_logprobs(policy.model, policy.adapter, batch, temperature=temperature)
    return batch, logp


def test_images_of_turns_one_and_three_land_at_their_tokens(vlm, vlm_rollout):
    _, trajectories = vlm_rollout
    batch, _ = _rescore(vlm, trajectories, 0.7)
    image_token, merge = vlm.model.config.image_token_id, vlm.image_processor.merge_size
    features = vlm.model.model.get_image_features(batch.vision.pixel_values, batch.vision.image_grid_thw).pooler_output
    assert len(features) == 2 * len(trajectories)  # two images per trajectory, in row order
    P = batch.prompt_len
    for i, t in enumerate(trajectories):
        assert t.num_turns == 3 and t.stop_reason == "done" and len(t.images) == 2
        # 112×112 prompt image → 8×8 patches → 16 tokens; 84×84 crop → 6×6 patches → 9 tokens
        assert [int(g.prod()) // merge**2 for g in t.vision.image_grid_thw] == [16, 9]
        positions = (batch.input_ids[i] == image_token).nonzero().flatten()
        runs = torch.split(positions, [16, 9])
        for run in runs:
            assert torch.equal(run, torch.arange(int(run[0]), int(run[0]) + len(run)))  # contiguous
        first, third = features[2 * i], features[2 * i + 1]
        assert (len(runs[0]), len(runs[1])) == (len(first), len(third))  # tokens = features, per image
        assert runs[0][-1] < P  # image 1 in the prompt (turn 1)
        turn2 = t.turns[1]  # image 2 in the observation after turn 2, i.e. before turn 3's tokens
        assert P + turn2.action_end <= runs[1][0] and runs[1][-1] < P + turn2.observation_end
        assert P + turn2.observation_end == P + t.turns[2].action_start


def test_the_loss_mask_covers_exactly_the_model_tokens(vlm, vlm_rollout):
    engine, trajectories = vlm_rollout
    for t in trajectories:
        model_positions = [j for turn in t.turns for j in range(turn.action_start, turn.action_end)]
        assert t.loss_mask.nonzero().flatten().tolist() == model_positions
        assert torch.all(t.behaviour_logp[t.loss_mask == 0] == 0) and torch.all(t.behaviour_logp[t.loss_mask == 1] < 0)
        # every mask-0 span is exactly the observation encoding of that turn, nothing the model produced
        replay = ImageOnTurnThree()
        replay.reset(t.sample)
        for turn in t.turns[:-1]:
            observation, _, _ = replay.step(turn.text)
            last = int(t.response_ids[turn.action_end - 1])
            expected = engine.encode_observation([observation_message(observation)], last_token=last).input_ids
            assert t.response_ids[turn.action_end : turn.observation_end].tolist() == expected
        assert not any(tok in vlm.adapter.special_token_ids() and tok not in vlm.eos_token_ids
                       for tok in t.response_ids[t.loss_mask == 1].tolist())


def test_teacher_forced_logp_equals_behaviour_logp_across_turns_vlm(vlm, vlm_rollout):
    _, trajectories = vlm_rollout
    _, logp = _rescore(vlm, trajectories, 0.7)
    for i, t in enumerate(trajectories):
        mask = t.loss_mask.bool()
        assert torch.allclose(logp[i, : len(mask)][mask], t.behaviour_logp[mask], atol=1e-4)


def test_teacher_forced_logp_equals_behaviour_logp_across_turns_text_model():
    policy = load_policy("tiny-qwen2")
    engine = HFEngine(policy)
    agent = AgentSettings(env=lambda: _TextFeedback(), max_turns=3)
    trajectories = multi_turn(engine, [engine.encode(s) for s in generate("arith", 3)],
                              SamplingParams(n=2, max_new_tokens=5), agent=agent)
    _, logp = _rescore(policy, trajectories, 1.0)
    for i, t in enumerate(trajectories):
        assert t.num_turns == 3 and t.images == [] and t.vision is None
        mask = t.loss_mask.bool()
        assert (~mask).sum() > 0 and torch.allclose(logp[i, : len(mask)][mask], t.behaviour_logp[mask], atol=1e-4)


class _TextFeedback(BaseEnv):
    def step(self, response_text):
        return Observation(text="Incorrect, try again."), False, {}


def test_failed_trajectories_still_collate(vlm):
    """A FAILED episode (its env crashed) keeps what it had and can sit in a training batch (the recipe masks it)."""

    class Crash(BaseEnv):
        def step(self, response_text):
            raise RuntimeError("boom")

    engine = HFEngine(vlm)
    request = engine.encode(generate("shapes", 1)[0])
    (t,) = multi_turn(engine, [request], SamplingParams(max_new_tokens=3),
                      agent=AgentSettings(env=Crash, max_turns=3, max_env_retries_per_turn=0))
    assert t.status is Status.FAILED and len(t.response_ids) == int(t.loss_mask.sum()) > 0
    batch, logp = _rescore(vlm, [t], 1.0)
    assert logp.shape == (1, len(t.response_ids))


def test_images_sized_differently_per_turn_do_not_break_generation(vlm):
    class Sizes(BaseEnv):
        def step(self, response_text):
            self.k = getattr(self, "k", 0) + 1
            return Observation(images=[Image.new("RGB", (28 * (self.k + 1), 56), (9, 9, 9))]), False, {}

    engine = HFEngine(vlm)
    (t,) = multi_turn(engine, [engine.encode(generate("shapes", 1)[0])], SamplingParams(max_new_tokens=2),
                      agent=AgentSettings(env=Sizes, max_turns=3))
    assert [list(g) for g in t.vision.image_grid_thw.tolist()] == [[1, 8, 8], [1, 4, 4], [1, 4, 6]]
    _, logp = _rescore(vlm, [t], 1.0)
    mask = t.loss_mask.bool()
    assert torch.allclose(logp[0][mask], t.behaviour_logp[mask], atol=1e-4)
