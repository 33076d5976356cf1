"""Training samples/s with Syn-GRPO synthesis off, synchronous and asynchronous (the seed's Table 5), in one run.

Emulates the seed's placement (a data server on its own device) on one machine: a `vlrl synth serve` process
(classical back-end, border segmenter, one worker process) is pinned to one core (``taskset``), this process —
the trainer, one torch thread — to the other. The task is the shapes grounding task (``locate``) with the
Syn-GRPO template and the ``syn_diversity`` reward shaper; the policy is the tiny Qwen2-VL preset. A random
tiny model cannot write the template, so each response's *text* is rewritten to a well-formed one (a random
predicted diversity, a description from a small list) before scoring: every prompt then yields one synthesis
job per step — the most work the server can get — while generation and training run on the model's own
tokens. Modes, against the same server and from the same weights:

- off:   synth.enabled with synthesize=false (template and diversity reward, no server)
- sync:  each step waits for its jobs before the next (the seed's "synchronous")
- async: jobs are posted by a background thread and swapped in when done; no step waits

    python benchmarks/synth_overhead.py                   # 8 prompts x 6 samples, <= 40 tokens, 10 steps, 4 repeats
    python benchmarks/synth_overhead.py --quick           # a smoke run: 4 steps, 1 repeat
    python benchmarks/synth_overhead.py --image-size 224  # heavier synthesis per job

Prints samples/s of each mode (trajectories trained per second of loop wall time; mean and median over the
round-robin repeats), async/off and sync/off, the trainer process's CPU seconds per step (``time.process_time``:
what synthesis costs the trainer's own core — the client thread's PNG and HTTP work — independent of waiting and
of other processes' load), the synthesis counters of each run, and the load average (other processes on the same
cores distort the wall-clock figures). Goal (issue 10): asynchronous within 10% of off.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DESCRIPTIONS = ("green grass", "ocean waves", "a red brick wall", "a dark city street at night", "a sandy desert",
                "white clouds in the sky", "a checkered floor", "pink polka dots")


class TemplateEngine:
    """Forwards to an engine and rewrites every response's text into the Syn-GRPO template (see the docstring)."""

    def __init__(self, engine, seed: int = 0) -> None:
        self.engine = engine
        self.rng = random.Random(seed)

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    def encode(self, sample):
        return self.engine.encode(sample)

    def generate(self, requests, sampling):
        out = self.engine.generate(requests, sampling)
        for t in out:
            box = [self.rng.randint(0, 80) for _ in range(2)]
            answer = f"[{box[0]}, {box[1]}, {box[0] + 25}, {box[1] + 25}]"
            t.response_text = (f"<diversity>{self.rng.randint(0, 10) / 10}</diversity><description>"
                               f"{self.rng.choice(DESCRIPTIONS)}</description><answer>{answer}</answer>")
        return out

    def update_weights(self, *, version, state_dict=None):
        self.engine.update_weights(version=version, state_dict=state_dict)


