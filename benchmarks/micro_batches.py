"""Micro-batches by token budget vs by count on a long-tail RL batch: loss, gradients, peak memory, time, rank balance.

    python benchmarks/micro_batches.py                          # tiny-qwen2-vl and tiny-qwen2-vl-20m, one process
    python benchmarks/micro_batches.py --ranks 2                # + the same batch on 2 gloo ranks (torchrun, DDP)

The batch: 16 prompts × 4 responses of the shapes suite; the first two prompts hold four images each and their
responses are 72–96 tokens long, every other response 8–11 (a long tail: 8 heavy rows among 64). Responses are random
non-special tokens (no rollout: the update is what is measured). One GRPO update (`prepare_batch` + `ppo_update`,
token_mean, one minibatch) per arm, back to back in one process:

- ``count``: ``train.micro_batch_size`` 16 — the heavy rows fall into the first micro-batches together;
- ``budget``: ``train.max_tokens_per_micro_batch`` = 1.05 × the count split's mean micro-batch cost
  (`vlrl.train.microbatch.CostModel`): about as many micro-batches, each near the mean.

Per arm: the loss and the gradient of the minibatch (max |Δ| against ``count``), the peak of torch's MemTracker over
the update's forward/backward passes (parameters, gradients, moments, activations, temporaries; after a warm-up
update so the moments exist), the median seconds of 3 updates, the micro-batches and the costliest one. With
``--ranks 2`` the rows are split as two data-parallel ranks would hold them (rank 0 the first half: both heavy
prompts) and each rank reports ``perf/rank_imbalance`` (max / mean rank cost) of both splits and its gradient.
torch uses one thread; seconds on a shared machine are comparable between arms of one run only.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROWS_PER_PROMPT, PROMPTS, HEAVY, LONG, SHORT, MICRO = 4, 16, 2, 96, 8, 16


def long_tail(policy):
    """(trajectories, RLStage settings) of the long-tail batch (module docstring)."""
    from vlrl.data import generate
    from vlrl.rollout import HFEngine
    from vlrl.rollout.types import Status, Trajectory

    samples = generate("shapes", PROMPTS, tasks=["count", "color"])
    extra = generate("shapes", 4 * HEAVY, tasks=["count"], split="test")
    for k in range(HEAVY):
        samples[k].images = [s.images[0] for s in extra[4 * k : 4 * k + 4]]
        samples[k].messages = [{"role": "user", "content": [{"type": "image"}] * 4 + samples[k].messages[0]["content"][1:]}]
    engine = HFEngine(policy)
    special = set(policy.adapter.special_token_ids())
    pool = torch.tensor([t for t in range(policy.model.config.get_text_config().vocab_size) if t not in special])
    generator = torch.Generator().manual_seed(0)
    rows = []
    for g, sample in enumerate(samples):
        request = engine.encode(sample)
        for j in range(ROWS_PER_PROMPT):
            n = (LONG - 8 * j) if g < HEAVY else (SHORT + j)  # lengths differ within a group: the loss is not 0
            rows.append(Trajectory(sample=sample, prompt_ids=torch.as_tensor(request.prompt_ids),
                                   response_ids=pool[torch.randint(len(pool), (n,), generator=generator)],
                                   loss_mask=torch.ones(n, dtype=torch.long), behaviour_logp=torch.full((n,), -1.0),
                                   vision=request.vision, images=request.images, status=Status.COMPLETED,
                                   group_index=g, reward=float((g + j) % 3)))
    return rows


def settings_for(policy, rows, budget: bool, whole=None):
    """The update's algorithm for ``rows``; with ``budget`` the token budget of the whole batch (``whole``, default
    ``rows``): a config value, the same on every rank."""
    from vlrl.config import RLStage
    from vlrl.train.batch import build_algorithm
    from vlrl.train.microbatch import CostModel, by_count

    stage = RLStage.model_validate({"rollout": {"n": ROWS_PER_PROMPT},
                                    "train": {"prompts_per_step": len(rows) // ROWS_PER_PROMPT, "micro_batch_size": MICRO}})
    algorithm = build_algorithm(stage, policy, apply_behaviour_weight=False)
    settings = algorithm.settings
    if budget:
        cost = CostModel.of(policy.model, padding_free=settings.padding_free, shared_prefix=settings.shared_prefix)
        whole = rows if whole is None else whole
        sizes = [cost.size(t.prompt_ids, t.response_ids, t.vision, prompt_key=str(t.group_index)) for t in whole]
        micro = by_count(range(len(whole)), MICRO)
        tokens = int(1.05 * sum(cost.micro([sizes[r] for r in m.rows]) for m in micro) / len(micro)) + 1
        settings = dataclasses.replace(settings, max_tokens_per_micro_batch=tokens)
    algorithm.settings = settings
    return algorithm


def step_tracker():
    """torch's MemTracker, restarting a module's stats when it is called again in the same step (each micro-batch
    calls the model once more; MemTracker refuses that otherwise). The global peak is kept across the step."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class StepTracker(MemTracker):
        def _pre_fw_hook(self, module, inputs):
            if module in self.memory_tracking and not self._mod_tracker.is_bw:
                for sub in module.modules():
                    self.memory_tracking.pop(sub, None)
            super()._pre_fw_hook(module, inputs)

    return StepTracker()


