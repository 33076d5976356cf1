"""The one teacher-forced pass (verl's ``dp_actor._forward_micro_batch``, the one function both its log-prob pass and
its update call): every log-prob the trainer computes — π_old, π_ref, a teacher's, the update's, SFT's — goes
through `teacher_forced`, which picks how to run the micro-batch:

    grouped   with gradients, ``shared_prefix``, rows share a prompt     one grouped forward (`vlrl.models.grouped`)
    cached    without gradients, ``shared_prefix``, rows share a prompt  one prefill per prompt, its KV cache expanded
                                                                         to its rows (`vlrl.models.kv_cache`)
    packed    ``padding_free``                                            sequences packed into rows (`vlrl.models.packed`)
    padded    otherwise                                                  prompts left-, responses right-padded
                                                                         (`vlrl.models.logprobs`)

All four return the same (B, R) log-probs (and entropy), right-padded with 0, equal up to float summation order
(tests/models/test_logprobs.py, tests/models/test_packed.py, tests/train/test_shared_prefix.py). The shared-prefix
passes step back to the plain one where they cannot be exact (`vlrl.models.shared_prefix`). What a pass needs to
know about the model is read once per model (`vlrl.models.traits`). `score` is the no-grad form the trainer's
extra passes (π_old, π_ref, a teacher) use: eval mode, no gradient, the result on the host.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch

from vlrl.models.adapters import TextAdapter
from vlrl.models.logprobs import HeadQuery, LogprobChunk, collate, response_logprobs
from vlrl.models.packed import default_rows, first_fit_rows, pack_sequences, packed_response_logprobs
from vlrl.models.policy import Policy
from vlrl.models.shared_prefix import shared_prefix_logprobs, tally
from vlrl.models.vision_inputs import VisionInputs

Ids = Sequence[int] | torch.Tensor
PassKind = Literal["grouped", "cached", "packed", "padded"]


@dataclass(frozen=True)
class PassLayout:
    """How a micro-batch is laid out for the model (``train.padding_free``, ``train.shared_prefix``,
    ``train.logprob_chunk``)."""

    padding_free: bool = False
    shared_prefix: bool = False
    logprob_chunk: LogprobChunk = "auto"


@dataclass
class Scores:
    """A teacher-forced pass's result: (B, R) log-probs and entropies (None unless asked), which pass ran, and the
    token positions the forward processed (the plain passes; the shared ones report their rows in ``sums``)."""

    logp: torch.Tensor
    entropy: torch.Tensor | None
    kind: PassKind
    positions: int = 0


def teacher_forced(model: torch.nn.Module, adapter: TextAdapter, prompts: Sequence[Ids], responses: Sequence[Ids],
                   visions: Sequence[VisionInputs | None], *, pad_token_id: int, temperature: float = 1.0,
                   with_entropy: bool = False, layout: PassLayout = PassLayout(),
                   sums: dict[str, list[float]] | None = None,
                   groups: Sequence[Sequence[int]] | None = None, query: HeadQuery | None = None) -> Scores:
    """(B, R) response log-probs (and entropy) of one micro-batch, through the pass ``layout`` and the gradient mode
    call for (module docstring). ``sums``: where the rows are counted under ``perf/shared_prefix_frac``
    (`vlrl.models.shared_prefix.tally`); ``groups``: padding-free rows (e.g. the bins of a packing plan; unset: the
    sequences first-fit into rows as long as the longest); ``query``: what else the head returns per position,
    in its ``result`` (`vlrl.models.logprobs.HeadQuery`: every layout carries it)."""
    if layout.shared_prefix:
        shared = shared_prefix_logprobs(model, adapter, prompts, responses, visions, pad_token_id=pad_token_id,
                                        temperature=temperature, with_entropy=with_entropy,
                                        logprob_chunk=layout.logprob_chunk, query=query)
        if shared is not None:
            tally(sums, shared=True, rows=len(prompts))
            return Scores(*shared, kind="grouped" if torch.is_grad_enabled() else "cached")
    tally(sums, shared=False, rows=len(prompts))
    if not layout.padding_free:
        tokens = collate(prompts, responses, visions, pad_token_id=pad_token_id)
        logp, entropy = response_logprobs(model, adapter, tokens, temperature=temperature, with_entropy=with_entropy,
                                          logprob_chunk=layout.logprob_chunk, query=query)
        return Scores(logp, entropy, "padded", tokens.input_ids.numel())
    if groups is None:
        lengths = [len(p) + len(r) for p, r in zip(prompts, responses, strict=True)]
        groups = first_fit_rows(lengths, max(lengths))
    batch = pack_sequences(model, adapter, prompts, responses, visions, pad_token_id=pad_token_id,
                           rows=default_rows(model, groups, len(prompts)))
    logp, entropy = packed_response_logprobs(model, adapter, batch, temperature=temperature,
                                             with_entropy=with_entropy, logprob_chunk=layout.logprob_chunk, query=query)
    return Scores(logp, entropy, "packed", batch.num_tokens)


class Scored(Protocol):
    """A row to score: a prompt, a response and the prompt's vision inputs (a rollout's ``Trajectory``)."""

    prompt_ids: Any
    response_ids: Any
    vision: VisionInputs | None


@contextmanager
def evaluating(model: torch.nn.Module) -> Iterator[None]:
    """No gradient and eval mode (no dropout) for a teacher-forced pass; the model's mode is restored after."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


def score(model: torch.nn.Module, policy: Policy, rows: Sequence[Scored], temperature: float, *,
          layout: PassLayout = PassLayout(), prompts: Sequence[Ids] | None = None,
          visions: Sequence[VisionInputs | None] | None = None,
          sums: dict[str, list[float]] | None = None, query: HeadQuery | None = None) -> torch.Tensor:
    """(B, R) log-probs of the rows' responses under ``model`` (the policy's, a frozen reference, a teacher; encoded
    as ``policy`` encodes) — no gradient, eval mode, on the host — after their own prompts or the given ``prompts`` /
    ``visions`` (a teacher's context): `teacher_forced` (the cached pass with ``layout.shared_prefix``, else packed
    or padded). ``query``: its ``result`` filled, on the host too (`vlrl.models.logprobs.HeadQuery`)."""
    prompts = [r.prompt_ids for r in rows] if prompts is None else prompts
    visions = [r.vision for r in rows] if visions is None else visions
    with evaluating(model):
        scores = teacher_forced(model, policy.adapter, prompts, [r.response_ids for r in rows], visions,
                                pad_token_id=policy.pad_token_id, temperature=temperature, layout=layout, sums=sums,
                                query=query)
    if query is not None:
        query.result = {name: value.cpu() for name, value in query.result.items()}
    return scores.logp.cpu()  # a step's batch lives on the host; the update moves its micro-batches
