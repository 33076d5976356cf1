"""Trained samples per second: synchronous vs asynchronous RL on separate "device pools".

Emulates a rollout partition and a trainer partition on one machine: a `vlrl serve` process pinned to one
core (``taskset``) generates, this process (the trainer) is pinned to the other; both use one torch thread.
The workload (tiny Qwen2-VL, shapes tasks) is sized so that one generation batch and one training step take
similar time (both are measured and printed first): async can at best hide the shorter of the two, so the ratio
is bounded by (t_gen + t_train) / max(t_gen, t_train) — 2x when they are equal. (With 40 new tokens generation
took 1.33 s against 0.98 s of training, a bound of ~1.7x; 30 tokens gave 1.05 s / 0.93 s.) Then, against the same server:

- sync:  `train_rl` (rollout.mode sync) with the HTTP engine — generate a batch, train on it, publish the weights, repeat;
         each partition idles while the other works.
- async: `train_rl` (rollout.mode async) at each η given (1, 2 and the seed's 4 by default) — the server generates the next batches while the
         trainer trains, and loads each new version while the trainer trains on (`HTTPEngine.publish`).
         With η = 1 the server may run one batch ahead: it idles from the end of that batch until the trainer's next
         version is confirmed. η = 2 lets it keep one more batch queued, η = 4 (the seed's) three more.
- async+partial (``--partial``): the same at each η with ``rollout.servers.on_weight_update=partial`` — at every
         update the server interrupts the batch it decodes, keeps every unfinished answer's tokens and goes on from
         them on the new weights (each token tagged with its version; η bounds the oldest).

    python benchmarks/async_vs_sync.py                       # 8 prompts x 6 samples, <= 30 tokens, 20 steps, 2 repeats
    python benchmarks/async_vs_sync.py --steps 40 --eta 8    # longer, more staleness allowed
    python benchmarks/async_vs_sync.py --long-tail --partial --eta 2 --max-new-tokens 64   # issue 48's comparison

``--long-tail``: answer lengths as reasoning RL sees them, most short and a few near ``max_new_tokens``. The untrained
model's own lengths are not that shape, so the server (this file run as `serve_long_tail`) plans each answer's length
and ends it there: 85 % of answers 2 to max/8 tokens, 15 % 0.8 × max to max, drawn from a hash of the prompt and the
answer's first token — so an answer continued after an update keeps its plan — and EOS is never sampled otherwise.

Prints the samples/s of each mode (trajectories trained per second of loop wall time) and their ratio, and — the
known risk of partial rollout is a length bias (long answers span more versions, so more of them are discarded as
stale) — the lengths of every answer generated and of every answer trained: mean, share ≥ 0.8 × max, and the
two-sample Kolmogorov–Smirnov distance between the two. Both runs start from the same weights; the machine's load
average is printed because other processes on the same cores distort the figures. The server runs in its own session
(see `start_server`).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-qwen2-vl")
    parser.add_argument("--steps", type=int, default=20, help="RL steps per mode")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument("--n", type=int, default=6, help="samples per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=30,
                        help="the untrained model always writes this many: 30 balances generation and training here")
    parser.add_argument("--eta", type=int, nargs="+", default=[1, 2, 4], help="max staleness of each async run")
    parser.add_argument("--server-core", type=int, default=0)
    parser.add_argument("--trainer-core", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2, help="alternate sync/async this many times")
    parser.add_argument("--quick", action="store_true", help="smoke run: 3 steps, 1 repeat")
    parser.add_argument("--long-tail", action="store_true", help="plan answer lengths: most short, a few near the max")
    parser.add_argument("--partial", action="store_true", help="also run async with on_weight_update=partial")
    parser.add_argument("--no-sync", action="store_true", help="skip the synchronous run")
    parser.add_argument("--serve-long-tail", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)  # (the server process)
    args = parser.parse_args()
    if args.serve_long_tail is not None:
        serve_long_tail(args.max_new_tokens, args.serve_long_tail)
        return
    if args.quick:
        args.steps, args.repeats = 3, 1

    os.sched_setaffinity(0, {args.trainer_core})  # this process = the trainer partition
    import torch

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    from vlrl.config import RLStage
    from vlrl.data import generate
    from vlrl.feed.async_rollout import GroupBuffer
    from vlrl.models import collate, load_policy, response_logprobs
    from vlrl.report import MetricsLogger
    from vlrl.rollout import SamplingParams
    from vlrl.rollout.http_engine import HTTPEngine
    from vlrl.rollout.http_settings import ClientSettings, SyncSettings
    from vlrl.train import learner as learner_module
    from vlrl.train.loop import train_rl

    key = secrets.token_urlsafe(16)
    server, url, log = start_server(args, key)
    shm = Path("/dev/shm")  # weights travel through a RAM disk where there is one (both modes publish every step)
    weights = Path(tempfile.mkdtemp(prefix="vlrl-bench-", dir=shm if shm.is_dir() else None))
    try:
        samples = generate("shapes", 256, tasks=["count", "color"])
        def stage(eta: int, mode: str, on_weight_update: str = "finish") -> RLStage:
            return RLStage.model_validate({
                "rollout": {"n": args.n, "max_new_tokens": args.max_new_tokens, "mode": mode,
                            "servers": {"max_concurrent_rollouts": 2 * args.prompts,
                                        "on_weight_update": on_weight_update}},
                "train": {"steps": args.steps, "prompts_per_step": args.prompts, "micro_batch_size": args.prompts * args.n,
                          "padding_free": args.long_tail},  # (long tail: the update pays for the tokens, not the longest)
                "staleness": {"eta": eta}, "optim": {"lr": 5e-4},
            })

        sampling = SamplingParams(n=args.n, max_new_tokens=args.max_new_tokens)

        def fresh(on_weight_update: str = "finish"):
            policy = load_policy(args.model)
            engine = HTTPEngine(policy, [url], SyncSettings(weights_dir=weights, on_weight_update=on_weight_update),
                                ClientSettings(api_key=key))
            engine.update_weights(version=0)
            return policy, engine

        # --- the workload: one generation batch vs one training step
        policy, engine = fresh()
        requests = [engine.encode(s) for s in samples[: args.prompts]]
        for _ in range(2):
            t0 = time.perf_counter()
            batch = engine.generate(requests, sampling)
            t_gen = time.perf_counter() - t0
        tokens = collate([t.prompt_ids for t in batch], [t.response_ids for t in batch], [t.vision for t in batch],
                         pad_token_id=policy.pad_token_id)
        for _ in range(2):
            t0 = time.perf_counter()
            logp, _ = response_logprobs(policy.model, policy.adapter, tokens)
            logp.sum().backward()
            t_train = time.perf_counter() - t0
        engine.close()
        print(f"workload: {args.model}, {args.prompts} prompts x {args.n} samples, <= {args.max_new_tokens} new tokens; "
              f"one generation batch {t_gen:.3f} s (server core {args.server_core}), one forward+backward "
              f"{t_train:.3f} s (trainer core {args.trainer_core})", flush=True)

        runs = [] if args.no_sync else [("sync", 0, "finish")]
        runs += [(f"async η={eta}", eta, "finish") for eta in args.eta]
        runs += [(f"async+partial η={eta}", eta, "partial") for eta in args.eta] if args.partial else []
        modes = [mode for mode, _, _ in runs]
        results: dict[str, list[float]] = {mode: [] for mode in modes}
        lengths: dict[str, dict[str, list[int]]] = {mode: {"generated": [], "trained": []} for mode in modes}
        tokens_per_s: dict[str, list[float]] = {mode: [] for mode in modes}
        for _ in range(args.repeats):
            for mode, eta, on_weight_update in runs:
                policy, engine = fresh(on_weight_update)
                torch.manual_seed(0)
                logger = MetricsLogger(None, quiet=True)
                load = os.getloadavg()[0]
                before = server_info(url, key)
                with record_lengths(GroupBuffer, learner_module, sync=mode == "sync") as seen:
                    stats = train_rl(policy, engine, samples, stage(eta, "sync" if mode == "sync" else "async", on_weight_update),
                                     logger=logger, seed=0)
                engine.close()
                after = server_info(url, key)
                per_batch = (after["rows"] - before["rows"]) / max(1, after["batches"] - before["batches"])
                rate = stats.steps * args.prompts * args.n / stats.seconds
                results[mode].append(rate)
                tokens_per_s[mode].append(sum(seen["trained"]) / stats.seconds)
                for kind in ("generated", "trained"):
                    lengths[mode][kind] += seen[kind]
                extra = ""
                if mode == "sync":
                    gen = sum(r["perf/gen_seconds"] for r in logger.records) / len(logger.records)
                    extra = f", the trainer waits {gen:.2f} s/step for generation"
                if mode != "sync":
                    stale = [r["staleness/mean"] for r in logger.records]
                    mixed = [r["staleness/mixed_frac"] for r in logger.records]
                    extra = (f", mean staleness {sum(stale) / len(stale):.2f}, discarded "
                             f"{logger.records[-1]['staleness/discarded_total']}, spanning two versions "
                             f"{sum(mixed) / len(mixed):.2f}")
                    wait = sum(r["perf/wait_seconds"] for r in logger.records) / len(logger.records)
                    sync_s = sum(r["perf/sync_seconds"] for r in logger.records) / len(logger.records)
                    extra += f", the trainer waits {wait:.2f} s/step for data, weight sync {sync_s:.2f} s/step"
                print(f"{mode:9s}: {stats.steps} steps in {stats.seconds:.1f} s -> {rate:.1f} trained samples/s "
                      f"({per_batch:.0f} sequences per server batch{extra}; load average {load:.1f})", flush=True)
        table(modes, results, tokens_per_s, lengths, args.max_new_tokens)
        if "sync" in results:
            sync_rate = sum(results["sync"]) / len(results["sync"])
            for mode in modes[1:]:
                async_rate = sum(results[mode]) / len(results[mode])
                pairs = " ".join(f"{a / b:.2f}x" for a, b in zip(results[mode], results["sync"], strict=True))
                print(f"{mode} / sync = {async_rate / sync_rate:.2f}x (mean rates; per repeat: {pairs}) "
                      "(goal >= 1.8x; AReaL reports 2.77x on GPUs)")
        for eta in args.eta if args.partial else []:
            plain, partial = results[f"async η={eta}"], results[f"async+partial η={eta}"]
            pairs = " ".join(f"{a / b:.2f}x" for a, b in zip(partial, plain, strict=True))
            print(f"async+partial η={eta} / async η={eta} = {sum(partial) / sum(plain):.2f}x (per repeat: {pairs}) "
                  "(issue 48's goal >= 1.25x at η = 2 on the long-tail shape, KS <= 0.05)")
    finally:
        server.terminate()
        server.wait(30)
        log.close()
        shutil.rmtree(weights, ignore_errors=True)


@contextlib.contextmanager
def record_lengths(buffer_type, learner_module, *, sync: bool):
    """The response lengths of every answer generated (async: every group pushed into the buffer — trained,
    discarded as stale, or left over at the end; sync: every batch) and of every answer trained on."""
    seen: dict[str, list[int]] = {"generated": [], "trained": []}
    real_put, real_update = buffer_type.put, learner_module.ppo_update

    def put(self, group):
        seen["generated"].extend(len(t.response_ids) for t in group.trajectories)
        return real_put(self, group)

    def update(policy, batch, *rest, **options):
        lengths = [len(t.response_ids) for t in batch.trajectories]
        seen["trained"].extend(lengths)
        if sync:
            seen["generated"].extend(lengths)
        return real_update(policy, batch, *rest, **options)

    buffer_type.put, learner_module.ppo_update = put, update
    try:
        yield seen
    finally:
        buffer_type.put, learner_module.ppo_update = real_put, real_update


def ks_distance(a: list[int], b: list[int]) -> float:
    """Two-sample Kolmogorov–Smirnov statistic: max over x of |F_a(x) − F_b(x)| (empirical distribution functions)."""
    if not a or not b:
        return float("nan")
    return max(abs(sum(v <= x for v in a) / len(a) - sum(v <= x for v in b) / len(b)) for x in set(a) | set(b))


def table(modes: list[str], rates: dict, tokens: dict, lengths: dict, max_new_tokens: int) -> None:
    """The side-by-side table (markdown): throughput, and the generated vs trained response lengths."""
    print("\n| mode | trained samples/s | trained tokens/s | generated: mean length, share ≥ 0.8 max | "
          "trained: mean length, share ≥ 0.8 max | KS(generated, trained) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for mode in modes:
        gen, trained = lengths[mode]["generated"], lengths[mode]["trained"]

        def shape(values: list[int]) -> str:
            if not values:
                return "–"
            return f"{sum(values) / len(values):.1f}, {sum(v >= 0.8 * max_new_tokens for v in values) / len(values):.3f}"

        print(f"| {mode} | {sum(rates[mode]) / len(rates[mode]):.1f} | {sum(tokens[mode]) / len(tokens[mode]):.0f} | "
              f"{shape(gen)} | {shape(trained)} | {ks_distance(gen, trained):.3f} |")
    print()


def serve_long_tail(max_new_tokens: int, serve_args: list[str]) -> None:
    """`vlrl serve` whose answers have planned lengths (``--long-tail``: the module docstring): EOS is never sampled, and
    each answer ends, as completed, when it reaches its planned length."""
    import hashlib

    from vlrl.cli import main as vlrl_main
    from vlrl.rollout import decode, hf_engine

    def planned(sample_id: str, first_token: int) -> int:
        u = int.from_bytes(hashlib.sha256(f"{sample_id}/{first_token}".encode()).digest()[:8], "big") / 2**64
        if u < 0.85:  # short: 2 .. max/8
            return 2 + int(u / 0.85 * max(1, max_new_tokens // 8 - 1))
        return int(0.8 * max_new_tokens) + int((u - 0.85) / 0.15 * (0.2 * max_new_tokens))  # long: 0.8 max .. max

    real_init, real_of, real_record = hf_engine.HFEngine.__init__, decode._Rows.of, decode._Rows.record

    def init(self, policy, **options):
        real_init(self, policy, **options)
        self.suppress = sorted(set(self.suppress) | set(policy.eos_token_ids))  # only the plan ends an answer

    def of(rows, limit):
        out = real_of(rows, limit)
        out.requests = list(rows)  # (a continued answer's prompt ends with the tokens it kept: `continuation`)
        out.kept = [limit - b for b in out.budgets]
        return out

    def record(self, live, new, logp, done, *rest):
        real_record(self, live, new, logp, done, *rest)
        for row in live.tolist():
            if done[row]:
                continue
            request, kept = self.requests[row], self.kept[row]
            first = request.prompt_ids[len(request.prompt_ids) - kept] if kept else self.tokens[row][0]
            if kept + len(self.tokens[row]) >= planned(request.sample.id, first):
                self.eos[row], done[row] = True, True

    hf_engine.HFEngine.__init__, decode._Rows.of, decode._Rows.record = init, of, record
    sys.argv = ["vlrl", *serve_args]
    vlrl_main()


def server_info(url: str, key: str) -> dict:
    import httpx

    return httpx.get(f"{url}/get_model_info", headers={"Authorization": f"Bearer {key}"}, timeout=30).json()


def start_server(args, key: str):
    """`vlrl serve` pinned to ``args.server_core`` with one torch thread; returns (process, url, log file)."""
    log = tempfile.TemporaryFile(mode="w+")
    serve = ["serve", "--model", args.model, "--port", "0", "--threads", "1", "--max-batch-size",
             str(args.prompts * args.n), "--batch-window-ms", "25"]
    program = ([__file__, "--max-new-tokens", str(args.max_new_tokens), "--serve-long-tail"] if args.long_tail
               else ["-m", "vlrl.cli"])
    command = ["taskset", "-c", str(args.server_core), sys.executable, *program, *serve]
    # Its own session: with the kernel's autogroup scheduling (on here) all processes of one session share one
    # CPU share, so under load from other users a server in the trainer's session would take its CPU from the
    # trainer instead of from its own core. A separate session is what a separate device pool is.
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "VLRL_API_KEY": key},
                               start_new_session=True)
    deadline = time.time() + 180
    while time.time() < deadline:
        log.seek(0)
        for line in log.read().splitlines():
            if "listening on " in line:
                return process, line.split("listening on ")[1].split()[0], log
        if process.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"vlrl serve exited:\n{log.read()}")
        time.sleep(0.2)
    process.terminate()
    raise TimeoutError("vlrl serve did not start within 180 s")


if __name__ == "__main__":
    main()
