"""The `vlrl` command. Each subcommand takes ``--config FILE`` and dotted overrides (``algo.clip_high=0.28``)."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import typer

from vlrl.check.options import load_run_config as load_config  # (the config with its plug-in options checked)
from vlrl.config import ConfigError, DemoConfig, EvalConfig, RLConfig, SFTConfig
from vlrl.rewards.cli import app as reward_app
from vlrl.synth.cli import app as synth_app

app = typer.Typer(add_completion=False, no_args_is_help=True, help="vlrl: RL from verifiable rewards for VLMs and LLMs.")
data_app = typer.Typer(no_args_is_help=True, help="Generate and inspect data.")
app.add_typer(data_app, name="data")
app.add_typer(reward_app, name="reward")
app.add_typer(synth_app, name="synth")

CONFIG = typer.Option(None, "--config", "-c", help="YAML config file (see configs/).")
OVERRIDES = typer.Argument(None, help="Dotted overrides, e.g. rl.algo.clip_high=0.28 data.n_train=500")
RESUME = typer.Option(None, "--resume", help="auto: continue from the latest complete checkpoint in OUT/checkpoints "
                      "(fresh start if none); or a checkpoint directory. Sets checkpoint.resume.")


TEST = typer.Option(None, "--test", help="Held-out samples file/dir (sets data.test). Without it, a seeded "
                    "data.test_fraction of --data is held out (never the procedural suite).")

# model.attn_implementation / revision / trust_remote_code / chat_template_kwargs of the commands without a config
ATTN = typer.Option(None, "--attn-implementation", help="Attention implementation (eager, sdpa, flash_attention_2; "
                    "as model.attn_implementation). Default: transformers' (sdpa), or the run's.")
REVISION = typer.Option(None, "--revision", help="Hub revision (branch, tag, commit) of --model (as model.revision).")
TRUST = typer.Option(None, "--trust-remote-code/--no-trust-remote-code", help="Run the modelling code the checkpoint "
                     "ships (as model.trust_remote_code; off by default).")
TEMPLATE_KWARGS = typer.Option(None, "--chat-template-kwargs", help="JSON object of chat-template variables, e.g. "
                               "'{\"enable_thinking\": false}' (as model.chat_template_kwargs).")


def _load_options(command: str, attn: str | None, revision: str | None, trust: bool | None, template_kwargs: str | None,
                  base=None):
    """The `LoadOptions` of a command's model flags, over ``base`` (a run's model section) when given."""
    from vlrl.models.policy import LoadOptions

    base = base or LoadOptions()
    kwargs = dict(base.chat_template_kwargs)
    if template_kwargs is not None:
        try:
            kwargs = json.loads(template_kwargs)
        except json.JSONDecodeError:
            kwargs = None
        if not isinstance(kwargs, dict):
            typer.secho(f"vlrl {command}: --chat-template-kwargs must be a JSON object, e.g. "
                        "'{\"enable_thinking\": false}'", fg="red", err=True)
            raise typer.Exit(2)
    return LoadOptions(attn_implementation=attn if attn is not None else base.attn_implementation,
                       revision=revision if revision is not None else base.revision,
                       trust_remote_code=trust if trust is not None else base.trust_remote_code,
                       chat_template_kwargs=kwargs)


NUMERICS = typer.Option(None, "--numerics", help="CPU kernels: native, portable (the same bits on any Intel CPU "
                        "with AVX2) or auto (portable where possible); see the numerics config field.")


def _apply_numerics(command: str, mode: str) -> None:
    """Pin the CPU kernels before the command's first tensor operation (`vlrl.numerics`); a bad mode or one that
    cannot take effect ends the command with its cause (exit 2)."""
    from vlrl.numerics import NumericsError, apply_numerics

    if mode not in ("native", "portable", "auto"):
        typer.secho(f"vlrl {command}: --numerics must be native, portable or auto, not {mode!r}", fg="red", err=True)
        raise typer.Exit(2)
    try:
        apply_numerics(mode)
    except NumericsError as err:
        typer.secho(f"vlrl {command}: {err}", fg="red", err=True)
        raise typer.Exit(2) from None


def _version(value: bool) -> None:
    if value:
        from importlib import metadata

        typer.echo(f"vlrl {metadata.version('vlrl')}")
        raise typer.Exit()


@app.callback()
def _main(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print vlrl's version and exit (`vlrl env`: everything a bug report needs).")
          ) -> None:
    """vlrl: RL from verifiable rewards for VLMs and LLMs."""


def _extra(data: str | None, resume: str | None, test: str | None = None) -> list[str]:
    return [*([f"data.train={data}"] if data else []), *([f"data.test={test}"] if test else []),
            *([f"checkpoint.resume={resume}"] if resume else [])]


def _load(cls, config: Path | None, overrides: list[str] | None, extra: list[str]):
    """The run's config, with its ``numerics`` pinned before anything computes (`vlrl.numerics`)."""
    from vlrl.numerics import NumericsError, apply_numerics

    try:
        return load_config(cls, config, [*extra, *(overrides or [])], prepare=lambda cfg: apply_numerics(cfg.numerics))
    except (ConfigError, NumericsError) as err:
        typer.secho(str(err), fg="red", err=True)
        raise typer.Exit(2) from None


