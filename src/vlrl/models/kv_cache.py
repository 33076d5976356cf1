"""The KV-cache helpers every pass that shares a prompt's work uses — the engine's group prefill
(`vlrl.rollout.decode`) and the no-grad shared-prefix pass (`vlrl.models.shared_prefix`):

    distinct_prompts   the distinct prompts among rows of (token ids, vision inputs) — a GRPO group's n rows share one
    prefill            the left-padded distinct prompts through the model once: last logits, the KV cache, positions
    expand_cache       the cache's rows copied to the rows of the batch (row → prompt), in place
    forward_last       one forward with a cache, the last position's logits

A prompt is anything with ``prompt_ids`` and ``vision`` (`PromptLike`: a rollout ``Request``, or `Prompt`).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch

from vlrl.models.adapters import TextAdapter
from vlrl.models.traits import model_traits
from vlrl.models.vision_inputs import VisionInputs

log = logging.getLogger(__name__)

TYPE_KEYS = ("mm_token_type_ids", "token_type_ids")  # per-token modality inputs: a generated token is text (0)
_NOT_EXPANDABLE: set[str] = set()  # families whose cache could not be expanded (logged once each)


class PromptLike(Protocol):
    """A prompt: its token ids and its vision inputs (None: text only)."""

    @property
    def prompt_ids(self) -> Sequence[int]: ...

    @property
    def vision(self) -> VisionInputs | None: ...


@dataclass(frozen=True)
class Prompt:
    """A prompt as the teacher-forced passes name one (`PromptLike`)."""

    prompt_ids: Sequence[int]
    vision: VisionInputs | None = None


P = TypeVar("P", bound=PromptLike)


FINGERPRINT_VALUES = 4096  # values per vision tensor a prompt's fingerprint reads (`distinct_prompts`)


def distinct_prompts(requests: Sequence[P]) -> tuple[list[P], list[int]]:
    """The distinct prompts among ``requests`` (equal token ids and equal vision tensors) and, per request, the
    index of its prompt among them (prompts in order of first appearance).

    Linear in the rows: a request object seen before (a group's n rows repeat one) is looked up by identity, and a
    new one is compared only with the earlier prompts of equal token ids *and* equal vision fingerprint
    (`_fingerprint`: a hash of a strided sample of its tensors), then confirmed with ``torch.equal``. (Comparing
    each row with every earlier prompt of the same ids was quadratic: at the demo's 64 prompts × 8 samples, one text
    shared by every prompt, 16,265 ``torch.equal`` calls a rollout.)"""
    unique: list[P] = []
    by_key: dict[tuple, list[int]] = {}
    by_object: dict[int, int] = {}  # id(request) → its prompt's index (``requests`` keeps every object alive)
    fingerprints: dict[int, bytes] = {}  # id(vision) → fingerprint, within this call
    index: list[int] = []
    for request in requests:
        match = by_object.get(id(request))
        if match is None:
            key = (tuple(request.prompt_ids), _fingerprint(request.vision, fingerprints))
            match = next((k for k in by_key.get(key, []) if _same_vision(unique[k].vision, request.vision)), None)
            if match is None:
                match = len(unique)
                unique.append(request)
                by_key.setdefault(key, []).append(match)
            by_object[id(request)] = match
        index.append(match)
    return unique, index


def _fingerprint(vision: VisionInputs | None, memo: dict[int, bytes]) -> bytes:
    """A digest of ``vision``'s tensors — names, dtypes, shapes and an evenly strided sample of at most
    ~`FINGERPRINT_VALUES` values each (-0.0 counted as 0.0) — cheap beside a prefill. Equal tensors give equal
    digests, so it only narrows the candidates `_same_vision` confirms."""
    if vision is None:
        return b""
    if id(vision) not in memo:
        digest = hashlib.blake2b(digest_size=16)
        for name, tensor in sorted(_tensors(vision).items()):
            flat = tensor.detach().reshape(-1)
            flat = flat[:: max(1, flat.numel() // FINGERPRINT_VALUES)].cpu()
            if flat.is_floating_point() or flat.is_complex():
                flat = flat + 0  # -0.0 → 0.0: torch.equal counts them equal
            digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
            digest.update(flat.contiguous().view(torch.uint8).numpy())
        memo[id(vision)] = digest.digest()
    return memo[id(vision)]


def _same_vision(a: VisionInputs | None, b: VisionInputs | None) -> bool:
    if a is b:
        return True
    if a is None or b is None:
        return False
    ta, tb = _tensors(a), _tensors(b)
    return ta.keys() == tb.keys() and all(ta[k].shape == tb[k].shape and torch.equal(ta[k], tb[k]) for k in ta)


def _tensors(vision: VisionInputs) -> dict[str, torch.Tensor]:
    tensors = getattr(vision, "tensors", None)  # a dict of processor outputs, or named fields
    if isinstance(tensors, dict):
        return tensors
    return {k: v for k, v in vars(vision).items() if isinstance(v, torch.Tensor)}


# ----------------------------------------------------------------------------------------------- the model's API
def forward_last(model: torch.nn.Module, kwargs: dict, cache) -> tuple[torch.Tensor, object]:
    """Run ``model`` on ``kwargs`` with ``cache``; the last position's logits (rows, V) and the cache."""
    traits = model_traits(model)
    if traits.logits_to_keep:
        kwargs = {**kwargs, "logits_to_keep": 1}
    out = model(**kwargs, use_cache=True, **({traits.cache_key: cache} if cache is not None else {}))
    cache = getattr(out, "cache", None) if hasattr(out, "cache") else getattr(out, "past_key_values", None)
    return out.logits[:, -1], cache


def prefill(model: torch.nn.Module, adapter: TextAdapter, prompts: Sequence[PromptLike], pad_token_id: int
            ) -> tuple[torch.Tensor, object, torch.Tensor, torch.Tensor, list[str]]:
    """Run the left-padded ``prompts`` through the model once.

    Returns ``(logits, cache, attention_mask, last_position, type_keys)``: the last position's logits (B, V), the
    cache, the prompt mask (B, P), each row's last position ids (..., B, 1) — 1-D or M-RoPE (3, B, 1) — and the
    per-token modality inputs the model takes (a decode step passes them as text)."""
    device = next(model.parameters()).device
    P = max(len(r.prompt_ids) for r in prompts)
    input_ids = torch.full((len(prompts), P), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), P), dtype=torch.long)
    for k, request in enumerate(prompts):
        n = len(request.prompt_ids)
        input_ids[k, P - n :] = torch.as_tensor(request.prompt_ids)
        attention_mask[k, P - n :] = 1
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    vision = VisionInputs.concat([r.vision for r in prompts])
    kwargs = adapter.forward_inputs(model, input_ids, attention_mask, vision.to(device) if vision is not None else None)
    position_ids = kwargs.get("position_ids")
    if position_ids is None:
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # (B, P)
        kwargs["position_ids"] = position_ids
    logits, cache = forward_last(model, kwargs, None)
    return logits, cache, attention_mask, position_ids[..., -1:], [k for k in TYPE_KEYS if k in kwargs]


