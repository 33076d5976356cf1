"""Teacher-forced per-token log-probs and entropy of responses given prompts.

Layout (the same as the rollout's): prompts are left-padded to ``P`` columns and responses right-padded to
``R`` columns, so every response starts at column ``P``. The logits at column ``t`` predict token ``t + 1``,
so the response is scored by the ``R + 1`` last logit columns minus the final one — the model is asked for
only those (`logits_to_keep`), never for the prompt's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vlrl.models.adapters import TextAdapter, VisionInputs


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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of every response token under ``model`` (logits / temperature), and optionally the entropy.

    Returns ``(logp, entropy)``, each (B, R); padded positions hold 0. Gradients flow when called with
    grad enabled.
    """
    R = batch.response_len
    device = next(model.parameters()).device
    kwargs = adapter.forward_inputs(
        model, batch.input_ids.to(device), batch.attention_mask.to(device), batch.vision.to(device) if batch.vision is not None else None
    )
    logits = model(**kwargs, logits_to_keep=R + 1, use_cache=False).logits[:, :-1]  # (B, R, V)
    logits = logits.float() / max(temperature, 1e-6)
    log_probs = F.log_softmax(logits, dim=-1)  # (B, R, V)
    targets = batch.response_ids.to(device)
    logp = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (B, R)
    mask = batch.response_mask.to(device).to(logp.dtype)
    logp = logp * mask
    entropy = None
    if with_entropy:
        entropy = -(log_probs.exp() * log_probs).sum(-1) * mask  # (B, R)
    return logp, entropy