def _run(command: str, recipe, cfg) -> None:
    """Run a recipe. What the user can fix ends the command with its message and exit 1, without a traceback:
    a failed preflight check (every problem in one list; nothing was loaded), or a data file / name / plan
    that fails once the run is under way (then the preflight lists every problem it can find)."""
    from vlrl.check import PreflightError, preflight
    from vlrl.data import DataError
    from vlrl.data.packing import PackingError
    from vlrl.registry import RegistryError
    from vlrl.train.checkpoint import CheckpointError
    from vlrl.train.common import NonFiniteError

    try:
        recipe(cfg)
    except PreflightError as err:
        _preflight_failed(command, str(cfg.out), err.report)
    except (CheckpointError, NonFiniteError) as err:  # a corrupt checkpoint, a failed save, a NaN loss/gradient
        typer.secho(f"vlrl {command}: {err}", fg="red", err=True)
        raise typer.Exit(1) from None
    except (DataError, RegistryError, PackingError, FileNotFoundError) as err:
        report = preflight(cfg) if cfg.check.enabled else None  # every bad record, not only the first
        if report is not None and not report.ok:
            _preflight_failed(command, str(cfg.out), report)
        typer.secho(f"vlrl {command}: {err}", fg="red", err=True)
        raise typer.Exit(1) from None


def _preflight_failed(command: str, what: str, report) -> None:
    typer.secho(f"vlrl {command}: the preflight check failed for {what}:\n{report.format()}", fg="red", err=True)
    typer.secho("(`vlrl check` runs the same check alone; check.enabled=false skips it)", err=True)
    raise typer.Exit(1)


@app.command()
def demo(
    config: Path | None = CONFIG,
    out: str | None = typer.Option(None, "--out", help="Run directory (default runs/demo)."),
    overrides: list[str] | None = OVERRIDES,
) -> None:
    """The main job: tiny VLM, shapes data, SFT warm start, eval, GRPO, eval, and an SFT control with the RL stage's FLOPs."""
    from vlrl.train.recipes import run_demo

    default = Path(__file__).parent / "configs" / "demo.yaml"
    cfg = _load(DemoConfig, config or default, overrides, [f"out={out or 'runs/demo'}"])
    _run("demo", run_demo, cfg)


@app.command()
def sft(
    config: Path | None = CONFIG,
    data: str | None = typer.Option(None, "--data", help="Training samples file/dir (sets data.train)."),
    test: str | None = TEST,
    stages: str | None = typer.Option(None, "--stages", help="Run only these stages of a staged config, e.g. "
                                      "midtrain,instruct (set model.path to the previous stage's checkpoint)."),
    resume: str | None = RESUME,
    overrides: list[str] | None = OVERRIDES,
) -> None:
    """Supervised fine-tuning on reference responses (one stage, or the stages of the config in order; one
    process, or every rank under torchrun)."""
    from vlrl.train.recipes import run_sft

    cfg = _load(SFTConfig, config, overrides, _extra(data, resume, test))
    if stages is not None:
        wanted = [s.strip() for s in stages.split(",") if s.strip()]
        known = [s.name for s in cfg.stages]
        unknown = [s for s in wanted if s not in known]
        if unknown or not wanted:
            typer.secho(f"--stages: unknown stage(s) {unknown or wanted}; the config's stages: {known or 'none'}",
                        fg="red", err=True)
            raise typer.Exit(2)
        cfg.stages = [s for s in cfg.stages if s.name in wanted]
    _run("sft", run_sft, cfg)


@app.command()
def rl(
    config: Path | None = CONFIG,
    data: str | None = typer.Option(None, "--data", help="Training prompts file/dir (sets data.train)."),
    test: str | None = TEST,
    resume: str | None = RESUME,
    overrides: list[str] | None = OVERRIDES,
) -> None:
    """GRPO-family RL with verifiable rewards (synchronous, or asynchronous with rollout.mode=async)."""
    from vlrl.train.recipes import run_rl

    _run("rl", run_rl, _load(RLConfig, config, overrides, _extra(data, resume, test)))


