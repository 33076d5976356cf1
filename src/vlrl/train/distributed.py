"""Data-parallel training on torch.distributed: the process group from the torchrun environment, DDP or FSDP2
wrapping, gradient accumulation that communicates once per optimizer step, global loss normalisers, and the
rank-aware helpers the recipes use.

One code path for one process and for N ranks: with one process nothing is wrapped and every collective is
the identity, so a single-process run is exactly the loop it always was.

**The gradient of one big batch.** Rank r holds a shard B_r of the global batch B and minimises

    L_r = Σ_{i∈B_r} ℓ_i / (N / W),      N = all-reduce-sum of every rank's count (tokens or sequences)

DDP and FSDP2 *average* gradients over the W ranks, so the optimizer sees

    (1/W) Σ_r ∇L_r = Σ_{i∈B} ∇ℓ_i / N = ∇L(B)

the gradient of the whole batch normalised once — the global-token normalisation of verl (``loss_scale_factor``)
and TRL. Callers pass ``normaliser / world_size`` (`DistContext.local_normaliser`).

**FSDP2 units** (machine.md): the vision tower is its own unit, as is every block transformers lists in
``_no_split_modules`` (decoder layers, vision blocks), then the root. transformers 5 encodes images before the
decoder's forward, so FSDP2's root is fixed by one tiny forward right after wrapping.

**LoRA** (``model.lora``) is wrapped the same way: peft's layers sit inside the decoder-layer units, so each unit
shards its frozen base weights and its adapters together; only the adapters get gradients (reduce-scattered) and
AdamW state. The reference and the merged export work on the shards (`vlrl.models.lora`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from vlrl import compat
from vlrl.config import DistConfig

MIXED_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


# ----------------------------------------------------------------------------------------------- process context
@dataclass(frozen=True)
class DistContext:
    """This process's place among the ranks; every collective helper is the identity when ``world_size == 1``."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    owns_group: bool = False  # this context joined the process group (and `shutdown` leaves it)

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_reduce_sum(self, values: Sequence[float]) -> list[float]:
        """Element-wise sum over ranks (float64: token counts stay exact up to 2⁵³)."""
        if not self.enabled:
            return [float(v) for v in values]
        tensor = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self._comm_device)
        dist.all_reduce(tensor)
        return tensor.cpu().tolist()

    def any(self, flag: bool) -> bool:
        """True on every rank if it is true on any rank (e.g. a wall-clock budget: all ranks stop together)."""
        return self.all_reduce_sum([1.0 if flag else 0.0])[0] > 0

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), in rank order, on every rank."""
        if not self.enabled:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def shard(self, items: Sequence[Any], *, what: str) -> list[Any]:
        """This rank's contiguous share of a global batch; the batch must split evenly (``what`` names the
        config field in the error) so that every rank runs the same number of collectives."""
        if len(items) % self.world_size:
            raise ValueError(f"{what}: {len(items)} does not split evenly over {self.world_size} ranks; "
                             f"use a multiple of {self.world_size}")
        size = len(items) // self.world_size
        return list(items[self.rank * size : (self.rank + 1) * size])

    def local_normaliser(self, global_count: float) -> float:
        """The normaliser a rank divides its loss sum by: N / W (see the module docstring)."""
        return max(global_count, 1.0) / self.world_size

    @property
    def _comm_device(self) -> torch.device:
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")


def init_distributed(cfg: DistConfig, device: str = "cpu") -> DistContext:
    """Join the process group torchrun (or `vlrl launch`) describes in RANK / WORLD_SIZE / LOCAL_RANK /
    MASTER_ADDR / MASTER_PORT; one process without them. Idempotent."""
    if cfg.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return DistContext(device=torch.device(device))
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    target = torch.device(device)
    if target.type == "cuda":  # under Ray each rank sees only its own GPU (CUDA_VISIBLE_DEVICES): index 0
        target = torch.device("cuda", local_rank % max(torch.cuda.device_count(), 1))
        torch.cuda.set_device(target)
    backend = cfg.backend if cfg.backend != "auto" else ("nccl" if target.type == "cuda" else "gloo")
    joined = not dist.is_initialized()
    if joined:
        dist.init_process_group(backend, timeout=timedelta(minutes=cfg.timeout_minutes))
    return DistContext(rank=rank, world_size=world_size, local_rank=local_rank, device=target, owns_group=joined)


def shutdown_distributed(ctx: DistContext) -> None:
    """Leave the process group if ``ctx`` joined it (a group the caller set up stays for the caller)."""
    if ctx.owns_group and dist.is_initialized():
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------- wrapping
def fsdp_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Modules that become FSDP2 units, innermost first: the blocks named in ``_no_split_modules`` (decoder
    layers, vision blocks), then the vision tower as a whole (`vlrl.models.adapters.vision_tower`: ``visual``,
    ``vision_tower`` or ``vision_model``, whichever the family has)."""
    from vlrl.compat import no_split_modules
    from vlrl.models.adapters import vision_tower

    block_names = no_split_modules(model)
    blocks = [m for m in model.modules() if type(m).__name__ in block_names]
    tower = vision_tower(model)
    return blocks + ([tower] if tower is not None else [])


