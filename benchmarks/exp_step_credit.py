"""Step-level credit on the embodied suite (issue 9): one SFT warm start on gold plans, then the same RL budget
for GRPO and each step-credit variant from that checkpoint; plan success and step accuracy of every one.

    python benchmarks/exp_step_credit.py            # the documented comparison (docs/experiments/step_credit.md)
    python benchmarks/exp_step_credit.py --quick    # a smoke run of the whole pipeline (a few minutes)
    python benchmarks/exp_step_credit.py --variants grpo,rule_prefix --rl-steps 60

Set-up (tiny preset, ~1M parameters): the ``embodied`` suite's ``pick_place`` plans (4–6 steps, or the rest of
one after a history), no action list in the prompt; SFT for ``--sft-steps`` on 2,000 gold responses, 30 %
of them with the reference plan in the prompt (so that the frozen SFT model can serve as the forward-proxy
teacher); RL on 2,000 other prompts, ``--rl-steps`` steps of 8 prompts × 8 samples, reward
0.8 · execution success + 0.2 · JSON format; evaluation on 100 held-out prompts: greedy and sampled (T = 1,
4 per prompt) plan success and step accuracy (gold positions whose action id the plan repeats).

Writes ``OUT/<variant>/`` run directories (``report.html`` with the step-credit tables), ``OUT/compare.html``,
``OUT/results.json``, and prints the table.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

from vlrl.config import RLConfig, SFTConfig
from vlrl.data import generate
from vlrl.models import load_policy
from vlrl.report import MetricsLogger
from vlrl.report.html import write_report
from vlrl.report.samples import SampleLog
from vlrl.report.watch import WatchedEngine
from vlrl.rewards import score_trajectories
from vlrl.rollout import HFEngine, SamplingParams
from vlrl.train.common import prepare_run_dir, seed_everything, write_json
from vlrl.train.loop import train_rl
from vlrl.train.sft import train_sft

PROXY = {"signal": "forward_proxy", "teacher": "reference", "score_source": "semantic", "credit_target": "semantic"}
VARIANTS: dict[str, list[dict]] = {
    "grpo": [],
    "rule_exact": [{"name": "step_credit", "options": {"signal": "rule", "match": "exact"}}],
    "rule_prefix": [{"name": "step_credit", "options": {"signal": "rule", "match": "prefix"}}],
    "rule_lcs": [{"name": "step_credit", "options": {"signal": "rule", "match": "lcs"}}],
    "forward_proxy": [{"name": "step_credit", "options": {**PROXY, "proxy": "contrast"}}],
    "residual_gate": [{"name": "step_credit", "options": {**PROXY, "proxy": "residual_contrast"}}],
    "stepopsd": [{"name": "step_credit", "options": {**PROXY, "proxy": "contrast", "injection": "stepopsd"}}],
}
SUITE = {"tasks": ["pick_place"], "list_actions": False}


def plan_eval(engine, samples, *, samples_per_prompt: int, temperature: float, max_new_tokens: int) -> dict:
    """Greedy and sampled plan success (``accuracy``) and step accuracy (``plan_success/step_acc``), per task."""
    requests = [engine.encode(s) for s in samples]
    greedy = engine.generate(requests, SamplingParams(n=1, temperature=0.0, max_new_tokens=max_new_tokens))
    sampled = engine.generate(requests, SamplingParams(n=samples_per_prompt, temperature=temperature,
                                                       max_new_tokens=max_new_tokens))
    score_trajectories(greedy)
    score_trajectories(sampled)
    table: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for name, batch in (("greedy", greedy), ("sampled", sampled)):
        for t in batch:
            for task in (t.sample.task, "mean"):
                table[f"{name}_success"][task].append(t.accuracy or 0.0)
                table[f"{name}_step_acc"][task].append(t.reward_parts.get("plan_success/step_acc", 0.0))
    return {metric: {task: round(sum(v) / len(v), 4) for task, v in by_task.items()} for metric, by_task in table.items()}


def log_eval(logger: MetricsLogger, stage: str, result: dict) -> None:
    logger.log(stage, 0, {f"{metric}/{task}": value for metric, by_task in result.items() for task, value in by_task.items()},
               show=("greedy_success/mean", "greedy_step_acc/mean", "sampled_success/mean"))


def run_sft(args, out: Path, train, test) -> tuple[Path, dict]:
    stage = SFTConfig.model_validate({
        "model": {"path": args.model}, "out": str(out / "sft"), "seed": args.seed,
        "data": {"suite": "embodied", "tasks": SUITE["tasks"], "n_train": args.n_train, "n_test": args.n_test,
                 "suite_options": {"list_actions": False, "reference_prob": 0.3}},
        "optim": {"lr": 2e-3, "betas": [0.5, 0.9]},
        "train": {"steps": args.sft_steps, "max_seconds": args.sft_seconds, "batch_size": 16, "micro_batch_size": 16,
                  "log_every": 50},
    })  # written to config.yaml; the data themselves are generated in main()
    run_dir, logger = prepare_run_dir(out / "sft", stage)
    seed_everything(args.seed)
    policy = load_policy(args.model)
    stats = train_sft(policy, train, stage, logger=logger, seed=args.seed)
    checkpoint = policy.save(run_dir / "checkpoints" / "final")
    engine = WatchedEngine(HFEngine(policy), logger, SampleLog(run_dir, per_task=2))
    result = plan_eval(engine, test, samples_per_prompt=args.eval_samples, temperature=1.0, max_new_tokens=args.max_new_tokens)
    log_eval(logger, "eval/sft", result)
    logger.close()
    write_report([run_dir])
    return checkpoint, {"eval": result, "steps": stats.steps, "seconds": round(stats.seconds, 1)}


def run_variant(args, name: str, out: Path, checkpoint: Path, train, test) -> dict:
    run_dir = out / name
    shaping = json.loads(json.dumps(VARIANTS[name]))
    for spec in shaping:  # the analysis files (sign flips, A^S tables, heatmaps) go to the run directory
        spec["options"].setdefault("analysis_dir", str(run_dir))
        spec["options"].setdefault("heatmap_every", max(1, args.rl_steps // 3))
    stage = RLConfig.model_validate({
        "model": {"path": str(checkpoint)}, "out": str(run_dir), "seed": args.seed,
        "data": {"suite": "embodied", "tasks": SUITE["tasks"], "n_train": args.n_train, "n_test": args.n_test,
                 "suite_options": {"list_actions": False}},
        "rollout": {"n": 8, "temperature": 1.0, "max_new_tokens": args.max_new_tokens},
        "algo": {"advantage": "grpo", "loss_agg": "token_mean", "clip_low": 0.2, "clip_high": 0.28,
                 "advantage_shaping": shaping},
        "optim": {"lr": args.rl_lr},
        "train": {"steps": args.rl_steps, "prompts_per_step": args.prompts_per_step, "micro_batch_size": 64, "log_every": 1},
    })
    run_dir, logger = prepare_run_dir(run_dir, stage)
    seed_everything(args.seed)
    policy = load_policy(str(checkpoint))
    engine = WatchedEngine(HFEngine(policy), logger, SampleLog(run_dir, per_task=2))
    start = time.time()
    with engine.training("rl", total_steps=args.rl_steps, snapshots=2):
        stats = train_rl(policy, engine, train, stage, logger=logger, seed=args.seed)
    rl_seconds = time.time() - start
    result = plan_eval(engine, test, samples_per_prompt=args.eval_samples, temperature=1.0, max_new_tokens=args.max_new_tokens)
    log_eval(logger, "eval/final", result)
    logger.close()
    write_report([run_dir])
    flips = [r for r in logger.records if r["stage"] == "rl"]
    return {"eval": result, "rl_seconds": round(rl_seconds, 1), "steps": stats.steps,
            "sign_flip_frac": _mean(r.get("shaping/step_credit/sign_flip_frac/all") for r in flips),
            "parse_fail_frac": _mean(r.get("shaping/step_credit/parse_fail_frac") for r in flips),
            "train_reward": _mean(r.get("reward/mean") for r in flips[-5:])}


def _mean(values) -> float | None:
    values = [v for v in values if isinstance(v, (int, float))]
    return round(sum(values) / len(values), 4) if values else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/exp_step_credit")
    parser.add_argument("--quick", action="store_true", help="smoke run: short SFT, 2 RL steps, 16 test prompts")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--model", default="tiny-qwen2-vl")
    parser.add_argument("--sft-steps", type=int, default=300)
    parser.add_argument("--sft-seconds", type=float, default=None, help="also stop SFT after this many seconds")
    parser.add_argument("--sft-checkpoint", default=None, help="skip SFT: start every variant from this checkpoint")
    parser.add_argument("--rl-steps", type=int, default=30)
    parser.add_argument("--prompts-per-step", type=int, default=8)
    parser.add_argument("--rl-lr", type=float, default=5e-4)
    parser.add_argument("--n-train", type=int, default=2000)
    parser.add_argument("--n-test", type=int, default=100)
    parser.add_argument("--eval-samples", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.quick:
        args.sft_steps, args.rl_steps, args.n_train, args.n_test, args.eval_samples = 20, 2, 200, 16, 2
        args.prompts_per_step = 4
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variant(s) {unknown}; choose from {list(VARIANTS)}")
    out = Path(args.out)
    start = time.time()
    sft_data = generate("embodied", args.n_train, split="train", seed=args.seed, reference_prob=0.3, **SUITE)
    rl_data = generate("embodied", args.n_train, split="rl", seed=args.seed, **SUITE)
    test = generate("embodied", args.n_test, split="test", seed=args.seed, **SUITE)
    if args.sft_checkpoint:
        checkpoint = Path(args.sft_checkpoint)
        engine = HFEngine(load_policy(str(checkpoint)))
        sft = {"eval": plan_eval(engine, test, samples_per_prompt=args.eval_samples, temperature=1.0,
                                 max_new_tokens=args.max_new_tokens), "steps": None, "seconds": None, "checkpoint": str(checkpoint)}
    else:
        checkpoint, sft = run_sft(args, out, sft_data, test)
    results = {"args": vars(args), "sft": sft, "variants": {}}
    print(f"SFT: {sft['steps']} steps in {sft['seconds']} s; {_row('sft checkpoint', sft['eval'])}", flush=True)
    for name in variants:
        results["variants"][name] = run_variant(args, name, out, checkpoint, rl_data, test)
        print(_row(name, results["variants"][name]["eval"]), flush=True)
    results["wall_seconds"] = round(time.time() - start, 1)
    results["analysis"] = {name: analysis(out / name) for name in variants if VARIANTS[name]}
    write_json(out / "results.json", results)
    write_report([out / name for name in variants], out / "compare.html")
    print(table(results))
    print(analysis_table(results["analysis"]))


def _row(name: str, result: dict) -> str:
    return (f"{name}: greedy success {result['greedy_success']['mean']:.3f}, step acc {result['greedy_step_acc']['mean']:.3f}; "
            f"sampled success {result['sampled_success']['mean']:.3f}, step acc {result['sampled_step_acc']['mean']:.3f}")


def analysis(run_dir: Path) -> dict:
    """The run's step-credit tables summed over its RL steps (what its report.html shows)."""
    from vlrl.report.step_credit import summarize

    summary, _ = summarize(run_dir)
    if summary is None:
        return {}
    flips = {row["group"]: row["ratio"] for row in summary.flips}
    return {"signal": summary.signal, "flip_ratio": flips,
            "new_signal": next(row["new_ratio"] for row in summary.flips if row["group"] == "all action tokens"),
            "step_scores": {row["group"]: {k: row[k] for k in ("n", "mean", "positive", "negative")} for row in summary.proxy},
            "step_acc": summary.totals["correct_steps"] / max(summary.totals["steps"], 1)}


