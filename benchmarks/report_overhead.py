"""What seeing a run costs: preflight check, metric logging per record, report.html rendering.

    python benchmarks/report_overhead.py [--steps 150]

Prints seconds per operation, measured side by side in one process (torch limited to one thread).
"""

from __future__ import annotations

import argparse
import math
import random
import tempfile
import time
from pathlib import Path

import torch


def _records(steps: int) -> list[tuple[str, int, dict[str, float]]]:
    """A demo-like metric stream: SFT every 50 steps, RL every step with ~25 metrics, three evals."""
    rng = random.Random(0)
    out = [("sft", s, {"sft/loss": 2 / s, "sft/grad_norm": rng.random(), "perf/step_seconds": 0.2, "sft/lr": 1e-3})
           for s in range(50, 601, 50)]
    out.append(("eval/sft", 0, {"accuracy/mean": 0.5, "accuracy/shapes/count": 0.5, "greedy/mean": 0.6}))
    for s in range(1, steps + 1):
        metrics = {f"reward/{t}": rng.random() for t in ("mean", "std", "shapes/count", "shapes/color")}
        metrics.update({f"accuracy/{t}": rng.random() for t in ("mean", "shapes/count", "shapes/color")})
        metrics.update({f"policy/{m}": rng.random() for m in ("loss", "entropy", "clip_low", "clip_high", "grad_norm",
                                                              "approx_kl_old", "zero_adv_groups_frac")})
        metrics.update({"response/length_mean": 5 + math.sin(s), "response/length_max": 8.0, "response/truncated_frac": 0.1,
                        "rollout/gen_prob": 0.4, "rollout/unique_frac": 0.7, "perf/step_seconds": 1.0,
                        "perf/gen_seconds": 0.4, "perf/tokens_per_s": 900.0, "data/epoch": 0})
        out.append(("rl", s, metrics))
    out.append(("eval/rl", 0, {"accuracy/mean": 0.6, "accuracy/shapes/count": 0.6, "greedy/mean": 0.65}))
    return out


def _time(fn, repeat: int = 1) -> float:
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=150, help="RL steps in the synthetic run")
    args = parser.parse_args()
    torch.set_num_threads(1)

    from vlrl.check import preflight
    from vlrl.config import DemoConfig, load_config
    from vlrl.models import load_policy
    from vlrl.report import MetricsLogger, make_sink
    from vlrl.report.html import build_report

    root = Path(__file__).parents[1]
    cfg = load_config(DemoConfig, root / "configs" / "demo.yaml")
    preflight(cfg)  # warm imports (transformers, tokenizers) so both sides below pay none
    t_check = _time(lambda: preflight(cfg))
    t_load = _time(lambda: load_policy(cfg.model.path))
    print(f"preflight (configs/demo.yaml, procedural data):  {t_check:6.2f} s")
    print(f"load_policy (the weights it runs before):         {t_load:6.2f} s")

    records = _records(args.steps)
    with tempfile.TemporaryDirectory() as tmp:
        for sinks in ([], ["tensorboard"]):
            run = Path(tmp) / ("run_" + "_".join(["jsonl", *sinks]))
            logger = MetricsLogger(run / "metrics.jsonl", quiet=True,
                                   sinks=[make_sink(s, run, run_name=run.name) for s in sinks])
            seconds = _time(lambda logger=logger: [logger.log(*r) for r in records])
            logger.close()
            print(f"log {len(records)} records, sinks {['jsonl', *sinks]}: {1e3 * seconds / len(records):6.3f} ms/record")
        run = Path(tmp) / "run_jsonl"
        (run / "config.yaml").write_text("model: {path: tiny-qwen2-vl}\nrollout: {n: 8}\n")
        build_report([run])  # warm matplotlib / jinja imports
        t_report = _time(lambda: build_report([run]))
        html = build_report([run])
        t_compare = _time(lambda: build_report([run, Path(tmp) / "run_jsonl_tensorboard"]))
    print(f"report.html, 1 run ({args.steps} RL steps):         {t_report:6.2f} s  ({len(html) / 1e6:.2f} MB)")
    print(f"report.html, 2 runs overlaid:                     {t_compare:6.2f} s")


if __name__ == "__main__":
    main()
