"""The group-prefill sampling loop (`vlrl.rollout.decode`), for one preset of every family in
`vlrl.models.presets.PRESETS`: each distinct prompt is prefilled once and its cache expanded to its n rows,
and the behaviour log-probs equal the trainer's teacher-forced log-probs (max |Δ| < 1e-4) — with images, n ∈
{1, 4}, and across a three-turn episode with an image in turn 3. A family whose cache cannot be expanded falls
back to one prefill per row (logged once) and is exact all the same."""

from __future__ import annotations

import logging

import pytest
import torch

from vlrl.data import generate
from vlrl.models import collate, kv_cache, load_policy, response_logprobs
from vlrl.models.presets import PRESETS
from vlrl.rollout import HFEngine, Request, SamplingParams, decode
from vlrl.rollout.agent import AgentSettings, multi_turn

from .test_agent_training import ImageOnTurnThree  # the 3-turn episode with an image in turn 3

pytestmark = pytest.mark.usefixtures("one_thread")
TOL = 1e-4
# One preset per family (the first listed), so families added to PRESETS are picked up.
FAMILY_PRESETS = list({spec.family: name for name, spec in reversed(list(PRESETS.items()))}.values())[::-1]
_POLICIES: dict[str, object] = {}


def _policy(name):
    if name not in _POLICIES:
        torch.manual_seed(0)
        _POLICIES[name] = load_policy(name)
    return _POLICIES[name]


def _samples(policy, k: int):
    return generate("shapes", k, tasks=["count", "locate"]) if policy.is_vision else generate("arith", k)


def _drift(policy, trajectories, temperature: float) -> float:
    """max over rows and model tokens of |teacher-forced − behaviour| log-prob."""
    batch = collate([t.prompt_ids for t in trajectories], [t.response_ids for t in trajectories],
                    [t.vision for t in trajectories], pad_token_id=policy.pad_token_id)
    with torch.no_grad():
        logp, _ = response_logprobs(policy.model, policy.adapter, batch, temperature=temperature)
    worst = 0.0
    for i, t in enumerate(trajectories):
        mask = t.loss_mask.bool()
        worst = max(worst, float((logp[i, : len(mask)][mask] - t.behaviour_logp[mask]).abs().max()))
    return worst


@pytest.mark.parametrize("n", [1, 4])
@pytest.mark.parametrize("name", FAMILY_PRESETS)
def test_group_prefill_is_exact(name, n, prefills):
    policy = _policy(name)
    engine = HFEngine(policy)
    requests = [engine.encode(s) for s in _samples(policy, 2)]
    assert all(r.vision is not None for r in requests) == policy.is_vision
    trajectories = engine.generate(requests, SamplingParams(n=n, temperature=0.8, max_new_tokens=8))
    assert [t.group_index for t in trajectories] == [0] * n + [1] * n
    assert _drift(policy, trajectories, 0.8) < TOL
    stats = engine.last_stats
    if stats.expanded:  # 2 prompts prefilled for 2n rows
        assert prefills == [2] and stats.prefilled == 2 and stats.rows == 2 * n
    else:  # the fallback: the 2 prompts, then every row
        assert n > 1 and prefills == [2, 2 * n]


@pytest.mark.parametrize("name", FAMILY_PRESETS)
def test_a_three_turn_episode_is_exact_and_its_first_turn_prefilled_once_per_group(name, prefills):
    policy = _policy(name)
    engine = HFEngine(policy)
    samples = _samples(policy, 2)
    trajectories = multi_turn(engine, [engine.encode(s) for s in samples],
                              SamplingParams(n=4, temperature=0.7, max_new_tokens=5),
                              agent=AgentSettings(env=ImageOnTurnThree, max_turns=3))
    assert all(t.num_turns == 3 for t in trajectories)
    assert all(len(t.images) == (2 if policy.is_vision else 0) for t in trajectories)
    assert _drift(policy, trajectories, 0.7) < TOL
    # turn 1: the 4 episodes of each of the 2 groups share their prompt → 2 prefills for 8 rows; turns 2 and 3:
    # each live episode's own context once (two episodes whose responses coincide share theirs)
    assert prefills[0] == 2 or not engine.last_stats.expanded
    assert len(prefills) >= 3 and all(calls <= 8 for calls in prefills)


class _FavourToken(torch.nn.Module):
    """The LM head with ``bonus`` added to one token's logit. A module, not a forward hook: the scoring pass hands
    the head's forward the hidden states and takes scores back (`head_scores`), so a hook there would see scores."""

    def __init__(self, head: torch.nn.Module, token: int, bonus: float) -> None:
        super().__init__()
        self.head, self.token, self.bonus = head, token, bonus
        self.out_features = head.weight.shape[0]

    @property
    def weight(self) -> torch.Tensor:
        return self.head.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.head(hidden)
        return logits.index_add(-1, torch.tensor([self.token]), torch.full((*logits.shape[:-1], 1), self.bonus))


