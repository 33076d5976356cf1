"""The shared-prefix teacher-forced passes: a group's n responses scored against one run of their prompt.

The plain pass (`vlrl.models.forward`, padded or packed) runs prompt + response for every row, so a GRPO group's
n rows repeat the same P prompt tokens n times (the vision tower already runs once per group:
`VisionInputs.concat_shared`). Here the language model runs over G·P + B·(R − 1) positions instead of B·(P + R),
in one of two ways:

- **with gradients (the update's forward): one forward** (`vlrl.models.grouped`, verl's PrefixGrouper layout):
  each distinct prompt once with its rows' responses beside it in the same row, every response attending to its
  prompt and to itself only. One forward per backward, no KV cache: it runs as it is under DDP / FSDP2 (their
  hooks see one forward) and under gradient checkpointing (the recomputed layers attend as the forward did).
  Autograd sums each prompt's gradient over its rows — the gradient of the plain pass, whose n prompt copies
  each receive their row's share.
- **without gradients (π_old, π_ref): the KV cache** (`vlrl.models.kv_cache`), as the engine's group prefill:

      prefill     the distinct prompts (vision tower included), once each        (G, P) → KV cache, last logits
      expand      the cache's rows to the rows of the micro-batch                 (G, ...) → (B, ...)  index_select
      responses   every row's response tokens but the last, against that cache    (B, R − 1), positions after the prompt

  which also serves recurrent layers (Qwen3.5's Gated DeltaNet: the cache copies their state).

Both score the token k of a response from the prompt's last position (k = 0) or the response's k − 1, chunked
above a size (`vlrl.models.logprobs.head_scores`), and return the plain pass's (B, R) log-probs (and entropy),
equal up to float summation order (tests/train/test_shared_prefix.py: < 1e-5; loss and every gradient atol 1e-6).

They apply when they can be exact and save work, else they return None and the caller runs the plain pass:

- no two rows share a prompt (equal token ids and equal vision inputs): nothing to share (silent);
- a response holds vision tokens (a multi-turn observation with an image: its features would have to be fed
  to the response part): logged once;
- without gradients: the family's cache cannot be expanded (`vlrl.models.kv_cache.expand_cache`, logged once per
  family);
- with gradients (`vlrl.models.traits.shared_prefix_refusal`): recurrent layers (a response would continue the previous one's state
  in the grouped row), token-type attention masks other than Gemma 3's image blocks (which the grouped attention
  builds), attention-logit soft caps or active dropout (the n rows would share one dropout mask over the prompt):
  logged once.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from vlrl.models import kv_cache
from vlrl.models.adapters import TextAdapter, VisionInputs
from vlrl.models.grouped import group_sequences, grouped_response_logprobs
from vlrl.models.logprobs import HeadQuery, LogprobChunk, head_scores
from vlrl.models.traits import model_traits

log = logging.getLogger(__name__)
_LOGGED: set[str] = set()  # fallback reasons already logged


def _log_once(key: str, message: str, *args) -> None:
    if key not in _LOGGED:
        _LOGGED.add(key)
        log.warning(message, *args)


def prompt_groups(prompts: Sequence[Sequence[int] | torch.Tensor], visions: Sequence[VisionInputs | None]
                  ) -> tuple[list[int], list[int]]:
    """The rows holding each distinct prompt's first occurrence, and per row the index of its prompt among them.
    Two rows share a prompt when their token ids and vision inputs are equal (the same object, or equal tensors)."""
    unique, index = kv_cache.distinct_prompts([kv_cache.Prompt(_ids(p), v) for p, v in zip(prompts, visions, strict=True)])
    return [index.index(g) for g in range(len(unique))], index


def rows_by_prompt(trajectories: Sequence, rows: Sequence[int]) -> list[int]:
    """``rows`` reordered so that rows sharing a prompt sit side by side (prompts in order of first appearance,
    rows of a prompt in their order): a minibatch shuffled by the update, then split into micro-batches, keeps a
    group's rows in as few micro-batches as possible. The gradient is a sum over rows: the order does not change
    it (beyond float summation order)."""
    rows = list(rows)
    _, index = prompt_groups([trajectories[r].prompt_ids for r in rows], [trajectories[r].vision for r in rows])
    return [row for _, row in sorted(zip(index, rows, strict=True), key=lambda pair: pair[0])]


def _ids(prompt: Sequence[int] | torch.Tensor) -> list[int]:
    return prompt.tolist() if isinstance(prompt, torch.Tensor) else [int(t) for t in prompt]


def shared_prefix_logprobs(model: torch.nn.Module, adapter: TextAdapter,
                           prompts: Sequence[Sequence[int] | torch.Tensor], responses: Sequence[Sequence[int] | torch.Tensor],
                           visions: Sequence[VisionInputs | None], *, pad_token_id: int, temperature: float = 1.0,
                           with_entropy: bool = False, logprob_chunk: LogprobChunk = "auto",
                           query: HeadQuery | None = None) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(B, R) response log-probs (and entropy), right-padded with 0, as `response_logprobs` lays them out —
    computed with each distinct prompt run once: in one grouped forward when grad is enabled, against an expanded
    KV cache otherwise; None when that does not apply (see the module docstring). ``query``: its ``result`` filled
    (`vlrl.models.logprobs.HeadQuery`)."""
    first, index = prompt_groups(prompts, visions)
    B = len(prompts)
    if len(first) == B:
        return None  # every prompt differs: the plain pass does the same work
    family = adapter.family
    responses = [torch.as_tensor(r, dtype=torch.long) for r in responses]
    token_types = getattr(adapter, "token_types", None)  # a vision adapter's: text 0, image 1, video 2
    if token_types is not None:
        if bool(token_types(torch.cat(responses).unsqueeze(0)).any()):  # every response's tokens at once
            _log_once(f"{family}/vision", "%s: a response holds vision tokens (a multi-turn observation with an "
                      "image); the teacher-forced pass runs every row's prompt (no shared prefix)", family)
            return None
    if torch.is_grad_enabled():
        refusal = model_traits(model).grouped_refusal
        if refusal is not None:
            _log_once(f"{family}/grad/{refusal}", "%s: the update's forward does not share a group's prompt (%s); "
                      "it runs every row's prompt", family, refusal)
            return None
        batch = group_sequences(model, adapter, prompts, responses, visions, index, pad_token_id=pad_token_id)
        return grouped_response_logprobs(model, adapter, batch, temperature=temperature, with_entropy=with_entropy,
                                         logprob_chunk=logprob_chunk, query=query)
    return _cached_prefix_logprobs(model, adapter, prompts, responses, visions, first, index,
                                   pad_token_id=pad_token_id, temperature=temperature, with_entropy=with_entropy,
                                   logprob_chunk=logprob_chunk, query=query)