def expand_cache(cache: object, index: torch.Tensor, family: str) -> bool:
    """Copy the cache's rows to ``index`` (row → prompt) in place; False (logged once per family) when the cache
    cannot be trusted to have expanded: not a transformers `Cache`, or a layer state left at the old batch size."""
    from transformers.cache_utils import Cache

    reason = None
    if not isinstance(cache, Cache):
        reason = f"the model returned a {type(cache).__name__}, not a transformers Cache"
    else:
        try:
            cache.reorder_cache(index)
            bad = [type(layer).__name__ for layer in cache.layers
                   if any(t.shape[0] != len(index) for t in _layer_tensors(layer))]
            if bad:
                reason = f"cache layer(s) {sorted(set(bad))} kept a state at the prompt batch size"
        except Exception as err:  # a layer type without a working reorder_cache
            reason = f"{type(err).__name__}: {err}"
    if reason is None:
        return True
    if family not in _NOT_EXPANDABLE:
        _NOT_EXPANDABLE.add(family)
        log.warning("%s: the KV cache cannot be expanded to a group's samples (%s); prefilling every sample "
                    "instead (same results, n× the prompt work)", family, reason)
    return False


def known_not_expandable(family: str) -> bool:
    """Whether `expand_cache` already found (and logged) that ``family``'s KV cache cannot be expanded, so a caller
    can skip the prefill that would only find it again."""
    return family in _NOT_EXPANDABLE


def _layer_tensors(layer: object) -> list[torch.Tensor]:
    """The per-row tensors a cache layer holds: keys/values, and linear-attention conv/recurrent states."""
    out = []
    for value in vars(layer).values():
        values = value.values() if isinstance(value, dict) else [value]
        out.extend(v for v in values if isinstance(v, torch.Tensor) and v.dim() >= 2 and v.numel() > 0)
    return out
