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


def test_a_shared_image_is_encoded_once_with_the_same_values_and_gradient(tiny_vlm):
    """Rows holding the same VisionInputs object (a GRPO group) are collated with each image once and an
    ``image_index``; log-probs, entropy and the gradient equal those of the same rows with private copies."""
    from vlrl.models.adapters import VisionInputs

    engine = HFEngine(tiny_vlm)
    a, b = [engine.encode(s) for s in generate("shapes", 2, tasks=["count", "color"])]
    prompts, responses = [a.prompt_ids, b.prompt_ids, a.prompt_ids, a.prompt_ids], [[7, 8], [9], [10, 11, 12], [7]]
    shared = collate(prompts, responses, [a.vision, b.vision, a.vision, a.vision], pad_token_id=tiny_vlm.pad_token_id)
    private = collate(prompts, responses,
                      [VisionInputs(v.pixel_values.clone(), v.image_grid_thw.clone()) for v in (a.vision, b.vision, a.vision, a.vision)],
                      pad_token_id=tiny_vlm.pad_token_id)
    assert shared.vision.image_index.tolist() == [0, 1, 0, 0] and len(shared.vision.image_grid_thw) == 2
    assert private.vision.image_index is None and len(private.vision.image_grid_thw) == 4
    expanded = shared.vision.expanded()  # what DDP / FSDP2 models get: one copy per occurrence
    assert torch.equal(expanded.pixel_values, private.vision.pixel_values)
    assert torch.equal(expanded.image_grid_thw, private.vision.image_grid_thw)
    results = []
    for tokens in (shared, private):
        tiny_vlm.model.zero_grad(set_to_none=True)
        logp, entropy = response_logprobs(tiny_vlm.model, tiny_vlm.adapter, tokens, with_entropy=True)
        (logp.sum() + entropy.sum()).backward()
        grads = {n: p.grad.clone() for n, p in tiny_vlm.model.named_parameters() if p.grad is not None}
        results.append((logp.detach(), entropy.detach(), grads))
    tiny_vlm.model.zero_grad(set_to_none=True)
    (lp_s, ent_s, g_s), (lp_p, ent_p, g_p) = results
    assert torch.allclose(lp_s, lp_p, atol=1e-5) and torch.allclose(ent_s, ent_p, atol=1e-5)
    assert g_s.keys() == g_p.keys() and any("visual" in n for n in g_s)
    for name, g in g_p.items():
        assert torch.allclose(g_s[name], g, rtol=1e-4, atol=1e-6), name