@pytest.mark.parametrize("name", FAMILY_PRESETS)
def test_rows_that_finish_early_leave_the_batch_and_the_others_stay_exact(name):
    """EOS made likely (+2.5 on its logit, in the model's own head, so the teacher-forced pass sees it too): rows
    end at different steps, the finished ones are dropped from the batch and its cache (a linear-attention
    state included), and every row's log-probs still equal the teacher-forced ones — single-turn and in
    multi-turn episodes whose turns end with EOS (the observation then follows the EOS, not a closing marker)."""
    policy = _policy(name)
    eos = policy.eos_token_ids[0]

    head = policy.model.get_output_embeddings()
    policy.model.set_output_embeddings(_FavourToken(head, eos, 2.5))
    try:
        engine = HFEngine(policy)
        requests = [engine.encode(s) for s in _samples(policy, 2)]
        torch.manual_seed(1)
        trajectories = engine.generate(requests, SamplingParams(n=8, temperature=0.9, top_k=50, max_new_tokens=12))
        lengths = [len(t.response_ids) for t in trajectories]
        assert engine.last_stats.compactions >= 1 and min(lengths) < max(lengths), lengths
        assert sum(int(t.response_ids[-1]) == eos for t in trajectories) >= 4  # ≥ a quarter ended with EOS
        assert _drift(policy, trajectories, 0.9) < TOL
        episodes = multi_turn(engine, requests, SamplingParams(n=4, temperature=0.7, top_k=50, max_new_tokens=8),
                              agent=AgentSettings(env=ImageOnTurnThree, max_turns=3))
        assert any(t.response_ids[turn.action_end - 1] == eos for t in episodes for turn in t.turns[:-1])
        assert _drift(policy, episodes, 0.7) < TOL
    finally:
        policy.model.set_output_embeddings(head)


@pytest.mark.parametrize("name", FAMILY_PRESETS)
def test_decode_positions_continue_the_teacher_forced_ones(name):
    """The positions a decode step feeds (the prompt's last + 1 + k, on every M-RoPE axis) are those the
    adapter gives the whole sequence (Qwen2-VL: `get_rope_index`, whose text positions after an image start at
    the image's max + 1 — the rope_deltas `generate` keeps)."""
    policy = _policy(name)
    engine = HFEngine(policy)
    request = engine.encode(_samples(policy, 1)[0])
    response = [policy.pad_token_id - 1 - k for k in range(5)]  # 5 ordinary tokens
    _, _, _, last, _ = kv_cache.prefill(policy.model, policy.adapter, [request], policy.pad_token_id)
    ids = torch.tensor([request.prompt_ids + response])
    full = policy.adapter.forward_inputs(policy.model, ids, torch.ones_like(ids), request.vision)["position_ids"]
    P = len(request.prompt_ids)
    assert torch.equal(full[..., P:], last + 1 + torch.arange(5))
    if policy.is_vision and full.dim() == 3:  # M-RoPE: an image makes positions run behind the token index
        assert int(full[0, 0, -1]) < P + 4


def test_a_cache_that_cannot_expand_falls_back_exactly_and_says_so_once(monkeypatch, caplog, prefills):
    from transformers.cache_utils import DynamicCache

    def broken(self, index):
        raise NotImplementedError("no reorder here")

    monkeypatch.setattr(DynamicCache, "reorder_cache", broken)
    monkeypatch.setattr(kv_cache, "_NOT_EXPANDABLE", set())
    policy = _policy("tiny-qwen2-vl")
    engine = HFEngine(policy)
    requests = [engine.encode(s) for s in _samples(policy, 2)]
    with caplog.at_level(logging.WARNING, logger="vlrl.rollout.decode"):
        first = engine.generate(requests, SamplingParams(n=3, max_new_tokens=4))
        engine.generate(requests, SamplingParams(n=3, max_new_tokens=4))
    assert prefills == [2, 6, 2, 6] and not engine.last_stats.expanded
    warnings = [r for r in caplog.records if "cannot be expanded" in r.getMessage()]
    assert len(warnings) == 1 and "qwen2_vl" in warnings[0].getMessage() and "no reorder here" in warnings[0].getMessage()
    assert _drift(policy, first, 1.0) < TOL


def test_equal_prompts_are_found_by_content():
    policy = _policy("tiny-qwen2-vl")
    engine = HFEngine(policy)
    a, b = _samples(policy, 2)
    ra, ra_again, rb = engine.encode(a), engine.encode(a), engine.encode(b)  # ra_again: equal, other objects
    assert ra_again.vision is not ra.vision
    prompts, index = kv_cache.distinct_prompts([ra, rb, ra_again, ra])
    assert index == [0, 1, 0, 0] and prompts == [ra, rb]


