"""Every use vlrl makes of a name that transformers or torch does not publish — in one file, each with its reason.

A private name can change in any release, with no deprecation; that is why pyproject.toml caps both packages at the
newest minor release the suite passed on (``transformers<5.25``; ``torch<2.15``: torch 2.14.1 passed the fast subset
and the torchrun/Ray tests, 2026-11-28 — the end-to-end demo runs were not run on it). Before raising a ceiling, read
this file against the new release: each function says what it reaches into and which public API would replace it.
The rest of vlrl imports these functions, never the private names.

Private uses that had a public equivalent were removed rather than wrapped: ``AutoModelForImageTextToText.
_model_mapping`` (now ``transformers.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING``), DTensor's ``_local_tensor`` (now
``to_local()``), the tokenizer's ``_set_model_specific_special_tokens`` (now the ``extra_special_tokens`` dict of
the constructor), ``use_fast=False`` (now ``backend="pil"``), DCP's ``_traverse.set_element`` (vlrl's own setter,
`vlrl.train.checkpoint`), and the ``_is_fsdp_managed_module`` flag (it told transformers' ``generate()`` to keep
ranks in step; vlrl samples with its own loop, `vlrl.rollout.decode`, which never read it).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache
from typing import Any

import torch

# ----------------------------------------------------------------------------------------------- transformers


def checkpoint_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (state-dict names) under the names ``save_pretrained`` writes: transformers 5 renames (and for
    some families merges or splits) weights between a checkpoint and the module.

    Reaches into ``transformers.core_model_loading.revert_weight_conversion``, the function ``save_pretrained``
    itself calls. Public replacement: ``save_pretrained`` to a directory and read its names back — a full write
    of the model per weight update, which is what `vlrl.rollout.weights.checkpoint_names` avoids."""
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, dict(state))


def copy_output_capturing(module: torch.nn.Module, original: type) -> None:
    """Let ``module`` (whose class FSDP2's `fully_shard` replaced by ``FSDP<original>``) record the intermediate
    outputs ``original`` records (the hidden states LLaVA-OneVision's and InternVL's ``vision_feature_layer``
    selects); without it the sharded tower returns none.

    Reaches into ``transformers.utils.output_capturing._CAN_RECORD_REGISTRY``: {``str(class)``: the class's
    ``_can_record_outputs``}, a plain dict up to 5.22 and a dict subclass keyed by the model from 5.23 on — both
    written here through ``dict`` itself, under the string key both read. Public replacement: none (transformers
    registers a class when a model is constructed, and `fully_shard` makes the class after that)."""
    from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY

    recorded = dict.get(_CAN_RECORD_REGISTRY, str(original))
    if recorded is not None:
        dict.__setitem__(_CAN_RECORD_REGISTRY, str(type(module)), recorded)


def no_split_modules(model: torch.nn.Module) -> set[str]:
    """Class names of the blocks transformers never splits across devices (decoder layers, vision blocks) —
    vlrl's FSDP2 units.

    Reads the model class's ``_no_split_modules``, which accelerate's ``device_map`` reads too. Public
    replacement: none."""
    return set(getattr(model, "_no_split_modules", None) or [])


def attn_implementation(config: Any) -> str:
    """The attention kernel the model runs (``sdpa``, ``eager``, ``flash_attention_2``, …; '' when unset).

    Reads ``config._attn_implementation``, the attribute transformers' own modeling code reads (the public
    ``model.set_attn_implementation`` only sets it). Public replacement: a getter, if transformers adds one."""
    return str(getattr(config, "_attn_implementation", "") or "")



def swap_attn_implementation(config: Any, implementation: str) -> str:
    """Set ``config``'s attention kernel to ``implementation`` and return the one it had, for vlrl's grouped
    attention to replace the language model's kernel for one call in one thread (`vlrl.models.grouped`).

    Writes ``config._attn_implementation_internal``, the value behind ``config._attn_implementation``. Public
    replacement: ``model.set_attn_implementation`` sets every sub-config of a model and checks the kernel each
    time — per call, and without a way to name only the language model's configs."""
    previous = config._attn_implementation_internal
    config._attn_implementation_internal = implementation
    return previous


@contextmanager
def gradient_checkpointing_wrapped(model: torch.nn.Module, wrap: Callable[[Callable], Callable]) -> Iterator[None]:
    """Within: every module of ``model`` that checkpoints its layers calls ``wrap(f)`` where it called its
    checkpointing function ``f`` — how `vlrl.models.grouped` re-enters its attention layout when a layer's forward
    is replayed in the backward pass. Restored on exit.

    Reads and writes the modules' ``_gradient_checkpointing_func``, set by ``gradient_checkpointing_enable``.
    Public replacement: ``gradient_checkpointing_enable(gradient_checkpointing_kwargs=...)`` takes the options of
    ``torch.utils.checkpoint``, not a function to call around the replay."""
    wrapped = []
    for m in model.modules():
        original = getattr(m, "_gradient_checkpointing_func", None)
        if getattr(m, "gradient_checkpointing", False) is True and callable(original):
            wrapped.append((m, "_gradient_checkpointing_func" in vars(m), original))
            m._gradient_checkpointing_func = wrap(original)
    try:
        yield
    finally:
        for m, own, original in wrapped:
            if own:
                m._gradient_checkpointing_func = original
            else:
                del m._gradient_checkpointing_func

