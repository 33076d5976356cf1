import torch

from vlrl.data import generate
from vlrl.models import collate, response_logprobs
from vlrl.rollout import HFEngine, SamplingParams


def _rescore(policy, trajectories, temperature):
    tokens = collate([t.prompt_ids for t in trajectories], [t.response_ids for t in trajectories],
                     [t.vision for t in trajectories], pad_token_id=policy.pad_token_id)
    with torch.no_grad():
        return tokens, *response_logprobs(policy.model, policy.adapter, tokens, temperature=temperature, with_entropy=True)


def test_behaviour_logp_equals_teacher_forced_recompute(tiny_vlm):
    """The log-probs recorded while sampling (left-padded, KV cache) equal a teacher-forced pass."""
    engine = HFEngine(tiny_vlm)
    requests = [engine.encode(s) for s in generate("shapes", 6, tasks=["count", "locate"])]
    trajectories = engine.generate(requests, SamplingParams(n=3, temperature=0.7, max_new_tokens=12))
    tokens, logp, entropy = _rescore(tiny_vlm, trajectories, 0.7)
    for i, t in enumerate(trajectories):
        n = len(t.response_ids)
        assert torch.allclose(logp[i, :n], t.behaviour_logp, atol=1e-4)
        assert torch.all(logp[i, n:] == 0) and torch.all(entropy[i, n:] == 0)  # padding is masked
    assert torch.all(entropy[tokens.response_mask.bool()] > 0)


def test_text_model_logp_matches_too(tiny_lm):
    engine = HFEngine(tiny_lm)
    requests = [engine.encode(s) for s in generate("arith", 4)]
    trajectories = engine.generate(requests, SamplingParams(n=2, max_new_tokens=10))
    _, logp, _ = _rescore(tiny_lm, trajectories, 1.0)
    for i, t in enumerate(trajectories):
        assert torch.allclose(logp[i, : len(t.response_ids)], t.behaviour_logp, atol=1e-4)


def test_padding_does_not_change_a_row(tiny_vlm):
    """A sequence scored alone and inside a batch of longer ones gets the same log-probs."""
    engine = HFEngine(tiny_vlm)
    short, long = [engine.encode(s) for s in generate("shapes", 2, tasks=["count", "locate"])]
    alone = collate([short.prompt_ids], [[7, 8, 9]], [short.vision], pad_token_id=tiny_vlm.pad_token_id)
    mixed = collate([short.prompt_ids, long.prompt_ids], [[7, 8, 9], [7, 8, 9, 10, 11, 12]],
                    [short.vision, long.vision], pad_token_id=tiny_vlm.pad_token_id)
    assert mixed.prompt_len > len(short.prompt_ids)  # the short prompt really is left-padded
    with torch.no_grad():
        a, _ = response_logprobs(tiny_vlm.model, tiny_vlm.adapter, alone)
        b, _ = response_logprobs(tiny_vlm.model, tiny_vlm.adapter, mixed)
    assert torch.allclose(a[0], b[0, :3], atol=1e-5)


def test_gradient_reaches_vision_tower(tiny_vlm):
    engine = HFEngine(tiny_vlm)
    request = engine.encode(generate("shapes", 1)[0])
    tokens = collate([request.prompt_ids], [[7, 8]], [request.vision], pad_token_id=tiny_vlm.pad_token_id)
    logp, _ = response_logprobs(tiny_vlm.model, tiny_vlm.adapter, tokens)
    logp.sum().backward()
    grad = tiny_vlm.model.model.visual.patch_embed.proj.weight.grad
    assert grad is not None and grad.abs().sum() > 0

# The shared-image path (a GRPO group's image encoded once) is tested for every family in test_families.py.
