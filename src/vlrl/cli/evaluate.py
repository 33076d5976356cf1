"""`vlrl eval`: greedy and sampled accuracy and pass@k on held-out data, by default the run's own."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from vlrl.cli.app import app
from vlrl.cli.common import (
    ATTN,
    NUMERICS,
    REVISION,
    TEMPLATE_KWARGS,
    TRUST,
    first_line,
    load_options,
    pin_numerics,
    preflight_failed,
    progress_bars,
)
from vlrl.config import EvalConfig


@app.command("eval")
def eval_(
    model: str = typer.Option(..., "--model", help="Model directory, preset name or hub id."),
    data: str | None = typer.Option(None, "--data", help="Held-out samples file/dir. Default: the held-out split of "
                                    "the run the checkpoint belongs to (RUN/config.yaml beside RUN/checkpoints/), "
                                    "else --n procedural shapes test prompts."),
    samples: int | None = typer.Option(None, "--samples", help="Samples per prompt for sampled accuracy and pass@k "
                                       "(default: the run's eval.samples, else 4)."),
    temperature: float | None = typer.Option(None, "--temperature", help="Sampling temperature (default: the run's "
                                             "eval.temperature, else 1.0)."),
    top_k: int | None = typer.Option(None, "--top-k", min=0, help="Top-k of the sampled responses, 0 = off (default: "
                                     "the run's eval.top_k, else 0)."),
    max_new_tokens: int | None = typer.Option(None, "--max-new-tokens", help="Generation budget (default: the run's "
                                              "eval.max_new_tokens, else 16)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the sampled responses: the same seed gives the same numbers."),
    n: int = typer.Option(200, "--n", help="Procedural test samples when there is neither --data nor a run config."),
    out: Path | None = typer.Option(None, "--out", help="Write the result as JSON here."),
    numerics: str | None = NUMERICS,
    attn_implementation: str | None = ATTN,
    revision: str | None = REVISION,
    trust_remote_code: bool | None = TRUST,
    chat_template_kwargs: str | None = TEMPLATE_KWARGS,
) -> None:
    """Greedy accuracy, sampled accuracy and pass@k per task on held-out data (preflight-checked first)."""
    from vlrl.config import DataConfig, ModelConfig, RolloutConfig, RunConfig
    from vlrl.eval import evaluate
    from vlrl.models import load_policy
    from vlrl.rollout import build_engine
    from vlrl.train.common import seed_everything

    run = _run_config_of(model)
    # by default the run's kernels, where this machine can reproduce them (a portable run re-evaluated on an AMD CPU
    # gets native kernels and says so) — the mode in effect is in the output's settings
    pin_numerics("eval", numerics or ("native" if run is None or run.numerics == "native" else "auto"))
    given = {"samples": samples, "temperature": temperature, "top_k": top_k, "max_new_tokens": max_new_tokens}
    settings = (run.eval if run is not None else EvalConfig()).model_copy(
        update={k: v for k, v in given.items() if v is not None})
    from vlrl.models.policy import LoadOptions

    bounds = {"min_pixels": run.model.min_pixels, "max_pixels": run.model.max_pixels} if run is not None else {}
    options = load_options("eval", attn_implementation, revision, trust_remote_code, chat_template_kwargs,
                            base=LoadOptions.of(run.model) if run is not None else None)
    cfg = RunConfig(model=ModelConfig(path=model, **bounds, attn_implementation=options.attn_implementation,
                                      revision=options.revision, trust_remote_code=options.trust_remote_code,
                                      chat_template_kwargs=dict(options.chat_template_kwargs)), eval=settings,
                    data=DataConfig(test=data, n_test=n) if data or run is None else run.data)
    budget = "--max-new-tokens" if max_new_tokens is not None else "eval.max_new_tokens"
    typer.echo(_eval_source(model, data, run, cfg, settings), err=True)
    test = _checked_test_split("eval", cfg, data, budget)
    progress = progress_bars()
    seed_everything(seed)
    with progress.task(f"load {model}"):
        policy = load_policy(model, **bounds, options=options)
    with progress.task(f"eval {len(test)} prompts × {settings.samples}"):
        result = evaluate(build_engine(RolloutConfig(), policy, max_batch_size=settings.max_batch_size), test, settings)
    from vlrl.numerics import applied

    decided = applied()
    numerics_used = {"requested": decided.requested, "mode": decided.mode, "reason": decided.reason}
    shown = settings.model_dump(exclude={"every", "samples_table"})  # (validation during training: not this command's)
    text = json.dumps({**result.to_dict(examples=False),
                       "settings": {**shown, "seed": seed, "numerics": numerics_used}}, indent=2)
    if out:
        out.write_text(text + "\n")
    typer.echo(text)


def _run_config_of(model: str):
    """The model, data and eval sections of the run a checkpoint belongs to (``RUN/checkpoints/<name>[/…]`` with
    ``RUN/config.yaml``), as a `RunConfig`; None for any other model. Only these sections are read, so a staged
    or demo run's config serves as well; its paths are absolute (relative ones, from older runs, are taken from
    the current directory, where that run was started)."""
    from pydantic import ValidationError

    from vlrl.config import DataConfig, ModelConfig, RunConfig
    from vlrl.safe_yaml import YamlRefused, load_file

    path = Path(model)
    for parent in list(path.parents)[:3]:
        config = parent.parent / "config.yaml"
        if parent.name != "checkpoints" or not config.is_file():
            continue
        try:
            raw = load_file(config) or {}
            return RunConfig(model=ModelConfig.model_validate(raw.get("model", {})),
                             data=DataConfig.model_validate(raw.get("data", {})),
                             eval=EvalConfig.model_validate(raw.get("eval", {})),
                             numerics=raw.get("numerics", "native"))
        except (YamlRefused, ValidationError, AttributeError) as err:
            typer.secho(f"vlrl eval: {config} (the run's config) does not load ({first_line(err)}); "
                        "give --data and the eval options", fg="red", err=True)
            raise typer.Exit(2) from None
    return None


def _eval_source(model: str, data: str | None, run, cfg, settings: EvalConfig) -> str:
    """One line on stderr: which prompts are evaluated, with which settings, and where they come from."""
    d = cfg.data
    if data:
        what = f"held-out samples of {data}"
    elif run is None:
        what = f"{d.n_test} procedural {d.suite} test prompts (no --data, and {model} is not a run's checkpoint)"
    elif d.test is not None:
        what = f"the run's held-out file {d.test}"
    elif d.train is not None:
        what = (f"the run's held-out split of {d.train} (data.test_fraction {d.test_fraction:g}, seed {d.seed}: the "
                "samples its training never saw)")
    else:
        what = f"the run's {d.n_test} procedural {d.suite} test prompts (tasks {', '.join(d.tasks)})"
    origin = "the run's config.yaml" if run is not None else "defaults"
    return (f"vlrl eval: {what}; samples {settings.samples}, temperature {settings.temperature:g}, top_k "
            f"{settings.top_k or 'off'}, max_new_tokens {settings.max_new_tokens} (options, else {origin})")


def _checked_test_split(command: str, cfg, data: str | None, budget: str) -> list:
    """The test samples of ``cfg``, after the preflight check (model, every record, prompt + budget within the
    context); a failed check ends the command with its list of problems."""
    from vlrl.check import CheckReport, preflight, read_data
    from vlrl.data import DataError
    from vlrl.data.splits import load_splits

    report = CheckReport()
    if data:
        test = read_data(report, "--data", data, "raise")
    else:
        try:
            test = load_splits(cfg.data)[1]
        except DataError:
            report = preflight(cfg)  # lists every bad record and the reason nothing can be held out
            preflight_failed(command, cfg.model.path, report)
    report = preflight(cfg, splits={"test": test}, budgets=[("test", budget, cfg.eval.max_new_tokens)], report=report)
    if not report.ok:
        preflight_failed(command, cfg.model.path, report)
    for warning in report.warnings:
        typer.secho(f"warning: {warning}", fg="yellow", err=True)
    return test
