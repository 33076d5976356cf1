"""Pieces every recipe uses: seeding, the optimizer, data loading, the prompt cursor, the run directory, frozen
copies and no-grad evaluation of a model."""

from __future__ import annotations

import copy
import hashlib
import json
import math
import random
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vlrl.config import DataConfig, OptimConfig, Section, dump_config
from vlrl.data import DataError, MediaLimits, Sample, SampleError, generate, prepare_media, read_samples
from vlrl.report import MetricsLogger


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def make_optimizer(
    model: torch.nn.Module, cfg: OptimConfig, module_groups: dict[str, tuple[str, ...]] | None = None, *,
    total_steps: int | None = None,
) -> tuple[torch.optim.Optimizer, Any]:
    """AdamW over trainable parameters, with linear warm-up, then ``cfg.schedule`` over ``total_steps``.

    ``cfg.module_lr`` gives modules their own learning rate; its names are the family's ``module_groups``
    (the policy adapter's) or parameter-name prefixes (`vlrl.train.modules`).
    """
    from vlrl.train.modules import param_groups

    params = param_groups(model, cfg.lr, cfg.module_lr, module_groups or {})
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, partial(lr_factor, cfg=cfg, total_steps=total_steps))
    return optimizer, scheduler


def lr_factor(step: int, *, cfg: OptimConfig, total_steps: int | None) -> float:
    """The learning rate of optimizer step ``step`` (0-based) as a fraction of the peak: ``(step + 1) / warmup``
    during the warm-up, then 1 (constant) or a decay that reaches ``min_lr_ratio`` at the last of ``total_steps``."""
    warmup = cfg.warmup_steps
    if step < warmup:
        return (step + 1) / warmup
    if cfg.schedule == "constant":
        return 1.0
    if total_steps is None:
        raise ValueError(f"optim.schedule={cfg.schedule} decays over the stage's train.steps, which this stage has not set")
    span = max(1, total_steps - warmup - 1)
    progress = min(1.0, (step - warmup) / span)
    shape = 1.0 - progress if cfg.schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape


class NonFiniteError(FloatingPointError):
    """A NaN or infinite loss or gradient norm, found before the optimizer applied it (the gradients are
    cleared, the weights and optimizer state untouched). ``which`` is "loss" or "grad norm"."""

    def __init__(self, which: str, value: float, where: str = "") -> None:
        self.which, self.value = which, value
        super().__init__(f"{where + ': ' if where else ''}the {which} is {value} — the run stopped before the optimizer "
                         "applied it (train.on_nonfinite=skip drops such updates instead; a learning rate too high "
                         "or a loss on empty masks are the usual causes)")


def clip_and_step(model: torch.nn.Module, optimizer, scheduler, grad_clip: float, *, loss: float | None = None,
                  ctx: Any = None) -> float:
    """Clip the global gradient norm (if > 0), step, zero the gradients; return the pre-clip norm.

    The one place an optimizer step happens (SFT, the RL update of both recipes, the critic). A non-finite
    ``loss`` (the step's, when given) or gradient norm raises `NonFiniteError` instead, with the gradients
    cleared and nothing applied; ranks agree on it (``ctx``, a `DistContext`), so all raise at the same step."""
    params = [p for p in model.parameters() if p.grad is not None]
    if grad_clip > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params]) if params else torch.tensor(0.0)
    value = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # FSDP2: a DTensor over all ranks
    flags = [0.0 if loss is None or math.isfinite(loss) else 1.0, 0.0 if math.isfinite(value) else 1.0]
    if ctx is not None:
        flags = ctx.all_reduce_sum(flags)
    if flags[0] or flags[1]:
        optimizer.zero_grad(set_to_none=True)
        raise NonFiniteError("loss", loss if loss is not None else math.nan) if flags[0] \
            else NonFiniteError("grad norm", value)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return value


