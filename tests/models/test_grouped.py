"""`vlrl.models.grouped`: the prefix-grouped layout and attention. Its masks worked out by hand, and on a text
model with a sliding window shorter than the sequences (which no family preset exercises) the grouped pass gives
the padded pass's log-probs, entropies and gradients. (Every family preset, gradient checkpointing, DDP and
FSDP2: tests/train/test_shared_prefix.py and test_shared_prefix_ranks.py.)"""

import pytest
import torch

from vlrl.models.grouped import GroupedLayout, group_sequences, grouped_response_logprobs

pytestmark = pytest.mark.usefixtures("one_thread")
T, F_ = True, False


def test_masks_hand_worked():
    # two groups, P = 3 prompt columns (group 0's prompt has 2 tokens: column 0 is padding), n = 2 slots of W = 2
    layout = GroupedLayout(prompt_len=3, slots=2, width=2, prompt_real=torch.tensor([[F_, T, T], [T, T, T]]))
    prompt, slot = layout.masks(None, torch.device("cpu"))
    assert prompt.shape == (2, 1, 3, 3) and slot.shape == (2, 1, 1, 2, 5)
    # group 0: the pad query sees itself only (no all-masked row), real queries the real keys up to themselves
    assert prompt[0, 0].tolist() == [[T, F_, F_], [F_, T, F_], [F_, T, T]]
    assert prompt[1, 0].tolist() == [[T, F_, F_], [T, T, F_], [T, T, T]]  # causal
    # a slot position: its group's real prompt keys, then its own slot causally
    assert slot[0, 0, 0].tolist() == [[F_, T, T, T, F_], [F_, T, T, T, T]]
    assert slot[1, 0, 0].tolist() == [[T, T, T, T, F_], [T, T, T, T, T]]
    # a window of 2 (in sequence positions): group 1's slot token 0 sits at position 3 and sees positions 2-3 (prompt
    # column 2 and itself); slot token 1 (position 4) sees 3-4 (its slot only)
    prompt_w, slot_w = layout.masks(2, torch.device("cpu"))
    assert prompt_w[1, 0].tolist() == [[T, F_, F_], [T, T, F_], [F_, T, T]]
    assert slot_w[1, 0, 0].tolist() == [[F_, F_, T, T, F_], [F_, F_, F_, T, T]]
    # group 0's prompt is shorter, but its columns are right-aligned: the same columns are in reach
    assert slot_w[0, 0, 0].tolist() == [[F_, F_, T, T, F_], [F_, F_, F_, T, T]]


def test_image_blocks_attend_within_an_image():
    layout = GroupedLayout(prompt_len=4, slots=1, width=1, prompt_real=torch.ones(1, 4, dtype=torch.bool),
                           prompt_blocks=torch.tensor([[-1, 0, 0, -1]]))
    prompt, _ = layout.masks(None, torch.device("cpu"))
    assert prompt[0, 0].tolist() == [[T, F_, F_, F_], [T, T, T, F_], [T, T, T, F_], [T, T, T, T]]


def _sliding_policy(window: int | None):
    from types import SimpleNamespace

    from transformers import Qwen2Config, Qwen2ForCausalLM

    from vlrl.models.adapters import TextAdapter
    from vlrl.models.policy import Policy

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, use_sliding_window=window is not None,
                         sliding_window=window, max_window_layers=1)  # layer 0 full, layer 1 sliding
    config._attn_implementation = "sdpa"
    tokenizer = SimpleNamespace(pad_token_id=0, eos_token_id=1)
    return Policy(Qwen2ForCausalLM(config).eval(), tokenizer, None, TextAdapter(tokenizer), source="test")


def test_a_sliding_window_is_kept():
    from vlrl.models.forward import teacher_forced

    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 64, (7,), generator=generator), torch.randint(2, 64, (5,), generator=generator)]
    index = [0, 0, 0, 1, 1, 1]
    rows = [prompts[g] for g in index]
    responses = [torch.randint(2, 64, (n,), generator=generator) for n in (1, 6, 3, 5, 2, 6)]
    policy = _sliding_policy(4)
    assert policy.model.config.layer_types == ["full_attention", "sliding_attention"]
    model = policy.model

    def run(grouped: bool):
        model.zero_grad(set_to_none=True)
        if grouped:
            batch = group_sequences(model, policy.adapter, rows, responses, [None] * 6, index, pad_token_id=0)
            logp, entropy = grouped_response_logprobs(model, policy.adapter, batch, temperature=0.7, with_entropy=True)
        else:
            scores = teacher_forced(model, policy.adapter, rows, responses, [None] * 6, pad_token_id=0,
                                    temperature=0.7, with_entropy=True)
            logp, entropy = scores.logp, scores.entropy
        (logp.sum() / 23 + 0.1 * entropy.sum() / 23).backward()
        return logp.detach(), entropy.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}

    plain, grouped = run(False), run(True)
    for a, b in zip(plain[:2], grouped[:2], strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
    for name, grad in plain[2].items():
        torch.testing.assert_close(grouped[2][name], grad, rtol=0, atol=1e-6, msg=name)
    # the window matters at these lengths: without it the same weights score differently
    unwindowed = _sliding_policy(None)
    unwindowed.model.load_state_dict(model.state_dict())
    with torch.no_grad():
        logp = teacher_forced(unwindowed.model, unwindowed.adapter, rows, responses, [None] * 6,
                              pad_token_id=0, temperature=0.7).logp
    assert float((logp - plain[0]).abs().max()) > 1e-3
