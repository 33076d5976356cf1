"""Experiment: clip-higher keeps token entropy up; dynamic sampling removes zero-advantage groups (DAPO §3.2.1–2).

    OMP_NUM_THREADS=1 python benchmarks/exp_clip_higher.py            # the full run (see docs/experiments/)
    OMP_NUM_THREADS=1 python benchmarks/exp_clip_higher.py --quick    # a smoke run (tiny numbers, ~1 min)
    OMP_NUM_THREADS=1 python benchmarks/exp_clip_higher.py --runs symmetric clip-higher \
        --lr 1e-4 --minibatches 8 --epochs 2      # 16 updates per rollout step: the upper clip binds, runs stay calm

On the shapes count + colour tasks (``--tasks``: others, e.g. ``locate --max-new-tokens 16``) with the tiny
Qwen2-VL preset:

1. SFT warm start from random weights (the same checkpoint for every run);
2. for each seed, three GRPO runs from that checkpoint with the same prompts and sampling seed:
   - ``symmetric``   PPO clip ε_low = ε_high = 0.2
   - ``clip-higher`` ε_low = 0.2, ε_high = 0.28 (DAPO)
   - ``dynamic``     clip-higher + dynamic sampling (drop all-equal groups, back-fill; DAPO eq. 11)
   Clipping only acts when the weights move within a rollout step, so every run takes several optimizer
   steps per batch (``--minibatches``, as DAPO does: 16 per rollout step); with one update per batch the
   ratio is exactly 1 and the two clips are the same run.
3. prints a table per seed and the mean over seeds: token entropy (mean over the first / last
   ``--window`` steps and over the whole run, and per window), clip fractions — the upper clip's also as a
   share of the positive-advantage tokens and of the low-probability ones (`ppo_clip_counted`) — reward,
   the largest KL to π_old and how many steps exceeded 1 nat, the fraction of zero-advantage groups in the
   update batches and the samples generated per step; then in how many seeds clip-higher's entropy was above
   symmetric's.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch

from vlrl.algos import LossOutput, PolicyLossInputs
from vlrl.algos.losses import ppo_clip
from vlrl.config import RLStage, SFTStage
from vlrl.data import generate
from vlrl.models import load_policy
from vlrl.report import MetricsLogger
from vlrl.rollout import HFEngine
from vlrl.train.common import seed_everything
from vlrl.train.loop import train_rl
from vlrl.train.sft import train_sft

RUNS = {
    "symmetric": {"algo": {"clip_low": 0.2, "clip_high": 0.2}},
    "clip-higher": {"algo": {"clip_low": 0.2, "clip_high": 0.28}},
    "dynamic": {"algo": {"clip_low": 0.2, "clip_high": 0.28,
                         "dynamic_sampling": {"enabled": True, "oversample": 1.0, "max_extra_rounds": 8}}},
}


def ppo_clip_counted(inputs: PolicyLossInputs, *, clip_low: float = 0.2, clip_high: float = 0.2) -> LossOutput:
    """`vlrl.algos.losses.ppo_clip` unchanged (same loss, same gradient), plus two token indicators so the
    upper clip's reach can be read per positive-advantage token (the metrics are masked means over tokens):

        pos_adv       A_t > 0                                  the tokens the upper clip can act on at all
        pos_adv_low_p A_t > 0 and π_old(y_t) < 1 / 1.28        tokens whose ratio can exceed 1.28 (p ≤ 1)

    ``clip_high / pos_adv`` is then the share of positive-advantage tokens whose gradient the upper clip
    removed; ``clip_high / pos_adv_low_p`` the share among the low-probability ones DAPO §3.2.1 is about.
    """
    out = ppo_clip(inputs, clip_low=clip_low, clip_high=clip_high)
    with torch.no_grad():
        positive = inputs.advantages > 0
        out.metrics["pos_adv"] = positive.float()
        out.metrics["pos_adv_low_p"] = (positive & (inputs.old_logp.exp() < 1.0 / 1.28)).float()
    return out


def rl_stage(args, changes: dict) -> RLStage:
    loss = "__main__:ppo_clip_counted" if __name__ == "__main__" else f"{__name__}:ppo_clip_counted"
    raw = {
        "rollout": {"n": args.n, "temperature": 1.0, "max_new_tokens": args.max_new_tokens},
        "algo": {"advantage": "grpo", "policy_loss": loss, "loss_agg": "token_mean", "kl_coef": 0.0},
        "optim": {"lr": args.lr},
        "train": {"steps": args.steps, "prompts_per_step": args.prompts, "minibatches": args.minibatches,
                  "ppo_epochs": args.epochs, "micro_batch_size": 128, "log_every": 1},
    }
    for section, values in changes.items():
        raw[section] = {**raw[section], **values}
    return RLStage.model_validate(raw)


def summarise(records: list[dict], window: int) -> dict[str, float]:
    def mean(key, rows):
        values = [r[key] for r in rows if key in r]
        return sum(values) / len(values) if values else float("nan")

    return {
        "entropy_first": mean("policy/entropy", records[:window]),
        "entropy_last": mean("policy/entropy", records[-window:]),
        "entropy_mean": mean("policy/entropy", records),
        "clip_low": mean("policy/clip_low", records),
        "clip_high": mean("policy/clip_high", records),
        "reward_first": mean("reward/mean", records[:window]),
        "reward_last": mean("reward/mean", records[-window:]),
        # the upper clip's share of the tokens it can act on (ratios of run means; see ppo_clip_counted)
        "clip_high_of_pos": mean("policy/clip_high", records) / max(mean("policy/pos_adv", records), 1e-12),
        "clip_high_of_low_p": mean("policy/clip_high", records) / max(mean("policy/pos_adv_low_p", records), 1e-12),
        "kl_old_max": max(r["policy/approx_kl_old"] for r in records),
        "kl_old_median": sorted(r["policy/approx_kl_old"] for r in records)[len(records) // 2],
        "kl_old_over_1": sum(r["policy/approx_kl_old"] > 1.0 for r in records),
        "zero_adv_mean": mean("policy/zero_adv_groups_frac", records),
        "zero_adv_max": max(r["policy/zero_adv_groups_frac"] for r in records),
        "samples_per_step": mean("sampling/samples_generated", records) if "sampling/samples_generated" in records[0]
        else records[0].get("_samples_per_step", float("nan")),
        "seconds": sum(r["perf/step_seconds"] for r in records),
    }


def print_table(title: str, rows: dict[str, dict[str, float]]) -> None:
    print(f"\n{title}")
    header = ("run", "H first", "H last", "H mean", "clip lo", "clip hi", "clip hi / A>0", "clip hi / A>0,p<.78",
              "R first", "R last", "KL_old max", "KL_old median", "steps KL_old>1", "zero-adv", "zero-adv max", "samples/step",
              "seconds")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    keys = ("entropy_first", "entropy_last", "entropy_mean", "clip_low", "clip_high", "clip_high_of_pos",
            "clip_high_of_low_p", "reward_first", "reward_last", "kl_old_max", "kl_old_median", "kl_old_over_1", "zero_adv_mean",
            "zero_adv_max", "samples_per_step", "seconds")
    for name, s in rows.items():
        cells = [f"{s[k]:.4f}" if k.startswith(("entropy", "clip")) else f"{s[k]:.0f}" if k == "kl_old_over_1"
                 else f"{s[k]:.3f}" for k in keys[:-2]]
        cells += [f"{s['samples_per_step']:.0f}", f"{s['seconds']:.0f}"]
        print(f"| {name} | " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny SFT and RL")
    parser.add_argument("--sft-steps", type=int, default=500)
    parser.add_argument("--steps", type=int, default=40, help="RL steps per run")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per RL step")
    parser.add_argument("--n", type=int, default=8, help="responses per prompt")
    parser.add_argument("--minibatches", type=int, default=4, help="optimizer steps per RL step")
    parser.add_argument("--epochs", type=int, default=1, help="passes over each rollout batch (ppo_epochs)")
    parser.add_argument("--lr", type=float, default=5e-4, help="RL learning rate")
    parser.add_argument("--tasks", nargs="+", default=["count", "color"],
                        help="shapes tasks (e.g. locate: a 4-number box, IoU reward); the warm start must match")
    parser.add_argument("--max-new-tokens", type=int, default=8, help="response budget (a locate answer is 12 tokens)")
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS), help="which runs to do")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--window", type=int, default=10, help="steps averaged for 'first' and 'last'")
    parser.add_argument("--out", default=None, help="write every run's per-step records to this JSON file")
    parser.add_argument("--log-dir", default=None,
                        help="also write each run's records as it goes, one JSONL per run (<run>_seed<seed>.jsonl)")
    parser.add_argument("--warm-start", default=None,
                        help="directory of the SFT checkpoint: loaded if it exists, else trained and saved there "
                        "(default runs/exp_clip_higher/sft<steps>)")
    args = parser.parse_args()
    if args.quick:
        args.sft_steps, args.steps, args.prompts, args.n, args.seeds, args.window = 30, 4, 4, 4, [0], 2

    t0 = time.time()
    seed_everything(0)
    train = generate("shapes", 4000, split="train", tasks=args.tasks)
    suffix = "" if args.tasks == ["count", "color"] else "_" + "-".join(args.tasks)
    warm_dir = Path(args.warm_start or f"runs/exp_clip_higher/sft{args.sft_steps}{suffix}")
    if not (warm_dir / "config.json").is_file():
        policy = load_policy("tiny-qwen2-vl")
        sft = SFTStage.model_validate({"optim": {"lr": 1e-3, "betas": [0.5, 0.9]},
                                       "train": {"steps": args.sft_steps, "batch_size": 32, "micro_batch_size": 32,
                                                 "log_every": 10**9}})
        sft_stats = train_sft(policy, train, sft, logger=MetricsLogger(None, quiet=True), seed=0)
        print(f"SFT warm start: {args.sft_steps} steps in {time.time() - t0:.0f}s, last loss "
              f"{sft_stats.metrics.get('sft/loss', float('nan')):.3f}; saved to {warm_dir}", flush=True)
        policy.save(warm_dir)
    policy = load_policy(str(warm_dir))  # always from disk: the first run and later ones start identically
    print(f"SFT warm start: {warm_dir}", flush=True)
    warm = copy.deepcopy(policy.model.state_dict())

    results: dict[int, dict[str, dict[str, float]]] = {}
    records_out: dict[str, list[dict]] = {}
    for seed in args.seeds:
        results[seed] = {}
        for name, changes in ((n, RUNS[n]) for n in args.runs):
            policy.model.load_state_dict(warm)
            seed_everything(seed)
            log_path = Path(args.log_dir) / f"{name}_seed{seed}.jsonl" if args.log_dir else None
            if log_path is not None:
                log_path.parent.mkdir(parents=True, exist_ok=True)
                log_path.unlink(missing_ok=True)
            logger = MetricsLogger(log_path, quiet=True)
            train_rl(policy, HFEngine(policy), train, rl_stage(args, changes), logger=logger, seed=seed)
            for r in logger.records:
                r.setdefault("_samples_per_step", args.prompts * args.n)
            results[seed][name] = summarise(logger.records, args.window)
            curve = [logger.records[i : i + args.window] for i in range(0, len(logger.records), args.window)]
            print(f"seed {seed} {name}: entropy by {args.window}-step window "
                  + " ".join(f"{sum(r['policy/entropy'] for r in w) / len(w):.3f}" for w in curve), flush=True)
            records_out[f"{name}/seed{seed}"] = logger.records
        print_table(f"seed {seed}: {args.steps} GRPO steps × {args.prompts} prompts × {args.n} samples, "
                    f"{args.minibatches} minibatches × {args.epochs} epochs, lr {args.lr}", results[seed])
        print(flush=True)
    if len(args.seeds) > 1:
        mean_rows = {name: {k: sum(results[s][name][k] for s in args.seeds) / len(args.seeds)
                            for k in results[args.seeds[0]][name]} for name in args.runs}
        print_table(f"mean over seeds {args.seeds}", mean_rows)
    if {"symmetric", "clip-higher"} <= set(args.runs):
        for key, what in (("entropy_mean", "mean over the run"), ("entropy_last", f"last {args.window} steps")):
            wins = sum(results[s]["clip-higher"][key] > results[s]["symmetric"][key] for s in args.seeds)
            diffs = " ".join(f"{results[s]['clip-higher'][key] - results[s]['symmetric'][key]:+.4f}" for s in args.seeds)
            print(f"\nclip-higher entropy ({what}) above symmetric in {wins}/{len(args.seeds)} seeds; "
                  f"differences per seed: {diffs}")
    if "dynamic" in args.runs:
        print(f"dynamic sampling: max zero-advantage fraction in any update batch "
              f"{max(results[s]['dynamic']['zero_adv_max'] for s in args.seeds):.3f}")
    print(f"total {time.time() - t0:.0f}s")
    if args.out:
        Path(args.out).write_text(json.dumps(records_out, indent=1))


if __name__ == "__main__":
    torch.set_num_threads(max(1, torch.get_num_threads()))
    main()