@app.command()
def serve(
    model: str = typer.Option(..., "--model", help="Model directory (transformers layout), preset name or hub id."),
    host: str = typer.Option("127.0.0.1", "--host", help="Bind address; loopback by default."),
    port: int = typer.Option(30000, "--port", help="Port; 0 picks a free one (the address is printed)."),
    api_key: str | None = typer.Option(None, "--api-key", envvar="VLRL_API_KEY", show_envvar=True,
                                       help="Bearer token clients must send; unset: a random one is generated and printed."),
    no_auth: bool = typer.Option(False, "--no-auth", help="Accept requests without a token (loopback addresses only)."),
    dtype: str = typer.Option("float32", "--dtype", help="float32, bfloat16 or float16."),
    device: str = typer.Option("cpu", "--device", help="Torch device, e.g. cpu or cuda."),
    max_batch_size: int = typer.Option(256, "--max-batch-size", help="Sequences decoded at once."),
    max_queued_requests: int = typer.Option(1024, "--max-queued-requests",
                                            help="Queue bound in samples (prompts × n); further requests get 503."),
    max_new_tokens: int = typer.Option(4096, "--max-new-tokens", help="Largest sampling_params.max_new_tokens accepted."),
    max_tokens_in_flight: int = typer.Option(1 << 20, "--max-tokens-in-flight",
                                             help="Budget of Σ samples × (prompt + max_new_tokens) queued or decoding."),
    max_body_mb: float = typer.Option(32.0, "--max-body-mb", help="Largest request body (413 beyond; chunked too)."),
    max_image_pixels: int = typer.Option(16 << 20, "--max-image-pixels", help="Largest image (pixels, from its header)."),
    max_request_pixels: int = typer.Option(128 << 20, "--max-request-pixels",
                                           help="Pixels of all the images of one request together (from their headers)."),
    max_inflight_body_mb: float = typer.Option(256.0, "--max-inflight-body-mb",
                                               help="Request bytes held at once over all requests (503 beyond)."),
    body_timeout: float = typer.Option(60.0, "--body-timeout", help="Seconds a client may take to send a body (408)."),
    join_timeout: float = typer.Option(120.0, "--join-timeout",
                                       help="Seconds an /init_weights_update_group may wait for the group's ranks."),
    admin_api_key: str | None = typer.Option(None, "--admin-api-key", envvar="VLRL_ADMIN_API_KEY", show_envvar=True,
                                             help="Key the weight and pause routes require instead of the API key "
                                             "(SGLang's --admin-api-key)."),
    request_timeout: float = typer.Option(600.0, "--request-timeout",
                                          help="Seconds after which a request is aborted at the next decode step."),
    image_root: list[str] | None = typer.Option(None, "--image-root", help="Directory whose files image_data may "
                                                "name by path (repeatable; default: no server paths)."),
    drain_seconds: float = typer.Option(30.0, "--drain-seconds",
                                        help="On SIGTERM, requests in flight get this long; the rest are aborted."),
    batch_window_ms: float = typer.Option(10.0, "--batch-window-ms",
                                          help="Wait while requests keep arriving at most this far apart before decoding."),
    threads: int | None = typer.Option(None, "--threads", help="torch CPU threads (default: torch's choice)."),
    init_seed: int = typer.Option(0, "--init-seed", help="Seed of a tiny preset's random initialisation."),
    numerics: str = typer.Option("native", "--numerics", help="CPU kernels: native, portable or auto (the trainer's "
                                 "numerics, for log-probs computed with the same kernels)."),
    attn_implementation: str | None = ATTN,
    revision: str | None = REVISION,
    trust_remote_code: bool | None = TRUST,
) -> None:
    """Serve a policy over SGLang's native HTTP API (/generate, /update_weights_from_disk, /health, /server_info, ...)."""
    _apply_numerics("serve", numerics)
    import torch

    from vlrl.check import model_path_problem
    from vlrl.rollout.server import ServeLimits
    from vlrl.rollout.server import serve as run_server

    if model_path_problem(model):
        typer.secho(f"vlrl serve: --model {model_path_problem(model)}", fg="red", err=True)
        raise typer.Exit(2)
    if threads:
        torch.set_num_threads(threads)
    try:
        limits = ServeLimits(max_new_tokens=max_new_tokens, max_body_bytes=int(max_body_mb * (1 << 20)),
                             max_image_pixels=max_image_pixels, request_timeout=request_timeout,
                             image_roots=tuple(image_root or ()), drain_seconds=drain_seconds,
                             max_request_pixels=max_request_pixels,
                             max_inflight_body_bytes=int(max_inflight_body_mb * (1 << 20)), body_timeout=body_timeout,
                             join_timeout=join_timeout)
        run_server(model, host=host, port=port, api_key=api_key, no_auth=no_auth, dtype=dtype, device=device,
                   max_batch_size=max_batch_size, max_queued_requests=max_queued_requests,
                   batch_window_ms=batch_window_ms, init_seed=init_seed, max_tokens_in_flight=max_tokens_in_flight,
                   limits=limits, admin_api_key=admin_api_key,
                   options=_load_options("serve", attn_implementation, revision, trust_remote_code, None))
    except (ValueError, OSError) as err:  # OSError: a model that cannot be read (no hub, missing files)
        typer.secho(f"vlrl serve: {err}", fg="red", err=True)
        raise typer.Exit(2) from None


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
    _apply_numerics("eval", numerics or ("native" if run is None or run.numerics == "native" else "auto"))
    given = {"samples": samples, "temperature": temperature, "top_k": top_k, "max_new_tokens": max_new_tokens}
    settings = (run.eval if run is not None else EvalConfig()).model_copy(
        update={k: v for k, v in given.items() if v is not None})
    from vlrl.models.policy import LoadOptions

    bounds = {"min_pixels": run.model.min_pixels, "max_pixels": run.model.max_pixels} if run is not None else {}
    options = _load_options("eval", attn_implementation, revision, trust_remote_code, chat_template_kwargs,
                            base=LoadOptions.of(run.model) if run is not None else None)
    cfg = RunConfig(model=ModelConfig(path=model, **bounds, attn_implementation=options.attn_implementation,
                                      revision=options.revision, trust_remote_code=options.trust_remote_code,
                                      chat_template_kwargs=dict(options.chat_template_kwargs)), eval=settings,
                    data=DataConfig(test=data, n_test=n) if data or run is None else run.data)
    budget = "--max-new-tokens" if max_new_tokens is not None else "eval.max_new_tokens"
    typer.echo(_eval_source(model, data, run, cfg, settings), err=True)
    test = _checked_test_split("eval", cfg, data, budget)
    progress = _progress()
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
            typer.secho(f"vlrl eval: {config} (the run's config) does not load ({_first_line(err)}); "
                        "give --data and the eval options", fg="red", err=True)
            raise typer.Exit(2) from None
    return None


def _first_line(err: Exception) -> str:
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__


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
            _preflight_failed(command, cfg.model.path, report)
    report = preflight(cfg, splits={"test": test}, budgets=[("test", budget, cfg.eval.max_new_tokens)], report=report)
    if not report.ok:
        _preflight_failed(command, cfg.model.path, report)
    for warning in report.warnings:
        typer.secho(f"warning: {warning}", fg="yellow", err=True)
    return test


@app.command()
def report(
    run_dirs: list[Path] = typer.Argument(..., help="One run directory, or several to overlay in one report."),
    out: Path | None = typer.Option(None, "--out", help="Output file (default RUN_DIR/report.html; compare.html for several)."),
    title: str | None = typer.Option(None, "--title", help="Page title."),
) -> None:
    """Write a self-contained HTML report (curves, sampled responses, eval, config) of one or several runs."""
    from vlrl.report.html import ReportError, write_report

    try:
        path = write_report(run_dirs, out, title=title)
    except ReportError as err:
        typer.secho(f"vlrl report: {err}", fg="red", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"wrote {path}")


@app.command()
def env() -> None:
    """Versions (vlrl, Python, every dependency), CPU and instruction sets, torch threads, numerics mode, CUDA and
    GPUs, extras installed: one block to paste into a bug report."""
    from vlrl.report.environment import bug_report, format_bug_report

    typer.echo(format_bug_report(bug_report()))


