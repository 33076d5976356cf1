"""Padding-free log-probs equal the padded pass: values, entropies, losses and gradients."""

import pytest
import torch

from vlrl.data import generate
from vlrl.models import collate, load_policy, response_logprobs
from vlrl.models.packed import default_rows, first_fit_rows, pack_sequences, packed_response_logprobs
from vlrl.rollout import HFEngine


def _batch(policy, suite, n=5):
    engine = HFEngine(policy)
    requests = [engine.encode(s) for s in generate(suite, n, tasks=None)]
    responses = [list(range(100, 103 + 2 * i)) for i in range(n)]  # different lengths: 3, 5, 7, ...
    return [r.prompt_ids for r in requests], responses, [r.vision for r in requests]


def _loss_and_grads(policy, logp, mask):
    policy.model.zero_grad(set_to_none=True)
    loss = -(logp * mask).sum() / mask.sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in policy.model.named_parameters() if p.grad is not None}
    policy.model.zero_grad(set_to_none=True)
    return loss.detach(), grads


@pytest.mark.parametrize("preset,suite", [("tiny-qwen2-vl", "shapes"), ("tiny-qwen2", "arith")])
def test_packed_equals_padded_logprobs_loss_and_gradients(preset, suite):
    policy = load_policy(preset)
    prompts, responses, visions = _batch(policy, suite)
    padded = collate(prompts, responses, visions, pad_token_id=policy.pad_token_id)
    logp_ref, ent_ref = response_logprobs(policy.model, policy.adapter, padded, with_entropy=True)
    loss_ref, grads_ref = _loss_and_grads(policy, logp_ref, padded.response_mask)
    # one flat row (the flash-attention layout), uneven rows (bins), one sequence per row
    for rows in ([[0, 1, 2, 3, 4]], [[3, 0], [1, 4, 2]], None):
        packed = pack_sequences(policy.model, policy.adapter, prompts, responses, visions,
                                pad_token_id=policy.pad_token_id, rows=rows)
        if rows is not None and len(rows) == 1:  # the flat row holds only real tokens
            assert packed.num_tokens == sum(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
        logp, ent = packed_response_logprobs(policy.model, policy.adapter, packed, with_entropy=True)
        assert torch.equal(packed.response_mask, padded.response_mask)
        assert torch.allclose(logp, logp_ref, atol=1e-5) and torch.allclose(ent, ent_ref, atol=1e-4)
        loss, grads = _loss_and_grads(policy, logp, packed.response_mask)
        assert torch.allclose(loss, loss_ref, atol=1e-6)
        assert grads.keys() == grads_ref.keys()
        if preset == "tiny-qwen2-vl":
            assert any("visual" in n for n in grads)  # the vision tower gets its gradient through the packed row
        for name, g in grads.items():
            assert torch.allclose(g, grads_ref[name], atol=1e-5, rtol=1e-4), name


def test_sequences_really_are_isolated(tiny_vlm):
    """Control: the same flat row with positions that do not restart (one long sequence) gives other
    log-probs for the second sequence, so the equality above is not vacuous."""
    prompts, responses, visions = _batch(tiny_vlm, "shapes", n=2)
    packed = pack_sequences(tiny_vlm.model, tiny_vlm.adapter, prompts, responses, visions,
                            pad_token_id=tiny_vlm.pad_token_id, rows=[[0, 1]])
    with torch.no_grad():
        isolated, _ = packed_response_logprobs(tiny_vlm.model, tiny_vlm.adapter, packed)
        packed.position_ids[0] = torch.arange(packed.input_ids.shape[1])  # text positions no longer restart
        leaking, _ = packed_response_logprobs(tiny_vlm.model, tiny_vlm.adapter, packed)
    n0, n1 = len(responses[0]), len(responses[1])
    assert torch.allclose(isolated[0, :n0], leaking[0, :n0], atol=1e-5)  # the first sequence sees nothing new
    assert (isolated[1, :n1] - leaking[1, :n1]).abs().max() > 1e-3  # the second now attends to the first


def test_first_fit_rows_hand_worked():
    # capacity 10, longest first: 7 → row A; 6 → row B; 3 → A (room 3); 2 → B (room 4); 2 → B (room 2)
    assert first_fit_rows([3, 7, 2, 6, 2], 10) == [[0, 1], [2, 3, 4]]
    assert first_fit_rows([12, 1], 10) == [[0], [1]]  # a sequence longer than the capacity gets its own row


def test_default_rows_by_attention_implementation(tiny_lm):
    assert default_rows(tiny_lm.model, [[0, 2], [1]], 3) == [[0, 2], [1]]
    assert default_rows(tiny_lm.model, None, 2) == [[0], [1]]
    tiny_lm.model.config._attn_implementation = "flash_attention_2"
    assert default_rows(tiny_lm.model, [[0, 2], [1]], 3) == [[0, 2, 1]]  # varlen: one flat row


def test_rows_must_cover_every_sequence_once(tiny_lm):
    prompts, responses, visions = _batch(tiny_lm, "arith", n=2)
    with pytest.raises(ValueError, match="exactly once"):
        pack_sequences(tiny_lm.model, tiny_lm.adapter, prompts, responses, visions, pad_token_id=0, rows=[[0, 0]])
