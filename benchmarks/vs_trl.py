"""vlrl's synchronous GRPO step against TRL's `GRPOTrainer`, side by side on the same weights and prompts.

Both arms train a copy of the same preset (same initial weights, fp32, one process, CPU) on the same shapes
prompts with the same reward (a dense length reward: every group has mixed rewards), one optimizer step per
batch of ``prompts × n`` responses: lr 1e-4, AdamW, no KL (β = 0), one update per batch (TRL
``num_iterations=1``; vlrl ``ppo_epochs=1``, so neither runs a π_old pass), temperature 1. Both run twice:
gradient checkpointing off and on (TRL's default; vlrl's ``train.gradient_checkpointing``, on by default from
100M parameters — its update still shares each group's prompt, `vlrl.models.grouped`). Each arm trains its own
copy of the weights. The arms alternate (vlrl, vlrl+ckpt, TRL, TRL+ckpt, vlrl, …) and every step is timed on its
own; the medians are reported, with the phases:

- vlrl: ``prefill`` (prompts, vision tower included, each prompt once per group) and ``decode`` from the
  engine; ``forward`` (the teacher-forced pass), ``optimizer`` (clip + AdamW) timed around their calls,
  ``backward`` = the update minus both; ``other`` = the step minus all of these (rewards, advantages, logging).
- TRL: ``generate`` (`model.generate`: prefill of every copy + decode), ``forward`` (``compute_loss``),
  ``backward`` (``accelerator.backward``), ``optimizer`` (between the trainer's pre/post optimizer callbacks),
  ``other`` the rest.

    pip install trl    # without it this script prints why and exits 0
    PYTHONPATH=src python benchmarks/vs_trl.py --shape today --preset tiny-qwen2-vl
    PYTHONPATH=src python benchmarks/vs_trl.py --shape realistic --preset tiny-qwen2-vl-20m --threads 2

Shapes: ``today`` 8 prompts × n 4 × 32 new tokens, 112×112 images (16 vision tokens); ``realistic`` 4 prompts
× n 8 × 64 new tokens, 448×448 images (256 vision tokens).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections import defaultdict

import torch

SHAPES = {"today": dict(prompts=8, n=4, new=32, side=112), "realistic": dict(prompts=4, n=8, new=64, side=448)}
LR = 1e-4


def length_reward(text: str) -> float:
    """Shorter is better: 1 / (1 + characters). Dense, so no group is all-equal."""
    return 1.0 / (1.0 + len(text))


class Phases:
    """Seconds per phase of the current step, and the finished steps."""

    def __init__(self) -> None:
        self.current: dict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []

    def timed(self, name: str, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.current[name] += time.perf_counter() - start
        return wrapper

    def finish(self, total: float) -> None:
        step = dict(self.current)
        step["other"] = total - sum(step.values())
        step["step"] = total
        self.steps.append(step)
        self.current = defaultdict(float)


# ----------------------------------------------------------------------------------------------- vlrl
class VlrlArm:
    def __init__(self, policy, samples, shape, *, checkpointing: bool = False) -> None:
        import dataclasses

        from vlrl.config import RLStage
        from vlrl.rollout import HFEngine

        policy = dataclasses.replace(policy, model=copy.deepcopy(policy.model))  # this arm's own weights
        self.policy, self.samples = policy, samples
        for s in self.samples:
            s.reward = "bench_length"
        self.engine = HFEngine(policy)
        rows = shape["prompts"] * shape["n"]
        self.stage = RLStage.model_validate({
            "optim": {"lr": LR}, "algo": {"kl_coef": 0.0},
            "rollout": {"n": shape["n"], "temperature": 1.0, "max_new_tokens": shape["new"]},
            "train": {"steps": 1, "prompts_per_step": shape["prompts"], "micro_batch_size": rows,
                      "gradient_checkpointing": checkpointing},
        })
        self.phases = Phases()
        self.tokens: list[int] = []

    def step(self) -> None:
        import vlrl.train.learner as learner
        import vlrl.train.loop as loop
        import vlrl.train.update as update
        from vlrl.report import MetricsLogger

        phases, saved = self.phases, (update.teacher_forced, update.step_or_skip, learner.ppo_update)
        update.teacher_forced = phases.timed("forward", saved[0])
        update.step_or_skip = phases.timed("optimizer", saved[1])
        learner.ppo_update = phases.timed("update", saved[2])
        before = copy.copy(self.engine.total_stats)
        logger = MetricsLogger(None, quiet=True)
        try:
            start = time.perf_counter()
            loop.train_rl(self.policy, self.engine, self.samples, self.stage, logger=logger, seed=len(phases.steps))
            total = time.perf_counter() - start
        finally:
            update.teacher_forced, update.step_or_skip, learner.ppo_update = saved
        stats = self.engine.total_stats
        phases.current["prefill"] = stats.prefill_seconds - before.prefill_seconds
        phases.current["decode"] = stats.decode_seconds - before.decode_seconds
        update_total = phases.current.pop("update")
        phases.current["backward"] = update_total - phases.current["forward"] - phases.current["optimizer"]
        phases.finish(total)
        record = logger.records[-1]
        self.signature = {k: record.get(k) for k in ("perf/shared_prefix_frac", "perf/gradient_checkpointing")}
        self.tokens.append(round(record["response/length_mean"] * len(self.samples[: self.stage.train.prompts_per_step])
                                 * self.stage.rollout.n))


def register_bench_reward() -> None:
    """``bench_length``: `length_reward` as a vlrl verifier (registered once, by `main`)."""
    from vlrl.rewards import register_reward

    register_reward("bench_length")(lambda response, answer, **meta: length_reward(response))


# ----------------------------------------------------------------------------------------------- TRL
def trl_processor(policy):
    """A transformers processor for the preset: the family's own when the adapter has one, else Qwen2-VL's
    (without a video processor, which needs torchvision)."""
    processor = getattr(policy.adapter, "processor", None)
    if processor is not None:
        if getattr(processor, "chat_template", None) is None:  # the presets keep the template on the tokenizer
            processor.chat_template = policy.tokenizer.chat_template
        return processor
    from transformers import Qwen2VLProcessor

    class ImageOnlyProcessor(Qwen2VLProcessor):
        def check_argument_for_proper_class(self, argument_name, argument):
            return None

    return ImageOnlyProcessor(image_processor=policy.image_processor, tokenizer=policy.tokenizer,
                              video_processor=None, chat_template=policy.tokenizer.chat_template)


class TrlArm:
    def __init__(self, policy, samples, shape, *, checkpointing: bool, workdir: str) -> None:
        from datasets import Dataset
        from transformers import TrainerCallback
        from trl import GRPOConfig, GRPOTrainer

        from vlrl.data.sample import load_image

        self.phases = phases = Phases()
        self.tokens: list[int] = []
        rows = shape["prompts"] * shape["n"]
        model = copy.deepcopy(policy.model)
        model.generate = phases.timed("generate", model.generate)
        records = [{"prompt": s.messages, "image": load_image(s.images[0])} for s in samples]
        dataset = Dataset.from_list(records * 50)
        eos = set(policy.eos_token_ids)
        suppress = [t for t in policy.adapter.special_token_ids() if t not in eos]  # as vlrl: no image tokens
        config = GRPOConfig(
            output_dir=workdir, use_cpu=True, bf16=False, fp16=False, learning_rate=LR, beta=0.0, num_iterations=1,
            num_generations=shape["n"], per_device_train_batch_size=rows, gradient_accumulation_steps=1,
            steps_per_generation=1, max_completion_length=shape["new"], temperature=1.0,
            gradient_checkpointing=checkpointing, max_steps=10_000, logging_steps=10_000, save_strategy="no",
            report_to=[], disable_tqdm=True, seed=0, dataloader_num_workers=0, remove_unused_columns=False,
            generation_kwargs={"suppress_tokens": suppress},
        )

        def reward(completions, **kwargs):
            return [length_reward(c if isinstance(c, str) else c[-1]["content"]) for c in completions]

        self.trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=config, train_dataset=dataset,
                                   processing_class=trl_processor(policy))
        self.trainer.compute_loss = phases.timed("forward", self.trainer.compute_loss)
        self.trainer.accelerator.backward = phases.timed("backward", self.trainer.accelerator.backward)
        arm = self

        class Timer(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                arm._start = time.perf_counter()

            def on_pre_optimizer_step(self, args, state, control, **kw):
                arm._opt = time.perf_counter()

            def on_optimizer_step(self, args, state, control, **kw):
                phases.current["optimizer"] += time.perf_counter() - arm._opt

            def on_step_end(self, args, state, control, **kw):
                phases.finish(time.perf_counter() - arm._start)
                mask = arm.trainer._last_completion_tokens
                arm.tokens.append(mask)
                control.should_training_stop = True  # one step per `step()` call

        self.trainer.add_callback(Timer())
        original = self.trainer._generate_and_score_completions

        def counted(*args, **kwargs):
            out = original(*args, **kwargs)
            self.trainer._last_completion_tokens = int(out["completion_mask"].sum())
            return out

        self.trainer._generate_and_score_completions = counted

    def step(self) -> None:
        self.trainer.train()


# ----------------------------------------------------------------------------------------------- main
def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="tiny-qwen2-vl")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="today")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3, help="timed steps per arm (after one warm-up step each)")
    parser.add_argument("--no-checkpointing-arm", action="store_true",
                        help="skip the arms with gradient checkpointing (vlrl's and TRL's)")
    args = parser.parse_args()
    try:
        import trl
    except ImportError:
        print("benchmarks/vs_trl.py: trl is not installed (pip install trl) — nothing to compare against; skipped.")
        return 0
    import tempfile
    import warnings

    import transformers

    warnings.filterwarnings("ignore", category=FutureWarning)
    transformers.logging.set_verbosity_error()

    from vlrl.data import generate
    from vlrl.models import load_policy

    torch.set_num_threads(args.threads)
    register_bench_reward()
    shape = SHAPES[args.shape]
    side = shape["side"]
    torch.manual_seed(0)
    policy = load_policy(args.preset, max_pixels=side * side)
    initial = copy.deepcopy(policy.model.state_dict())
    samples = generate("shapes", shape["prompts"], tasks=["count", "color"], image_size=side)
    workdir = tempfile.mkdtemp(prefix="vs_trl_")
    arms = {}
    arms["trl"] = TrlArm(policy, samples, shape, checkpointing=False, workdir=workdir)
    if not args.no_checkpointing_arm:
        arms["trl+ckpt"] = TrlArm(policy, samples, shape, checkpointing=True, workdir=workdir)
    policy.model.load_state_dict(initial)
    vlrl_arms = {"vlrl": VlrlArm(policy, samples, shape)}
    if not args.no_checkpointing_arm:
        vlrl_arms["vlrl+ckpt"] = VlrlArm(policy, samples, shape, checkpointing=True)
    arms = {**vlrl_arms, **arms}
    vision = sum(1 for t in arms["vlrl"].engine.encode(samples[0]).prompt_ids if t == policy.model.config.image_token_id)
    print(f"vlrl vs TRL {trl.__version__} (transformers {transformers.__version__}, torch {torch.__version__}); "
          f"{args.preset} ({policy.num_parameters() / 1e6:.1f}M), shape {args.shape}: {shape['prompts']} prompts × n "
          f"{shape['n']} × {shape['new']} new tokens, {vision} vision tokens/image, fp32, {args.threads} thread(s), "
          f"lr {LR}, no KL, one update per batch; arms alternated, {args.rounds} timed steps each")
    for arm in arms.values():  # warm-up
        arm.step()
        arm.phases.steps.clear()
        arm.tokens.clear()
    for _ in range(args.rounds):
        for arm in arms.values():
            arm.step()
    names = ["prefill", "decode", "generate", "forward", "backward", "optimizer", "other"]
    print(f"{'arm':9s} {'s/step':>7s} {'gen tok/s':>9s} " + " ".join(f"{n:>9s}" for n in names))
    medians = {}
    for name, arm in arms.items():
        med = {k: statistics.median(step.get(k, 0.0) for step in arm.phases.steps) for k in names + ["step"]}
        gen = med["prefill"] + med["decode"] + med["generate"]
        tokens = statistics.median(arm.tokens)
        medians[name] = med["step"]
        print(f"{name:9s} {med['step']:7.2f} {tokens / gen:9.0f} " + " ".join(
            f"{med[k]:9.2f}" if (k not in ("prefill", "decode", "generate") or med[k]) else f"{'-':>9s}" for k in names))
    for name in arms:
        if name != "vlrl":
            print(f"vlrl throughput / {name}: {medians[name] / medians['vlrl']:.2f}x")
    for name, arm in vlrl_arms.items():  # what the update ran: the shared prompt, checkpointing
        print(f"{name}: " + ", ".join(f"{k} = {v}" for k, v in arm.signature.items()))
    if "vlrl+ckpt" in medians and "trl+ckpt" in medians:
        print(f"vlrl+ckpt throughput / trl+ckpt: {medians['trl+ckpt'] / medians['vlrl+ckpt']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
