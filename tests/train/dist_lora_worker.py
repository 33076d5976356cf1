"""The 2-rank side of tests/train/test_lora_fsdp.py: ``model.lora`` under FSDP2 on 2 gloo ranks.

    torchrun --standalone --nproc_per_node 2 tests/train/dist_lora_worker.py MODEL_DIR OUT_DIR

Reads OUT_DIR/trajectories.pt (`dist_helpers.rl_trajectories`); rank 0 writes OUT_DIR/lora_fsdp.pt:
    reference    this rank's rows scored by π_ref (`reference_model`: the sharded policy, adapters disabled), and
    adapted      by the policy (adapters on), before training — rank 0's rows and rank 1's, in rank order
    grads        `dist_helpers.lora_steps` on this rank's half: the first step's full gradients,
    adapters     and the full adapters after the last step
    ranks_equal  whether both ranks hold the same full adapters
and OUT_DIR/export/ (`vlrl.train.checkpoint.export_hf` after those steps: merged weights + adapter/).
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dist_helpers import lora_policy, lora_steps  # noqa: E402

from vlrl.config import DistConfig  # noqa: E402
from vlrl.models.forward import score
from vlrl.train.batch import reference_model  # noqa: E402
from vlrl.train.checkpoint import export_hf  # noqa: E402
from vlrl.train.distributed import init_distributed, shutdown_distributed, wrap_model  # noqa: E402
from vlrl.train.runtime import Runtime  # noqa: E402


def main(model_dir: str, out: str) -> None:
    out_dir = Path(out)
    cfg = DistConfig(strategy="fsdp")
    ctx = init_distributed(cfg)
    policy = lora_policy(model_dir)
    rt = Runtime(ctx, wrap_model(policy.model, ctx, cfg), cfg)
    trajectories = ctx.shard(torch.load(out_dir / "trajectories.pt", weights_only=False), what="trajectories")
    with torch.no_grad():
        reference = score(reference_model(policy), policy, trajectories, 1.0)
        adapted = score(policy.model, policy, trajectories, 1.0)
    grads, adapters = lora_steps(policy, trajectories, rt.module, rt)
    adapters = {name: weight.full_tensor() for name, weight in adapters.items()}  # DTensor shards → full (collective)
    everyone = ctx.gather_objects({"adapters": adapters, "reference": reference, "adapted": adapted})
    export_hf(policy, rt.module, out_dir / "export", ctx)
    if ctx.is_main:
        torch.save({"grads": grads, "adapters": adapters,
                    "ranks_equal": all(torch.equal(everyone[0]["adapters"][k], everyone[1]["adapters"][k]) for k in adapters),
                    "reference": [e["reference"] for e in everyone], "adapted": [e["adapted"] for e in everyone],
                    "sharded": all(hasattr(p, "full_tensor") for p in policy.model.parameters())},
                   out_dir / "lora_fsdp.pt")
    shutdown_distributed(ctx)


if __name__ == "__main__":
    main(*sys.argv[1:3])
