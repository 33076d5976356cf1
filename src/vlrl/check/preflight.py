"""Preflight (`vlrl check CONFIG`, and automatically at the start of every recipe): find what would break a run
before any model weights are loaded.

It reads the model's config, tokenizer and image processor (a tiny preset is built on the ``meta`` device:
no weights exist), reads the data files (every record must parse) and encodes a handful of samples — the
first few of every task and the longest prompts — to check:

- every image's vision-token count in the prompt equals the number of features the vision tower will
  produce (``prod(grid_thw) / spatial_merge_size²`` of the *model*), the mismatch that otherwise stops
  training with "Image features and image tokens do not match";
- prompt + ``max_new_tokens`` (rollout and eval) and prompt + reference response (SFT) fit the context;
- batch, group and micro-batch sizes divide;
- every reward name, estimator, policy loss, metric sink and dotted path (``pkg.mod:fn``, e.g. an
  environment) resolves; every verifier the data names has its optional dependencies; the procedural suite
  and its tasks exist; data files exist and parse;
- the ``code`` reward's sandbox can have the isolation ``sandbox.isolation`` asks for (when the data uses it);
- on-policy distillation's teacher reads and shares the student's tokenizer, or its server answers
  (`vlrl.check.teacher`).

Every problem names the config field or the ``file:line``; all of them are listed at once.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import re
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from vlrl.check.report import Budget, CheckReport
from vlrl.check.samples import check_samples, load_processor, sample_location
from vlrl.check.teacher import check_teachers
from vlrl.config import DemoConfig, RLConfig, RLStage, RunConfig, SFTConfig, SFTStage
from vlrl.data import DataError, MediaLimits, Sample, read_samples
from vlrl.registry import RegistryError

_DOTTED = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
_SHOWN_RECORDS = 10  # bad data records listed one by one; the rest are counted




def preflight(cfg: RunConfig, *, splits: dict[str, list[Sample]] | None = None,
              budgets: list[Budget] | None = None, report: CheckReport | None = None) -> CheckReport:
    """Check ``cfg`` (and its data: ``splits`` if already loaded, else read/generated here).

    ``budgets``: the generation budgets to fit in the context, ``(split, name, new tokens)``; default: every
    RL stage's ``rollout.max_new_tokens`` on ``train`` and ``eval.max_new_tokens`` on ``test``. The commands
    that only generate (`vlrl eval`, `vlrl data select`) pass their own, named by their options, and the
    ``report`` that `read_data` filled while reading their files."""
    report = report if report is not None else CheckReport()
    sft, rl = _stages(cfg)
    _check_sizes(report, sft, rl)
    _check_names(report, cfg, rl)
    _check_synth(report, rl)
    _check_held_out(report, cfg)
    if splits is None:
        splits = _read_splits(report, cfg)
    _check_reward_dependencies(report, splits)
    _check_sandbox(report, cfg, splits)
    _check_sft_responses(report, splits.get("train", []), sft)
    _check_batches_against_data(report, cfg, splits, sft, rl)
    bundle = load_processor(report, cfg.model)
    check_teachers(report, bundle, rl)
    if bundle is not None:
        picks = {split: _pick(samples, cfg.check.samples_per_task) for split, samples in splits.items()}
        if budgets is None:
            budgets = [("train", f"{p}rollout.max_new_tokens", stage.rollout.max_new_tokens) for p, stage in rl]
            budgets.append(("test", "eval.max_new_tokens", cfg.eval.max_new_tokens))
        shortest = check_samples(report, bundle, picks, sft, budgets)
        if shortest is not None:
            _check_batches_against_memory(report, cfg, sft, rl, shortest, _vocabulary(bundle.config))
    return report


def _stages(cfg: RunConfig) -> tuple[list[tuple[str, SFTStage]], list[tuple[str, RLStage]]]:
    """(field prefix, stage) of the SFT and RL stages of a config: ``("sft.", ...)`` in a demo, ``("", cfg)``."""
    if isinstance(cfg, DemoConfig):
        return [("sft.", cfg.sft)], [("rl.", cfg.rl)]
    if isinstance(cfg, SFTConfig) and cfg.stages:  # staged SFT: each stage has its own train section
        return [(f"stages.{k}.", stage) for k, stage in enumerate(cfg.stages)], []
    if isinstance(cfg, RLConfig) and cfg.stages:  # RL curriculum: each stage has its own sections
        return [], [(f"stages.{k}.", stage) for k, stage in enumerate(cfg.stages)]
    return ([("", cfg)] if isinstance(cfg, SFTConfig) else []), ([("", cfg)] if isinstance(cfg, RLConfig) else [])


# ----------------------------------------------------------------------------------------------- sizes
def _check_sizes(report: CheckReport, sft, rl) -> None:
    for p, stage in sft:
        batch, micro = stage.train.batch_size, stage.train.micro_batch_size
        if micro < batch and batch % micro and stage.train.max_tokens_per_micro_batch is None:  # else: cut by cost
            report.problem(f"{p}train.micro_batch_size", f"{micro} does not divide {p}train.batch_size = {batch}")
    for p, stage in rl:
        per_step = stage.train.prompts_per_step * stage.rollout.n
        minibatch = per_step // stage.train.minibatches  # the config already requires an exact split
        micro = stage.train.micro_batch_size
        if micro < minibatch and minibatch % micro and stage.train.max_tokens_per_micro_batch is None:
            report.problem(f"{p}train.micro_batch_size",
                           f"{micro} does not divide the minibatch of {minibatch} responses ({p}train.prompts_per_step "
                           f"{stage.train.prompts_per_step} × {p}rollout.n {stage.rollout.n} / {p}train.minibatches "
                           f"{stage.train.minibatches})")
        if stage.rollout.n == 1:
            report.warn(f"{p}rollout.n", "1 response per prompt: every group-normalised advantage (grpo) is 0")


def _training_samples(cfg: RunConfig, splits: dict[str, list[Sample]], stage: Any) -> tuple[int, str] | None:
    """(how many training samples a stage draws from, where that number comes from); None when unknown here
    (a stage's own data file, a packing plan: its batches count packed sequences)."""
    data = getattr(stage, "data", None) or cfg.data
    if data.packing_plan is not None or (data is not cfg.data and data.train is not None):
        return None
    if data is cfg.data and data.train is not None:
        if "train" not in splits:
            return None
        count, source = len(splits["train"]), f"data.train {data.train}"
    else:
        count, source = data.n_train, "data.n_train"
    limit = stage.train.max_samples
    if limit is not None and limit < count:
        count, source = limit, "train.max_samples"
    return count, source


def _check_batches_against_data(report: CheckReport, cfg: RunConfig, splits: dict[str, list[Sample]], sft, rl) -> None:
    """A step that asks for more samples than the data holds repeats samples within that one step: said, with the
    numbers (the cursor's passes make it run; a tiny debugging run may mean it)."""
    for p, stage, name in ([(p, s, "train.batch_size") for p, s in sft] + [(p, s, "train.prompts_per_step") for p, s in rl]):
        known = _training_samples(cfg, splits, stage)
        wanted = stage.train.batch_size if name == "train.batch_size" else stage.train.prompts_per_step
        if known is not None and wanted > known[0] > 0:
            report.warn(f"{p}{name}", f"{wanted:,} per step, more than the {known[0]:,} training samples ({known[1]}): "
                        f"each step repeats samples ({wanted / known[0]:.3g} passes over the data per step)")


def memory_bytes() -> tuple[int, str] | None:
    """(bytes, what they are) of the memory this process can have: the machine's, or its container's (cgroup)
    limit when lower; None when unknown."""
    import os

    found = []
    try:
        found.append((os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's"))
    except (ValueError, OSError, AttributeError):
        pass
    for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:
            found.append((int(text), "this container's (cgroup)"))
    return min(found) if found else None


def _vocabulary(config: Any) -> int | None:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    value = getattr(text, "vocab_size", None)
    return int(value) if value else None


def _gib(n: float) -> str:
    return f"{n / (1 << 30):,.1f} GiB"


def _check_batches_against_memory(report: CheckReport, cfg: RunConfig, sft, rl, shortest: int,
                                  vocabulary: int | None) -> None:
    """Sizes whose step cannot fit in memory, by a lower bound with every factor shown: a step holds at least its
    sequences' token ids (8 bytes each; every sequence at least as long as the shortest checked prompt, an RL
    response at least one token), and on a CPU one forward at least its micro-batch's logits (float32 over the
    vocabulary)."""
    found = memory_bytes()
    if found is None:
        return
    memory, whose = found
    stages = [(p, s, s.train.batch_size, shortest, "train.batch_size", "samples") for p, s in sft]
    stages += [(p, s, s.train.prompts_per_step * s.rollout.n, shortest + 1, "train.prompts_per_step",
                f"sequences ({p}train.prompts_per_step × {p}rollout.n)") for p, s in rl]
    for p, stage, sequences, tokens, field_name, what in stages:
        held = sequences * tokens * 8
        if held > memory:
            report.problem(f"{p}{field_name}", f"one step holds at least {sequences:,} {what} × {tokens:,} tokens × "
                           f"8 bytes = {_gib(held)} of token ids, more than {whose} {_gib(memory)} of memory (the "
                           f"shortest checked prompt has {shortest:,} tokens)")
            continue
        micro = min(stage.train.micro_batch_size, sequences)
        logits = micro * tokens * (vocabulary or 0) * 4
        if str(cfg.model.device).startswith("cpu") and logits > memory:
            report.problem(f"{p}train.micro_batch_size", f"one forward's logits alone take {micro:,} sequences × "
                           f"{tokens:,} tokens × {vocabulary:,} vocabulary × 4 bytes = {_gib(logits)}, more than "
                           f"{whose} {_gib(memory)} of memory")


# ----------------------------------------------------------------------------------------------- names
def _check_names(report: CheckReport, cfg: RunConfig, rl) -> None:
    from vlrl.algos import get_advantage, get_advantage_shaping, get_policy_loss, get_reward_shaping
    from vlrl.check.options import config_problems
    from vlrl.report.sinks import SINKS, sink_requirement
    from vlrl.train import step_credit  # noqa: F401  (the training room's shaper registers itself)

    for where, message in config_problems(cfg):  # options against each plug-in's signature
        report.problem(where, message)

    checked = set()
    for p, stage in rl:
        shapers = [(f"algo.reward_shaping.{k}.name", get_reward_shaping, spec.name)
                   for k, spec in enumerate(stage.algo.reward_shaping)]
        shapers += [(f"algo.advantage_shaping.{k}.name", get_advantage_shaping, spec.name)
                    for k, spec in enumerate(stage.algo.advantage_shaping)]
        for name, lookup, value in [("algo.advantage", get_advantage, stage.algo.advantage),
                                    ("algo.policy_loss", get_policy_loss, stage.algo.policy_loss), *shapers]:
            checked.add(f"{p}{name}")
            try:
                lookup(value)
            except RegistryError as err:
                report.problem(f"{p}{name}", str(err))
    for k, name in enumerate(cfg.report.sinks):
        checked.add(f"report.sinks.{k}")
        try:
            SINKS.get(name)
        except RegistryError as err:
            report.problem("report.sinks", str(err))
            continue
        package = sink_requirement(name)
        if package and importlib.util.find_spec(package) is None:
            report.problem("report.sinks", f"the {name} sink needs the '{package}' package: pip install 'vlrl[{name}]'")
    for where, value in _strings(cfg.model_dump(mode="json")):
        if where not in checked and _DOTTED.match(value):
            problem = _import_problem(value)
            if problem:
                report.problem(where, problem)


def _check_synth(report: CheckReport, rl) -> None:
    """Syn-GRPO (``synth.enabled``): back-end, segmenter and their model directories, the diversity shaper."""
    from vlrl.synth.workflow import synth_problems

    for p, stage in rl:
        for kind, where, message in synth_problems(stage):
            (report.problem if kind == "problem" else report.warn)(f"{p}{where}", message)


def _strings(node: Any, prefix: str = ""):
    """(dotted field, value) of every string in a nested config dump."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _strings(value, f"{prefix}{key}.")
    elif isinstance(node, list):
        for k, value in enumerate(node):
            yield from _strings(value, f"{prefix}{k}.")
    elif isinstance(node, str):
        yield prefix.rstrip("."), node


def _import_problem(path: str) -> str | None:
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # ImportError, or the module failing at import
        return f"{path!r}: cannot import module {module_name!r} ({type(err).__name__}: {err})"
    if not hasattr(module, attr):
        return f"{path!r}: module {module_name!r} has no {attr!r}"
    return None


# ----------------------------------------------------------------------------------------------- data
def _check_held_out(report: CheckReport, cfg: RunConfig) -> None:
    """Held-out data that measures the training data: never the procedural suite beside a user's files."""
    data = cfg.data
    staged = [f"stages.{k}.data.train" for k, stage in enumerate(getattr(cfg, "stages", []))
              if stage.data is not None and stage.data.train is not None]
    if data.train is None and data.test is None and staged:
        report.problem("data.test", f"unset, and the stages train on your files ({', '.join(staged)}): the held-out "
                       f"evaluation would run on the procedural {data.suite!r} suite; give held-out samples with data.test")


def _read_splits(report: CheckReport, cfg: RunConfig) -> dict[str, list[Sample]]:
    from vlrl.data.splits import (
        generate_split,
        hold_out_problem,
        holds_out,
        media_limits,
        schema_for,
        split_held_out,
    )

    data, out = cfg.data, {}
    for split, path, count in (("train", data.train, data.n_train), ("test", data.test, data.n_test)):
        if path is None and split == "test" and holds_out(data):
            continue  # held out of the training file below
        if path is None:
            n = min(count, cfg.check.samples_per_task * max(1, len(data.tasks)) * 2)
            try:
                out[split] = generate_split(data, split, n)  # videos as frames, within the data.* budgets
            except DataError as err:
                report.problem("data", str(err))
            except RegistryError as err:
                report.problem("data.suite", str(err))
            except TypeError as err:
                report.problem("data.suite_options", str(err))
            except ValueError as err:
                report.problem("data.tasks", str(err))
            continue
        try:
            schema = schema_for(data, split)
        except (ValueError, OSError) as err:
            report.problem("data", str(err))
            continue
        out[split] = read_data(report, f"data.{split}", path, data.on_error, media_limits(data), schema)
    if holds_out(data) and "train" in out:
        problem = hold_out_problem(data, len(out["train"]) or None)  # an unreadable file is reported already
        if problem:
            report.problem("data.test", problem)
        elif out["train"]:
            out["train"], out["test"] = split_held_out(out["train"], data)
            report.facts.append(f"data.test unset: {len(out['test'])} of {len(out['train']) + len(out['test'])} samples "
                                f"of data.train held out for evaluation (data.test_fraction {data.test_fraction:g}, "
                                f"seed {data.seed})")
    return out


def _check_reward_dependencies(report: CheckReport, splits: dict[str, list[Sample]]) -> None:
    """Every verifier the samples name has its optional modules (``math`` without math-verify: the install command)."""
    from vlrl.rewards import missing_dependency

    for name in sorted({name for samples in splits.values() for s in samples for name in s.reward_names()}):
        try:
            message = missing_dependency(name)
        except RegistryError:
            continue  # unknown names are reported where the records are read
        if message:
            report.problem("data", message)


def runs_programs(splits: dict[str, list[Sample]]) -> bool:
    """Whether any sample is scored by the ``code`` reward (model-written programs run in the sandbox)."""
    return any("code" in s.reward_names() for samples in splits.values() for s in samples)


def sandbox_isolation(cfg: RunConfig, splits: dict[str, list[Sample]]) -> dict[str, str] | None:
    """What the run's programs get (`vlrl.rewards.sandbox.report_isolation`: setting, isolation obtained,
    description, process-tree bound) when the samples use the ``code`` reward, else None. Raises
    `vlrl.rewards.sandbox.SandboxUnavailable` when ``sandbox.isolation`` (or ``sandbox.tree_bound: cgroup``)
    cannot be had here."""
    if not runs_programs(splits):
        return None
    from vlrl.rewards.sandbox import SandboxUnavailable, report_isolation
    from vlrl.rewards.sandbox_bounds import BoundUnavailable, tree_bound

    box = cfg.sandbox
    try:
        tree = tree_bound(box.max_memory_mb, box.max_processes, box.tree_bound)
    except BoundUnavailable as err:
        raise SandboxUnavailable(str(err)) from None
    return report_isolation(box.isolation, tree=tree)


def _check_sandbox(report: CheckReport, cfg: RunConfig, splits: dict[str, list[Sample]]) -> None:
    """The ``code`` reward's sandbox gets the isolation ``sandbox.isolation`` asks for, or the run stops here."""
    from vlrl.rewards.sandbox import SandboxUnavailable

    try:
        record = sandbox_isolation(cfg, splits)
    except SandboxUnavailable as err:
        report.problem("sandbox.tree_bound" if "tree_bound" in str(err) else "sandbox.isolation", str(err))
        return
    if record is not None:
        report.facts.append(f"code sandbox: isolation {record['isolation']} (sandbox.isolation {record['setting']}): "
                            f"{record['description']}; process tree: {record['tree_bound']}")


def read_data(report: CheckReport, field_name: str, path: str | Path, on_error: str,
              media: MediaLimits | None = None, schema: Any = None) -> list[Sample]:
    """Every usable record of a data source (file, directory, glob, `save_to_disk` folder, hub id), each checked
    as the recipes read it (reward names, images, answers its verifier can score, videos as frames within the
    ``media`` budgets — default ones when None) in the layout of ``schema`` (`vlrl.data.schemas.Schema`; default:
    detected); bad ones become problems (``on_error=raise``) or warnings (``skip``) in ``report``, listed one by
    one with ``file:line`` / ``file:row N``, never raised. The layout each table was read as is a fact."""
    from vlrl.data.splits import sample_check

    try:
        with _quiet("vlrl.data.io"):  # its "skipped N records" warning: every record is listed below instead
            read = read_samples(path, on_error="skip", check=sample_check, media=media or MediaLimits(), schema=schema)
    except (DataError, ValueError) as err:
        report.problem(field_name, str(err))
        return []
    report.facts.extend(f"{field_name}: {line}" for line in read.layout_lines())
    for where, reason in read.skipped[:_SHOWN_RECORDS]:
        (report.problem if on_error == "raise" else report.warn)(where, reason)
    if len(read.skipped) > _SHOWN_RECORDS:
        more = f"{len(read.skipped) - _SHOWN_RECORDS} more bad record(s) in {path}"
        (report.problem if on_error == "raise" else report.warn)(field_name, more)
    if not read.samples:
        report.problem(field_name, f"{path}: no usable samples")
    return read.samples


@contextmanager
def _quiet(logger_name: str):
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _check_sft_responses(report: CheckReport, train: list[Sample], sft) -> None:
    for _prefix, stage in sft:
        used = train[: stage.train.max_samples] if stage.train.max_samples else train
        missing = [s for s in used if s.response is None]
        if missing:
            report.problem("data.train", f"{len(missing)} of {len(used)} samples have no reference 'response' "
                           f"(SFT needs one; first: {sample_location(missing[0], 'train')})")


def _pick(samples: list[Sample], per_task: int) -> list[Sample]:
    """The first ``per_task`` samples of every task, plus the longest prompts: the two with the most images
    (then the longest text), and the two with the longest text."""
    taken: dict[str, int] = defaultdict(int)
    picks: dict[str, Sample] = {}
    for s in samples:
        if taken[s.task] < per_task:
            taken[s.task] += 1
            picks[s.id] = s
    for key in ((lambda s: (s.num_image_parts(), len(s.prompt_text()))), (lambda s: len(s.prompt_text()))):
        for s in sorted(samples, key=key, reverse=True)[:2]:
            picks.setdefault(s.id, s)
    return list(picks.values())


# ----------------------------------------------------------------------------------------------- model
# ----------------------------------------------------------------------------------------------- samples
def detect_recipe(raw: dict[str, Any], path: str | Path | None = None) -> str:
    """Which recipe a config file is for: ``demo`` (has sft/rl sections), ``rl`` (rollout/algo), else ``sft``
    (train.batch_size or a file name with 'sft'), else ``rl``."""
    if {"sft", "rl", "control"} & set(raw):
        return "demo"
    if {"rollout", "algo"} & set(raw):
        return "rl"
    stages = raw.get("stages") if isinstance(raw.get("stages"), list) else []
    if any(isinstance(st, dict) and {"rollout", "algo", "prompt_template", "staleness"} & set(st) for st in stages):
        return "rl"  # an RL curriculum
    train = raw.get("train") if isinstance(raw.get("train"), dict) else {}
    if any(isinstance(st, dict) and isinstance(st.get("train"), dict) and "batch_size" in st["train"] for st in stages):
        return "sft"  # staged SFT
    if "batch_size" in train or (path is not None and "sft" in Path(path).stem):
        return "sft"
    return "rl"
