"""PPO with GAE (a critic) on 2 ranks (and on 1): `train_rl` (the synchronous feed) with a scripted engine (responses fixed per prompt,
so both runs see the same rewards) and the tiny policy, over gloo. Run by tests/train/test_gae_ranks.py:

    torchrun --standalone --nproc_per_node 2 tests/train/dist_gae_worker.py MODEL_DIR OUT_FILE fsdp|ddp

Rank 0 writes OUT_FILE: {"records": the logged metrics per step, "actor": the final full weights of the policy,
"critic": the final full weights of the value model}.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dist_dynamic_worker import TokenEngine  # noqa: E402
from fakes import scripted_samples  # noqa: E402

from vlrl.config import RLConfig  # noqa: E402
from vlrl.models import load_policy  # noqa: E402
from vlrl.report import MetricsLogger  # noqa: E402
from vlrl.train.distributed import init_distributed, shutdown_distributed, unwrap  # noqa: E402
from vlrl.train.loop import train_rl  # noqa: E402
from vlrl.train.runtime import make_runtime  # noqa: E402

# answer "a"; responses of different lengths (1–4 tokens), so GAE's per-token advantages and the whitening over
# the batch's tokens differ from a per-rank whitening. 8 prompts, 2 steps of 4 prompts × 4 responses: 16 per step,
# 8 per rank; micro-batches of 3 (3+3+3+3+3+1 on 1 rank, 3+3+2 on each of 2).
SPECS = [("a", ["a", "bb", "abc", "a"], "a"), ("a", ["b", "aaaa"], "b"), ("a", ["a", "ba", "bc", "c"], "a"),
         ("a", ["cab", "a"], "b"), ("a", ["b", "bb", "a", "aa"], "a"), ("a", ["ab", "a", "cc"], "a"),
         ("a", ["a", "bcb", "b"], "a"), ("a", ["ccc", "a", "b", "abab"], "b")]


def config(strategy: str = "fsdp") -> RLConfig:
    """configs/shapes_ppo.yaml's algorithm (GAE γ = 1, λ = 0.95 whitened, clipped PPO, k1 KL in the reward,
    clipped value loss) at test size; 2 PPO epochs, so the second reuses π_old and the critic's old values.
    Text-only prompts: the vision tower gets no gradient (DDP must be told). The plain teacher-forced pass on 1
    rank too (train.shared_prefix off): a DDP / FSDP2 update cannot share a prompt, and after 4 Adam steps the
    float-order difference of the shared pass (losses equal to 2e-7) moves a near-zero-gradient weight by ~4e-5."""
    return RLConfig.model_validate({
        "train": {"steps": 2, "prompts_per_step": 4, "micro_batch_size": 3, "ppo_epochs": 2, "log_every": 1,
                  "shared_prefix": False},
        "rollout": {"n": 4, "max_new_tokens": 4}, "optim": {"lr": 1e-3},
        "algo": {"advantage": "gae", "advantage_options": {"gamma": 1.0, "lam": 0.95}, "policy_loss": "ppo_clip",
                 "kl_coef": 0.01, "kl_mode": "reward", "kl_estimator": "k1"},
        "critic": {"lr": 1e-3, "value_clip": 0.2},
        "dist": {"strategy": strategy, "find_unused_parameters": strategy == "ddp"}})


def full(module: torch.nn.Module) -> dict:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()  # FSDP2: gathered
            for k, v in unwrap(module).state_dict().items()}


def run(model_dir: str, strategy: str, run_dir: str) -> tuple[list[dict], dict, dict, int]:
    """The run as `vlrl rl` builds it (`make_runtime`: the reference and the critic copied before the actor is
    sharded, each wrapped like it); one process when there is no torchrun environment."""
    cfg = config(strategy)
    ctx = init_distributed(cfg.dist)
    policy = load_policy(model_dir)
    rt = make_runtime(cfg, ctx, policy, run_dir)
    logger = MetricsLogger(None, quiet=True)
    train_rl(policy, TokenEngine(), scripted_samples(SPECS), cfg, logger=logger, seed=0, runtime=rt)
    out = logger.records, full(rt.module), full(rt.critic), rt.ctx.rank
    shutdown_distributed(ctx)
    return out


def main(model_dir: str, out_file: str, strategy: str) -> None:
    records, actor, critic, rank = run(model_dir, strategy, str(Path(out_file).parent / "run"))
    if rank == 0:
        torch.save({"records": records, "actor": actor, "critic": critic}, out_file)


if __name__ == "__main__":
    main(*sys.argv[1:4])
