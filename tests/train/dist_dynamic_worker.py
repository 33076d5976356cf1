"""DAPO dynamic sampling on 2 ranks (and on 1): `train_rl` (the synchronous feed) with a scripted engine (responses fixed per prompt, so
both runs see the same rewards) and the tiny policy, FSDP2 over gloo. Run by tests/train/test_dynamic_ranks.py:

    torchrun --standalone --nproc_per_node 2 tests/train/dist_dynamic_worker.py MODEL_DIR OUT_FILE

Rank 0 writes OUT_FILE: {"records": the logged metrics per step, "state": the final full weights}.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fakes import ScriptedEngine, scripted_samples  # noqa: E402

from vlrl.config import DistConfig, RLStage  # noqa: E402
from vlrl.models import load_policy  # noqa: E402
from vlrl.report import MetricsLogger  # noqa: E402
from vlrl.train.distributed import init_distributed, shutdown_distributed, unwrap, wrap_model  # noqa: E402
from vlrl.train.loop import train_rl  # noqa: E402
from vlrl.train.runtime import Runtime  # noqa: E402

# answer "a": prompts whose 4 responses all agree (all "a" or all "b") are uninformative and dropped; the others
# are kept. 12 prompts: the cursor goes around (reshuffled per epoch) within 3 steps. Micro-batches of 3 split the
# 16 responses of a step differently on 1 rank (3+3+3+3+3+1) and on 2 (3+3+2 each): the logged numbers must not care.
SPECS = [("a", ["a", "bb"], "a"), ("a", ["b"], "b"), ("a", ["a", "a", "bc"], "a"), ("a", ["a"], "a"),
         ("a", ["cb", "a"], "b"), ("a", ["b", "b", "b", "a"], "a"), ("a", ["b"], "a"), ("a", ["a", "b", "cc"], "b"),
         ("a", ["a"], "b"), ("a", ["b", "a", "a"], "a"), ("a", ["b"], "b"), ("a", ["a", "bcb"], "a")]


class TokenEngine(ScriptedEngine):
    """`ScriptedEngine` whose response tokens spell the response (a → 101, b → 102, …): different answers are
    different sequences, so a group's advantages do not cancel in the gradient."""

    def generate(self, requests, sampling):
        out = super().generate(requests, sampling)
        for t in out:
            t.response_ids = torch.tensor([4 + ord(c) for c in t.response_text])
        return out


def stage() -> RLStage:
    return RLStage.model_validate({
        "train": {"steps": 3, "prompts_per_step": 4, "micro_batch_size": 3, "log_every": 1},
        "rollout": {"n": 4, "max_new_tokens": 4}, "optim": {"lr": 1e-3},
        "algo": {"dynamic_sampling": {"enabled": True, "oversample": 1.5, "max_extra_rounds": 3}}})


def run(model_dir: str, runtime_for) -> tuple[list[dict], dict, int]:
    policy = load_policy(model_dir)
    rt = runtime_for(policy)
    logger = MetricsLogger(None, quiet=True)
    train_rl(policy, TokenEngine(), scripted_samples(SPECS), stage(), logger=logger, seed=0, runtime=rt)
    state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()  # FSDP2: gathered
             for k, v in unwrap(rt.module).state_dict().items()}
    return logger.records, state, rt.ctx.rank


def main(model_dir: str, out_file: str) -> None:
    cfg = DistConfig(strategy="fsdp")
    ctx = init_distributed(cfg)
    records, state, rank = run(model_dir, lambda policy: Runtime(ctx, wrap_model(policy.model, ctx, cfg), cfg))
    if rank == 0:
        torch.save({"records": records, "state": state}, out_file)
    shutdown_distributed(ctx)


if __name__ == "__main__":
    main(*sys.argv[1:3])
