"""Prefix-grouped teacher forcing: a group's prompt and all its responses in one forward, the prompt once.

A GRPO group's n rows share one prompt. The plain pass (`vlrl.models.forward`, padded or packed) runs the prompt
once per row; the KV-cache pass (`vlrl.models.shared_prefix`) runs it once, then the responses against its
copied keys/values — two forwards, which a DDP / FSDP2 module (its hooks expect one forward per backward) and
transformers' gradient checkpointing (no cache then) do not allow. Here one forward does both, as verl's
PrefixGrouper does (``actor.use_prefix_grouper``, verl PR #4368): each group is one row,

    [ pad … pad  prompt_g ][ slot 1 ][ slot 2 ] … [ slot n ]        (G, L),  L = P + n·W
      P columns, left-padded  W = R − 1 columns each: a response without its last token (it is never an input)

and the attention of the language model (`grouped_attention`, registered with transformers' AttentionInterface
as ``vlrl_grouped`` and selected for this forward only) lets

- a prompt position attend causally to its prompt (left padding masked; a pad position sees itself only),
- a slot position attend to its group's whole prompt and causally to its own slot — the prompt's keys/values
  expanded to the slots as the KV-cache pass copies its cache to the rows, so the cost is that pass's
  G·P² + B·W·(P + W) scores, not (P + n·W)² per group; sliding-window layers keep their window (in sequence
  positions).

Positions: the prompt's own (M-RoPE from the model's ``get_rope_index``), a slot's continue after its prompt's
last position (+1 per token on every axis — text after the prompt, as the engine's decode and the cache pass
do). Scores (`vlrl.models.logprobs.head_scores`, chunked above a size): the prompt's last position predicts the
first token of each of its responses, slot position k the token k + 1. Everything else — vision tower, DeepStack,
MoE routing, the LM head — is the model's own forward, so the values are the plain pass's up to float summation
order (tests/train/test_shared_prefix.py: log-probs < 1e-5, loss and every gradient atol 1e-6, fp32).

Gradient checkpointing recomputes a decoder layer in the backward, after this pass has returned: for the
forward, the layers' checkpoint function is wrapped so that the recomputation runs under the same layout and
attention (`_replayed`). Gemma 3's image tokens attend to each other within an image (its ``token_type_ids``
mask): the prompt block does too (`image_blocks`). What this layout cannot express — recurrent layers (a slot
would continue the previous slot's state), other token-type masks (PaliGemma's prefix-LM), attention-logit soft
caps, attention sinks, dropout — is refused by the caller (`vlrl.models.traits.shared_prefix_refusal`).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from vlrl import compat
from vlrl.models.adapters import TextAdapter, VisionInputs
from vlrl.models.logprobs import HeadQuery, LogprobChunk, head_scores

GROUPED_ATTENTION = "vlrl_grouped"  # the AttentionInterface name of `grouped_attention`
_ACTIVE = threading.local()  # .layout: the `GroupedLayout` of the forward (or recomputation) running in this thread


@dataclass
class GroupedLayout:
    """Where a grouped row's prompt and slots are, for `grouped_attention`.

    Attributes:
        prompt_len: P, the prompt block's columns (the longest prompt; shorter ones left-padded).
        slots: n, slots per row (the most rows of a group; a smaller group leaves slots empty).
        width: W, columns per slot.
        prompt_real: (G, P) True at a prompt's real (non-pad) columns.
        prompt_blocks: (G, P) the image block of each prompt column (−1: none) for a family whose image tokens
            attend bidirectionally within their image (Gemma 3), or None.
    """

    prompt_len: int
    slots: int
    width: int
    prompt_real: torch.Tensor
    prompt_blocks: torch.Tensor | None = None
    _masks: dict = field(default_factory=dict, repr=False)

    def masks(self, window: int | None, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(prompt mask (G, 1, P, P), slot mask (G, 1, 1, W, P + W)), True = may attend; cached per window."""
        key = (window, str(device))
        if key not in self._masks:
            P, W = self.prompt_len, self.width
            real = self.prompt_real.to(device)  # (G, P)
            q = torch.arange(P, device=device).unsqueeze(1)  # (P, 1)
            k = torch.arange(P, device=device).unsqueeze(0)  # (1, P)
            allowed = (k <= q).expand(real.shape[0], -1, -1)  # (G, P, P) causal
            if self.prompt_blocks is not None:  # or within one image (transformers' `blockwise_overlay`)
                blocks = self.prompt_blocks.to(device)
                allowed = allowed | ((blocks[:, :, None] == blocks[:, None, :]) & (blocks[:, :, None] >= 0))
            if window is not None:
                allowed = allowed & (q - k < window)
            prompt = (real[:, None, :] & allowed) | (q == k)  # a pad query sees itself (never an all-masked row)
            s = torch.arange(W, device=device).unsqueeze(1)  # (W, 1) slot query
            to_prompt = real[:, None, :].expand(-1, W, -1)  # (G, W, P)
            if window is not None:  # slot token s sits P + s − j sequence positions after prompt column j
                to_prompt = to_prompt & (P + s - k < window)
            j = torch.arange(W, device=device).unsqueeze(0)  # (1, W) slot key
            to_slot = j <= s
            if window is not None:
                to_slot = to_slot & (s - j < window)
            slot = torch.cat([to_prompt, to_slot.expand(real.shape[0], -1, -1)], dim=-1)  # (G, W, P + W)
            self._masks[key] = (prompt.unsqueeze(1), slot[:, None, None])
        return self._masks[key]


