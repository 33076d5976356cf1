import pytest
import torch

# tests/ is on sys.path: one preset per family, loaded once per session, and the shared-prefix tests' rollout
from rollout.test_decode import FAMILY_PRESETS, _policy
from train.test_shared_prefix import _rollout
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


# ----------------------------------------------------------------------------------------------- chunked scoring
# (train.logprob_chunk, `vlrl.models.logprobs.head_scores`): the LM head and the fp32 log-softmax / entropy run over
# chunks of tokens inside the forward, each chunk recomputed in the backward; the values are the whole pass's.
CHUNK = 3  # tokens per chunk: every pass below scores ~25-30 tokens, so 8-10 chunks


def test_chunk_tokens_by_setting_and_size():
    from vlrl.models.logprobs import AUTO_CHUNK_ELEMENTS, chunk_tokens

    assert AUTO_CHUNK_ELEMENTS == 2**26
    assert chunk_tokens(0, 10_000, 151_936) is None  # 0: never
    assert chunk_tokens(256, 10_000, 151_936) == 256
    assert chunk_tokens(256, 256, 151_936) is None  # one chunk would hold everything: the whole pass
    assert chunk_tokens("auto", 441, 151_936) is None  # 441 × 151,936 = 67.0M ≤ 2^26 = 67.1M values
    assert chunk_tokens("auto", 442, 151_936) == 441  # ⌊2^26 / 151,936⌋ tokens per chunk
    assert chunk_tokens("auto", 64 * 1024, 2048) == 32_768


def _layouts():
    """name → (scorer(policy, trajectories, chunk) → (logp, entropy), with gradients?) of every teacher-forced pass."""
    from vlrl.models.forward import PassLayout, teacher_forced

    def inputs(trajectories):
        return [t.prompt_ids for t in trajectories], [t.response_ids for t in trajectories], [t.vision for t in trajectories]

    def plain(padding_free):
        def run(policy, trajectories, chunk):
            scores = teacher_forced(policy.model, policy.adapter, *inputs(trajectories),
                                    pad_token_id=policy.pad_token_id, temperature=0.9, with_entropy=True,
                                    layout=PassLayout(padding_free=padding_free, logprob_chunk=chunk))
            return scores.logp, scores.entropy
        return run

    def shared(policy, trajectories, chunk):  # grouped with grad, the KV-cache pass without
        scores = teacher_forced(policy.model, policy.adapter, *inputs(trajectories), pad_token_id=policy.pad_token_id,
                                temperature=0.9, with_entropy=True, layout=PassLayout(shared_prefix=True, logprob_chunk=chunk))
        return scores.logp, scores.entropy

    return {"padded": (plain(False), True), "packed": (plain(True), True), "shared": (shared, True),
            "shared, no grad": (shared, False)}


def _scores_and_gradients(policy, run, trajectories, chunk, *, grad):
    model = policy.model
    if not grad:
        with torch.no_grad():
            return *run(policy, trajectories, chunk), {}
    model.zero_grad(set_to_none=True)
    model.train()
    logp, entropy = run(policy, trajectories, chunk)
    mask = (logp != 0).float()
    weights = torch.linspace(-1, 1, logp.numel()).view_as(logp)  # a loss whose gradient each token shapes
    ((weights * logp * mask).sum() / mask.sum() + 0.1 * (entropy * mask).sum() / mask.sum()).backward()
    model.eval()
    grads = {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return logp.detach(), entropy.detach(), grads


@pytest.mark.parametrize("name", FAMILY_PRESETS)
def test_chunked_scores_and_gradients_equal_the_whole_pass(name, monkeypatch):
    """Every family preset, every layout (padded, packed, shared prefix: grouped with grad, KV cache without):
    log-probs, entropy and every gradient, chunks of 3 tokens vs the whole logits,
    fp32 (values to atol 1e-6 + rtol 1e-6 — an entropy of 7 nats is rounded at 4.8e-7 —, gradients to atol 1e-6;
    the head's matmul over 3 rows rounds differently from one over 40); the chunked passes never hand the log-softmax more than 3 rows of logits."""
    from vlrl.models import logprobs

    sizes: list[int] = []
    real = logprobs.token_logprobs

    def spy(logits, targets, **kwargs):
        sizes.append(logits.shape[0])
        return real(logits, targets, **kwargs)

    monkeypatch.setattr(logprobs, "token_logprobs", spy)
    policy = _policy(name)
    trajectories = _rollout(policy, 3)  # 2 prompts × 3 responses of 2 ... 8 tokens
    for layout, (run, grad) in _layouts().items():
        sizes.clear()
        whole = _scores_and_gradients(policy, run, trajectories, 0, grad=grad)
        assert max(sizes) >= 2 * CHUNK, (layout, sizes)
        sizes.clear()
        chunked = _scores_and_gradients(policy, run, trajectories, CHUNK, grad=grad)
        assert sizes and max(sizes) <= CHUNK, (layout, sizes)
        for k, (a, b) in enumerate(zip(whole[:2], chunked[:2], strict=True)):  # values of ~7 nats: ≤ 1e-6 + 1 ulp
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6, msg=f"{layout} {k}")
        assert float(whole[0].abs().max()) > 0 and float(whole[1].abs().max()) > 0
        grads, chunked_grads = whole[2], chunked[2]
        assert grads.keys() == chunked_grads.keys() and (not grad or max(float(g.abs().max()) for g in grads.values()) > 1e-3)
        for key, g in grads.items():
            assert torch.allclose(chunked_grads[key], g, rtol=0, atol=1e-6), (layout, key)


