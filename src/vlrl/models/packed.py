"""Padding-free teacher-forced log-probs: sequences packed into rows, each attending only to itself.

`response_logprobs` (logprobs.py) pads every sequence of a batch to the longest; here sequences (prompt +
response) are concatenated into rows with no padding between them. Every sequence gets its own position ids
(restarting at 0, and for Qwen2-VL its own M-RoPE positions from the model's ``get_rope_index``) and no
attention mask is passed, which is transformers' standard packed-sequence input (the same as
``DataCollatorWithFlattening``): with sdpa/eager attention the model builds a block-diagonal causal mask from
the position ids; with flash-attention it derives ``cu_seqlens`` from them and calls the varlen kernel. So a
token never attends across sequences and the result equals the padded pass (tests/models/test_packed.py
checks log-probs, losses and gradients).

Layouts (``rows``): one flat row for flash-attention (varlen cost is Σ Lᵢ²), or one row per group of
sequences (a packing bin) for sdpa/eager on CPU, whose dense masked attention costs rows × T² — rows of about
the capacity keep that near the padded pass's cost per real token. `default_rows` picks by the model's
attention implementation.

Only the logits that predict a response token are computed (``logits_to_keep`` as a boolean mask); the
result is laid out as `response_logprobs` lays it out, (B, R) right-padded, so losses do not change.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vlrl.models.adapters import TextAdapter, VisionInputs
from vlrl.models.logprobs import HeadQuery, LogprobChunk, head_scores


@dataclass
class PackedBatch:
    """Sequences packed into rows.

    Attributes:
        input_ids: (N, T) rows of concatenated sequences; a row shorter than T ends with a pad segment.
        position_ids: (D, N, T) per-sequence positions (D = 1 for text models, 4 for Qwen2-VL: text + M-RoPE).
        vision: vision inputs of all sequences, in the order their image tokens appear (row-major).
        keep: (N, T) True where the logit predicts a response token.
        targets: (K,) those response tokens, in row-major order of ``keep``.
        out_index: (K,) where each target goes in the flattened (B, R) output.
        response_mask: (B, R) 1 for real response tokens.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    vision: VisionInputs | None
    keep: torch.Tensor
    targets: torch.Tensor
    out_index: torch.Tensor
    response_mask: torch.Tensor

    @property
    def batch_size(self) -> int:
        return self.response_mask.shape[0]

    @property
    def response_len(self) -> int:
        return self.response_mask.shape[1]

    @property
    def num_tokens(self) -> int:
        """Tokens the forward pass processes (real tokens + the end padding of shorter rows)."""
        return self.input_ids.numel()


def default_rows(model: torch.nn.Module, groups: Sequence[Sequence[int]] | None, n: int) -> list[list[int]]:
    """Flash-attention: everything in one row (varlen). Otherwise one row per group (bin), or one row per
    sequence when no groups are given."""
    from vlrl.compat import attn_implementation

    implementation = attn_implementation(getattr(model, "module", model).config)  # through a DDP wrapper
    if "flash" in implementation:
        return [list(range(n)) if groups is None else [i for g in groups for i in g]]
    return [[i] for i in range(n)] if groups is None else [list(g) for g in groups]