def wrap_model(model: torch.nn.Module, ctx: DistContext, cfg: DistConfig) -> torch.nn.Module:
    """The module to train: ``model`` itself (one process), a DDP wrapper (same parameters), or ``model``
    sharded in place by FSDP2 (its parameters become DTensor shards). A model built on the meta device on ranks
    other than 0 (``dist.rank0_load``) gets its shards from rank 0's weights (`shard`)."""
    if not ctx.enabled:
        return model
    if cfg.strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
                                       find_unused_parameters=cfg.find_unused_parameters, broadcast_buffers=False)
    shard(model, fsdp_units(model), ctx, cfg)
    _keep_output_capturing(model)
    device = ctx.device
    with torch.no_grad():  # FSDP2 takes the first module to run forward as its root: make it the model
        model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device), use_cache=False)
    return model


def wrap_critic(value_model: torch.nn.Module, ctx: DistContext, cfg: DistConfig) -> torch.nn.Module:
    """The critic's value model wrapped like the actor: DDP (same parameters, gradients all-reduced), or FSDP2
    with the same units inside its backbone (decoder layers, vision blocks, vision tower) and the value model —
    backbone + head — as the root, so the head is sharded too and its forward is the one that gathers."""
    if not ctx.enabled:
        return value_model
    if cfg.strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(value_model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
                                       find_unused_parameters=cfg.find_unused_parameters, broadcast_buffers=False)
    shard(value_model, fsdp_units(value_model.backbone), ctx, cfg)
    _keep_output_capturing(value_model)
    return value_model


