"""Teacher-forced per-token log-probs and entropy of responses given prompts.

Layout (the same as the rollout's): prompts are left-padded to ``P`` columns and responses right-padded to
``R`` columns, so every response starts at column ``P``. The logits at column ``t`` predict token ``t + 1``,
so the response is scored by the ``R + 1`` last logit columns minus the final one — the model is asked for
only those (`logits_to_keep`), never for the prompt's.

Every teacher-forced pass (this padded one, the packed one in `vlrl.models.packed`, the shared-prefix passes in
`vlrl.models.shared_prefix`) scores its tokens through `head_scores`: inside the model's forward, the LM head
(its output embedding) is replaced by `score_tokens`, which turns the final hidden states it is handed into
per-token log-probs and entropies. Above a size (`chunk_tokens`, ``train.logprob_chunk``) it does so chunk by
chunk — the head, the fp32 log-softmax and the entropy of ``c`` tokens at a time, each chunk recomputed in the
backward (``torch.utils.checkpoint``) — so the full fp32 ``[tokens, vocab]`` logits (27.9 GiB in the README's
7B plan) never exist: a chunk's are ``c × V``. The arithmetic per token is the unchunked pass's (the same ops on
the same rows), so the values agree to float rounding (tests/models/test_logprobs.py: atol 1e-6 fp32, log-probs,
entropy and gradients, every family preset, padded, packed and shared). The head runs inside the forward, so a
DDP / FSDP2 module's hooks see one forward whose output is the scores (FSDP2 has the head's weight unsharded
there). For comparison: TRL's ``selective_log_softmax`` and chunked ``entropy_from_logits`` save the log-softmax
buffer but start from the logits the model already returned; verl's ``use_fused_kernels`` and Liger's fused
linear cross-entropy take the hidden states and the head's weight, as here, in fused (GPU) kernels.

A pass may ask the head for more per position than the target's log-prob (`HeadQuery`: on-policy distillation's
top-k and argmax, `vlrl.algos.distill`): the extra columns are computed from the same chunk's log-softmax and
leave the forward beside the scores, so every layout and chunk size carries them at no extra ``[tokens, vocab]``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from vlrl.models.adapters import TextAdapter, VisionInputs
from vlrl.models.traits import model_traits

LogprobChunk = int | Literal["auto"]  # train.logprob_chunk: tokens per chunk, 0 = never chunk, auto = above a size
AUTO_CHUNK_ELEMENTS = 1 << 26  # auto: chunk when a pass's fp32 logits would exceed 2^26 values (256 MiB), in
# chunks of ⌊2^26 / V⌋ tokens (441 at Qwen's V = 151,936: a chunk's backward holds ~5 such buffers, 1.3 GiB,
# benchmarks/logprob_memory.py)


NO_MASS = torch.finfo(torch.float32).min  # the log-prob of an empty "rest" bucket (k = the whole vocabulary):
# finite, so a gradient through it is 0, never NaN (exp(NO_MASS) = 0)
MAX_EXACT_ID = 1 << 24  # token ids travel as fp32 columns of the head's output: exact below 2^24


@dataclass
class HeadQuery:
    """What a teacher-forced pass asks of the LM head at every scored position besides the target's log-prob —
    computed from the same (chunk's) fp32 log-softmax at the pass's temperature, and laid out (B, R, ·) like the
    log-probs in ``result`` after the pass (0 at padding):

        top_k   the k most likely tokens: ``topk_logp`` (B, R, k), ``topk_ids`` (B, R, k), and ``topk_rest``
                (B, R), log(1 − Σ_topk p), the mass outside them (`NO_MASS` when k is the whole vocabulary)
        at      (B, R', k) token ids (R' ≥ R): ``at_logp`` (B, R, k), the log-probs there, and ``at_rest`` (B, R),
                the log of the mass outside them — with gradient (the student's update pass)
        argmax  ``argmax`` (B, R), the most likely token

    (on-policy distillation's top-k estimator and agreement, `vlrl.algos.distill`)."""

    top_k: int = 0
    at: torch.Tensor | None = None
    argmax: bool = False
    result: dict[str, torch.Tensor] = field(default_factory=dict)

    def width(self, vocab: int) -> int:
        """Columns the head adds to each position's scores."""
        k = min(self.top_k, vocab)
        return (2 * k + 1 if k else 0) + (self.at.shape[-1] + 1 if self.at is not None else 0) + int(self.argmax)

    def ids_at(self, index: torch.Tensor, B: int, R: int) -> torch.Tensor | None:
        """(K, k) of ``at`` at the flat (B·R) positions ``index`` (K,), on index's device; None without ``at``."""
        if self.at is None:
            return None
        return self.at[:, :R].reshape(B * R, -1).to(index.device, torch.long)[index]

    def columns(self, log_probs: torch.Tensor, at: torch.Tensor | None) -> torch.Tensor:
        """(K, width) from fp32 log-probs (K, V) and the rows' ``at`` ids (K, k)."""
        parts = []
        if self.top_k:
            if log_probs.shape[-1] > MAX_EXACT_ID:
                raise ValueError(f"a vocabulary of {log_probs.shape[-1]} tokens: top-k ids travel as fp32, exact "
                                 f"below {MAX_EXACT_ID}")
            values, ids = log_probs.topk(min(self.top_k, log_probs.shape[-1]), dim=-1)
            parts += [values, ids.to(log_probs.dtype), rest_logprob(log_probs, ids).unsqueeze(-1)]
        if self.at is not None:
            parts += [log_probs.gather(-1, at), rest_logprob(log_probs, at).unsqueeze(-1)]
        if self.argmax:
            parts.append(log_probs.argmax(-1, keepdim=True).to(log_probs.dtype))
        return torch.cat(parts, dim=-1)

    def place(self, values: torch.Tensor, index: torch.Tensor | None, B: int, R: int) -> None:
        """``result`` from a pass's (K, width) columns at the flat (B·R) positions ``index`` (None: all of them, in
        order), 0 elsewhere."""
        if index is not None:
            values = values.new_zeros(B * R, values.shape[-1]).index_put((index,), values)
        values = values.view(B, R, -1)
        self.result, start = {}, 0
        if self.top_k:
            k = (values.shape[-1] - (self.at.shape[-1] + 1 if self.at is not None else 0) - int(self.argmax) - 1) // 2
            self.result.update(topk_logp=values[..., :k], topk_ids=values[..., k : 2 * k].long(),
                               topk_rest=values[..., 2 * k])
            start = 2 * k + 1
        if self.at is not None:
            k = self.at.shape[-1]
            self.result.update(at_logp=values[..., start : start + k], at_rest=values[..., start + k])
            start += k + 1
        if self.argmax:
            self.result["argmax"] = values[..., start].long()


def rest_logprob(log_probs: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log Σ_{v ∉ ids} p(v) (K,) of log-probs (K, V) and ids (K, k): a log-sum-exp over the tokens outside ``ids``
    (exact where 1 − Σ_ids p would round), `NO_MASS` when they are the whole vocabulary."""
    return log_probs.scatter(-1, ids, NO_MASS).logsumexp(-1).clamp_min(NO_MASS)


@dataclass
class TokenBatch:
    """A padded batch of (prompt, response) sequences.

    Attributes:
        input_ids: (B, P + R) token ids, prompts left-padded, responses right-padded.
        attention_mask: (B, P + R) 1 for real tokens.
        response_ids: (B, R) the response part of ``input_ids``.
        response_mask: (B, R) 1 for real (non-pad) response tokens.
        vision: the vision inputs of all rows, concatenated in row order, shared images once (or None).
        prompt_len: P.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    vision: VisionInputs | None
    prompt_len: int

    @property
    def response_len(self) -> int:
        return self.response_ids.shape[1]


def collate(
    prompts: Sequence[Sequence[int] | torch.Tensor],
    responses: Sequence[Sequence[int] | torch.Tensor],
    visions: Sequence[VisionInputs | None],
    *,
    pad_token_id: int,
) -> TokenBatch:
    """Pad prompts on the left and responses on the right into one `TokenBatch`."""
    prompts = [torch.as_tensor(p, dtype=torch.long) for p in prompts]
    responses = [torch.as_tensor(r, dtype=torch.long) for r in responses]
    B = len(prompts)
    P = max(len(p) for p in prompts)
    R = max(1, max(len(r) for r in responses))
    input_ids = torch.full((B, P + R), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((B, P + R), dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        input_ids[i, P - len(p) : P] = p
        input_ids[i, P : P + len(r)] = r
        attention_mask[i, P - len(p) : P + len(r)] = 1
    return TokenBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        response_ids=input_ids[:, P:],
        response_mask=attention_mask[:, P:].clone(),
        vision=VisionInputs.concat_shared(list(visions)),  # a group's shared image is encoded once
        prompt_len=P,
    )


def response_logprobs(
    model: torch.nn.Module,
    adapter: TextAdapter,
    batch: TokenBatch,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    logprob_chunk: LogprobChunk = "auto",
    query: HeadQuery | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of every response token under ``model`` (logits / temperature), and optionally the entropy.

    Returns ``(logp, entropy)``, each (B, R); padded positions hold 0. Gradients flow when called with
    grad enabled. ``logprob_chunk``: `chunk_tokens`; ``query``: its ``result`` filled (`HeadQuery`)."""
    B, R = batch.response_ids.shape
    device = next(model.parameters()).device
    kwargs = adapter.forward_inputs(
        model, batch.input_ids.to(device), batch.attention_mask.to(device), batch.vision.to(device) if batch.vision is not None else None
    )
    targets = batch.response_ids.to(device).reshape(-1)  # (B·R,)

    def select(hidden: torch.Tensor) -> torch.Tensor:  # (B, R + 1, H) → (B·R, H): the last column predicts nothing
        return hidden[:, :-1].reshape(-1, hidden.shape[-1])

    every = torch.arange(B * R, device=device)
    out = head_scores(model, lambda: model(**kwargs, logits_to_keep=R + 1, use_cache=False), select, targets,
                      temperature=temperature, with_entropy=with_entropy, chunk=logprob_chunk, query=query,
                      at=query.ids_at(every, B, R) if query is not None else None)
    logp, entropy = out[0], out[1]
    mask = batch.response_mask.to(device).to(logp.dtype)
    logp = logp.view(B, R) * mask
    if entropy is not None:
        entropy = entropy.view(B, R) * mask
    if query is not None:
        query.place(out[2] * mask.view(-1, 1), None, B, R)
    return logp, entropy


# ----------------------------------------------------------------------------------------------- scoring
def chunk_tokens(setting: LogprobChunk, tokens: int, vocab: int) -> int | None:
    """Tokens per chunk when ``tokens`` positions are scored over a ``vocab``-sized head (None: one piece, the
    full logits). ``setting``: a number of tokens (0: never chunk), or ``auto`` — chunks of ⌊2^26 / vocab⌋ tokens
    once the fp32 logits would hold more than 2^26 values (`AUTO_CHUNK_ELEMENTS`)."""
    if setting == "auto":
        if tokens * vocab <= AUTO_CHUNK_ELEMENTS:
            return None
        size = max(1, AUTO_CHUNK_ELEMENTS // vocab)
    else:
        size = int(setting)
    return size if 0 < size < tokens else None


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, temperature: float, with_entropy: bool,
                   query: HeadQuery | None = None, at: torch.Tensor | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """log softmax(logits / T) at ``targets`` (K,), the entropy of that distribution (K,) and a ``query``'s columns
    (K, width) (``at``: its rows' ids, `HeadQuery.ids_at`), from logits (K, V) in fp32 — the arithmetic of every
    teacher-forced pass."""
    log_probs = F.log_softmax(logits.float() / max(temperature, 1e-6), dim=-1)  # (K, V)
    logp = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (K,)
    entropy = -(log_probs.exp() * log_probs).sum(-1) if with_entropy else None  # (K,)
    return logp, entropy, query.columns(log_probs, at) if query is not None else None


def score_tokens(head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, targets: torch.Tensor, *,
                 temperature: float, with_entropy: bool, chunk: int | None, query: HeadQuery | None = None,
                 at: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """`token_logprobs` of ``head(hidden)`` — hidden (K, H) final hidden states, targets (K,) — whole, or
    ``chunk`` tokens at a time: a chunk's logits live only while it is scored, and with gradients each chunk is
    a ``torch.utils.checkpoint`` unit (its head, log-softmax and entropy recomputed in the backward), so the
    forward keeps only the hidden states and the backward holds one chunk's ``[chunk, V]`` at a time."""
    def piece(h: torch.Tensor, t: torch.Tensor, a: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        out = token_logprobs(head(h), t, temperature=temperature, with_entropy=with_entropy, query=query, at=a)
        return tuple(x for x in out if x is not None)

    if chunk is None:
        parts = [piece(hidden, targets, at)]
    else:
        recompute = torch.is_grad_enabled()
        ats = at.split(chunk) if at is not None else [None] * len(targets.split(chunk))
        parts = [checkpoint(piece, h, t, a, use_reentrant=False) if recompute else piece(h, t, a)
                 for h, t, a in zip(hidden.split(chunk), targets.split(chunk), ats, strict=True)]
    joined = [torch.cat(column) if len(parts) > 1 else column[0] for column in zip(*parts, strict=True)]
    logp, entropy = joined[0], joined[1] if with_entropy else None
    return logp, entropy, joined[-1] if query is not None else None


def output_head(model: torch.nn.Module) -> torch.nn.Module:
    """The LM head (output embedding) of ``model``, through a DDP wrapper or `AdaptersOff` (``.module``)."""
    base = getattr(model, "module", model)
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if head is None:
        raise ValueError(f"{type(base).__name__} has no output embedding (LM head) to score tokens with")
    return head


def _vocab(head: torch.nn.Module) -> int:
    size = getattr(head, "out_features", None)
    return int(size) if size is not None else int(head.weight.shape[0])


@contextmanager
def _head_replaced(head: torch.nn.Module, forward: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[None]:
    had_own = "forward" in vars(head)  # an instance-level forward (e.g. a hook library's): put it back after
    own = vars(head).get("forward")
    head.forward = forward
    try:
        yield
    finally:
        if had_own:
            head.forward = own
        else:
            del head.forward


def head_scores(model: torch.nn.Module, run: Callable[[], object], select: Callable[[torch.Tensor], torch.Tensor],
                targets: torch.Tensor, *, temperature: float, with_entropy: bool, chunk: LogprobChunk = "auto",
                query: HeadQuery | None = None, at: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """Per-token log-probs (K,) and entropies (K,) (or None) of ``targets`` (K,) from one forward of ``model`` —
    and, with a ``query``, its columns (K, width) third (``at``: the rows' ids, `HeadQuery.ids_at`).

    ``run()`` calls the model (the only call made); inside it the LM head is handed the final hidden states the
    model keeps (``logits_to_keep``) and, instead of the logits, returns the scores (K, 1, 2 or more), which come
    back as the output's ``.logits`` — so DDP / FSDP2 see them as the forward's output. ``select`` maps the hidden
    states the head receives to the (K, H) rows that predict ``targets``, in order (an index may repeat: a shared
    prompt's last position predicts the first token of each of its responses). ``chunk``: `chunk_tokens`. A model
    that rescales its logits after the head (`vlrl.models.traits.POST_HEAD`) is scored from its own logits, whole."""
    if model_traits(model).rescales_logits:
        logits = run().logits
        out = token_logprobs(select(logits), targets, temperature=temperature, with_entropy=with_entropy,
                             query=query, at=at)
        return out if query is not None else out[:2]
    head = output_head(model)
    original = head.forward
    vocab = _vocab(head)

    def scores(hidden: torch.Tensor) -> torch.Tensor:
        rows = select(hidden)  # (K, H)
        size = chunk_tokens(chunk, rows.shape[0], vocab)
        parts = score_tokens(original, rows, targets, temperature=temperature, with_entropy=with_entropy,
                             chunk=size, query=query, at=at)
        columns = [parts[0].unsqueeze(-1)] + ([parts[1].unsqueeze(-1)] if with_entropy else [])
        return torch.cat(columns + ([parts[2]] if query is not None else []), dim=-1)  # (K, 1 | 2 [+ width])

    with _head_replaced(head, scores):
        out = run().logits
    out = out.reshape(-1, out.shape[-1])
    first = 2 if with_entropy else 1
    scored = (out[:, 0], (out[:, 1] if with_entropy else None))
    return (*scored, out[:, first:]) if query is not None else scored
