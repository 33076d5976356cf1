"""LoRA adapters through peft (`pip install vlrl[peft]`): ``model.lora`` in a run's config.

`apply_lora` injects the adapters into the policy's transformers model *in place* (peft's ``get_peft_model``),
so ``policy.model`` stays the transformers model every room already drives — generation, the family adapter's
``model.model.visual``, FSDP units — and now computes W·x + (α/r)·B·A·x in the targeted projections. The peft
wrapper is kept beside it as ``policy.lora`` for what only it does:

- the KL reference is `AdaptersOff`: the same weights with the adapters disabled (``disable_adapter()``), no
  second copy of the model;
- `merged_state_dict`: W + (α/r)·B·A under the plain transformers names — what the rollout servers load and what
  the final export writes; computed per layer, the live weights are never merged and unmerged (which would
  round the frozen base);
- `save_adapter`: the adapter directory (adapter_config.json + adapter_model.safetensors) peft and TRL load.

Resumable checkpoints (`vlrl.train.checkpoint`) hold the module's whole state — the adapters with it — so a
resumed LoRA run continues exactly.

**Under torchrun.** DDP: every rank holds the whole model and DDP averages the adapters' gradients; the reference,
the merged weights and the adapter directory are each rank's own, identical, and rank 0 writes. FSDP2: the peft
model is sharded like any model (`vlrl.train.distributed.wrap_model`: the frozen base and the adapters of a decoder
layer are shards of that layer's unit; only the adapters have gradients, reduce-scattered, and AdamW state). The
reference disables the adapters of the sharded layers, whose forward all-gathers as usual. The merge runs on the
shards: peft's ``get_delta_weight`` computes (α/r)·B·A on DTensors (B's rows stay sharded, the small r × in A is
gathered) and adds it to the base weight's own shard, so `merged_state_dict` holds DTensor shards of the merged
weights; `full_merged_state_dict` / `full_adapter_state_dict` then gather them onto rank 0's CPU one tensor at a
time (``DTensor.full_tensor``, the all-gather DCP's ``full_state_dict`` + ``cpu_offload`` does) — never a second
copy of the whole model on a rank other than rank 0's export.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

ADAPTER_DIR = "adapter"  # the adapter directory inside an exported model directory


def require_peft():
    try:
        import peft
    except ImportError as err:
        raise ImportError("model.lora needs peft: pip install 'vlrl[peft]' (or pip install peft)") from err
    return peft


def apply_lora(policy, cfg) -> Any:
    """Inject ``cfg`` (a `vlrl.config.LoraConfig`) into ``policy.model`` and set ``policy.lora`` (the peft
    model); returns the policy. Only the adapters and ``cfg.modules_to_save`` require gradients afterwards."""
    peft = require_peft()
    if cfg.load_in_4bit and not torch.cuda.is_available():
        raise ValueError("model.lora.load_in_4bit: QLoRA needs bitsandbytes on a CUDA GPU; there is none here")
    config = peft.LoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                             target_modules=cfg.target_modules, modules_to_save=list(cfg.modules_to_save) or None)
    try:
        with warnings.catch_warnings():  # peft reads transformers' deprecated `is_gradient_checkpointing`
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            policy.lora = peft.get_peft_model(policy.model, config)
    except ValueError as err:  # "Target modules {...} not found in the base model"
        raise ValueError(f"model.lora.target_modules: {err}") from None
    policy.model = policy.lora.get_base_model()  # the same object, adapters injected
    return policy


def lora_parameter_names(model: torch.nn.Module) -> list[str]:
    """Parameters peft added for the adapters (``lora_A`` / ``lora_B``) and the trained copies of
    ``modules_to_save``."""
    return [n for n, _ in model.named_parameters() if ".lora_" in n or ".modules_to_save." in n]


class AdaptersOff(torch.nn.Module):
    """The base model of a LoRA policy as a module: the policy's own weights, its adapters disabled while it
    runs — the KL reference π_ref without a second copy of the weights. Attribute access falls through to the
    transformers model (``config``, ``model.visual``, ``get_rope_index``), so the family adapter drives it as it
    drives the policy."""

    def __init__(self, peft_model) -> None:
        super().__init__()
        self.base = peft_model.get_base_model()
        object.__setattr__(self, "_peft", peft_model)  # not a submodule: its parameters are `base`'s

    @property
    def module(self) -> torch.nn.Module:
        """The wrapped transformers model, as a DDP wrapper's ``.module``: the family adapter reads which inputs its
        forward takes from it, and — the model being wrapped — never calls its vision encoder outside this
        forward (where the adapters would be on): images go through `forward`, per row."""
        return self.base

    def forward(self, *args, **kwargs):
        with self._peft.disable_adapter():
            return self.base(*args, **kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("base"), name)


@torch.no_grad()
def merged_tensors(policy, *, deltas: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """(transformers name, weight) of base + adapters, one tensor at a time in state-dict order: W + ΔW for every
    adapted layer (peft's ``get_delta_weight``: (α/r)·B·A, transposed for fan-in-fan-out layers), the trained copy
    of every ``modules_to_save`` module, every other tensor as it is. No live weight is changed. On an
    FSDP2-sharded model each is a DTensor shard (the delta's matmul is a collective: every rank iterates).
    ``deltas=False``: the layout only — the same names, shapes and order with W for W + ΔW (nothing computed, no
    collective), for planning what the merged weights will fill."""
    peft_model = policy.lora
    adapter = peft_model.active_adapter
    from peft.tuners.lora import LoraLayer

    layers = {f"{name}.weight": module for name, module in policy.model.named_modules()
              if isinstance(module, LoraLayer) and adapter in module.lora_A}
    for key, value in policy.model.state_dict().items():
        if ".lora_" in key or ".original_module." in key:
            continue
        key = key.replace(".base_layer.", ".").replace(f".modules_to_save.{adapter}.", ".")
        merge = deltas and key in layers
        yield key, (value + layers[key].get_delta_weight(adapter).to(value.dtype) if merge else value)


def merged_state_dict(policy) -> dict[str, torch.Tensor]:
    """`merged_tensors` as a state dict (DTensor shards on an FSDP2-sharded model: see `full_merged_state_dict`)."""
    return dict(merged_tensors(policy))


def adapter_tensors(policy) -> Iterator[tuple[str, torch.Tensor]]:
    """(peft name, tensor) of the adapters and ``modules_to_save`` copies — the entries of ``policy.lora``'s
    state dict that `save_adapter` writes."""
    for key, value in policy.lora.state_dict().items():
        if ".lora_" in key or ".modules_to_save." in key:
            yield key, value


def full_merged_state_dict(policy) -> dict[str, torch.Tensor]:
    """`merged_state_dict` as full tensors on rank 0's CPU: FSDP2 shards merged on the shards and gathered one
    tensor at a time (a collective: every rank calls it; the other ranks get ``{}``). A model that is not
    sharded gives its merged tensors as they are."""
    return gather_on_rank0(merged_tensors(policy))


def full_adapter_state_dict(policy) -> dict[str, torch.Tensor]:
    """The adapter tensors (`adapter_tensors`) gathered like `full_merged_state_dict`."""
    return gather_on_rank0(adapter_tensors(policy))


def gather_on_rank0(tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """{name: full tensor} on rank 0's CPU from (name, tensor) pairs, ``{}`` on the other ranks: a DTensor shard
    is all-gathered as it comes (every rank iterates the same pairs), so one full tensor at a time exists beside
    what rank 0 keeps; a plain tensor (one process, DDP) is kept as it is."""
    import torch.distributed as dist

    main = not dist.is_initialized() or dist.get_rank() == 0
    out = {}
    for name, tensor in tensors:
        if hasattr(tensor, "full_tensor"):
            tensor = tensor.full_tensor()
        if main:
            out[name] = tensor.cpu()
    return out


def merged_weights(policy, state_dict: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """What a rollout server loads: ``state_dict`` itself when it is already merged (no adapter tensor in it —
    e.g. gathered by `full_merged_state_dict` from FSDP2 shards), else base + adapters merged from the live module
    (``state_dict`` None, or the peft model's own state dict)."""
    if state_dict is not None and not any(".lora_" in key for key in state_dict):
        return state_dict
    return merged_state_dict(policy)


def save_merged(policy, out_dir: Path, state_dict: dict[str, torch.Tensor] | None = None) -> None:
    """Write the merged weights in the transformers layout (config, generation config, safetensors);
    ``state_dict``: the merged weights already gathered (`full_merged_state_dict`)."""
    policy.model.save_pretrained(out_dir, state_dict=dict(state_dict) if state_dict is not None else merged_state_dict(policy))


def save_adapter(policy, out_dir: str | Path, state_dict: dict[str, torch.Tensor] | None = None) -> Path:
    """The adapter directory (adapter_config.json + adapter_model.safetensors), loadable with
    ``PeftModel.from_pretrained(base, out_dir)``; ``state_dict``: the adapter tensors already gathered
    (`full_adapter_state_dict`)."""
    out_dir = Path(out_dir)
    policy.lora.save_pretrained(out_dir, **({"state_dict": dict(state_dict)} if state_dict is not None else {}))
    return out_dir
