"""Which parameters a stage trains, and at which learning rate.

Names in config are module groups of the model family (the adapter's ``module_groups``: for Qwen2-VL
``projector`` = ``model.visual.merger``, ``vision`` = the rest of ``model.visual``, ``llm`` = the language
model and ``lm_head``) or plain parameter-name prefixes (``model.language_model.layers.0.``). A parameter
belongs to the most specific name that matches it (the longest matching prefix), so ``vision`` does not
swallow the projector. A name that matches no parameter is an error, never silently ignored.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

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