def first_fit_rows(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Group sequences into rows of at most ``capacity`` tokens (first fit, longest first); a sequence longer
    than ``capacity`` gets a row of its own. For run-time batches (RL micro-batches) that have no plan."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda k: -lengths[k]):
        for r, free in enumerate(room):
            if lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(capacity - lengths[i])
    return [sorted(r) for r in rows]


def pack_sequences(
    model: torch.nn.Module,
    adapter: TextAdapter,
    prompts: Sequence[Sequence[int] | torch.Tensor],
    responses: Sequence[Sequence[int] | torch.Tensor],
    visions: Sequence[VisionInputs | None],
    *,
    pad_token_id: int,
    rows: Sequence[Sequence[int]] | None = None,
) -> PackedBatch:
    """Pack (prompt, response) pairs into rows; ``rows`` lists the sequence indices of each row (in order),
    default: `default_rows` for the model, one sequence per row on CPU."""
    prompts = [torch.as_tensor(p, dtype=torch.long) for p in prompts]
    responses = [torch.as_tensor(r, dtype=torch.long) for r in responses]
    B = len(prompts)
    rows = default_rows(model, None, B) if rows is None else [list(r) for r in rows]
    if adapter.one_sequence_per_row:  # recurrent layers / token-type masks: exact only one sequence per row
        rows = [[i] for row in rows for i in row]
    if sorted(i for r in rows for i in r) != list(range(B)):
        raise ValueError(f"rows must hold every sequence index 0..{B - 1} exactly once, got {rows}")
    R = max(1, max(len(r) for r in responses))
    sequences = [torch.cat([p, r]) for p, r in zip(prompts, responses, strict=True)]
    T = max(sum(len(sequences[i]) for i in row) for row in rows)
    D = len(adapter.segment_position_ids(model, sequences[0][:1], None))  # 1 (text) or 4 (M-RoPE)
    input_ids = torch.full((len(rows), T), pad_token_id, dtype=torch.long)
    position_ids = torch.zeros((D, len(rows), T), dtype=torch.long)
    keep = torch.zeros((len(rows), T), dtype=torch.bool)
    targets, out_index, vision_order = [], [], []
    for n, row in enumerate(rows):
        offset = 0
        for i in row:
            ids, p, r = sequences[i], len(prompts[i]), len(responses[i])
            L = len(ids)
            input_ids[n, offset : offset + L] = ids
            position_ids[:, n, offset : offset + L] = adapter.segment_position_ids(model, ids, visions[i])
            if r:  # logits at p − 1 ... p + r − 2 predict the response tokens p ... p + r − 1
                keep[n, offset + p - 1 : offset + p + r - 1] = True
            vision_order.append(visions[i])
            offset += L
        if offset < T:  # the end padding is a sequence of its own (positions restart), never a target
            position_ids[:, n, offset:] = torch.arange(T - offset)
    # targets in row-major order of ``keep`` (rows in order, sequences in row order, positions in order)
    for row in rows:
        for i in row:
            r = len(responses[i])
            targets.append(responses[i])
            out_index.append(i * R + torch.arange(r))
    response_mask = torch.zeros((B, R), dtype=torch.long)
    for i, r in enumerate(responses):
        response_mask[i, : len(r)] = 1
    return PackedBatch(
        input_ids=input_ids, position_ids=position_ids, vision=VisionInputs.concat(vision_order), keep=keep,
        targets=torch.cat(targets) if targets else torch.zeros(0, dtype=torch.long),
        out_index=torch.cat(out_index) if out_index else torch.zeros(0, dtype=torch.long),
        response_mask=response_mask,
    )


def packed_response_logprobs(
    model: torch.nn.Module,
    adapter: TextAdapter,
    batch: PackedBatch,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    logprob_chunk: LogprobChunk = "auto",
    query: HeadQuery | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of every response token (logits / temperature) from one packed forward pass, laid out (B, R)
    right-padded with 0 at padding, exactly as `response_logprobs` returns it; optionally the entropy.
    ``logprob_chunk``: `vlrl.models.logprobs.chunk_tokens`; ``query``: its ``result`` filled (`HeadQuery`)."""
    device = next(model.parameters()).device
    kwargs = adapter.packed_forward_inputs(
        batch.input_ids.to(device), batch.position_ids.to(device),
        batch.vision.to(device) if batch.vision is not None else None,
    )
    keep = batch.keep.to(device)

    def select(hidden: torch.Tensor) -> torch.Tensor:  # (K, H) or (1, K, H): the kept positions, row-major
        return hidden.reshape(-1, hidden.shape[-1])

    B, R = batch.batch_size, batch.response_len
    index = batch.out_index.to(device)
    out = head_scores(model, lambda: model(**kwargs, logits_to_keep=keep, use_cache=False), select,
                      batch.targets.to(device), temperature=temperature, with_entropy=with_entropy, chunk=logprob_chunk,
                      query=query, at=query.ids_at(index, B, R) if query is not None else None)  # (K,) each
    logp_k, entropy_k = out[0], out[1]
    if query is not None:
        query.place(out[2], index, B, R)
    logp = torch.zeros(B * R, device=device, dtype=logp_k.dtype).index_put((index,), logp_k).view(B, R)
    entropy = None
    if entropy_k is not None:
        entropy = torch.zeros(B * R, device=device, dtype=entropy_k.dtype).index_put((index,), entropy_k).view(B, R)
    return logp, entropy
