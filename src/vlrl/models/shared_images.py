"""Rows that share images (a GRPO group's n responses) encode them once: the encoder outputs of the distinct
images, joined back into row order, go to the model as ``mm_encoder_outputs``.

Used by `vlrl.models.adapters.VisionAdapter` only after a check on the model has shown that this gives the
per-row path's output (`VisionAdapter.shares_images`); `compared_output` is what that check compares.
"""

from __future__ import annotations

from typing import Any

import torch


class NotShareable(Exception):
    """Encoder outputs whose structure `join_outputs` cannot replicate per row."""


def _join(values: list[Any]) -> Any:
    """Join one field of several encoder outputs in row order: tensors along dim 0, per-image lists by
    concatenation, lists of per-image lists (DeepStack's per-layer features) layer by layer."""
    first = values[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(values)
    if isinstance(first, (list, tuple)) and all(isinstance(v, type(first)) and len(v) == len(first) for v in values):
        if first and all(isinstance(x, torch.Tensor) for x in first):
            return type(first)(x for v in values for x in v)
        if first and all(isinstance(x, (list, tuple)) for x in first):
            return type(first)(_join(list(layer)) for layer in zip(*values, strict=True))
    raise NotShareable(f"an encoder output field of type {type(first).__name__}")


# Per-layer diagnostics of an encoder output (the encoder has already read what it needs from them): not handed on.
DIAGNOSTIC_FIELDS = ("hidden_states", "attentions")


def join_outputs(outputs: list[Any]) -> Any:
    """The encoder output of several rows from the outputs of each (a transformers ``ModelOutput``)."""
    first = outputs[0]
    keys = [k for k in first.keys() if k not in DIAGNOSTIC_FIELDS]
    if any([k for k in o.keys() if k not in DIAGNOSTIC_FIELDS] != keys for o in outputs):
        raise NotShareable("encoder outputs with different fields")
    return type(first)(**{k: _join([o[k] for o in outputs]) for k in keys})


def compared_output(out: Any) -> torch.Tensor:
    """What the sharing check compares: log-softmax of the logits, or a backbone's last hidden state."""
    logits = getattr(out, "logits", None)
    if logits is not None:
        return logits.float().log_softmax(-1)
    return out.last_hidden_state.float()
