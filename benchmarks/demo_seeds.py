"""The demo's claim across training seeds and torch thread counts: `vlrl demo` once per (threads, seed).

    OMP_NUM_THREADS=1 python benchmarks/demo_seeds.py                      # seeds 0 1 2 × threads 1 2
    python benchmarks/demo_seeds.py --seeds 0 1 2 3 --threads 2 --out runs/demo_seeds

Each run is `vlrl demo --out OUT/t<threads>_s<seed> seed=<seed>` (the shipped `src/vlrl/configs/demo.yaml`
unless ``--config``; ``--set`` adds overrides) in a subprocess with ``OMP_NUM_THREADS=<threads>``, one at a
time. A run whose ``summary.json`` exists is read, not re-run (``--force`` re-runs), so an interrupted sweep
continues where it stopped. Printed: per run and mean ± sd over seeds (per thread count) of held-out sampled
pass@1 / greedy accuracy of SFT, RL and the SFT control scored strictly (right, well-formed and ended: issue 52),
RL − SFT, RL − control (points), RL's well-formed fraction and its accuracy by the verifier alone, the control's
budget (steps matched on FLOPs and on wall time) and wall time; which of the demo's claims hold at every seed; and
a README-ready markdown table with the date, the package versions and the thread counts the runs used.

The claims checked (issue 52): at every seed RL ≥ SFT + 5 strict points sampled pass@1, RL above the FLOP-matched
control on strict sampled and greedy accuracy, and ≥ 95 % of RL's answers well-formed; each run ≤ 15 minutes (wall
time is only meaningful on a quiet machine — a busy one stretches every stage).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "src" / "vlrl" / "configs" / "demo.yaml"
COLUMNS = ("sft_s", "sft_g", "rl_s", "rl_g", "ctl_s", "ctl_g", "rl_sft_s", "rl_sft_g", "rl_ctl_s", "rl_ctl_g", "rl_wf_s",
           "rl_wf_g")


def run_one(out: Path, seed: int, threads: int, config: Path, overrides: list[str], force: bool, timeout: float) -> dict:
    summary = out / "summary.json"
    if summary.is_file() and not force:
        return json.loads(summary.read_text())
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, "-m", "vlrl.cli", "demo", "--config", str(config), "--out", str(out), f"seed={seed}",
               'report.progress="off"', *overrides]
    print(f"$ OMP_NUM_THREADS={threads} {' '.join(command[1:])}", flush=True)
    subprocess.run(command, env=env, check=True, timeout=timeout)
    return json.loads(summary.read_text())


def row(summary: dict) -> dict[str, float]:
    """Accuracies (0..1) and differences (points) of one run, scored strictly (right, well-formed and ended; the
    verifier's own accuracy where a summary predates strict scoring), RL's well-formed fraction and its verifier's
    accuracy."""
    def scores(stage: dict) -> tuple[float, float]:
        if "strict" in stage:
            return stage["strict"]["mean"], stage["strict_greedy"]["mean"]
        return stage["accuracy"]["mean"], stage["greedy"]["mean"]

    get = {stage: scores(summary[stage]) for stage in ("sft", "rl", "sft_control")}
    (sft_s, sft_g), (rl_s, rl_g), (ctl_s, ctl_g) = get["sft"], get["rl"], get["sft_control"]
    rl = summary["rl"]
    budget = summary.get("budget", {})
    return {"sft_s": sft_s, "sft_g": sft_g, "rl_s": rl_s, "rl_g": rl_g, "ctl_s": ctl_s, "ctl_g": ctl_g,
            "rl_sft_s": 100 * (rl_s - sft_s), "rl_sft_g": 100 * (rl_g - sft_g),
            "rl_ctl_s": 100 * (rl_s - ctl_s), "rl_ctl_g": 100 * (rl_g - ctl_g),
            "rl_wf_s": rl.get("well_formed", {}).get("mean", float("nan")),
            "rl_wf_g": rl.get("well_formed_greedy", {}).get("mean", float("nan")),
            "rl_acc_s": rl["accuracy"]["mean"], "rl_acc_g": rl["greedy"]["mean"], "strict": "strict" in rl,
            "control_steps": budget.get("control_steps"), "flops_steps": budget.get("flops_matched_steps"),
            "wall_steps": budget.get("wall_matched_steps"), "wall": summary.get("wall_seconds", float("nan"))}


def mean_sd(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def fmt(key: str, value: float) -> str:
    return f"{value:+.1f}" if key.startswith(("rl_sft", "rl_ctl")) else f"{value:.3f}"


def table(rows: dict[tuple[int, int], dict], threads: list[int]) -> list[str]:
    head = ("| threads | seed | SFT | RL | SFT control (same FLOPs) | RL − SFT (points) | RL − control (points) "
            "| RL well-formed | RL by the verifier alone | control steps (FLOPs / wall-matched) | wall time |")
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for t in threads:
        seeds = sorted(s for (tt, s) in rows if tt == t)
        for s in seeds:
            r = rows[(t, s)]
            lines.append(f"| {t} | {s} | {r['sft_s']:.3f} / {r['sft_g']:.3f} | {r['rl_s']:.3f} / {r['rl_g']:.3f} | "
                         f"{r['ctl_s']:.3f} / {r['ctl_g']:.3f} | {r['rl_sft_s']:+.1f} / {r['rl_sft_g']:+.1f} | "
                         f"{r['rl_ctl_s']:+.1f} / {r['rl_ctl_g']:+.1f} | {r['rl_wf_s']:.3f} / {r['rl_wf_g']:.3f} | "
                         f"{r['rl_acc_s']:.3f} / {r['rl_acc_g']:.3f} | {r['control_steps']} ({r['flops_steps']} / "
                         f"{r['wall_steps']}) | {r['wall'] / 60:.1f} min |")
        if len(seeds) > 1:
            stats = {k: mean_sd([rows[(t, s)][k] for s in seeds]) for k in (*COLUMNS, "wall")}

            def pair(a: str, b: str, stats: dict = stats) -> str:
                return " / ".join(f"{fmt(k, stats[k][0])} ± {fmt(k, stats[k][1]).lstrip('+')}" for k in (a, b))
            lines.append(f"| {t} | **mean ± sd** | {pair('sft_s', 'sft_g')} | {pair('rl_s', 'rl_g')} | "
                         f"{pair('ctl_s', 'ctl_g')} | **{pair('rl_sft_s', 'rl_sft_g')}** | **{pair('rl_ctl_s', 'rl_ctl_g')}** "
                         f"| {pair('rl_wf_s', 'rl_wf_g')} | | | {stats['wall'][0] / 60:.1f} min |")
    return lines


def claims(rows: dict[tuple[int, int], dict], threads: list[int]) -> list[str]:
    """The README's claims (issue 52), each with whether it held: at every seed RL ≥ SFT + 5 strict points sampled,
    RL above the FLOP-matched control on strict sampled and greedy accuracy, ≥ 95 % of RL's answers well-formed;
    every run ≤ 15 minutes."""
    lines = []
    for t in threads:
        seeds = sorted(s for (tt, s) in rows if tt == t)
        if not seeds:
            continue
        every = [rows[(t, s)]["rl_sft_s"] >= 5 for s in seeds]
        beat = [rows[(t, s)]["rl_ctl_s"] > 0 and rows[(t, s)]["rl_ctl_g"] > 0 for s in seeds]
        formed = [rows[(t, s)]["rl_wf_s"] >= 0.95 for s in seeds]
        slow = [s for s in seeds if rows[(t, s)]["wall"] > 15 * 60]
        scored = "strict" if all(rows[(t, s)]["strict"] for s in seeds) else "the verifier's accuracy (not strict)"
        lines += [
            f"{t} thread(s), seeds {seeds}, scored by {scored}:",
            f"  RL ≥ SFT + 5 points sampled at every seed: {'yes' if all(every) else 'NO'} ({sum(every)} of {len(seeds)})",
            f"  RL above the control sampled and greedy at every seed: {'yes' if all(beat) else 'NO'} "
            f"({sum(beat)} of {len(seeds)})",
            f"  ≥ 95 % of RL's sampled answers well-formed at every seed: {'yes' if all(formed) else 'NO'} "
            f"({sum(formed)} of {len(seeds)})",
            f"  every run ≤ 15 min: {'yes' if not slow else 'NO (seeds ' + str(slow) + '; wall time depends on load)'}",
        ]
    return lines


def environment_line(summaries: list[dict]) -> str:
    envs = {json.dumps({k: v for k, v in s.get("environment", {}).items() if k not in ("torch_threads", "OMP_NUM_THREADS")},
                       sort_keys=True) for s in summaries}
    if len(envs) != 1:
        return "package versions differ between the runs: " + "; ".join(sorted(envs))
    env = json.loads(envs.pop())
    names = ("torch", "transformers", "tokenizers", "pillow", "numpy", "vlrl")
    line = (" · ".join(f"{n} {env.get(n)}" for n in names) + f" · Python {env.get('python')} · {env.get('platform')}"
            f" · {env.get('cpus')} CPUs")
    if env.get("numerics"):  # runs before vlrl.numerics recorded none
        line += (f" ({env.get('cpu')}) · numerics {env['numerics']}: {env.get('cpu_kernels')} kernels, MKL "
                 f"{env.get('mkl_cbwr')}")
    return line


def commit() -> str:
    try:
        return subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--config", type=Path, default=CONFIG)
    parser.add_argument("--set", nargs="*", default=[], help="dotted overrides for every run")
    parser.add_argument("--out", type=Path, default=Path("runs/demo_seeds"))
    parser.add_argument("--force", action="store_true", help="re-run runs that have a summary.json")
    parser.add_argument("--timeout", type=float, default=3 * 3600, help="seconds per run before it is stopped")
    args = parser.parse_args()

    rows, summaries, days = {}, [], set()
    for threads in args.threads:
        for seed in args.seeds:
            out = args.out / f"t{threads}_s{seed}"
            summary = run_one(out, seed, threads, args.config, args.set, args.force, args.timeout)
            summaries.append(summary)
            # the day the run finished (its summary.json's), not today's: a re-print of earlier runs keeps their date
            days.add(datetime.date.fromtimestamp((out / "summary.json").stat().st_mtime))
            rows[(threads, seed)] = row(summary)
            print(json.dumps({"threads": threads, "seed": seed, **{k: round(v, 4) if isinstance(v, float) else v
                                                                    for k, v in rows[(threads, seed)].items()}}),
                  flush=True)
    print()
    first, last = min(days).isoformat(), max(days).isoformat()
    when = first if first == last else f"{first} to {last}"
    print(f"Measured {when} with `python benchmarks/demo_seeds.py --seeds "
          f"{' '.join(map(str, args.seeds))} --threads {' '.join(map(str, args.threads))}` "
          f"({args.config.name}{', ' + ' '.join(args.set) if args.set else ''}; printed at commit {commit()}):")
    print(environment_line(summaries) + "; held-out sampled pass@1 (T = 1) / greedy accuracy, strict (right, "
          "well-formed and ended), RL's well-formed fraction and its accuracy by the verifier alone:")
    print()
    print("\n".join(table(rows, args.threads)))
    print()
    print("\n".join(claims(rows, args.threads)))


if __name__ == "__main__":
    main()