def start_server(core: int, key: str, workdir: Path) -> tuple[subprocess.Popen, str]:
    """`vlrl synth serve` pinned to ``core`` in its own session; returns (process, url)."""
    log = open(workdir / "synth_server.log", "w+")
    command = [sys.executable, "-m", "vlrl.cli", "synth", "serve", "--port", "0", "--workers", "1",
               "--segmenter", "border", "--results-dir", str(workdir / "results")]
    if shutil.which("taskset"):
        command = ["taskset", "-c", str(core), *command]
    env = {**os.environ, "VLRL_API_KEY": key, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.time() + 180
    while time.time() < deadline:
        log.seek(0)
        for line in log.read().splitlines():
            if "listening on " in line:
                return process, line.split("listening on ")[1].split()[0]
        if process.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"vlrl synth serve exited: {log.read()}")
        time.sleep(0.2)
    raise TimeoutError("vlrl synth serve did not start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-qwen2-vl")
    parser.add_argument("--steps", type=int, default=10, help="RL steps per mode and repeat")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step (one synthesis job each)")
    parser.add_argument("--n", type=int, default=6, help="samples per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=40)
    parser.add_argument("--image-size", type=int, default=112, help="side of the shapes images")
    parser.add_argument("--repeats", type=int, default=4, help="run off/sync/async this many times, round-robin")
    parser.add_argument("--server-core", type=int, default=0)
    parser.add_argument("--trainer-core", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="smoke run: 4 steps, 1 repeat")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.repeats = 3, 1

    if hasattr(os, "sched_setaffinity") and args.trainer_core < (os.cpu_count() or 1):
        os.sched_setaffinity(0, {args.trainer_core})  # this process = the trainer's device
    import torch

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    from vlrl.config import RLStage
    from vlrl.data import generate
    from vlrl.models import load_policy
    from vlrl.report import MetricsLogger
    from vlrl.rollout import HFEngine
    from vlrl.train.loop import train_rl

    workdir = Path(tempfile.mkdtemp(prefix="vlrl-synth-bench-"))
    key = "bench-" + str(random.Random().getrandbits(64))
    os.environ["VLRL_API_KEY"] = key
    process, url = start_server(args.server_core, key, workdir)
    try:
        samples = generate("shapes", 256, tasks=["locate"], image_size=args.image_size)
        policy = load_policy(args.model)
        initial = {k: v.clone() for k, v in policy.model.state_dict().items()}
        print(f"tiny policy {policy.num_parameters() / 1e6:.2f}M parameters; server {url} on core {args.server_core}, "
              f"trainer on core {args.trainer_core}; {args.prompts} prompts x {args.n} samples, <= {args.max_new_tokens} "
              f"tokens, {args.image_size} px images, {args.steps} steps per mode", flush=True)
        modes = {"off": {"synthesize": False}, "sync": {"mode": "sync"}, "async": {"mode": "async"}}
        results: dict[str, list[float]] = {m: [] for m in modes}
        cpu: dict[str, list[float]] = {m: [] for m in modes}
        counters: dict[str, dict] = {}
        for repeat in range(args.repeats):
            for mode, synth in modes.items():
                policy.model.load_state_dict(initial)
                stage = RLStage.model_validate({
                    "optim": {"lr": 1e-4}, "rollout": {"n": args.n, "max_new_tokens": args.max_new_tokens},
                    "train": {"steps": args.steps, "prompts_per_step": args.prompts,
                              "micro_batch_size": args.prompts * args.n},
                    "algo": {"reward_shaping": [{"name": "syn_diversity"}]},
                    "synth": {"enabled": True, "template": "short", "server": url, **synth},
                })
                run_dir = workdir / f"{mode}-{repeat}"
                logger = MetricsLogger(run_dir / "metrics.jsonl", quiet=True)
                cpu0 = time.process_time()
                stats = train_rl(policy, TemplateEngine(HFEngine(policy), seed=repeat), samples, stage,
                                   logger=logger, seed=repeat)
                cpu[mode].append((time.process_time() - cpu0) / max(stats.steps, 1))
                rate = stats.steps * args.prompts * args.n / stats.seconds
                results[mode].append(rate)
                counters[mode] = {k.removeprefix("synth/"): v for k, v in stats.metrics.items()
                                  if k in ("synth/submitted", "synth/completed", "synth/failed", "synth/swapped",
                                           "synth/latency_mean", "synth/in_flight", "synth/dataset_synthetic_frac",
                                           "synth/client_cpu_seconds")}
                print(f"  repeat {repeat + 1} {mode:5s}: {rate:6.1f} samples/s ({stats.seconds:.1f} s for "
                      f"{stats.steps} steps; trainer CPU {cpu[mode][-1]:.2f} s/step; load {os.getloadavg()[0]:.1f})",
                      flush=True)
        mean = {m: statistics.mean(v) for m, v in results.items()}
        median = {m: statistics.median(v) for m, v in results.items()}
        cpu_mean = {m: statistics.mean(v) for m, v in cpu.items()}
        print("\nmode    samples/s (mean, median)   vs off (mean, median)   trainer CPU s/step   synthesis (last run)")
        for mode in modes:
            detail = ", ".join(f"{k} {v:.3g}" for k, v in counters[mode].items()) if mode != "off" else "—"
            print(f"{mode:6s} {mean[mode]:8.2f} {median[mode]:8.2f}          {mean[mode] / mean['off']:6.3f} "
                  f"{median[mode] / median['off']:6.3f}          {cpu_mean[mode]:8.3f}          {detail}")
        per_repeat = [a / o for a, o in zip(results["async"], results["off"], strict=True)]
        print(f"\nasync / off per repeat: {', '.join(f'{r:.3f}' for r in per_repeat)}; mean {mean['async'] / mean['off']:.3f}, "
              f"median {median['async'] / median['off']:.3f}; goal ≥ 0.90: "
              f"{'met' if median['async'] / median['off'] >= 0.9 else 'NOT met'} (median)")
        print(f"sync / off: mean {mean['sync'] / mean['off']:.3f}, median {median['sync'] / median['off']:.3f}; "
              f"trainer CPU async / off: {cpu_mean['async'] / cpu_mean['off']:.3f}; load average: {os.getloadavg()[0]:.2f}")
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
