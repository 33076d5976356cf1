import torch

from vlrl.data import generate
from vlrl.rollout import HFEngine, SamplingParams, Status


def test_n_samples_per_prompt_grouped_in_order(tiny_vlm):
    engine = HFEngine(tiny_vlm, max_batch_size=5)  # forces several generate calls
    samples = generate("shapes", 3)
    trajectories = engine.generate([engine.encode(s) for s in samples], SamplingParams(n=4, max_new_tokens=6))
    assert len(trajectories) == 12
    assert [t.group_index for t in trajectories] == [0] * 4 + [1] * 4 + [2] * 4
    assert all(t.sample is samples[t.group_index] for t in trajectories)
    for t in trajectories:
        assert len(t.response_ids) == len(t.loss_mask) == len(t.behaviour_logp) <= 6
        assert torch.all(t.behaviour_logp <= 0)
        eos_seen = t.response_ids[-1].item() in tiny_vlm.eos_token_ids
        assert (t.status is Status.COMPLETED) == eos_seen
        assert t.status is Status.COMPLETED or len(t.response_ids) == 6


def test_greedy_is_deterministic_and_never_emits_image_tokens(tiny_vlm):
    engine = HFEngine(tiny_vlm)
    requests = [engine.encode(s) for s in generate("shapes", 4)]
    a = engine.generate(requests, SamplingParams(temperature=0, max_new_tokens=10))
    b = engine.generate(requests, SamplingParams(temperature=0, max_new_tokens=10))
    assert [t.response_ids.tolist() for t in a] == [t.response_ids.tolist() for t in b]
    sampled = engine.generate(requests, SamplingParams(n=8, temperature=1.5, max_new_tokens=16))
    image_token = tiny_vlm.model.config.image_token_id
    assert not any((t.response_ids == image_token).any() for t in sampled)


def test_update_weights_sets_version(tiny_vlm):
    engine = HFEngine(tiny_vlm)
    engine.update_weights(version=3)
    t = engine.generate([engine.encode(generate("shapes", 1)[0])], SamplingParams(max_new_tokens=2))[0]
    assert t.weight_version == 3