def step_or_skip(model: torch.nn.Module, optimizer, scheduler, grad_clip: float, *, on_nonfinite: str, where: str,
                 loss: float | None = None, ctx: Any = None) -> float | None:
    """`clip_and_step` under ``train.on_nonfinite``: the gradient norm; or, for a non-finite loss or gradient,
    ``stop`` raises `NonFiniteError` naming ``where`` (e.g. "sft step 12") and the value, ``skip`` returns
    None — the update is dropped, the scheduler still advances (the learning rate stays a function of the step)."""
    try:
        return clip_and_step(model, optimizer, scheduler, grad_clip, loss=loss, ctx=ctx)
    except NonFiniteError as err:
        if on_nonfinite != "skip":
            raise NonFiniteError(err.which, err.value, where) from None
        scheduler.step()
        return None


def reward_names_check(sample: Sample) -> None:
    """Reject a sample whose reward names are not registered (the reader adds file and line)."""
    from vlrl.rewards import get_reward

    for name in sample.reward_names():
        get_reward(name)


def sample_check(sample: Sample) -> None:
    """`reward_names_check`, and reject a sample whose reference answer its own verifier can never score as
    correct (`vlrl.rewards.reference`: ``answer: "seven"`` with ``number``)."""
    from vlrl.rewards.reference import unscorable_answer

    reward_names_check(sample)
    problem = unscorable_answer(sample.answer, sample.reward, sample.metadata, sample.response)
    if problem:
        raise ValueError(problem)


def media_limits(cfg: DataConfig) -> MediaLimits:
    """Video frame sampling and per-sample image budgets of ``cfg`` (`vlrl.data.video`)."""
    return MediaLimits(video_fps=cfg.video_fps, max_frames=cfg.max_frames, max_images=cfg.max_images,
                       max_image_pixels=cfg.max_image_pixels, max_sample_pixels=cfg.max_sample_pixels,
                       max_record_bytes=cfg.max_record_bytes)


def schema_for(cfg: DataConfig, split: str = "train"):
    """The layout settings of ``cfg`` for its ``train`` or ``test`` data (`vlrl.data.schemas.Schema`); a
    ``prompt_template`` naming a file is read here. `ValueError` names the field."""
    from vlrl.data.schemas import Schema

    template = cfg.prompt_template
    if template is not None and "{" not in template and Path(template).expanduser().is_file():
        template = Path(template).expanduser().read_text(encoding="utf-8")
    return Schema(format=cfg.format, columns=dict(cfg.columns), prompt_template=template,
                  system_prompt=cfg.system_prompt, reward=cfg.reward, reward_by_source=dict(cfg.reward_by_source),
                  split=cfg.split if split == "train" else cfg.test_split, subset=cfg.subset, revision=cfg.revision)


def generate_split(cfg: DataConfig, split: str, n: int) -> list[Sample]:
    """``n`` samples of the procedural suite, their videos as sampled frames and within the budgets (a sample
    over one raises `DataError` naming it and the field: the suite's options are then wrong for the budgets)."""
    limits, samples = media_limits(cfg), []
    for sample in generate(cfg.suite, n, split=split, seed=cfg.seed, tasks=cfg.tasks, **cfg.suite_options):
        try:
            samples.append(prepare_media(sample, limits))
        except SampleError as err:
            raise DataError(f"{cfg.suite} sample {sample.id}: {err}") from err
    return samples


def load_split(cfg: DataConfig, split: str, logger: MetricsLogger | None = None) -> list[Sample]:
    """The ``train`` or ``test`` samples: read from the configured file, or generated procedurally; videos become
    sampled frames and the per-sample budgets hold (`media_limits`). (Reads ``cfg.train`` whole: the held-out
    split of a training file is `load_splits`'.)"""
    path = cfg.train if split == "train" else cfg.test
    if path is None:
        samples = generate_split(cfg, split, cfg.n_train if split == "train" else cfg.n_test)
        _log_videos(samples, cfg, split, logger)
        return samples
    report = read_samples(path, on_error=cfg.on_error, check=sample_check, media=media_limits(cfg),
                          schema=schema_for(cfg, split))
    _log_videos(report.samples, cfg, split, logger)
    if logger is not None:
        from rich.markup import escape  # names such as DIR[train] are not console markup

        logger.info(escape(f"data {split}: {path}: {report.summary()}"))
        for line in report.layout_lines():
            logger.info(escape(f"data {split}: {line}"))
        if report.skipped:
            logger.log("data", 0, {f"data/{split}_skipped": len(report.skipped), f"data/{split}_read": len(report.samples)})
    if not report.samples:
        raise DataError(f"{path}: no usable samples ({len(report.skipped)} skipped)")
    return report.samples