def _cached_prefix_logprobs(model: torch.nn.Module, adapter: TextAdapter, prompts: Sequence, responses: list[torch.Tensor],
                            visions: Sequence[VisionInputs | None], first: list[int], index: list[int], *,
                            pad_token_id: int, temperature: float, with_entropy: bool, logprob_chunk: LogprobChunk,
                            query: HeadQuery | None = None) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The no-grad pass: one prefill per distinct prompt, its KV cache expanded to its rows, the responses run
    against it (None: the cache cannot be expanded)."""
    family = adapter.family
    device = next(model.parameters()).device
    if kv_cache.known_not_expandable(family):  # found (and logged) before: not one more prefill to find it again
        return None
    B = len(prompts)
    groups = [kv_cache.Prompt(_ids(prompts[k]), visions[k]) for k in first]
    logits, cache, prompt_mask, last_position, type_keys = kv_cache.prefill(model, adapter, groups, pad_token_id)
    rows = torch.tensor(index, dtype=torch.long, device=device)  # (B,) row → prompt
    if not kv_cache.expand_cache(cache, rows, family):
        return None
    R = max(1, max(len(r) for r in responses))
    response_ids = torch.full((B, R), pad_token_id, dtype=torch.long)
    response_mask = torch.zeros((B, R), dtype=torch.long)
    for i, r in enumerate(responses):
        response_ids[i, : len(r)] = r
        response_mask[i, : len(r)] = 1
    response_ids, response_mask = response_ids.to(device), response_mask.to(device)
    # response token 0: the prompt's last logits (G, V) — the log-softmax per prompt, then each row's token
    log_probs = F.log_softmax(logits.float() / max(temperature, 1e-6), dim=-1)  # (G, V)
    logp = log_probs[rows, response_ids[:, 0]].unsqueeze(1)  # (B, 1)
    entropy = (-(log_probs.exp() * log_probs).sum(-1))[rows].unsqueeze(1) if with_entropy else None  # (B, 1)
    positions = torch.arange(B, device=device).unsqueeze(1) * R + torch.arange(R, device=device)  # (B, R) flat
    columns = [query.columns(log_probs[rows], query.ids_at(positions[:, 0], B, R)).unsqueeze(1)] if query else []
    if R > 1:
        inputs = response_ids[:, : R - 1]  # (B, R − 1): the last response token is never an input
        kwargs = {"input_ids": inputs,
                  "attention_mask": torch.cat([prompt_mask[rows], response_mask[:, : R - 1]], dim=-1),  # (B, P + R − 1)
                  "position_ids": last_position[..., rows, :] + 1 + torch.arange(R - 1, device=device)}
        kwargs.update({k: torch.zeros_like(inputs, dtype=torch.int32) for k in type_keys})  # response tokens: text
        key = model_traits(model).cache_key
        rest = head_scores(
            model, lambda: model(**kwargs, use_cache=True, **{key: cache}),
            lambda hidden: hidden.reshape(-1, hidden.shape[-1]), response_ids[:, 1:].reshape(-1),
            temperature=temperature, with_entropy=with_entropy, chunk=logprob_chunk, query=query,
            at=query.ids_at(positions[:, 1:].reshape(-1), B, R) if query else None)  # (B·(R − 1),) each
        rest_logp, rest_entropy = rest[0], rest[1]
        columns += [rest[2].view(B, R - 1, -1)] if query else []
        logp = torch.cat([logp, rest_logp.view(B, R - 1)], dim=1)
        if with_entropy:
            entropy = torch.cat([entropy, rest_entropy.view(B, R - 1)], dim=1)
    mask = response_mask.to(logp.dtype)
    if query is not None:
        query.place((torch.cat(columns, dim=1) * mask.unsqueeze(-1)).view(B * R, -1), None, B, R)
    return logp * mask, entropy * mask if with_entropy else None


SHARED_METRIC = "perf/shared_prefix_frac"  # of a step's teacher-forced rows (π_old, π_ref, update): shared prefill


def tally(sums: dict[str, list[float]] | None, *, shared: bool, rows: int) -> None:
    """Count ``rows`` teacher-forced rows, shared or not, into ``sums`` (name → [Σ shared rows, Σ rows]: the
    per-token metric layout of `UpdateStats.token_sums`, pooled over passes and ranks)."""
    if sums is not None:
        total = sums.setdefault(SHARED_METRIC, [0.0, 0.0])
        total[0] += rows if shared else 0
        total[1] += rows