# ----------------------------------------------------------------------------------------------- head queries
# (`vlrl.models.logprobs.HeadQuery`): on-policy distillation's top-k, log-probs at given ids and argmax, computed
# in the head beside the scores — every layout and chunk size returns the full logits' values (B, R, ·).
def _full_log_probs(policy, trajectories, temperature):
    """(B, R, V) log softmax(logits / T) of every response position from the model's own logits (no head swap)."""
    tokens = collate([t.prompt_ids for t in trajectories], [t.response_ids for t in trajectories],
                     [t.vision for t in trajectories], pad_token_id=policy.pad_token_id)
    kwargs = policy.adapter.forward_inputs(policy.model, tokens.input_ids, tokens.attention_mask, tokens.vision)
    with torch.no_grad():
        logits = policy.model(**kwargs, use_cache=False).logits[:, tokens.prompt_len - 1 : -1]
    return torch.log_softmax(logits.float() / temperature, dim=-1), tokens.response_mask.bool()


@pytest.mark.parametrize("chunk", [0, CHUNK])
def test_head_query_equals_the_full_logits_in_every_layout(chunk):
    from vlrl.models.forward import PassLayout, teacher_forced
    from vlrl.models.logprobs import HeadQuery

    policy = _policy("tiny-qwen2-vl")
    trajectories = _rollout(policy, 3)
    full, mask = _full_log_probs(policy, trajectories, 0.9)  # (B, R, V), (B, R)
    B, R, V = full.shape
    top = full.topk(4, dim=-1)
    at = torch.randint(0, V, (B, R, 3), generator=torch.Generator().manual_seed(0))
    at[0, 0] = top.indices[0, 0, :3]  # a repeat of the top ids
    expected_rest = torch.log1p(-full.gather(-1, at).exp().sum(-1))
    prompts, responses = [t.prompt_ids for t in trajectories], [t.response_ids for t in trajectories]
    visions = [t.vision for t in trajectories]
    for name, layout, grad in [("padded", PassLayout(logprob_chunk=chunk), True),
                               ("packed", PassLayout(padding_free=True, logprob_chunk=chunk), True),
                               ("grouped", PassLayout(shared_prefix=True, logprob_chunk=chunk), True),
                               ("cached", PassLayout(shared_prefix=True, logprob_chunk=chunk), False)]:
        query = HeadQuery(top_k=4, at=at, argmax=True)
        with torch.set_grad_enabled(grad):
            teacher_forced(policy.model, policy.adapter, prompts, responses, visions,
                           pad_token_id=policy.pad_token_id, temperature=0.9, layout=layout, query=query)
        got = query.result
        m = mask
        torch.testing.assert_close(got["topk_logp"][m], top.values[m], rtol=1e-5, atol=1e-5, msg=name)
        assert torch.equal(got["topk_ids"][m], top.indices[m]), name
        assert torch.equal(got["argmax"][m], top.indices[..., 0][m]), name
        rest = torch.log1p(-top.values.exp().sum(-1))
        torch.testing.assert_close(got["topk_rest"][m], rest[m], rtol=1e-4, atol=1e-4, msg=name)
        torch.testing.assert_close(got["at_logp"][m], full.gather(-1, at)[m], rtol=1e-5, atol=1e-5, msg=name)
        torch.testing.assert_close(got["at_rest"][m], expected_rest[m], rtol=1e-4, atol=1e-4, msg=name)
        assert bool((got["topk_logp"][~m] == 0).all()) and bool((got["argmax"][~m] == 0).all())  # padding: 0
        assert got["at_logp"].requires_grad == grad, name


def test_the_rest_of_the_whole_vocabulary_is_empty_and_its_gradient_finite():
    """``rest_logprob`` of every id is `NO_MASS` (exp → 0), and a loss through it has a finite (0) gradient."""
    from vlrl.models.logprobs import NO_MASS, rest_logprob

    logits = torch.randn(2, 5, requires_grad=True)
    log_probs = torch.log_softmax(logits, dim=-1)
    rest = rest_logprob(log_probs, torch.arange(5).expand(2, 5))
    assert bool((rest == NO_MASS).all())
    (rest.exp() * 3.0).sum().backward()
    assert torch.equal(logits.grad, torch.zeros(2, 5))
    two = rest_logprob(log_probs.detach(), torch.tensor([[0, 1], [2, 3]]))  # the other 3 tokens' mass
    expected = torch.log(log_probs.detach().exp()[[[0], [1]], [[2, 3, 4], [0, 1, 4]]].sum(-1))
    torch.testing.assert_close(two, expected)