def test_distinct_prompts_is_linear_in_the_rows(monkeypatch):
    """64 prompts sharing one text, 8 rows each (the demo's rollout): each row is placed by identity or by its
    vision fingerprint; ``torch.equal`` confirms one candidate per new request object (the old search compared
    each row with every earlier prompt of the same ids: ~16,000 calls here)."""
    from vlrl.models.vision_inputs import VisionInputs

    def request(seed: int) -> Request:
        g = torch.Generator().manual_seed(seed)
        return Request(sample=None, prompt_ids=[1, 2, 3],
                       vision=VisionInputs({"pixel_values": torch.randn(16, 12, generator=g),
                                            "image_grid_thw": torch.tensor([[1, 4, 4]])}, num_images=1))

    prompts = [request(k) for k in range(64)]
    twin = request(5)  # equal tensors, other objects: the same prompt
    zero = Request(sample=None, prompt_ids=[1, 2, 3], vision=VisionInputs(
        {"pixel_values": torch.zeros(16, 12), "image_grid_thw": torch.tensor([[1, 4, 4]])}, num_images=1))
    negative_zero = Request(sample=None, prompt_ids=[1, 2, 3], vision=VisionInputs(
        {"pixel_values": -torch.zeros(16, 12), "image_grid_thw": torch.tensor([[1, 4, 4]])}, num_images=1))
    big = torch.randn(100, 100, generator=torch.Generator().manual_seed(7))
    nudged = big.clone()
    nudged[0, 1] += 1  # a value the fingerprint's strided sample (every 2nd of 10,000) does not read
    large, large_nudged = (Request(sample=None, prompt_ids=[1, 2, 3], vision=VisionInputs({"pixel_values": t}))
                           for t in (big, nudged))
    rows = [p for p in prompts for _ in range(8)] + [twin, zero, negative_zero, Request(None, [1, 2, 3]),
                                                      large, large_nudged]
    calls = []
    real = torch.equal
    monkeypatch.setattr(torch, "equal", lambda a, b: calls.append(1) or real(a, b))
    unique, index = kv_cache.distinct_prompts(rows)
    assert unique == prompts + [zero, rows[-3], large, large_nudged]
    assert index == [k for k in range(64) for _ in range(8)] + [5, 64, 64, 65, 66, 67]  # -0.0 equals 0.0 (torch.equal)
    # twin and negative_zero: one candidate each, two tensors each; large_nudged: same fingerprint, told apart by
    # torch.equal on its one tensor
    assert len(calls) == 2 * 2 + 1


def test_next_tokens_greedy_suppression_top_k_top_p():
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0]]).repeat(200, 1)  # token 1 most likely, then 2, 3, 0
    greedy, sampled = SamplingParams(temperature=0), SamplingParams(temperature=1.0)
    assert decode.next_tokens(logits, greedy, None).unique().tolist() == [1]
    assert decode.next_tokens(logits, greedy, torch.tensor([1])).unique().tolist() == [2]  # suppressed: next best
    assert set(decode.next_tokens(logits, sampled, torch.tensor([1])).tolist()) <= {0, 2, 3}
    top2 = SamplingParams(temperature=1.0, top_k=2)
    assert set(decode.next_tokens(logits, top2, None).tolist()) == {1, 2}  # 200 draws: both seen (p(2) ≈ 0.27)
    # softmax([0, 3, 2, 1]) ≈ [0.032, 0.644, 0.237, 0.087]: top_p 0.5 keeps token 1 alone (0.644 ≥ 0.5),
    # top_p 0.8 keeps tokens 1 and 2 (0.644 < 0.8 ≤ 0.881)
    assert decode.next_tokens(logits, SamplingParams(top_p=0.5), None).unique().tolist() == [1]
    assert set(decode.next_tokens(logits, SamplingParams(top_p=0.8), None).tolist()) == {1, 2}


def test_draw_follows_the_distribution_and_never_draws_a_zero():
    torch.manual_seed(0)
    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3]]).repeat(20000, 1)
    drawn = decode.draw(probs)
    freq = torch.bincount(drawn, minlength=4).double() / len(drawn)
    assert freq[1] == 0  # zero probability: never
    # binomial std of a frequency over 20,000 draws ≤ sqrt(0.25 / 20000) ≈ 0.0035: 0.015 is > 4 std
    assert torch.allclose(freq, torch.tensor([0.1, 0.0, 0.6, 0.3], dtype=torch.double), atol=0.015)
    unnormalised = torch.tensor([[0.0, 0.0, 2.0]])  # (the last index is the only one with mass)
    assert decode.draw(unnormalised.repeat(100, 1)).unique().tolist() == [2]