def _repeat_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(..., Hkv, T, d) → (..., heads, T, d), each key/value head repeated for its query heads (as transformers'
    ``repeat_kv``)."""
    rep = heads // x.shape[-3]
    return x if rep == 1 else x.repeat_interleave(rep, dim=-3)


def grouped_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query (G, H, L, d), key / value (G, Hkv, L, d) → output
    (G, L, H, d). The layout is the one of the running grouped forward (``attention_mask`` is unused)."""
    layout: GroupedLayout | None = getattr(_ACTIVE, "layout", None)
    if layout is None:
        raise RuntimeError("vlrl_grouped attention outside a grouped forward (vlrl.models.grouped)")
    if dropout or kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise ValueError("vlrl_grouped attention supports no dropout, attention soft cap or attention sinks")
    window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
    G, H, L, d = query.shape
    P, n, W = layout.prompt_len, layout.slots, layout.width
    prompt_mask, slot_mask = layout.masks(window, query.device)
    key, value = _repeat_heads(key, H), _repeat_heads(value, H)  # (G, H, L, d)
    out = [F.scaled_dot_product_attention(query[:, :, :P], key[:, :, :P], value[:, :, :P], attn_mask=prompt_mask,
                                          scale=scaling)]  # (G, H, P, d)
    if n * W:
        def by_slot(x: torch.Tensor) -> torch.Tensor:  # (G, H, n·W, d) → (G, n, H, W, d)
            return x[:, :, P:].reshape(G, H, n, W, d).transpose(1, 2)

        def with_prompt(x: torch.Tensor) -> torch.Tensor:  # every slot's keys: its prompt's, then its own
            keys = torch.cat([x[:, :, :P].unsqueeze(1).expand(G, n, H, P, d), by_slot(x)], dim=-2)
            return keys.reshape(G * n, H, P + W, d)

        mask = slot_mask.expand(G, n, 1, W, P + W).reshape(G * n, 1, W, P + W)
        slots = F.scaled_dot_product_attention(by_slot(query).reshape(G * n, H, W, d), with_prompt(key),
                                               with_prompt(value), attn_mask=mask, scale=scaling)  # (G·n, H, W, d)
        out.append(slots.view(G, n, H, W, d).transpose(1, 2).reshape(G, H, n * W, d))
    return torch.cat(out, dim=2).transpose(1, 2).contiguous(), None


def _no_mask(*args, **kwargs) -> None:
    """The mask function of ``vlrl_grouped``: none (the layout is the mask)."""
    return None


@functools.cache
def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(GROUPED_ATTENTION, grouped_attention)
    AttentionMaskInterface.register(GROUPED_ATTENTION, _no_mask)


def _decoder(model: torch.nn.Module) -> torch.nn.Module:
    base = getattr(model, "module", model)
    try:
        return base.get_decoder()
    except (AttributeError, ValueError, NotImplementedError):
        return base


def _decoder_configs(model: torch.nn.Module, decoder: torch.nn.Module) -> list:
    """The config objects the language model's modules read their attention implementation from (never the vision
    tower's, should ``decoder`` hold it: a model without ``get_decoder``)."""
    from transformers import PretrainedConfig

    from vlrl.models.adapters import vision_tower

    def held(module: torch.nn.Module | None) -> dict:
        if module is None:
            return {}
        return {id(m.config): m.config for m in module.modules() if isinstance(getattr(m, "config", None), PretrainedConfig)}

    tower = held(vision_tower(model))
    return [c for key, c in held(decoder).items() if key not in tower]