RECIPES = {"demo": DemoConfig, "rl": RLConfig, "sft": SFTConfig}


@app.command()
def check(
    config: Path = typer.Argument(..., help="The YAML config of the run to check."),
    overrides: list[str] | None = OVERRIDES,
    recipe: str = typer.Option("auto", "--recipe", help="auto (from the file's sections), sft, rl or demo."),
    data: str | None = typer.Option(None, "--data", help="Training samples file/dir (sets data.train)."),
    test: str | None = TEST,
) -> None:
    """Preflight: processor, vision tokens, context length, batch sizes, names and data files — no weights loaded."""
    from vlrl.check import detect_recipe, preflight
    from vlrl.safe_yaml import YamlRefused, load_file

    if recipe == "auto":
        try:
            raw = load_file(config) if config.is_file() else {}
        except YamlRefused:
            raw = {}  # load_config below reports the YAML error with the file name
        recipe = detect_recipe(raw if isinstance(raw, dict) else {}, config)
    if recipe not in RECIPES:
        typer.secho(f"vlrl check: --recipe must be auto, sft, rl or demo (got {recipe!r})", fg="red", err=True)
        raise typer.Exit(2)
    typer.echo(f"vlrl check {config} (as a `vlrl {recipe}` config)")
    try:
        cfg = load_config(RECIPES[recipe], config, [*_extra(data, None, test), *(overrides or [])])
    except ConfigError as err:
        typer.secho("\n".join(f"  ✗ {line}" for line in str(err).splitlines()), fg="red")
        typer.secho("preflight: the config does not load", fg="red")
        raise typer.Exit(1) from None
    result = preflight(cfg)
    typer.secho(result.format(), fg=None if result.ok else "red")
    if not result.ok:
        raise typer.Exit(1)