def arm(policy, rows, budget: bool, repeats: int) -> dict:
    from vlrl.train.batch import prepare_batch
    from vlrl.train.common import make_optimizer
    from vlrl.train.runtime import Runtime
    from vlrl.train.update import accumulate, minibatches, ppo_update

    algorithm = settings_for(policy, rows, budget)
    settings = algorithm.settings
    batch = prepare_batch(algorithm, policy, rows, step=0, max_new_tokens=LONG)
    state = {k: v.clone() for k, v in policy.model.state_dict().items()}
    optimizer, scheduler = make_optimizer(policy.model, algorithm_optim())
    ppo_update(policy, batch, settings, optimizer, scheduler, seed=0, step=0)  # warm-up: AdamW's moments exist
    policy.model.load_state_dict(state)
    model = policy.model
    model.train()
    mb = next(minibatches(policy, batch, settings, Runtime.single(model), seed=0, step=0))
    tracker = step_tracker()
    tracker.track_external(model, optimizer)
    with tracker:
        stats = accumulate(policy, mb.batch, [], settings, normaliser=mb.normaliser, micro_batches=mb.micro_batches)
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    seconds = []
    for r in range(repeats):
        start = time.perf_counter()
        ppo_update(policy, batch, settings, optimizer, scheduler, seed=0, step=1 + r)
        seconds.append(time.perf_counter() - start)
        policy.model.load_state_dict(state)
    return {"loss": stats.values["policy/loss"][0], "grads": grads, "micro_batches": len(mb.micro_batches),
            "costliest": mb.largest, "budget": settings.max_tokens_per_micro_batch,
            "peak_mib": peak["Total"] / 2**20 if "Total" in peak else sum(peak.values()) / 2**20,
            "act_mib": peak.get("Activation", 0) / 2**20, "seconds": statistics.median(seconds)}


def algorithm_optim():
    from vlrl.config import RLStage

    return RLStage().optim


def one_process(preset: str, repeats: int) -> None:
    from vlrl.models import load_policy

    policy = load_policy(preset)
    rows = long_tail(policy)
    tokens = [len(t.prompt_ids) + len(t.response_ids) for t in rows]
    print(f"{preset}: {len(rows)} rows, tokens per row {min(tokens)}–{max(tokens)} (mean {sum(tokens) / len(tokens):.0f})")
    out = {name: arm(policy, rows, name == "budget", repeats) for name in ("count", "budget")}
    count = out["count"]
    print(f"{'arm':<8s}{'micro':>6s}{'costliest':>11s}{'peak MiB':>10s}{'act MiB':>9s}{'update s':>10s}"
          f"{'loss':>12s}{'max |Δgrad|':>13s}")
    for name, r in out.items():
        diff = max(float((r["grads"][k] - g).abs().max()) for k, g in count["grads"].items())
        label = name + (f" ({r['budget']})" if r["budget"] else "")
        print(f"{label:<8s}{r['micro_batches']:>6d}{r['costliest']:>11.0f}{r['peak_mib']:>10.1f}{r['act_mib']:>9.1f}"
              f"{r['seconds']:>10.2f}{r['loss']:>12.3e}{diff:>13.2e}")


def rank_worker(preset: str) -> None:
    """One of 2 gloo ranks (DDP): this rank's half of the batch, both splits' ``perf/rank_imbalance`` and micro-batch
    counts, and whether the budget's gradient equals the count split's."""
    from vlrl.config import DistConfig
    from vlrl.models import load_policy
    from vlrl.train.batch import prepare_batch
    from vlrl.train.distributed import GlobalAdvantage, init_distributed, unwrap, wrap_model
    from vlrl.train.runtime import Runtime
    from vlrl.train.update import accumulate, minibatches

    cfg = DistConfig(strategy="ddp")
    ctx = init_distributed(cfg)
    policy = load_policy(preset)
    whole = long_tail(policy)
    rows = ctx.shard(whole, what="rows")
    rt = Runtime(ctx, wrap_model(policy.model, ctx, cfg), cfg)
    got = {}
    for name in ("count", "budget"):
        algorithm = settings_for(policy, rows, name == "budget", whole)
        algorithm.advantage_fn = GlobalAdvantage(algorithm.advantage_fn, ctx)
        batch = prepare_batch(algorithm, policy, rows, step=0, max_new_tokens=LONG)
        rt.module.train()
        rt.module.zero_grad(set_to_none=True)
        mb = next(minibatches(policy, batch, algorithm.settings, rt, seed=0, step=0))
        accumulate(policy, mb.batch, [], algorithm.settings, normaliser=mb.normaliser, runtime=rt,
                   micro_batches=mb.micro_batches)
        got[name] = ({n: p.grad.clone() for n, p in unwrap(rt.module).named_parameters() if p.grad is not None}, mb)
    diff = max(float((got["budget"][0][k] - g).abs().max()) for k, g in got["count"][0].items())
    for name, (_, mb) in got.items():
        print(f"rank {ctx.rank} {name}: perf/rank_imbalance {mb.metrics['perf/rank_imbalance']:.3f}, "
              f"{len(mb.micro_batches)} micro-batches ({int(mb.metrics['perf/noop_micro_batches'])} no-op), "
              f"costliest {mb.largest:.0f}" + (f", max |Δgrad| vs count {diff:.2e}" if name == "budget" else ""),
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="*", default=["tiny-qwen2-vl", "tiny-qwen2-vl-20m"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=1, help="2: also the batch on 2 gloo ranks (torchrun)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.worker:
        rank_worker(args.worker)
        return
    for preset in args.presets:
        one_process(preset, args.repeats)
        if args.ranks == 2:
            subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                            str(Path(__file__).resolve()), "--worker", preset], check=True)


if __name__ == "__main__":
    main()
