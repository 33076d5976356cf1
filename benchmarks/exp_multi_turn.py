"""Multi-turn GRPO on ``shapes_feedback`` through the CLI: does the reward rise and ``agent/turns_mean`` fall as the
model learns to answer right the first time? (docs/experiments/multi_turn.md)

    1. vlrl sft --config configs/shapes_sft.yaml train.steps=N                     the warm start
    2. vlrl rl  --config configs/shapes_feedback_grpo.yaml model.path=<1>/checkpoints/final train.steps=M

then a table of the RL run's metrics.jsonl in windows of steps: reward, first-turn accuracy (the share of episodes
that ended on turn 1, the environment's "done" on a right answer), turns per episode, and the held-out evaluation
before and after (greedy and sampled, episodes of up to 3 turns, the final answer scored).

    OMP_NUM_THREADS=1 python benchmarks/exp_multi_turn.py --out runs/exp_multi_turn
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(*args: str) -> float:
    start = time.time()
    subprocess.run([sys.executable, "-m", "vlrl.cli", *args], check=True, cwd=REPO,
                   env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    return time.time() - start


def records(path: Path, stage: str) -> list[dict]:
    lines = (path / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["stage"] == stage]


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/exp_multi_turn")
    parser.add_argument("--sft-steps", type=int, default=400)
    parser.add_argument("--rl-steps", type=int, default=80)
    parser.add_argument("--window", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-sft", action="store_true", help="reuse OUT/sft")
    parser.add_argument("--rl", nargs="*", default=[], help="extra overrides of the RL run, e.g. optim.lr=5e-4")
    parser.add_argument("--rl-name", default="rl", help="the RL run's directory under OUT (several arms, one SFT)")
    args = parser.parse_args()
    out = Path(args.out)
    seconds = {}
    if not args.skip_sft:
        seconds["sft"] = run("sft", "--config", "configs/shapes_sft.yaml", f"train.steps={args.sft_steps}",
                             "train.log_every=50", f"seed={args.seed}", f"out={out / 'sft'}")
    seconds["rl"] = run("rl", "--config", "configs/shapes_feedback_grpo.yaml",
                        f"model.path={out / 'sft' / 'checkpoints' / 'final'}", f"train.steps={args.rl_steps}",
                        "train.log_every=1", f"seed={args.seed}", *args.rl, f"out={out / args.rl_name}")
    rl = records(out / args.rl_name, "rl")
    print(f"\nRL steps {len(rl)}; wall seconds {seconds}")
    print("| steps | reward/mean | accuracy/mean | right on turn 1 | agent/turns_mean | response tokens |")
    print("| --- | --- | --- | --- | --- | --- |")
    for start in range(0, len(rl), args.window):
        w = rl[start : start + args.window]
        print(f"| {w[0]['step']}–{w[-1]['step']} | {mean([r['reward/mean'] for r in w]):.3f} "
              f"| {mean([r.get('accuracy/mean', float('nan')) for r in w]):.3f} "
              f"| {mean([r.get('agent/turns=1', 0.0) for r in w]):.3f} | {mean([r['agent/turns_mean'] for r in w]):.3f} "
              f"| {mean([r['agent/action_tokens_mean'] for r in w]):.1f} |")
    summary = json.loads((out / args.rl_name / "summary.json").read_text())
    for key in ("initial", "rl"):
        s = summary[key]
        agent = s.get("agent", {})
        print(f"held-out {key}: sampled {s['accuracy']['mean']:.3f}, greedy {s['greedy']['mean']:.3f}, "
              f"pass@{s['k']} {s['pass@k']['mean']:.3f}; sampled episodes: turns {agent.get('agent/turns_mean', 0):.3f}, "
              f"right on turn 1 {agent.get('agent/turns=1', 0):.3f}")
    if (out / "sft" / "summary.json").exists():
        s = json.loads((out / "sft" / "summary.json").read_text())["sft"]
        print(f"SFT checkpoint, single-turn eval: sampled {s['accuracy']['mean']:.3f}, greedy {s['greedy']['mean']:.3f}")


if __name__ == "__main__":
    main()
