"""The 2-rank side of tests/train/test_lean_start.py, run once under torchrun (gloo on loopback):

    torchrun --standalone --nproc_per_node 2 tests/train/dist_start_worker.py MODEL_DIR OUT_DIR

Writes into OUT_DIR, per rank r:
    shards_{full,lean}_{plain,lora}_r.pt   this rank's local FSDP2 shards (and buffers) of the actor and of the KL
                                           reference after `make_runtime` — every rank loading the model
                                           (dist.rank0_load=false) or rank 1 built on the meta device and sent its
                                           shards by rank 0 (true); plain and with model.lora
    meta_r.pt                              whether this rank's policy was built on the meta device (lean start)
    offload_{on,off}_r.pt                  one SFT step under FSDP2 with and without dist.cpu_offload: the full
                                           gradients, this rank's shards after the AdamW step, where the shards
                                           live, and the offload policy fully_shard got
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dist_helpers import MICRO, grads_of, sft_batch, sft_stage  # noqa: E402

from vlrl.config import DistConfig, RLConfig, load_config  # noqa: E402
from vlrl.models import load_policy  # noqa: E402
from vlrl.recipes.run import load_run_policy  # noqa: E402
from vlrl.report import MetricsLogger  # noqa: E402
from vlrl.train.common import clip_and_step, make_optimizer  # noqa: E402
from vlrl.train.distributed import init_distributed, shutdown_distributed, wrap_model  # noqa: E402
from vlrl.train.runtime import Runtime, make_runtime  # noqa: E402
from vlrl.train.sft import sft_backward  # noqa: E402


def local_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's shards (DTensor → its local tensor) and buffers, by name."""
    out = {}
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        out[name] = local.detach().clone()
    return out


def start(model_dir: str, out: Path, ctx, *, lean: bool, lora: bool) -> None:
    overrides = [f"model.path={model_dir}", "dist.strategy=fsdp", f"dist.rank0_load={str(lean).lower()}",
                 "algo.kl_coef=0.05", f"out={out / 'unused'}"] + (["model.lora.r=4"] if lora else [])
    cfg = load_config(RLConfig, None, overrides)
    policy = load_run_policy(cfg, MetricsLogger(None, quiet=True), ctx)  # the recipes' own start-up
    built_on_meta = next(policy.model.parameters()).is_meta
    rt = make_runtime(cfg, ctx, policy, out / "unused")  # the reference is copied and sharded before the actor
    name = f"{'lean' if lean else 'full'}_{'lora' if lora else 'plain'}"
    torch.save({"actor": local_state(rt.module), "reference": local_state(rt.reference) if rt.reference else {}},
               out / f"shards_{name}_{ctx.rank}.pt")
    if lean and not lora:
        torch.save(built_on_meta, out / f"meta_{ctx.rank}.pt")


def offload_step(model_dir: str, out: Path, ctx, *, offload: bool) -> None:
    from torch.distributed.fsdp import FSDPModule

    cfg = DistConfig(strategy="fsdp", cpu_offload=offload)
    policy = load_policy(model_dir)
    module = wrap_model(policy.model, ctx, cfg)
    rt = Runtime(ctx, module, cfg)
    module.train()
    optimizer, scheduler = make_optimizer(module, sft_stage().optim)
    sft_backward(policy, rt, ctx.shard(sft_batch(policy), what="batch"), MICRO)
    grads = grads_of(module)
    clip_and_step(module, optimizer, scheduler, 1.0, ctx=ctx)
    policies = {type(m._get_fsdp_state()._fsdp_param_group.offload_policy).__name__
                for m in module.modules() if isinstance(m, FSDPModule) and m._get_fsdp_state()._fsdp_param_group}
    torch.save({"grads": grads, "shards": local_state(module), "policies": sorted(policies),
                "devices": sorted({p.to_local().device.type for p in module.parameters()})},
               out / f"offload_{'on' if offload else 'off'}_{ctx.rank}.pt")


def main(model_dir: str, out: str) -> None:
    out_dir = Path(out)
    ctx = init_distributed(DistConfig())
    for lora in (False, True):
        for lean in (False, True):
            start(model_dir, out_dir, ctx, lean=lean, lora=lora)
    for offload in (False, True):
        offload_step(model_dir, out_dir, ctx, offload=offload)
    shutdown_distributed(ctx)


if __name__ == "__main__":
    main(*sys.argv[1:3])
