"""Experiment: the Syn-GRPO seed's comparison at tiny scale — GRPO, Entropy Loss, Entropy Adv., Clip-Higher,
Clip-Cov, KL-Cov and Syn-GRPO on the same task, seeds and steps (docs/experiments/entropy_methods.md).

    python benchmarks/exp_entropy_methods.py                       # SFT warm start, then 7 arms x 3 seeds
    python benchmarks/exp_entropy_methods.py --table-only          # print the table of the runs already finished

1. Data: shapes ``count`` + ``color`` rewritten to the Syn-GRPO template without ``<think>`` (every arm answers in
   it, so Syn-GRPO's descriptions exist and the task is the same for all; reward ``{number | multiple_choice: 1,
   syn_format: 1}``).
2. One SFT warm start of ``tiny-qwen2-vl`` on templated samples (it learns the format), shared by every run.
3. RL from that checkpoint, per seed, each arm with the same steps, batch, learning rate and 2 minibatches per
   step (so the ratio leaves 1 and the clip- and KL-based mechanisms can act):
   - ``grpo``: PPO clip 0.2 / 0.2;  ``clip_higher``: 0.2 / 0.28;
   - ``entropy_loss``: ``entropy_bonus`` (β below);  ``entropy_adv``: ``entropy_advantage`` (α 0.4, κ 2);
   - ``clip_cov`` / ``kl_cov``: the covariance losses, selection fraction scaled up (tiny batches: the papers'
     2e-4 / 2e-3 of ~1.6k tokens would pick 1–3 tokens);
   - ``syn_grpo``: GRPO + the ``syn_diversity`` reward (γ 0.7) + asynchronous synthesis (classical back-end).
4. The table: held-out sampled accuracy after RL, token entropy (``policy/entropy``) and answer diversity V(q)
   (``rollout/diversity``, Syn-GRPO eq. 4) averaged over the last third of the steps — mean ± standard error over
   seeds. Each finished run writes OUT/<arm>/seed<k>/summary.json, so a run cut short still reports what finished.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

ARMS: dict[str, dict] = {
    "grpo": {"algo": {"policy_loss": "ppo_clip", "clip_high": 0.2}},
    "entropy_loss": {"algo": {"policy_loss": "entropy_bonus", "clip_high": 0.2, "policy_loss_options": {"coef": 0.01}}},
    "entropy_adv": {"algo": {"policy_loss": "entropy_advantage", "clip_high": 0.2,
                             "policy_loss_options": {"alpha": 0.4, "kappa": 2.0}}},
    "clip_higher": {"algo": {"policy_loss": "ppo_clip", "clip_high": 0.28}},
    "clip_cov": {"algo": {"policy_loss": "clip_cov", "clip_high": 0.2, "policy_loss_options": {"fraction": 0.02}}},
    "kl_cov": {"algo": {"policy_loss": "kl_cov", "clip_high": 0.2, "policy_loss_options": {"fraction": 0.02}}},
    "syn_grpo": {"algo": {"policy_loss": "ppo_clip", "clip_high": 0.2,
                          "reward_shaping": [{"name": "syn_diversity", "options": {"gamma": 0.7}}]},
                 "synth": {"synthesize": True, "backend": "classical", "segmenter": "border", "mode": "async",
                           "preserve": "objects", "max_generations": 5}},
}
LABELS = {"grpo": "GRPO", "entropy_loss": "Entropy Loss", "entropy_adv": "Entropy Adv.", "clip_higher": "Clip-Higher",
          "clip_cov": "Clip-Cov", "kl_cov": "KL-Cov", "syn_grpo": "Syn-GRPO"}


def mean_se(values: list[float]) -> tuple[float, float]:
    values = [v for v in values if v == v]
    if not values:
        return float("nan"), float("nan")
    m = sum(values) / len(values)
    if len(values) < 2:
        return m, float("nan")
    var = sum((v - m) ** 2 for v in values) / (len(values) - 1)
    return m, math.sqrt(var / len(values))


def last_third(records: list[dict], key: str) -> float:
    rows = [float(r[key]) for r in records if key in r]
    if not rows:
        return float("nan")
    tail = rows[-max(1, len(rows) // 3):]
    return sum(tail) / len(tail)


def run_row(run: Path) -> dict | None:
    """The numbers of one finished run (None while it has no summary)."""
    if not (run / "summary.json").exists():
        return None
    summary = json.loads((run / "summary.json").read_text())
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in records if r["stage"] == "rl"]
    own = {}
    for key in ("policy/entropy_bonus", "policy/entropy_adv", "policy/clip_cov", "policy/kl_cov", "policy/clip_high",
                "synth/submitted"):
        if any(key in r for r in rl):
            own[key] = sum(float(r.get(key, 0.0)) for r in rl) / len(rl)
    return {"heldout": summary["rl"]["accuracy"]["mean"], "heldout_initial": summary["initial"]["accuracy"]["mean"],
            "entropy": last_third(rl, "policy/entropy"), "entropy_first": float(rl[0]["policy/entropy"]),
            "diversity": last_third(rl, "rollout/diversity"), "train_acc": last_third(rl, "accuracy/mean"),
            "steps": len(rl), "own": own}


def table(out: Path) -> None:
    print("| method | seeds | held-out acc. (initial → after) | entropy (step 1 → last third) | V(q) last third | "
          "train acc. last third | its own metric (mean over steps) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for arm in ARMS:
        rows = [row for run in sorted((out / arm).glob("seed*")) if (row := run_row(run)) is not None]
        if not rows:
            print(f"| {LABELS[arm]} | 0 | not run | | | | |")
            continue
        fmt = lambda key, rows=rows: "{:.3f} ± {:.3f}".format(*mean_se([r[key] for r in rows]))  # noqa: E731
        initial, _ = mean_se([r["heldout_initial"] for r in rows])
        entropy_first, _ = mean_se([r["entropy_first"] for r in rows])
        own = {k: mean_se([r["own"].get(k, float("nan")) for r in rows])[0] for k in rows[0]["own"]}
        own_text = ", ".join(f"{k.split('/')[1]} {v:.3g}" for k, v in own.items())
        print(f"| {LABELS[arm]} | {len(rows)} ({rows[0]['steps']} steps) | {initial:.3f} → {fmt('heldout')} | "
              f"{entropy_first:.3f} → {fmt('entropy')} | {fmt('diversity')} | {fmt('train_acc')} | {own_text} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/exp_entropy_methods")
    parser.add_argument("--sft-steps", type=int, default=80)
    parser.add_argument("--sft-lr", type=float, default=3e-3)
    parser.add_argument("--steps", type=int, default=10, help="RL steps per run")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per RL step")
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--n-train", type=int, default=64, help="RL training prompts")
    parser.add_argument("--n-test", type=int, default=24, help="held-out prompts (x 2 samples each)")
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--arms", default=",".join(ARMS), help="comma-separated subset of " + ",".join(ARMS))
    parser.add_argument("--table-only", action="store_true")
    args = parser.parse_args()
    out = Path(args.out)
    if args.table_only:
        table(out)
        return
    import torch

    torch.set_num_threads(1)
    from vlrl.config import RLConfig, SFTConfig
    from vlrl.data import generate
    from vlrl.data.io import write_samples
    from vlrl.recipes import run_rl, run_sft
    from vlrl.synth.workflow import apply_syn_template

    start = time.time()
    data = out / "data"
    templated = lambda split, n: [apply_syn_template(s, template="short")  # noqa: E731
                                  for s in generate("shapes", n, split=split, tasks=["count", "color"], seed=0)]
    sft_data = templated("train", 2000)
    write_samples(sft_data, data / "sft.jsonl")
    write_samples(sft_data[: args.n_train], data / "rl.jsonl")
    write_samples(templated("test", args.n_test), data / "test.jsonl")
    common = {"data": {"test": str(data / "test.jsonl")}, "report": {"progress": "off", "html": False},
              "eval": {"samples": 2, "max_new_tokens": 64}, "check": {"enabled": False}}
    checkpoint = out / "sft" / "checkpoints" / "final"
    if not (checkpoint / "config.json").exists():
        run_sft(SFTConfig.model_validate({**common, "data": {**common["data"], "train": str(data / "sft.jsonl")},
                                          "train": {"steps": args.sft_steps, "batch_size": 16, "log_every": 20},
                                          "optim": {"lr": args.sft_lr}, "out": str(out / "sft")}))
        print(f"SFT done in {(time.time() - start) / 60:.1f} min", flush=True)
    for seed in range(args.seeds):  # seed-major: a cut-short run still has every arm at the first seeds
        for arm in args.arms.split(","):
            run = out / arm / f"seed{seed}"
            if (run / "summary.json").exists():
                continue
            spec = ARMS[arm]
            synth = {"enabled": True, "template": "none", "synthesize": False, **spec.get("synth", {})}
            cfg = RLConfig.model_validate({
                **common, "seed": seed, "model": {"path": str(checkpoint)},
                "data": {**common["data"], "train": str(data / "rl.jsonl")},
                "rollout": {"n": args.n, "max_new_tokens": 64, "temperature": 1.0},
                "algo": {"loss_agg": "seq_mean_token_mean", "clip_low": 0.2, **spec["algo"]},
                "optim": {"lr": args.lr},
                "train": {"steps": args.steps, "prompts_per_step": args.prompts, "minibatches": 2,
                          "micro_batch_size": args.prompts * args.n, "log_every": 1},
                "synth": synth, "out": str(run),
            })
            t0 = time.time()
            run_rl(cfg)
            print(f"{arm} seed {seed}: {(time.time() - t0) / 60:.1f} min", flush=True)
    table(out)
    print(f"\nwall time {(time.time() - start) / 60:.1f} min")


if __name__ == "__main__":
    main()