@contextmanager
def _attending(configs: Sequence, layout: GroupedLayout) -> Iterator[None]:
    """``vlrl_grouped`` attention with ``layout`` for the language model (its configs), in this thread."""
    previous = getattr(_ACTIVE, "layout", None)
    saved = [(c, compat.swap_attn_implementation(c, GROUPED_ATTENTION)) for c in configs]
    _ACTIVE.layout = layout
    try:
        yield
    finally:
        for c, implementation in saved:
            compat.swap_attn_implementation(c, implementation)
        _ACTIVE.layout = previous


def _replayed(original, configs: Sequence, layout: GroupedLayout, function, *args, **kwargs):
    """A decoder layer's checkpoint function during a grouped forward: the layer runs (now, and again when the
    backward recomputes it) under this forward's layout and attention."""
    def within(*a, **k):
        with _attending(configs, layout):
            return function(*a, **k)

    return original(within, *args, **kwargs)


def _checkpointing_within(decoder: torch.nn.Module, configs: Sequence, layout: GroupedLayout):
    """Within: ``decoder``'s checkpointed layers replay their forward under ``layout``'s attention."""
    return compat.gradient_checkpointing_wrapped(decoder, lambda original: functools.partial(_replayed, original, configs,
                                                                                             layout))


# ----------------------------------------------------------------------------------------------- the batch
@dataclass
class GroupedBatch:
    """Groups of (one prompt, its responses) laid out one group per row.

    Attributes:
        input_ids: (G, L) rows, L = P + n·W.
        position_ids: (D, G, L) positions (D = 1 for text models, 4 for M-RoPE: text + (t, h, w)); 0 at padding.
        vision: the G prompts' vision inputs, in row order (or None).
        keep: (G, L) True at the positions whose hidden states predict a response token.
        source: (T,) per scored token, its row in the kept hidden states (row-major order of ``keep``).
        targets: (T,) the scored response tokens.
        out_index: (T,) where each goes in the flattened (B, R) output.
        response_mask: (B, R) 1 for real response tokens.
        layout: the attention layout.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    vision: VisionInputs | None
    keep: torch.Tensor
    source: torch.Tensor
    targets: torch.Tensor
    out_index: torch.Tensor
    response_mask: torch.Tensor
    layout: GroupedLayout

    @property
    def num_tokens(self) -> int:
        """Positions the forward processes (pads and empty slots included)."""
        return self.input_ids.numel()


def group_sequences(model: torch.nn.Module, adapter: TextAdapter, prompts: Sequence[Sequence[int] | torch.Tensor],
                    responses: Sequence[Sequence[int] | torch.Tensor], visions: Sequence[VisionInputs | None],
                    index: Sequence[int], *, pad_token_id: int) -> GroupedBatch:
    """Lay out B (prompt, response) pairs by prompt: ``index`` gives each row's group (0 .. G − 1, e.g.
    `vlrl.models.shared_prefix.prompt_groups`); a group's rows share one prompt (its first row's ``prompts`` and
    ``visions`` are used)."""
    prompts = [torch.as_tensor(p, dtype=torch.long) for p in prompts]
    responses = [torch.as_tensor(r, dtype=torch.long) for r in responses]
    B, G = len(prompts), max(index) + 1
    members = [[b for b in range(B) if index[b] == g] for g in range(G)]
    first = [m[0] for m in members]
    P = max(len(prompts[b]) for b in first)
    R = max(1, max(len(r) for r in responses))
    n, W = max(len(m) for m in members), R - 1
    L = P + n * W
    positions = [adapter.segment_position_ids(model, prompts[b], visions[b]) for b in first]  # (D, P_g) each
    D = positions[0].shape[0]
    input_ids = torch.full((G, L), pad_token_id, dtype=torch.long)
    position_ids = torch.zeros((D, G, L), dtype=torch.long)
    prompt_real = torch.zeros((G, P), dtype=torch.bool)
    keep = torch.zeros((G, L), dtype=torch.bool)
    scored: list[tuple[int, int, int, int]] = []  # (g, column of the predicting position, b, k)
    for g, b0 in enumerate(first):
        p = len(prompts[b0])
        input_ids[g, P - p : P] = prompts[b0]
        position_ids[:, g, P - p : P] = positions[g].to(torch.long)
        prompt_real[g, P - p :] = True
        after = positions[g][:, -1:].to(torch.long) + 1 + torch.arange(W)  # (D, W): a slot continues its prompt
        for s, b in enumerate(members[g]):
            start, r = P + s * W, len(responses[b])
            input_ids[g, start : start + max(r - 1, 0)] = responses[b][: max(r - 1, 0)]
            position_ids[:, g, start : start + W] = after
            scored += [(g, P - 1 if k == 0 else start + k - 1, b, k) for k in range(r)]
    for g, column, _, _ in scored:
        keep[g, column] = True
    kept = keep.flatten().cumsum(0) - 1  # (G·L,) a kept position's row among the kept hidden states
    source = torch.tensor([int(kept[g * L + c]) for g, c, _, _ in scored], dtype=torch.long)
    targets = torch.tensor([int(responses[b][k]) for _, _, b, k in scored], dtype=torch.long)
    out_index = torch.tensor([b * R + k for _, _, b, k in scored], dtype=torch.long)
    response_mask = torch.zeros((B, R), dtype=torch.long)
    for b, r in enumerate(responses):
        response_mask[b, : len(r)] = 1
    layout = GroupedLayout(P, n, W, prompt_real, image_blocks(model, adapter, input_ids[:, :P]))
    return GroupedBatch(input_ids, position_ids, VisionInputs.concat([visions[b] for b in first]), keep, source,
                        targets, out_index, response_mask, layout)


def image_blocks(model: torch.nn.Module, adapter: TextAdapter, input_ids: torch.Tensor) -> torch.Tensor | None:
    """(G, P) image block ids of the prompt columns (−1 elsewhere; transformers'
    ``get_block_sequence_ids_for_mask``) for a family whose forward takes ``token_type_ids`` to let an image's
    tokens attend to each other (Gemma 3), else None."""
    from vlrl.models.introspect import method_parameters as _parameters

    if "token_type_ids" not in _parameters(type(getattr(model, "module", model)), "forward"):
        return None
    is_image = adapter.token_types(input_ids) == 1  # (G, P)
    starts = is_image & ~F.pad(is_image, (1, 0))[:, :-1]
    return torch.where(is_image, starts.long().cumsum(1) - 1, -1)


def grouped_response_logprobs(model: torch.nn.Module, adapter: TextAdapter, batch: GroupedBatch, *,
                              temperature: float = 1.0, with_entropy: bool = False,
                              logprob_chunk: LogprobChunk = "auto", query: HeadQuery | None = None,
                              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(B, R) response log-probs (and entropy), right-padded with 0, as `vlrl.models.logprobs.response_logprobs`
    lays them out — from one forward of ``batch`` with `grouped_attention`. Gradients flow when grad is enabled;
    under gradient checkpointing the recomputed layers attend as the forward did. ``query``: its ``result``
    filled (`vlrl.models.logprobs.HeadQuery`)."""
    _register()
    device = next(model.parameters()).device
    kwargs = adapter.packed_forward_inputs(batch.input_ids.to(device), batch.position_ids.to(device),
                                           batch.vision.to(device) if batch.vision is not None else None)
    keep, source = batch.keep.to(device), batch.source.to(device)
    decoder = _decoder(model)
    configs = _decoder_configs(model, decoder)
    layout = batch.layout

    def select(hidden: torch.Tensor) -> torch.Tensor:  # kept (K, H) → one row per scored token (T, H)
        return hidden.reshape(-1, hidden.shape[-1]).index_select(0, source)

    B, R = batch.response_mask.shape
    index = batch.out_index.to(device)
    with _attending(configs, layout), _checkpointing_within(decoder, configs, layout):
        out = head_scores(model, lambda: model(**kwargs, logits_to_keep=keep, use_cache=False), select,
                          batch.targets.to(device), temperature=temperature, with_entropy=with_entropy,
                          chunk=logprob_chunk, query=query,
                          at=query.ids_at(index, B, R) if query is not None else None)  # (T,) each
    logp_t, entropy_t = out[0], out[1]
    if query is not None:
        query.place(out[2], index, B, R)
    logp = torch.zeros(B * R, device=device, dtype=logp_t.dtype).index_put((index,), logp_t).view(B, R)
    entropy = None
    if entropy_t is not None:
        entropy = torch.zeros(B * R, device=device, dtype=entropy_t.dtype).index_put((index,), entropy_t).view(B, R)
    return logp, entropy