def _log_videos(samples: list[Sample], cfg: DataConfig, split: str, logger: MetricsLogger | None) -> None:
    """State how many videos a split holds and how many frames they became (``data/<split>_videos``,
    ``data/<split>_frames_per_video``)."""
    frames = [n for s in samples for n in s.metadata.get("video_frames", [])]
    if logger is None or not frames:
        return
    mean = sum(frames) / len(frames)
    logger.info(f"data {split}: {len(frames)} video(s) fed as sampled frames, {mean:.1f} per video on average "
                f"(data.video_fps {cfg.video_fps:g}, data.max_frames {cfg.max_frames}; each frame is an image)")
    logger.log("data", 0, {f"data/{split}_videos": len(frames), f"data/{split}_frames_per_video": mean})


def holds_out(cfg: DataConfig) -> bool:
    """Whether the held-out samples come out of ``cfg.train`` (a file given, no ``cfg.test``)."""
    return cfg.train is not None and cfg.test is None


def hold_out_problem(cfg: DataConfig, n_train: int | None = None) -> str | None:
    """Why no test split can be held out of ``cfg.train`` (``n_train`` samples), or None. The message is about
    the field ``data.test``."""
    if not holds_out(cfg):
        return None
    if cfg.packing_plan is not None:
        return (f"unset, and data.train ({cfg.train}) is packed by data.packing_plan, which covers the whole file: "
                "give held-out samples with --test FILE / data.test")
    if cfg.test_fraction == 0:
        return (f"unset, and data.test_fraction is 0: evaluating on the procedural {cfg.suite!r} suite would not "
                f"measure your data ({cfg.train}); give held-out samples with --test FILE / data.test, or set "
                "data.test_fraction (e.g. 0.1) to hold some out of data.train")
    if n_train is not None and n_train < 2:
        return f"unset, and data.train ({cfg.train}) holds {n_train} sample(s): too few to hold any out; give --test FILE"
    return None


def split_held_out(samples: list[Sample], cfg: DataConfig) -> tuple[list[Sample], list[Sample]]:
    """(train, test): ``round(test_fraction × N)`` samples (at least 1, at most ``n_test``, leaving at least 1 to
    train on) held out of ``samples``. They are the samples whose sha256(seed:id) sort first, so the split
    depends only on the ids and ``cfg.seed``: `vlrl sft` and `vlrl rl` on the same file hold out the same
    samples, and reordering or appending to the file moves few of them."""
    count = min(max(1, round(cfg.test_fraction * len(samples))), cfg.n_test, len(samples) - 1)
    rank = sorted(range(len(samples)), key=lambda k: hashlib.sha256(f"{cfg.seed}:{samples[k].id}".encode()).hexdigest())
    test_index = set(rank[:count])
    return ([s for k, s in enumerate(samples) if k not in test_index],
            [s for k, s in enumerate(samples) if k in test_index])