def analysis_table(rows: dict) -> str:
    fmt = lambda v: "—" if v is None else f"{v:.3f}"  # noqa: E731
    lines = ["| variant | flip ratio: all | successful traj. | failed traj. | rule-correct steps | rule-wrong steps "
             "| new signal (A^E = 0) | A^S correct: mean (> 0) | A^S wrong: mean (> 0) |", "|---|---|---|---|---|---|---|---|---|"]
    for name, a in rows.items():
        if not a:
            continue
        f, sc = a["flip_ratio"], a["step_scores"]
        right, wrong = sc["rule-correct steps"], sc["rule-wrong steps"]
        lines.append(f"| {name} | {fmt(f['all action tokens'])} | {fmt(f['successful trajectories'])} | "
                     f"{fmt(f['failed trajectories'])} | {fmt(f['rule-correct steps'])} | {fmt(f['rule-wrong steps'])} | "
                     f"{fmt(a['new_signal'])} | {fmt(right['mean'])} ({fmt(right['positive'])}) | "
                     f"{fmt(wrong['mean'])} ({fmt(wrong['positive'])}) |")
    return "\n".join(lines)


def table(results: dict) -> str:
    head = ("| run | greedy success | greedy step acc | sampled success | sampled step acc | train reward (last 5) "
            "| sign-flip ratio | parse fail | RL s |\n|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    sft = results["sft"]["eval"]
    lines.append(f"| SFT checkpoint | {sft['greedy_success']['mean']:.3f} | {sft['greedy_step_acc']['mean']:.3f} | "
                 f"{sft['sampled_success']['mean']:.3f} | {sft['sampled_step_acc']['mean']:.3f} | | | | |")
    for name, r in results["variants"].items():
        e = r["eval"]
        fmt = lambda v: "—" if v is None else f"{v:.3f}"  # noqa: E731
        lines.append(f"| {name} | {e['greedy_success']['mean']:.3f} | {e['greedy_step_acc']['mean']:.3f} | "
                     f"{e['sampled_success']['mean']:.3f} | {e['sampled_step_acc']['mean']:.3f} | {fmt(r['train_reward'])} | "
                     f"{fmt(r['sign_flip_frac'])} | {fmt(r['parse_fail_frac'])} | {r['rl_seconds']:.0f} |")
    return "\n".join(lines) + f"\n\nwall time {results['wall_seconds']:.0f} s"


if __name__ == "__main__":
    main()