def fsdp_options(ctx: DistContext, cfg: DistConfig) -> dict[str, Any]:
    """`fully_shard`'s keyword arguments for ``cfg``: the 1-D mesh over the ranks, ``dist.reshard_after_forward``,
    ``dist.mixed_precision`` (MixedPrecisionPolicy: gathered in bf16/fp16, reduced in fp32) and ``dist.cpu_offload``
    (CPUOffloadPolicy: the sharded parameters, their gradients and so the optimizer's state live in host memory;
    each unit's shard is copied to the device for its all-gather, its gradient back after the reduce-scatter;
    pinned host memory on GPUs)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    options: dict[str, Any] = {"mesh": init_device_mesh(ctx.device.type, (ctx.world_size,)),
                               "reshard_after_forward": cfg.reshard_after_forward}
    if cfg.mixed_precision != "none":
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=MIXED_DTYPES[cfg.mixed_precision], reduce_dtype=torch.float32)
    if cfg.cpu_offload:
        options["offload_policy"] = CPUOffloadPolicy(pin_memory=ctx.device.type == "cuda")
    return options


def shard(root: torch.nn.Module, units: list[torch.nn.Module], ctx: DistContext, cfg: DistConfig) -> None:
    """`fully_shard` each of ``units``, then ``root`` (FSDP2, in place, `fsdp_options`).

    **Memory-lean start** (``dist.rank0_load``): when ``root`` was built on the meta device on the ranks other than
    0 (no weights read, no memory), every unit, just before it is sharded, gets rank 0's tensors (`from_rank0`):
    the ranks on meta allocate that unit alone, rank 0 broadcasts its parameters and buffers one tensor at a time,
    and `fully_shard` then keeps each rank's shard and frees the rest. A rank holds its shards plus one unit at a
    time — rank 0 the model it loaded, released unit by unit as it is sharded, as without the lean start. (The same
    end as `set_model_state_dict(…, broadcast_from_rank0=True)` on a model sharded on meta, without holding rank 0's
    whole model beside all of its shards.) Collective: every rank calls it, with the same units."""
    from torch.distributed.fsdp import fully_shard

    on_meta = any(p.is_meta for p in root.parameters())
    from_rank0_needed = ctx.any(on_meta)  # the same answer on every rank
    if from_rank0_needed and on_meta and ctx.is_main:
        raise ValueError("dist.rank0_load: rank 0 must hold the weights (it was built on the meta device)")
    options = fsdp_options(ctx, cfg)
    for unit in [*units, root]:
        if from_rank0_needed:
            from_rank0(unit, ctx)
        fully_shard(unit, **options)


def from_rank0(unit: torch.nn.Module, ctx: DistContext) -> None:
    """Give every rank rank 0's values of ``unit``'s own parameters and buffers — those not inside a sub-module
    already sharded — allocating them where they are on the meta device. A parameter shared by two modules (tied
    embeddings) is sent once and stays shared."""
    from torch.distributed.fsdp import FSDPModule

    done: dict[int, torch.Tensor] = {}
    for module in _own_modules(unit, FSDPModule):
        for table in compat.own_tensor_tables(module):
            for name, tensor in list(table.items()):
                if tensor is None:
                    continue
                if id(tensor) not in done:
                    value = tensor.detach()
                    if value.is_meta:
                        value = torch.empty(value.shape, dtype=value.dtype, device=ctx.device)
                    dist.broadcast(value if value.is_contiguous() else value.contiguous(), src=0)
                    done[id(tensor)] = (torch.nn.Parameter(value, requires_grad=tensor.requires_grad)
                                        if isinstance(tensor, torch.nn.Parameter) else value) if tensor.is_meta else tensor
                table[name] = done[id(tensor)]


def _own_modules(unit: torch.nn.Module, sharded: type) -> list[torch.nn.Module]:
    """``unit`` and its sub-modules, without those inside a sub-module that is already an FSDP2 unit."""
    out, stack = [], [unit]
    while stack:
        module = stack.pop()
        out.append(module)
        stack.extend(child for child in module.children() if not isinstance(child, sharded))
    return out


def _keep_output_capturing(model: torch.nn.Module) -> None:
    """transformers 5 records a model's intermediate outputs (the hidden states LLaVA-OneVision's and InternVL's
    ``vision_feature_layer`` selects) through a registry keyed by the module's class name; `fully_shard` gives
    every unit a new class (``FSDP<name>``), so re-register each unit under it — or the tower returns no hidden
    states."""
    from torch.distributed.fsdp import FSDPModule

    from vlrl.compat import copy_output_capturing

    for module in model.modules():
        if isinstance(module, FSDPModule):
            copy_output_capturing(module, next(c for c in type(module).__mro__[1:] if not issubclass(c, FSDPModule)))


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside a DDP wrapper (an FSDP2 model is its own module)."""
    return getattr(module, "module", module)


