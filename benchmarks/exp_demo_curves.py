"""Learning curves behind the demo configuration (docs/experiments/demo.md): held-out accuracy of SFT, of RL
and of the SFT control as a function of steps, so that one run gives the control at every budget.

Three kinds of run, each appending one JSON record per evaluation to ``--out`` (a jsonl file):

    sft      the demo's SFT stage (``sft.train.max_samples`` labels) from the untrained preset, evaluated at
             ``--eval-at`` steps; checkpoints saved at ``--save-at`` steps under ``--ckpt-dir``
    rl       the demo's RL stage from a saved SFT checkpoint (``--init``), evaluated at ``--eval-at`` steps
    control  more SFT on the same labels from a saved SFT checkpoint (fresh optimizer, seed + 1 — what
             `vlrl demo`'s control does), evaluated at ``--eval-at`` steps

An ``rl`` run with ``--set rl.algo.distill.teacher=DIR`` distils from that teacher (on-policy distillation,
docs/experiments/opd.md): ``flops`` stays the student's (its forward hooks), the teacher's passes are counted
apart under ``teacher_flops``.

Every run starts from ``src/vlrl/configs/demo.yaml`` with dotted overrides (``--set rl.optim.lr=1e-4``), so
its settings are the demo's unless stated. Evaluations save and restore the torch RNG: the training run is
the one it would be without them. One torch thread unless ``--threads``.

    OMP_NUM_THREADS=1 python benchmarks/exp_demo_curves.py sft --tag L100 --set sft.train.max_samples=100 \\
        --eval-at 100 200 400 --save-at 200 400 --out runs/explore/curves.jsonl
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from vlrl.config import DemoConfig, load_config
from vlrl.data.splits import load_split
from vlrl.eval import evaluate
from vlrl.models import load_policy
from vlrl.report import MetricsLogger
from vlrl.rollout import HFEngine
from vlrl.train.budget import FlopMeter
from vlrl.train.common import seed_everything
from vlrl.train.loop import train_rl
from vlrl.train.sft import train_sft

DEMO = Path(__file__).resolve().parents[1] / "src" / "vlrl" / "configs" / "demo.yaml"


class EvalLogger(MetricsLogger):
    """A quiet logger that evaluates the policy when the loop logs one of the chosen steps."""

    def __init__(self, on_step) -> None:
        super().__init__(None, quiet=True, progress="off")
        self.on_step = on_step

    def log(self, stage, step, metrics, *, show=()):
        super().log(stage, step, metrics, show=show)
        self.on_step(step, metrics)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=["sft", "rl", "control"])
    parser.add_argument("--tag", required=True, help="name of this run in the records")
    parser.add_argument("--set", nargs="*", default=[], help="dotted overrides of the demo config")
    parser.add_argument("--init", help="rl / control: the SFT checkpoint to start from")
    parser.add_argument("--steps", type=int, help="steps to train (default: the last --eval-at)")
    parser.add_argument("--eval-at", type=int, nargs="+", required=True)
    parser.add_argument("--save-at", type=int, nargs="*", default=[])
    parser.add_argument("--ckpt-dir", default="runs/explore/ckpt")
    parser.add_argument("--out", default="runs/explore/curves.jsonl")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokenizer", help="use this preset's tokenizer instead of the checkpoint's (--init) and "
                        "the teacher's: a saved tiny-qwen2 text checkpoint reloads with transformers' Qwen2Tokenizer, "
                        "which splits numbers into digits where the preset's tokenizer.json does not (docs/experiments/opd.md)")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    cfg = load_config(DemoConfig, DEMO, args.set)
    train, test = load_split(cfg.data, "train"), load_split(cfg.data, "test")
    seed_everything(cfg.seed)
    policy = load_policy(args.init or cfg.model.path, seed=cfg.model.init_seed)
    if args.tokenizer:
        use_tokenizer(policy, load_policy(args.tokenizer).tokenizer)
    engine = HFEngine(policy, max_batch_size=cfg.rl.rollout.engine.max_batch_size)
    steps = args.steps or max(args.eval_at)
    eval_at, save_at = set(args.eval_at), set(args.save_at)
    start = time.time()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    meter = FlopMeter(policy.model).__enter__()  # training + generation FLOPs of the run, evaluations excluded
    excluded = [0.0]
    teacher_meters = count_teacher_flops()  # algo.distill's teacher: its passes apart from the student's

    def record(step: int, metrics: dict) -> None:
        if step in save_at:
            policy.save(Path(args.ckpt_dir) / f"{args.tag}_{step}")
        if step not in eval_at:
            return
        rng, before = torch.get_rng_state(), meter.flops.total
        t0 = time.time()
        result = evaluate(engine, test, cfg.eval).to_dict(examples=False)
        torch.set_rng_state(rng)
        excluded[0] += meter.flops.total - before
        row = {"kind": args.kind, "tag": args.tag, "step": step, "sampled": result["accuracy"]["mean"],
               "greedy": result["greedy"]["mean"], f"pass@{result['k']}": result["pass@k"]["mean"],
               "strict": result["strict"]["mean"], "strict_greedy": result["strict_greedy"]["mean"],
               "well_formed": result["well_formed"]["mean"], "well_formed_greedy": result["well_formed_greedy"]["mean"],
               "train_seconds": round(time.time() - start, 1), "eval_seconds": round(time.time() - t0, 1),
               "flops": meter.flops.total - excluded[0],
               "teacher_flops": sum(m.flops.total for m in teacher_meters), "threads": args.threads, "init": args.init, "set": args.set,
               **{k: round(float(v), 4) for k, v in metrics.items()
                  if k in ("sft/loss", "reward/mean", "response/well_formed_frac", "response/truncated_frac",
                           "policy/entropy", "policy/zero_adv_groups_frac", "distill/reverse_kl", "distill/teacher_logprob",
                           "distill/agreement",
                           "policy/skipped_rows_frac", "perf/step_seconds", "perf/gen_seconds")}}
        with open(out, "a") as handle:
            handle.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)

    logger = EvalLogger(record)
    if 0 in eval_at:
        record(0, {})
    if args.kind == "rl":
        stage = cfg.rl.model_copy(deep=True)
        stage.train.steps, stage.train.log_every = steps, 1
        train_rl(policy, engine, train, stage, logger=logger, seed=cfg.seed)
    else:
        stage = cfg.sft.model_copy(deep=True)
        stage.train.steps, stage.train.log_every = steps, 1
        train_sft(policy, train, stage, logger=logger, seed=cfg.seed + (1 if args.kind == "control" else 0))


def count_teacher_flops() -> list[FlopMeter]:
    """Install a `FlopMeter` on every distillation teacher the RL stage loads (`vlrl.train.batch.load_teacher`);
    the returned list fills as teachers load."""
    import vlrl.train.batch as batch

    meters: list[FlopMeter] = []
    load = batch.load_teacher

    def load_and_count(spec, policy):
        teacher = load(spec, policy)  # it scores the student's token ids: its own tokenizer is only compared
        meters.append(FlopMeter(teacher.model).__enter__())
        return teacher

    batch.load_teacher = load_and_count
    return meters


def use_tokenizer(policy, tokenizer) -> None:
    """``policy`` encodes and decodes with ``tokenizer`` (the same vocabulary, another pre-tokenizer)."""
    if tokenizer.get_vocab() != policy.tokenizer.get_vocab():
        raise ValueError("--tokenizer: another vocabulary than the checkpoint's")
    policy.tokenizer = policy.adapter.tokenizer = tokenizer


if __name__ == "__main__":
    main()