def load_splits(cfg: DataConfig, logger: MetricsLogger | None = None) -> tuple[list[Sample], list[Sample]]:
    """(train, test) of a run: each read from its file or generated; with a training file and no test file, a
    seeded share of the file held out (`split_held_out`, stated in the log) — never the procedural suite.
    Raises `DataError` (``data.test: …``) when nothing can be held out."""
    train = load_split(cfg, "train", logger)
    if not holds_out(cfg):
        return train, load_split(cfg, "test", logger)
    problem = hold_out_problem(cfg, len(train))
    if problem:
        raise DataError(f"data.test: {problem}")
    train, test = split_held_out(train, cfg)
    if logger is not None:
        logger.info(f"data test: held out {len(test)} of {len(train) + len(test)} samples of {cfg.train} "
                    f"(data.test_fraction {cfg.test_fraction:g}, at most data.n_test {cfg.n_test}; seed data.seed "
                    f"{cfg.seed}); training on the other {len(train)}. Give --test FILE to evaluate on your own split.")
    return train, test


class PromptCursor:
    """Endless shuffled passes over a dataset; each epoch's order is fixed by (seed, epoch)."""

    def __init__(self, samples: list[Sample], seed: int) -> None:
        if not samples:
            raise ValueError("no samples to draw prompts from")
        self.samples, self.seed = samples, seed
        self.epoch, self.position = 0, 0
        self._initial = len(samples)  # a dataset may grow as it trains (Syn-GRPO's append): from the next epoch on
        self._order = self._permutation()

    def _permutation(self, size: int | None = None) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return torch.randperm(len(self.samples) if size is None else size, generator=generator).tolist()

    def next(self, count: int) -> list[Sample]:
        out = []
        while len(out) < count:
            if self.position == len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation()
            index = self._order[self.position]
            if index >= len(self.samples):  # an order restored from a checkpoint of a larger dataset
                raise ValueError(f"data cursor: the checkpoint's epoch orders more samples than the {len(self.samples)} "
                                 "of this dataset: the checkpoint was written for different data")
            out.append(self.samples[index])
            self.position += 1
        return out

    def state(self) -> dict[str, int]:
        """Epoch and position; and the size of the epoch's order when the dataset has grown since it was given."""
        state = {"epoch": self.epoch, "position": self.position}
        if len(self._order) != self._initial:
            state["size"] = len(self._order)
        return state

    def load_state(self, state: dict[str, int]) -> None:
        """Continue from a `state()` (checkpoints): the same epoch order, the same position in it."""
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._permutation(int(state.get("size", len(self.samples))))  # (sizes checked as it draws)
        if not 0 <= self.position <= len(self._order):
            raise ValueError(f"data cursor position {self.position} is outside the dataset of {len(self._order)} "
                             "samples: the checkpoint was written for different data")


def prepare_run_dir(out: str | Path, config: Section, *, keep_metrics_bytes: int | None = None) -> tuple[Path, MetricsLogger]:
    """Create the run directory, write the resolved ``config.yaml``, open ``metrics.jsonl`` — a fresh one, or
    (resuming) the existing one, whose first ``keep_metrics_bytes`` are what the checkpoint saw: the clock goes
    on from their last record. The file is cut back to them only once the checkpoint has loaded
    (`vlrl.train.checkpoint.Checkpointer.load`), so a resume that fails leaves it whole."""
    run_dir = Path(out)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_config(config))
    metrics = run_dir / "metrics.jsonl"
    elapsed = 0.0
    if keep_metrics_bytes is not None and metrics.exists():
        with open(metrics, "rb") as handle:
            lines = handle.read(keep_metrics_bytes).decode("utf-8", errors="replace").splitlines()
        elapsed = float(json.loads(lines[-1]).get("time", 0.0)) if lines else 0.0
    elif metrics.exists():
        metrics.unlink()
    logger = MetricsLogger(metrics)
    logger.start -= elapsed  # a resumed run's "time" goes on from the checkpoint's last record
    return run_dir, logger


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A frozen copy of ``model`` in eval mode (a reference policy, a teacher)."""
    reference = copy.deepcopy(model).eval()
    for p in reference.parameters():
        p.requires_grad_(False)
    return reference


@contextmanager
def evaluating(model: torch.nn.Module) -> Iterator[None]:
    """No gradient and eval mode (no dropout) for a teacher-forced pass; the model's mode is restored after."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)