@contextmanager
def gradient_sync(module: torch.nn.Module, enabled: bool) -> Iterator[None]:
    """Reduce gradients across ranks in this backward only when ``enabled`` (the last micro-batch of an
    optimizer step): DDP ``no_sync``, FSDP2 ``set_requires_gradient_sync``."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(module, DistributedDataParallel) and not enabled:
        with module.no_sync():
            yield
        return
    if isinstance(module, FSDPModule):
        module.set_requires_gradient_sync(enabled)
    yield


def check_scalable(cfg, world_size: int) -> None:
    """What runs under several ranks and with resumable checkpoints; the error names the field."""
    scaled = world_size > 1 or cfg.checkpoint.every or cfg.checkpoint.resume
    if getattr(cfg, "stages", None) and scaled:
        raise ValueError("stages: a staged run goes through its stages in one process without resumable checkpoints; "
                         "for torchrun / checkpoint.every / --resume run each stage as a run of its own (model.path = "
                         "the previous stage's checkpoint)")
    rollout = getattr(cfg, "rollout", None)
    if rollout is None:
        return
    synth = getattr(cfg, "synth", None)
    if synth is not None and synth.enabled and rollout.mode == "async" and world_size > 1:
        raise ValueError("synth.enabled with rollout.mode=async: under torchrun Syn-GRPO runs with the synchronous "
                         "recipe (rank 0's synthesis client, swaps broadcast at step boundaries); the asynchronous "
                         "recipe's background rollout draws from the dataset while it is rewritten, so its swaps have "
                         "no step boundary all ranks share — use rollout.mode=sync, or one process")


# ----------------------------------------------------------------------------------------------- RL over ranks
class GlobalAdvantage:
    """An advantage estimator applied to the *global* batch: every rank gathers the estimator's inputs of all
    ranks (small (B, R) tensors), computes the same advantages, and keeps its own rows. Group estimators
    (GRPO, RLOO) give the same result as on the shard — a prompt's n samples never leave their rank — but
    estimators that normalise over the whole batch (REINFORCE++) then see the batch one process would see."""

    def __init__(self, fn, ctx: DistContext) -> None:
        self.fn, self.ctx = fn, ctx

    def __call__(self, inputs):
        if not self.ctx.enabled:
            return self.fn(inputs)
        B, R = inputs.loss_mask.shape
        parts = self.ctx.gather_objects({f.name: getattr(inputs, f.name) for f in dataclasses.fields(inputs)})
        sizes = [p["loss_mask"].shape for p in parts]
        width = max(r for _, r in sizes)
        offset = 0
        merged: dict[str, Any] = {}
        for name in parts[0]:
            values = [p[name] for p in parts]
            if values[0] is None:
                merged[name] = None
            elif name == "group_index":  # prompt ids are per rank: make them distinct
                shifted = []
                for v in values:
                    shifted.append(v + offset)
                    offset += int(v.max()) + 1 if len(v) else 0
                merged[name] = torch.cat(shifted)
            elif values[0].dim() == 2:
                merged[name] = torch.cat([torch.nn.functional.pad(v, (0, width - v.shape[1])) for v in values])
            else:
                merged[name] = torch.cat(values)
        out = self.fn(dataclasses.replace(inputs, **merged))
        start = sum(b for b, _ in sizes[: self.ctx.rank])
        return dataclasses.replace(out, **{f.name: _rows(getattr(out, f.name), start, B, R)
                                           for f in dataclasses.fields(out)})


class GlobalRewardShaping:
    """A reward-shaping chain (`vlrl.train.batch.ShapingChain`) applied to the *global* batch, like
    `GlobalAdvantage`: every rank gathers the shapers' inputs (scalars per response and the responses without
    prompt tokens, vision inputs or images), runs the chain on the whole batch and keeps its own rows. A shaper
    whose output depends on the batch — syn_diversity's V_k^batch_avg and its EMA — then sees what one process
    sees, and its state is the same on every rank. Names, states and length are the chain's."""

    def __init__(self, chain, ctx: DistContext) -> None:
        self.__dict__.update(chain=chain, ctx=ctx)

    @classmethod
    def over(cls, chain, ctx: DistContext):
        """``chain`` itself in one process or without shapers, else the global chain."""
        return cls(chain, ctx) if ctx.enabled and len(chain) else chain

    def __len__(self) -> int:
        return len(self.chain)

    def __getattr__(self, name: str):
        return getattr(self.chain, name)

    def __setattr__(self, name: str, value) -> None:  # `ShaperStates.restore` sets the chain's states
        setattr(self.chain, name, value)

    def apply(self, inputs):
        B = len(inputs.rewards)
        tensors = ("rewards", "group_index", "response_length", "truncated")
        light = [dataclasses.replace(t, prompt_ids=t.prompt_ids[:0], vision=None, images=[None] * len(t.images),
                                     sample=dataclasses.replace(t.sample, images=[None] * len(t.sample.images)))
                 for t in inputs.trajectories]
        parts = self.ctx.gather_objects({**{name: getattr(inputs, name) for name in tensors}, "trajectories": light})
        merged: dict[str, Any] = {name: torch.cat([p[name] for p in parts]) for name in tensors if name != "group_index"}
        shifted, offset = [], 0
        for p in parts:  # prompt ids are per rank: make them distinct
            shifted.append(p["group_index"] + offset)
            offset += int(p["group_index"].max()) + 1 if len(p["group_index"]) else 0
        merged["group_index"] = torch.cat(shifted)
        merged["trajectories"] = [t for p in parts for t in p["trajectories"]]
        values, metrics = self.chain.apply(dataclasses.replace(inputs, **merged))
        start = sum(len(p["rewards"]) for p in parts[: self.ctx.rank])
        return values[start : start + B], metrics


def _rows(value, start: int, count: int, width: int):
    if not isinstance(value, torch.Tensor):
        return value
    value = value[start : start + count]
    return value[:, :width] if value.dim() == 2 else value
