"""What a teacher-forced pass needs to know about a model, read once per model object (`model_traits`): verl's
``_forward_micro_batch`` asks its model the same questions once, not at every micro-batch.

    rescales_logits   the model rescales its logits after the LM head (Gemma 2's soft cap, Cohere's logit scale,
                      Granite's divisor): the head's output is not the logits, so it is scored from its logits, whole
    grouped_refusal   why a pass *with gradients* cannot share a prompt's work in one grouped forward (None: it can;
                      `shared_prefix_refusal`)
    cache_key         the keyword its forward takes the KV cache under (``past_key_values`` / ``cache_params``)
    logits_to_keep    whether its forward takes ``logits_to_keep``

A model whose configuration changes after its first pass (a module added, a config attribute rewritten) must be
read again with ``refresh=True``; the calls that ask the live model (`shared_prefix_refusal`) stay public for that.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from vlrl.compat import cache_argument
from vlrl.models.introspect import ATTENTION_LAYERS, method_parameters


@dataclass(frozen=True)
class ModelTraits:
    """See the module docstring."""

    rescales_logits: bool
    grouped_refusal: str | None
    cache_key: str
    logits_to_keep: bool


_READ: weakref.WeakKeyDictionary[torch.nn.Module, ModelTraits] = weakref.WeakKeyDictionary()


def model_traits(model: torch.nn.Module, *, refresh: bool = False) -> ModelTraits:
    """``model``'s `ModelTraits`, read at its first pass and kept for as long as the model lives."""
    traits = None if refresh else _READ.get(model)
    if traits is None:
        base = getattr(model, "module", model)
        traits = _READ[model] = ModelTraits(
            rescales_logits=rescales_logits(model), grouped_refusal=shared_prefix_refusal(model),
            cache_key=cache_argument(model), logits_to_keep="logits_to_keep" in method_parameters(type(base), "forward"))
    return traits


# Configuration attributes by which a transformers model rescales its logits after the head (Gemma 2's soft cap,
# Cohere's logit scale, Granite's divisor): the head's output is then not the logits, and `head_scores` asks
# the model for its logits instead (whole: no chunks).
POST_HEAD = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def rescales_logits(model: torch.nn.Module) -> bool:
    config = getattr(getattr(model, "module", model), "config", None)
    configs = [config, config.get_text_config() if hasattr(config, "get_text_config") else None]
    return any(getattr(c, name, None) not in (None, 1, 1.0) for c in configs if c is not None for name in POST_HEAD)


def shared_prefix_refusal(model: torch.nn.Module) -> str | None:
    """Why a pass with gradients through ``model`` cannot share its prompts' work exactly in one grouped forward
    (`vlrl.models.grouped`); None: it can (under DDP / FSDP2 and gradient checkpointing too)."""
    base = getattr(model, "module", model)
    config = getattr(base, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    recurrent = set(getattr(text, "layer_types", None) or []) - ATTENTION_LAYERS
    if recurrent:
        return f"layers {sorted(recurrent)} carry a recurrent state from one response into the next"
    if "token_type_ids" in method_parameters(type(base), "forward") and (
            getattr(config, "model_type", None) != "gemma3" or getattr(text, "use_bidirectional_attention", False)):
        return "its attention mask depends on token types in a way the grouped attention does not build"
    if getattr(text, "attn_logit_softcapping", None) is not None:
        return "its attention logits are soft-capped"
    dropout = [name for name, m in base.named_modules() if isinstance(m, torch.nn.Dropout) and m.p > 0]
    if dropout or float(getattr(text, "attention_dropout", 0.0) or 0.0) > 0:
        return "dropout is active (the n rows would share one dropout mask over the prompt)"
    return None
