"""What a transformers model takes and how it is wrapped, read from the model itself (no family code).

- `method_parameters`: which keyword arguments a model's ``forward`` (or ``get_image_features``) takes — which
  processor outputs, token types and encoder outputs the family layer hands it;
- `inner_model` / `is_wrapped`: the transformers base model behind a DDP wrapper, and whether a module is a DDP
  or FSDP2 one (whose submodules must not be called outside its own forward);
- `one_sequence_per_row`: whether padding-free rows must hold one sequence each for the model to be exact;
- `image_text_model_class`: the class ``AutoModelForImageTextToText`` builds for a config.
"""

from __future__ import annotations

import inspect
from functools import cache
from typing import Any

import torch

# Layer types of attention (a packed row's sequences are kept apart by the mask); any other type is recurrent.
ATTENTION_LAYERS = frozenset({"full_attention", "sliding_attention", "chunked_attention", "attention"})


@cache
def method_parameters(cls: type, method: str) -> frozenset[str]:
    """Parameter names of a transformers method (which processor outputs a model's ``forward`` takes)."""
    fn = getattr(cls, method, None)
    return frozenset(inspect.signature(fn).parameters) if fn is not None else frozenset()


def is_wrapped(model: torch.nn.Module) -> bool:
    """A DDP or FSDP2 module: its submodules must not be called outside its own forward."""
    from torch.distributed.fsdp import FSDPModule

    return hasattr(model, "module") or isinstance(model, FSDPModule)


def inner_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers base model: through a DDP wrapper (``.module``), then ``ForConditionalGeneration.model``."""
    model = getattr(model, "module", model)
    inner = getattr(model, "model", None)
    return inner if isinstance(inner, torch.nn.Module) else model


def one_sequence_per_row(model_config: Any, model_cls: type | None) -> bool:
    """Whether padding-free rows must hold one sequence each for this model to be exact:

    - recurrent layers (Qwen3.5's Gated DeltaNet, Mamba, ...; a text config's ``layer_types`` other than
      attention) carry their state from one sequence into the next in a packed row — only varlen kernels
      (flash-linear-attention with ``cu_seqlens``) would stop it, and transformers' PyTorch fallback has none;
    - an attention mask that depends on token types (Gemma 3's bidirectional attention within an image, its
      forward takes ``token_type_ids``): transformers 5 applies the image blocks of sliding-window layers at
      positions remapped for packing, so an image of a second sequence in the row attends to the wrong tokens.
    """
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    layer_types = set(getattr(text, "layer_types", None) or [])
    if layer_types - ATTENTION_LAYERS:
        return True
    return model_cls is not None and "token_type_ids" in method_parameters(model_cls, "forward")


def image_text_model_class(model_config: Any) -> type | None:
    """The class ``AutoModelForImageTextToText`` builds for ``model_config`` (None: not an image-text model)."""
    from transformers import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING  # the table of AutoModelForImageTextToText

    try:
        return MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING[type(model_config)]
    except KeyError:
        return None