@app.command()
def launch(
    config: Path = typer.Argument(..., help="The YAML config of the run (sft or rl); its launch section places the ranks."),
    overrides: list[str] | None = OVERRIDES,
    ray_address: str = typer.Option("local", "--ray", help="Ray cluster address (e.g. auto, ray://head:10001), or "
                                    "local: start a one-node Ray here."),
    nproc: int | None = typer.Option(None, "--nproc", help="Trainer ranks (sets launch.nproc)."),
    recipe: str = typer.Option("auto", "--recipe", help="auto (from the file's sections), sft or rl."),
    resume: str | None = RESUME,
) -> None:
    """Run `vlrl sft|rl` on launch.nproc Ray actors in a placement group (torch.distributed rendezvous wired), with
    launch.rollout_servers `vlrl serve` actors beside them."""
    from vlrl.launch import launcher

    extra = [*([f"launch.nproc={nproc}"] if nproc else []), *([f"checkpoint.resume={resume}"] if resume else [])]
    try:
        # servers the launch starts stand in for rollout.servers while the config is checked (their URLs come later)
        ready = launcher.prepare(launcher.detect(config, recipe), config, [*(overrides or []), *extra])  # before Ray starts
    except ConfigError as err:
        typer.secho(str(err), fg="red", err=True)
        raise typer.Exit(2) from None
    except launcher.LaunchRefused as err:
        typer.secho(f"vlrl launch: {err}", fg="red", err=True)
        raise typer.Exit(2) from None
    try:
        launcher.launch(ready.spec, ready.cfg.launch, address=ray_address, servers=ready.servers)
    except launcher.LaunchError as err:
        typer.secho(f"vlrl launch: {err}", fg="red", err=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        typer.secho("vlrl launch: interrupted; every rank and rollout server was stopped", fg="red", err=True)
        raise typer.Exit(130) from None


@app.command()
def plan(
    config: Path = typer.Argument(..., help="The YAML config of the run (sft or rl)."),
    overrides: list[str] | None = OVERRIDES,
    gpus: int = typer.Option(8, "--gpus", help="Devices to place the run on."),
    gpu_mem: float = typer.Option(80.0, "--gpu-mem", help="Memory per device, GiB (an \"80GB\" A100 holds 80 GiB)."),
    tflops: float = typer.Option(312.0, "--tflops", help="Peak dense TFLOP/s per device in the compute dtype (A100: 312)."),
    bandwidth: float = typer.Option(2039.0, "--bandwidth", help="Device memory bandwidth, GB/s (A100-80GB: 2039)."),
    link: float = typer.Option(300.0, "--link", help="Bandwidth between devices, GB/s (NVLink ~300, across machines ~25)."),
    mfu: float = typer.Option(0.4, "--mfu", help="Assumed model-FLOPs utilisation of training and prefill."),
    recipe: str = typer.Option("auto", "--recipe", help="auto (from the file's sections), sft or rl."),
    measure: bool = typer.Option(False, "--measure", help="Also run one training step on this machine's CPU and "
                                 "print its measured peak memory beside the estimate (for small models)."),
    apply: Path | None = typer.Option(None, "--apply", help="Write the config with the chosen placement's launch "
                                      "settings in it to this YAML file (`vlrl launch --ray … FILE` starts it)."),
    pick: int | None = typer.Option(None, "--pick", min=1, help="With --apply: the placement ranked #N (default: #1)."),
) -> None:
    """Estimate per-device memory and step time of every placement (colocated/separate, FSDP/DDP); rank the feasible
    ones, each with the `vlrl launch` command that starts it."""
    from vlrl.check import detect_recipe, model_path_problem
    from vlrl.launch import planner
    from vlrl.safe_yaml import YamlRefused, load_file

    if recipe == "auto":
        try:
            raw = load_file(config) if config.is_file() else {}
        except YamlRefused:
            raw = {}  # _load below reports the YAML error with the file name
        recipe = detect_recipe(raw if isinstance(raw, dict) else {}, config)
    if recipe not in ("sft", "rl"):
        typer.secho(f"vlrl plan: plans sft and rl runs (got recipe {recipe!r}; pass --recipe)", fg="red", err=True)
        raise typer.Exit(2)
    cfg = _load(RECIPES[recipe], config, overrides, [])
    try:
        problem = model_path_problem(cfg.model.path)
        if problem and not planner.is_config_only(cfg.model.path):  # a bare config.json plans too
            raise FileNotFoundError(problem)
        if measure and planner.is_config_only(cfg.model.path):
            raise ValueError("--measure runs a training step on this CPU: it needs the model's tokenizer and weights, "
                             "not a config.json alone")
        model, adapter = planner.meta_model(cfg.model.path, init_seed=cfg.model.init_seed)
    except (OSError, ValueError) as err:  # a missing directory, no hub, an unsupported family
        typer.secho(f"vlrl plan: model.path: {err}", fg="red", err=True)
        raise typer.Exit(2) from None
    from vlrl.data import DataError

    try:
        shape, work = planner.model_shape(model), planner.workload(cfg, adapter, model=model)
    except DataError as err:  # the prompts' sizes come from a few samples of data.train (a hub id may be unreachable)
        typer.secho(f"vlrl plan: data.train: {err} — plan with a local sample of the data (data.train=FILE) or the "
                    "procedural prompts (data.train=null)", fg="red", err=True)
        raise typer.Exit(2) from None
    device = planner.Device(gpus, gpu_mem, tflops=tflops, bandwidth_gbs=bandwidth, link_gbs=link, mfu=mfu)
    plans = planner.plan_placements(shape, work, device)
    launches = {p.name: planner.launch_settings(p, cfg, recipe, config, list(overrides or []))
                for p in planner.ranked(plans, device)}
    feasible = planner.ranked(plans, device, launches)  # what `#N` numbers: fits, and vlrl launch accepts it
    typer.echo(planner.format_plans(plans, device, work, shape, launches))
    if apply is not None:
        _apply_plan(apply, pick, feasible, launches, recipe, config, list(overrides or []))
    if measure:
        from vlrl.models import load_policy
        from vlrl.models.policy import LoadOptions

        policy = load_policy(cfg.model.path, dtype=cfg.model.dtype, seed=cfg.model.init_seed,
                             options=LoadOptions.of(cfg.model))
        typer.echo("\n" + planner.format_measurement(planner.measure_train_step(cfg, policy, work), shape, work))


def _apply_plan(out: Path, pick: int | None, feasible: list, launches: dict, recipe: str, config: Path,
                overrides: list[str]) -> None:
    """`vlrl plan --apply OUT`: the run's config with placement #pick's (or the best launchable one's) settings."""
    from vlrl.launch import planner
    from vlrl.launch.launcher import LaunchRefused, prepare

    if not feasible:
        typer.secho("vlrl plan: --apply: no placement that fits can be launched (see ✗ above)", fg="red", err=True)
        raise typer.Exit(1)
    if pick is not None and pick > len(feasible):
        typer.secho(f"vlrl plan: --pick {pick}: {len(feasible)} placement(s) are ranked", fg="red", err=True)
        raise typer.Exit(2)
    rank = pick or 1
    plan, settings = feasible[rank - 1], launches[feasible[rank - 1].name]
    header = (f"vlrl plan --apply: placement #{rank} {plan.name} (~{planner.human_seconds(plan.step_seconds)}/step)\n"
              f"from {config}{' with ' + ' '.join(overrides) if overrides else ''}\n"
              f"start it: vlrl launch --ray local|ADDRESS {out}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(planner.applied_config(RECIPES[recipe], config, [*overrides, *settings.overrides], header))
    try:
        prepare(recipe, out, [])  # what was written is what the launch accepts
    except (ConfigError, LaunchRefused) as err:
        typer.secho(f"vlrl plan: --apply: {out} is not accepted by vlrl launch: {err}", fg="red", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"vlrl plan: wrote {out} (placement #{rank} {plan.name}: {' '.join(settings.overrides)}); "
               f"start it with: vlrl launch --ray local {out}")


@data_app.command("gen")
def data_gen(
    suite: str = typer.Argument(..., help="Task suite: shapes, arith or embodied."),
    n: int = typer.Option(100, "--n", help="Number of samples."),
    split: str = typer.Option("train", "--split", help="train or test (separate random streams)."),
    out: Path = typer.Option(..., "--out", help="Output directory (writes <split>.jsonl and images/) or a .parquet file."),
    seed: int = typer.Option(0, "--seed"),
    tasks: str | None = typer.Option(None, "--tasks", help="Comma-separated sub-tasks, e.g. count,color."),
    template: str | None = typer.Option(
        None, "--template", help="Prompt template of shapes/arith: answer (their default), think or none."),
) -> None:
    """Generate a procedural task suite as Sample files."""
    from vlrl.data import TASK_SUITES, generate, write_samples
    from vlrl.registry import RegistryError

    progress = _progress()
    try:
        with progress.task(f"generate {n} {suite} samples"):
            options = {"template": template} if template is not None else {}  # embodied has a fixed JSON prompt
            samples = generate(suite, n, split=split, seed=seed, tasks=tasks.split(",") if tasks else None, **options)
    except (RegistryError, ValueError) as err:
        typer.secho(f"vlrl data gen: {err}", fg="red", err=True)
        raise typer.Exit(2) from None
    target = out if out.suffix in (".jsonl", ".parquet") else out / f"{split}.jsonl"
    with progress.task(f"write {target}"):
        path = write_samples(samples, target)
    typer.echo(f"wrote {len(samples)} {suite} samples to {path} (suites: {', '.join(TASK_SUITES.names())})")


@data_app.command("import")
def data_import(
    source: str = typer.Argument(..., help="A data path: file, folder, glob, `save_to_disk` folder or hub id (PATH@split "
                                 "picks a split)."),
    out: Path = typer.Option(..., "--out", help="Output directory: <split>.jsonl and images/ (or a .jsonl / .parquet file)."),
    fmt: str = typer.Option("auto", "--format", help="Layout of the rows: auto, vlrl, easyr1, verl or trl (as data.format)."),
    column: list[str] | None = typer.Option(None, "--column", help="FIELD=COLUMN (repeatable), as data.columns, e.g. "
                                            "--column prompt=question --column answer=label."),
    split: str = typer.Option("train", "--split", help="Split of a hub id or `save_to_disk` DatasetDict (as data.split)."),
    subset: str | None = typer.Option(None, "--subset", help="Hub dataset configuration (as data.subset)."),
    revision: str | None = typer.Option(None, "--revision", help="Hub dataset revision (as data.revision)."),
    prompt_template: str | None = typer.Option(None, "--prompt-template", help="Jinja text or .jinja file (as "
                                               "data.prompt_template)."),
    system_prompt: str | None = typer.Option(None, "--system-prompt", help="System message (as data.system_prompt)."),
    reward: str | None = typer.Option(None, "--reward", help="Default verifier (as data.reward)."),
    on_error: str = typer.Option("raise", "--on-error", help="Bad records: raise, or skip them (listed)."),
) -> None:
    """Read a dataset in any supported layout and write it as vlrl's own jsonl + images, to inspect or edit it."""
    from vlrl.config import ConfigError, DataConfig
    from vlrl.data import DataError, read_samples, write_samples
    from vlrl.data.sources import split_suffix
    from vlrl.data.splits import sample_check, schema_for

    pairs = [c.partition("=") for c in column or []]
    try:
        if any(not sep or not field or not name for field, sep, name in pairs):
            raise ValueError("--column: give FIELD=COLUMN, e.g. --column answer=solution")
        cfg = DataConfig(format=fmt, columns={field: name for field, _, name in pairs}, split=split, subset=subset,
                         revision=revision, prompt_template=prompt_template, system_prompt=system_prompt, reward=reward,
                         on_error=on_error)
        schema = schema_for(cfg)
    except (ValueError, ConfigError, OSError) as err:
        typer.secho(f"vlrl data import: {_first_line(err)}", fg="red", err=True)
        raise typer.Exit(2) from None
    progress = _progress()
    try:
        with progress.task(f"read {source}"):
            report = read_samples(source, on_error=cfg.on_error, check=sample_check, schema=schema, verify_images=True)
        chosen = split_suffix(source)[1] or schema.split  # SOURCE@test: test.jsonl
        target = out if out.suffix in (".jsonl", ".parquet") else out / f"{chosen}.jsonl"
        with progress.task(f"write {target}"):
            path = write_samples(report.samples, target)
    except DataError as err:
        typer.secho(f"vlrl data import: {err}", fg="red", err=True)
        raise typer.Exit(1) from None
    for line in report.layout_lines():
        typer.echo(line)
    for where, reason in report.skipped:
        typer.secho(f"skipped {where}: {reason}", fg="yellow", err=True)
    typer.echo(f"wrote {len(report.samples)} samples to {path}" + (f" ({len(report.skipped)} skipped)" if report.skipped else ""))


@data_app.command("pack")
def data_pack(
    data: Path = typer.Option(..., "--data", help="Sample file (.jsonl/.parquet) or directory to plan."),
    out: Path = typer.Option(..., "--out", help="Plan file (.npz); the statistics go to the .json beside it."),
    capacity: int = typer.Option(..., "--capacity", help="Tokens per packed sequence (e.g. 8192)."),
    model: str = typer.Option("tiny-qwen2-vl", "--model", help="Model whose tokenizer/processor counts tokens (no weights loaded)."),
    min_pixels: int | None = typer.Option(None, "--min-pixels", help="Native-resolution lower bound (as model.min_pixels)."),
    max_pixels: int | None = typer.Option(None, "--max-pixels", help="Native-resolution upper bound (as model.max_pixels)."),
    init_seed: int = typer.Option(0, "--init-seed", help="model.init_seed of a tiny preset."),
    workers: int = typer.Option(1, "--workers", help="Processes counting tokens."),
    seed: int = typer.Option(0, "--seed", help="The plan is deterministic for a seed."),
    on_overlong: str = typer.Option("drop", "--on-overlong", help="Samples longer than the capacity: drop, truncate or raise."),
    greedy_only: bool = typer.Option(False, "--greedy-only", help="Skip the diversity-first phase (fill greedily)."),
    on_error: str = typer.Option("raise", "--on-error", help="Bad records: raise, or skip (they are then not in the plan's file set)."),
    video_fps: float = typer.Option(2.0, "--video-fps", help="Frames per second taken from video files (as data.video_fps)."),
    max_frames: int = typer.Option(8, "--max-frames", help="Most frames per video (as data.max_frames)."),
    max_images: int = typer.Option(32, "--max-images", help="Most images per sample, frames included (as data.max_images)."),
    revision: str | None = REVISION,
    trust_remote_code: bool | None = TRUST,
    chat_template_kwargs: str | None = TEMPLATE_KWARGS,
) -> None:
    """Offline packing: count every sample's tokens, plan bins of --capacity tokens, write the plan once."""
    from vlrl.data import DataError, MediaLimits, read_samples
    from vlrl.data.packing import PackingError, plan_samples
    from vlrl.models.lengths import TokenCounter
    from vlrl.models.policy import load_processor

    if on_overlong not in ("drop", "truncate", "raise") or on_error not in ("raise", "skip"):
        typer.secho("vlrl data pack: --on-overlong is drop, truncate or raise; --on-error is raise or skip", fg="red", err=True)
        raise typer.Exit(2)
    progress = _progress()
    try:
        with progress.task(f"read {data}"):
            media = MediaLimits(video_fps=video_fps, max_frames=max_frames, max_images=max_images)
            samples = read_samples(data, on_error=on_error, verify_images=False, media=media).samples
        with progress.task(f"load the processor of {model}"):
            processor = load_processor(model, seed=init_seed, min_pixels=min_pixels, max_pixels=max_pixels,
                                       options=_load_options("data pack", None, revision, trust_remote_code,
                                                             chat_template_kwargs))
        with progress.task(f"count tokens of {len(samples)} samples and pack"):
            plan = plan_samples(samples, TokenCounter(processor), capacity, workers=workers, source=str(data),
                                model={"path": model, "init_seed": init_seed, "min_pixels": min_pixels,
                                       "max_pixels": max_pixels},
                                seed=seed, on_overlong=on_overlong, diversity=not greedy_only)
        path = plan.save(out)
    except (DataError, PackingError, ValueError, OSError) as err:
        typer.secho(f"vlrl data pack: {err}", fg="red", err=True)
        raise typer.Exit(2) from None
    s = plan.meta["stats"]
    typer.echo(f"wrote {path} (+ {path.with_suffix('.json').name}): {s['packed_samples']} samples in {s['bins']} bins of "
               f"{capacity} tokens (lower bound {s['lower_bound']}), fill {s['fill_ratio']:.2%}, padding compression "
               f"vs one sample per sequence {s['compression_vs_naive']:.1f}x; {s['truncated']} truncated, "
               f"{s['dropped']} dropped (longer than the capacity, listed in the .json)")


@data_app.command("balance")
def data_balance(
    data: Path = typer.Option(..., "--data", help="Sample file (.jsonl/.parquet) or directory to balance."),
    vocabulary: Path = typer.Option(..., "--vocabulary", help="Concept vocabulary: one concept per line."),
    out: Path = typer.Option(..., "--out", help="Output directory: index.json, report.json, coverage.png, train.jsonl."),
    embedder: str = typer.Option("clip", "--embedder", help="Registered embedder (clip) or pkg.mod:factory."),
    embedder_path: str = typer.Option(..., "--embedder-path", help="Local directory of the embedding model."),
    template: str = typer.Option("a photo of {}.", "--template", help="Prompt each concept is embedded in ({} = the concept)."),
    top_k: int = typer.Option(5, "--top-k", help="Concepts retrieved per sample."),
    n_out: int | None = typer.Option(None, "--n-out", help="Samples to draw (default: as many as the input holds)."),
    power: float = typer.Option(1.0, "--power", help="Weight exponent: w ∝ mean f_c^(−power) over the sample's concepts."),
    replace: bool | None = typer.Option(None, "--replace/--no-replace", help="Draw with replacement (default: only when --n-out exceeds the input)."),
    seed: int = typer.Option(0, "--seed"),
    batch_size: int = typer.Option(64, "--batch-size", help="Samples embedded per batch."),
    write_data: bool = typer.Option(True, "--write-data/--index-only", help="Also write the resampled samples as train.jsonl."),
    on_error: str = typer.Option("raise", "--on-error", help="Bad records: raise, or skip them."),
) -> None:
    """Concept balancing: top-K concepts per image, inverse-frequency resampling, coverage before/after."""
    from vlrl.data import DataError, read_samples, write_samples
    from vlrl.data.balance import balance_samples, get_embedder, plot_coverage, read_vocabulary, resampled
    from vlrl.data.packing import ids_fingerprint
    from vlrl.registry import RegistryError

    progress = _progress()
    try:
        words = read_vocabulary(str(vocabulary))
        samples = read_samples(data, on_error=on_error).samples
        model = get_embedder(embedder)(embedder_path)
        with progress.task(f"embed {len(samples)} samples, {len(words)} concepts"):
            result = balance_samples(samples, model, words, top_k=top_k, n_out=n_out, power=power, replace=replace,
                                     seed=seed, batch_size=batch_size, template_texts=[template.replace("{}", w) for w in words])
    except (DataError, RegistryError, ValueError, OSError) as err:
        typer.secho(f"vlrl data balance: {err}", fg="red", err=True)
        raise typer.Exit(2) from None
    out.mkdir(parents=True, exist_ok=True)
    ids = [s.id for s in samples]
    (out / "index.json").write_text(json.dumps({"data": str(data), "ids_sha256": ids_fingerprint(ids),
                                                "indices": result.indices.tolist(),
                                                "ids": [ids[i] for i in result.indices.tolist()]}) + "\n")
    (out / "report.json").write_text(json.dumps(result.report, indent=2) + "\n")
    from vlrl.report.plots import NO_CHARTS, can_draw

    if can_draw():
        plot_coverage(result, str(out / "coverage.png"))
    else:
        typer.secho(f"coverage.png not drawn: {NO_CHARTS.split(': ', 1)[1].split(';')[0]}", fg="yellow", err=True)
    if write_data:
        write_samples(resampled(samples, result.indices), out / "train.jsonl")
    r = result.report
    for name in ("pool", "uniform", "balanced"):
        c = r[name]
        typer.echo(f"{name:9s} {c['samples']:>8} samples: {c['concepts_covered']}/{len(words)} concepts covered "
                   f"({c['coverage']:.1%}), evenness {c['evenness']:.3f}, top-1% concepts hold {c['head_1pct_share']:.1%} "
                   "of mentions")
    typer.echo(f"wrote {out}/index.json, report.json, coverage.png" + (", train.jsonl" if write_data else ""))


@data_app.command("select")
def data_select(
    data: Path = typer.Option(..., "--data", help="Prompts (.jsonl/.parquet file or directory) with answers and rewards."),
    model: str = typer.Option(..., "--model", help="The current model: directory, preset or hub id."),
    out: Path = typer.Option(..., "--out", help="Output directory: selected.jsonl, stats.jsonl, summary.json."),
    n: int = typer.Option(8, "--n", help="Rollouts per prompt (N)."),
    k: int | None = typer.Option(None, "--k", help="pass@k of the gap (default: k = N)."),
    temperature: float = typer.Option(1.0, "--temperature"),
    top_k: int = typer.Option(0, "--top-k", min=0, help="Top-k of the rollouts, 0 = off (the full vocabulary); give "
                              "the RL run's rollout.top_k to select with the distribution it will sample."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens"),
    min_mean_reward: float | None = typer.Option(0.1, "--min-mean-reward", help="Drop items whose mean reward is lower (unsolvable)."),
    max_mean_reward: float | None = typer.Option(0.9, "--max-mean-reward", help="Drop items whose mean reward is higher (trivial)."),
    min_gap: float | None = typer.Option(None, "--min-gap", help="Keep only items with pass@k − pass@1 ≥ this."),
    store: Path | None = typer.Option(None, "--store", help="Rollout cache (jsonl) to reuse and extend; default OUT/rollouts.jsonl."),
    servers: str | None = typer.Option(None, "--servers", help="Comma-separated rollout servers (vlrl serve / SGLang) already serving --model."),
    batch_prompts: int = typer.Option(64, "--batch-prompts", help="Prompts per generate call."),
    seed: int = typer.Option(0, "--seed"),
    on_error: str = typer.Option("raise", "--on-error", help="Bad records: raise, or skip them."),
    attn_implementation: str | None = ATTN,
    revision: str | None = REVISION,
    trust_remote_code: bool | None = TRUST,
    chat_template_kwargs: str | None = TEMPLATE_KWARGS,
) -> None:
    """Discrepancy-driven selection: N rollouts per prompt, pass@1 / pass@k / mean reward, keep the band."""
    from vlrl.check import CheckReport, preflight, read_data
    from vlrl.config import DataConfig, ModelConfig, RolloutConfig, RunConfig
    from vlrl.data import DataError, write_samples
    from vlrl.data.select import Band, RolloutStore, rollout_and_score, select, summarise
    from vlrl.models import load_policy
    from vlrl.rollout import SamplingParams, build_engine, close_engine
    from vlrl.train.common import seed_everything

    if on_error not in ("raise", "skip"):
        typer.secho("vlrl data select: --on-error is raise or skip", fg="red", err=True)
        raise typer.Exit(2)
    report = CheckReport()  # the preflight: every record, the model, prompt + --max-new-tokens within the context
    samples = read_data(report, "--data", data, on_error)
    options = _load_options("data select", attn_implementation, revision, trust_remote_code, chat_template_kwargs)
    model_cfg = ModelConfig(path=model, attn_implementation=options.attn_implementation, revision=options.revision,
                            trust_remote_code=options.trust_remote_code,
                            chat_template_kwargs=dict(options.chat_template_kwargs))
    report = preflight(RunConfig(model=model_cfg, data=DataConfig(on_error=on_error)),
                       splits={"train": samples}, budgets=[("train", "--max-new-tokens", max_new_tokens)], report=report)
    if not report.ok:
        _preflight_failed("data select", str(data), report)
    for warning in report.warnings:
        typer.secho(f"warning: {warning}", fg="yellow", err=True)
    progress = _progress()
    engine = None
    try:
        band = Band(min_mean_reward=min_mean_reward, max_mean_reward=max_mean_reward, min_gap=min_gap, k=k or n)
        rollout_store = RolloutStore(store or out / "rollouts.jsonl")
        seed_everything(seed)
        with progress.task(f"load {model}"):
            if servers:  # they already serve --model: only its tokenizer and processor are loaded here
                from vlrl.models.policy import load_processor

                urls = [u.strip() for u in servers.split(",") if u.strip()]
                engine = build_engine(RolloutConfig(servers=urls, weights_dir=str(out / "weights")),
                                      load_processor(model, options=options), sync_weights=False)
            else:
                engine = build_engine(RolloutConfig(), load_policy(model, options=options))
        sampling = SamplingParams(n=n, temperature=temperature, top_k=top_k, max_new_tokens=max_new_tokens)
        with progress.task(f"roll out {len(samples)} prompts × {n}", total=len(samples)) as task:
            rollouts, generated, failures = rollout_and_score(
                engine, samples, sampling, rollout_store, model=model, batch_prompts=batch_prompts,
                on_progress=lambda done: task.update(completed=done))
        kept, stats = select(samples, rollouts, band)
    except (DataError, ValueError, OSError) as err:
        typer.secho(f"vlrl data select: {err}", fg="red", err=True)
        raise typer.Exit(2) from None
    finally:
        close_engine(engine)
    out.mkdir(parents=True, exist_ok=True)
    write_samples(kept, out / "selected.jsonl")
    with open(out / "stats.jsonl", "w", encoding="utf-8") as handle:
        for s in stats:
            handle.write(json.dumps({**s.__dict__, "gap": s.gap}) + "\n")
    summary = {**summarise(stats), "band": band.__dict__, "generated": generated,
               "reused_from_store": len(samples) - generated, "reward_failures": failures,
               "store": str(rollout_store.path), "model": model, "n": n}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    typer.echo(f"kept {len(kept)} of {len(samples)} items ({summary['verdicts']}); rolled out {generated}, reused "
               f"{len(samples) - generated} from {rollout_store.path}; wrote {out}/selected.jsonl, stats.jsonl, summary.json")


def _progress():
    """Progress bars on stderr (only when it is a terminal)."""
    from rich.console import Console

    from vlrl.report.progress import LiveProgress

    return LiveProgress(Console(file=sys.stderr))


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        app()
    except ConfigError as err:
        typer.secho(str(err), fg="red", err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
