"""Which parameters a stage trains, and at which learning rate.

Names in config are module groups of the model family (the adapter's ``module_groups``: for Qwen2-VL
``projector`` = ``model.visual.merger``, ``vision`` = the rest of ``model.visual``, ``llm`` = the language
model and ``lm_head``) or plain parameter-name prefixes (``model.language_model.layers.0.``). A parameter
belongs to the most specific name that matches it (the longest matching prefix), so ``vision`` does not
swallow the projector. A name that matches no parameter is an error, never silently ignored.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import torch

ALL = "all"


def _prefixes(name: str, groups: Mapping[str, Iterable[str]]) -> list[str]:
    return list(groups[name]) if name in groups else [name]


def assign(model: torch.nn.Module, names: Iterable[str], groups: Mapping[str, Iterable[str]], *, field: str) -> dict[str, str]:
    """Parameter name → the config name (group or prefix) whose longest prefix matches it.

    Raises ``ValueError`` naming ``field`` for a name that matches no parameter.
    """
    names = list(names)
    owner: dict[str, tuple[int, str]] = {}
    params = [n for n, _ in model.named_parameters()]
    for name in names:
        prefixes = _prefixes(name, groups)
        matched = False
        for param in params:
            best = max((len(p) for p in prefixes if param.startswith(p)), default=-1)
            if best < 0:
                continue
            # the most specific prefix over all groups owns the parameter; a group's generic prefix yields to
            # another group's more specific one (vision: model.visual. vs projector: model.visual.merger.)
            specific = max(
                (len(p) for other in names for p in _prefixes(other, groups) if param.startswith(p)), default=-1
            )
            if best == specific:
                owner[param] = (best, name)
                matched = True
        if not matched:
            known = ", ".join(sorted(groups)) or "none"
            raise ValueError(f"{field}: {name!r} matches no parameter of the model (module groups of this family: "
                             f"{known}; or give a parameter-name prefix such as {params[0]!r})")
    return {param: name for param, (_, name) in owner.items()}


def set_trainable(model: torch.nn.Module, trainable: list[str], groups: Mapping[str, Iterable[str]]) -> dict[str, bool]:
    """Freeze every parameter outside ``trainable`` (``["all"]`` trains everything); returns the previous
    ``requires_grad`` of every parameter so it can be restored."""
    before = {n: p.requires_grad for n, p in model.named_parameters()}
    if ALL in trainable:
        if len(trainable) > 1:
            raise ValueError(f"train.trainable: 'all' cannot be combined with other names ({trainable})")
        for p in model.parameters():
            p.requires_grad_(True)
        return before
    chosen = assign(model, trainable, groups, field="train.trainable")
    for n, p in model.named_parameters():
        p.requires_grad_(n in chosen)
    return before


def restore_trainable(model: torch.nn.Module, before: dict[str, bool]) -> None:
    for n, p in model.named_parameters():
        p.requires_grad_(before.get(n, True))


def param_groups(
    model: torch.nn.Module, lr: float, module_lr: Mapping[str, float], groups: Mapping[str, Iterable[str]]
) -> list[dict]:
    """AdamW parameter groups over the trainable parameters: one per ``module_lr`` entry (its lr), and one for
    the rest (``lr``). Empty groups are left out."""
    owner = assign(model, module_lr, groups, field="optim.module_lr") if module_lr else {}
    buckets: dict[str | None, list[torch.nn.Parameter]] = {}
    for n, p in model.named_parameters():
        if p.requires_grad:
            buckets.setdefault(owner.get(n), []).append(p)
    out = []
    for name, params in buckets.items():
        out.append({"params": params, "lr": lr if name is None else float(module_lr[name]), "name": name or "default"})
    return out


# ----------------------------------------------------------------------------------------------- memory
AUTO_CHECKPOINTING_PARAMS = 100_000_000  # train.gradient_checkpointing=auto: on from this many parameters


def checkpointing_wanted(model: torch.nn.Module, setting: bool | str) -> bool:
    """``train.gradient_checkpointing`` resolved: ``auto`` is on for models of ≥ 100M parameters (any real
    VLM), off for the tiny presets, whose activations are small and whose tests time the plain loop."""
    if isinstance(setting, bool):
        return setting
    return sum(p.numel() for p in model.parameters()) >= AUTO_CHECKPOINTING_PARAMS


@contextmanager
def gradient_checkpointing(model: torch.nn.Module, setting: bool | str) -> Iterator[bool]:
    """Within the block, the model's decoder blocks and vision blocks (transformers' `GradientCheckpointingLayer`s)
    keep only their inputs in a training forward and recompute the rest in backward — transformers' own
    mechanism with ``use_reentrant=False`` (works under DDP, FSDP2, frozen towers and LoRA, and with keyword
    inputs). Same loss and gradients, less activation memory, one more forward per block. Yields whether it is on;
    the model's previous setting is restored after."""
    base = getattr(model, "module", model)  # a DDP wrapper holds the transformers model in .module
    if not checkpointing_wanted(base, setting):
        yield False
        return
    if not getattr(base, "supports_gradient_checkpointing", False):
        raise ValueError(f"train.gradient_checkpointing: {type(base).__name__} does not support activation "
                         "checkpointing in transformers; set it to false")
    was_on = bool(getattr(base, "is_activation_checkpointing", None) if hasattr(base, "activation_checkpointing_enable")
                  else base.is_gradient_checkpointing)
    kwargs = {"use_reentrant": False}
    if hasattr(base, "activation_checkpointing_enable"):  # transformers ≥ 5.24 (gradient_checkpointing_enable: alias)
        base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    try:
        yield True
    finally:
        if not was_on:
            (getattr(base, "activation_checkpointing_disable", None) or base.gradient_checkpointing_disable)()


def checkpointed_blocks(model: torch.nn.Module) -> list[str]:
    """Names of the blocks that recompute their activations now (the signature tests look for)."""
    return [name for name, m in getattr(model, "module", model).named_modules()
            if getattr(m, "gradient_checkpointing", False) is True and name]


def freeze_for_stage(policy, trainable: list[str]) -> dict[str, bool]:
    """`set_trainable` for a stage's ``train.trainable``; with LoRA (``policy.lora``) the adapters (and
    ``model.lora.modules_to_save``) are what trains, so only ``[all]`` is accepted and nothing changes."""
    if getattr(policy, "lora", None) is not None:
        if list(trainable) != [ALL]:
            raise ValueError(f"train.trainable: {trainable} cannot be combined with model.lora, which trains the adapters "
                             "and model.lora.modules_to_save only; leave train.trainable at [all] (or put whole modules "
                             "in model.lora.modules_to_save)")
        return {n: p.requires_grad for n, p in policy.model.named_parameters()}
    return set_trainable(policy.model, trainable, policy.adapter.module_groups)


@dataclass(frozen=True)
class StageModules:
    """What `stage_modules` set up: trainable parameter count and whether activation checkpointing is on."""

    trainable_params: int
    gradient_checkpointing: bool


@contextmanager
def stage_modules(policy, train) -> Iterator[StageModules]:
    """A training stage's module settings for the block: ``train.trainable`` (`freeze_for_stage`) and
    ``train.gradient_checkpointing``; both are undone after (the next stage starts from the loaded state)."""
    frozen = freeze_for_stage(policy, train.trainable)
    try:
        with gradient_checkpointing(policy.model, train.gradient_checkpointing) as on:
            yield StageModules(sum(p.numel() for p in policy.model.parameters() if p.requires_grad), on)
    finally:
        restore_trainable(policy.model, frozen)