@cache
def _forward_params(cls: type) -> frozenset[str]:
    return frozenset(inspect.signature(cls.forward).parameters)


def cache_argument(model: torch.nn.Module) -> str:
    """The name of the KV-cache argument of ``model``'s forward: ``cache`` from transformers 5.24 on,
    ``past_key_values`` before (both public names; transformers 5.23 and older have the old one)."""
    return "cache" if "cache" in _forward_params(type(getattr(model, "module", model))) else "past_key_values"


def llava_onevision_packed_features(config: Any, features: list[torch.Tensor], image_sizes: Any) -> list:
    """LLaVA-OneVision's anyres packing of per-crop features (crops unpadded to the image's aspect ratio, a
    newline per row), run on stand-in features to count the tokens an image gets without its tower.

    Calls ``LlavaOnevisionModel.pack_image_features`` with a stand-in ``self`` holding only ``config`` (it reads
    nothing else) — an implementation detail of that method. Public replacement: none that counts an image's
    tokens from its size alone (the preflight check loads no weights)."""
    import types

    from transformers.models.llava_onevision.modeling_llava_onevision import LlavaOnevisionModel

    packed, _ = LlavaOnevisionModel.pack_image_features(types.SimpleNamespace(config=config), features, image_sizes,
                                                        image_newline=torch.zeros(1),
                                                        vision_aspect_ratio=config.vision_aspect_ratio)
    return packed


# ----------------------------------------------------------------------------------------------- torch


def separate_process_group(store: Any, *, rank: int, world_size: int, backend: str, group_name: str,
                           timeout: Any) -> Any:
    """A process group of ``world_size`` ranks on ``store``, beside (not inside) any default group: the trainer
    ranks and the rollout servers' weight-update group, as SGLang's ``init_custom_process_group`` makes it. The
    group's ranks are its own (0 … world_size-1), so ``dist.broadcast(..., group=)`` takes them.

    Calls ``torch.distributed.distributed_c10d._new_process_group_helper`` and writes ``_world.pg_group_ranks``.
    Public replacement: ``dist.new_group`` needs every process in one default group first, which a trainer
    (its own torchrun world) and a server do not share; a ``dist.ProcessGroupGloo``/``ProcessGroupNCCL`` built
    directly works only through its own methods, not ``dist.broadcast``."""
    from torch.distributed import distributed_c10d as c10d

    group, _ = c10d._new_process_group_helper(world_size, rank, [], backend, store, group_name=group_name,
                                              timeout=timeout)
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group




def dcp_metadata_path(reader: Any, rank: int | None) -> Any:
    """The path of the metadata file a ``torch.distributed.checkpoint.FileSystemReader`` would unpickle, so
    `vlrl.train.checkpoint` can read it with a restricted unpickler instead.

    Calls the reader's ``_get_metadata_path``. Public replacement: none (``read_metadata`` unpickles the file with
    no way to restrict what it may construct)."""
    return reader._get_metadata_path(rank)

def own_tensor_tables(module: torch.nn.Module) -> tuple[dict, dict]:
    """``module``'s own parameters and buffers (not its sub-modules'), as the two dicts that hold them, so a value
    can be replaced under its name with whatever else points at the module (FSDP2's hooks, tied weights) intact.

    Returns ``module._parameters`` and ``module._buffers``. Public replacement: ``named_parameters(recurse=False)``
    to read and ``register_parameter`` / ``register_buffer`` to write — which re-checks each name and needs each
    buffer's ``persistent`` flag, which only ``_non_persistent_buffers_set`` holds."""
    return module._parameters, module._buffers

def memory_tracker(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Any:
    """torch's ``MemTracker`` set up for one training step of ``model`` and ``optimizer``: the peak memory by
    category (parameters, gradients, optimizer state, activations) on any device, CPU included — what ``vlrl plan
    --measure`` reports. Use it as a context manager around the step.

    Imports ``torch.distributed._tools.mem_tracker``, a private module, and writes its tracker's
    ``_param_to_grad_hook_handles``: MemTracker hooks every parameter's gradient, which fails on a frozen one
    (it never has one), so each frozen parameter gets a placeholder that marks it hooked. Public replacement: on
    CUDA ``torch.cuda.memory_stats`` gives totals without categories; on CPU there is none."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    for param in model.parameters():
        if not param.requires_grad:
            tracker._param_to_grad_hook_handles[param] = (_NoHook(), _NoHook())
    return tracker


class _NoHook:
    def remove(self) -> None:
        pass
