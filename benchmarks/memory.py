"""Peak memory and time of one GRPO update on the ~20M preset: full / full + checkpointing / LoRA / LoRA + ckpt.

    python benchmarks/memory.py             # tiny-qwen2-vl-20m, 16 prompts × 8 responses, 3 repeats per arm
    python benchmarks/memory.py --quick     # tiny-qwen2-vl, 4 × 8, 1 repeat

One batch of trajectories is sampled once from the preset (shapes count/color prompts, 16 new tokens) and every
arm runs the same `ppo_update` on it (the part of a GRPO step these options change; generation is the same for
all arms): teacher-forced forward + backward in micro-batches of 32 + AdamW step. Peak memory is torch's
MemTracker on CPU (its per-module stats restarted when the vision tower is called again for the next image
group in the same step) over one micro-batch's forward + backward (parameters, gradients, AdamW moments, activations
and temporaries; micro-batches run one by one, so this is the update's peak), after a warm-up update so the
moments exist. Time: the median of whole `ppo_update` calls. Arms run back to back in one process, so their ratios are comparable even on a shared machine;
absolute seconds are not. torch uses one thread.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _step_tracker():
    """torch's `MemTracker`, tolerating a top-level module called more than once in one step.

    The update encodes each distinct image group once (`_shared_kwargs` calls the vision tower per group,
    outside the decoder's forward), which `MemTracker` takes for a new iteration and refuses. Here such a
    repeated call restarts that module's (and its submodules') per-module stats instead; the global peak and the
    category totals this benchmark reads are kept across the step."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class StepTracker(MemTracker):
        def _pre_fw_hook(self, module, inputs):
            name = self._mod_tracker.get_known_fqn(module)
            repeated = (module in self.memory_tracking and not self._mod_tracker.is_bw
                        and set(self._mod_tracker.parents) - {name} == {"Global"})
            if repeated:
                for sub in module.modules():
                    self.memory_tracking.pop(sub, None)
            super()._pre_fw_hook(module, inputs)

    return StepTracker()


def arm_update(preset: str, trajectories, *, lora: bool, checkpointing: bool, micro: int, repeats: int):
    from vlrl.compat import _NoHook
    from vlrl.config import LoraConfig, RLStage
    from vlrl.models import load_policy
    from vlrl.models.lora import apply_lora
    from vlrl.train.batch import build_algorithm, prepare_batch
    from vlrl.train.common import make_optimizer
    from vlrl.train.modules import gradient_checkpointing
    from vlrl.train.update import accumulate, ppo_update

    policy = load_policy(preset)
    if lora:
        apply_lora(policy, LoraConfig(r=16, alpha=32))
    stage = RLStage.model_validate({"rollout": {"n": 8}, "train": {"prompts_per_step": len(trajectories) // 8,
                                                                   "micro_batch_size": micro}})
    algorithm = build_algorithm(stage, policy, apply_behaviour_weight=False)
    batch = prepare_batch(algorithm, policy, trajectories, step=0, max_new_tokens=16)
    optimizer, scheduler = make_optimizer(policy.model, stage.optim)
    with gradient_checkpointing(policy.model, checkpointing):
        ppo_update(policy, batch, algorithm.settings, optimizer, scheduler, seed=0, step=0)  # warm-up: moments exist
        tracker = _step_tracker()
        tracker.track_external(policy.model, optimizer)
        for p in policy.model.parameters():
            if not p.requires_grad:
                tracker._param_to_grad_hook_handles[p] = (_NoHook(), _NoHook())
        policy.model.train()  # as inside ppo_update (which leaves the model in eval mode): blocks checkpoint in training
        with tracker:  # one micro-batch's forward + backward (the update's peak: micro-batches run one by one)
            accumulate(policy, batch, range(micro), algorithm.settings, normaliser=float(batch.loss_mask.sum()))
            optimizer.zero_grad(set_to_none=False)  # gradients stay allocated, as in the update's later micro-batches
        peak = {str(k).split(".")[-1].lower(): v for k, v in tracker.get_tracker_snapshot("peak")[torch.device("cpu")].items()}
        seconds = []
        for r in range(repeats):
            t0 = time.perf_counter()
            ppo_update(policy, batch, algorithm.settings, optimizer, scheduler, seed=0, step=2 + r)
            seconds.append(time.perf_counter() - t0)
    return peak, statistics.median(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=3, help="timed updates per arm (median)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from vlrl.data import generate
    from vlrl.models import load_policy
    from vlrl.rollout import HFEngine, SamplingParams

    preset, prompts, n, repeats = ("tiny-qwen2-vl", 4, 8, 1) if args.quick else ("tiny-qwen2-vl-20m", 16, 8, args.repeats)
    torch.manual_seed(0)
    engine = HFEngine(load_policy(preset))
    samples = generate("shapes", prompts, tasks=["count", "color"])
    trajectories = engine.generate([engine.encode(s) for s in samples], SamplingParams(n=n, max_new_tokens=16))
    for k, t in enumerate(trajectories):  # distinct rewards: every advantage non-zero, every row trained
        t.reward = float(k % 3)
    print(f"{preset}: {prompts} prompts × {n} responses, update in micro-batches of 32, {repeats} timed repeat(s)")
    print(f"{'arm':<26s}{'peak MiB':>10s}{'activations MiB':>17s}{'grads+moments MiB':>19s}{'update s':>10s}")
    rows = {}
    for name, lora, ckpt in (("full", False, False), ("full + checkpointing", False, True),
                             ("LoRA r=16", True, False), ("LoRA r=16 + checkpointing", True, True)):
        peak, seconds = arm_update(preset, trajectories, lora=lora, checkpointing=ckpt, micro=32, repeats=repeats)
        rows[name] = (peak, seconds)
        print(f"{name:<26s}{peak['total'] / 2**20:10.1f}{peak.get('act', 0) / 2**20:17.1f}"
              f"{(peak.get('grad', 0) + peak.get('opt', 0)) / 2**20:19.1f}{seconds:10.2f}", flush=True)
    for base, ckpt in (("full", "full + checkpointing"), ("LoRA r=16", "LoRA r=16 + checkpointing")):
        (p0, s0), (p1, s1) = rows[base], rows[ckpt]
        print(f"checkpointing vs {base}: activations ÷{p0.get('act', 0) / max(p1.get('act', 1), 1):.2f}, "
              f"peak ÷{p0['total'] / p1['total']:.2f}, update time ×{s1 / s0:.2f}")


if __name__ == "__main__":
    main()
