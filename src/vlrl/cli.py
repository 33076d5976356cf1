"""The `vlrl` command. Each subcommand takes ``--config FILE`` and dotted overrides (``algo.clip_high=0.28``)."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import typer

from vlrl.config import ConfigError, DemoConfig, EvalConfig, RLConfig, SFTConfig, load_config
from vlrl.rewards.cli import app as reward_app

app = typer.Typer(add_completion=False, no_args_is_help=True, help="vlrl: RL from verifiable rewards for VLMs and LLMs.")
data_app = typer.Typer(no_args_is_help=True, help="Generate and inspect data.")
app.add_typer(data_app, name="data")
app.add_typer(reward_app, name="reward")

CONFIG = typer.Option(None, "--config", "-c", help="YAML config file (see configs/).")
OVERRIDES = typer.Argument(None, help="Dotted overrides, e.g. rl.algo.clip_high=0.28 data.n_train=500")


def _load(cls, config: Path | None, overrides: list[str] | None, extra: list[str]):
    try:
        return load_config(cls, config, [*extra, *(overrides or [])])
    except ConfigError as err:
        typer.secho(str(err), fg="red", err=True)
        raise typer.Exit(2) from None


def _run(recipe, cfg) -> None:
    """Run a recipe; a failed preflight check exits 1 with its list of problems (nothing was loaded)."""
    from vlrl.check import PreflightError

    try:
        recipe(cfg)
    except PreflightError as err:
        typer.secho(f"vlrl: the preflight check failed for {cfg.out}:\n{err}", fg="red", err=True)
        typer.secho("(`vlrl check` runs the same check alone; check.enabled=false skips it)", err=True)
        raise typer.Exit(1) from None


@app.command()
def demo(
    config: Path | None = CONFIG,
    out: str | None = typer.Option(None, "--out", help="Run directory (default runs/demo)."),
    overrides: list[str] | None = OVERRIDES,
) -> None:
    """The main job: tiny VLM, shapes data, SFT warm start, eval, GRPO, eval, and an equal-time SFT control."""
    from vlrl.train.recipes import run_demo

    default = Path(__file__).parent / "configs" / "demo.yaml"
    cfg = _load(DemoConfig, config or default, overrides, [f"out={out or 'runs/demo'}"])
    _run(run_demo, cfg)


@app.command()
def sft(
    config: Path | None = CONFIG,
    data: str | None = typer.Option(None, "--data", help="Training samples file/dir (sets data.train)."),
    overrides: list[str] | None = OVERRIDES,
) -> None:
    """Supervised fine-tuning on reference responses."""
    from vlrl.train.recipes import run_sft

    _run(run_sft, _load(SFTConfig, config, overrides, [f"data.train={data}"] if data else []))


@app.command()
def rl(
    config: Path | None = CONFIG,
    data: str | None = typer.Option(None, "--data", help="Training prompts file/dir (sets data.train)."),
    overrides: list[str] | None = OVERRIDES,
) -> None:
    """GRPO-family RL with verifiable rewards (synchronous, or asynchronous with rollout.mode=async)."""
    from vlrl.train.recipes import run_rl

    _run(run_rl, _load(RLConfig, config, overrides, [f"data.train={data}"] if data else []))


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
    max_queued_requests: int = typer.Option(1024, "--max-queued-requests", help="Queue bound; further requests get 503."),
    batch_window_ms: float = typer.Option(10.0, "--batch-window-ms",
                                          help="Wait while requests keep arriving at most this far apart before decoding."),
    threads: int | None = typer.Option(None, "--threads", help="torch CPU threads (default: torch's choice)."),
    init_seed: int = typer.Option(0, "--init-seed", help="Seed of a tiny preset's random initialisation."),
) -> None:
    """Serve a policy over SGLang's native HTTP API (/generate, /update_weights_from_disk, /health, /get_model_info)."""
    import torch

    from vlrl.rollout.server import serve as run_server

    if threads:
        torch.set_num_threads(threads)
    try:
        run_server(model, host=host, port=port, api_key=api_key, no_auth=no_auth, dtype=dtype, device=device,
                   max_batch_size=max_batch_size, max_queued_requests=max_queued_requests,
                   batch_window_ms=batch_window_ms, init_seed=init_seed)
    except ValueError as err:
        typer.secho(f"vlrl serve: {err}", fg="red", err=True)
        raise typer.Exit(2) from None


@app.command("eval")
def eval_(
    model: str = typer.Option(..., "--model", help="Model directory, preset name or hub id."),
    data: str | None = typer.Option(None, "--data", help="Held-out samples file/dir; default: procedural shapes test split."),
    samples: int = typer.Option(4, "--samples", help="Samples per prompt for sampled accuracy and pass@k."),
    temperature: float = typer.Option(1.0, "--temperature"),
    max_new_tokens: int = typer.Option(16, "--max-new-tokens"),
    n: int = typer.Option(200, "--n", help="Procedural test samples when --data is not given."),
    out: Path | None = typer.Option(None, "--out", help="Write the result as JSON here."),
) -> None:
    """Greedy accuracy, sampled accuracy and pass@k per task on held-out data."""
    from vlrl.config import DataConfig
    from vlrl.eval import evaluate
    from vlrl.models import load_policy
    from vlrl.rollout import HFEngine
    from vlrl.train.common import load_split

    progress = _progress()
    with progress.task(f"load {model}"):
        policy = load_policy(model)
    test = load_split(DataConfig(test=data, n_test=n), "test")
    with progress.task(f"eval {len(test)} prompts × {samples}"):
        result = evaluate(HFEngine(policy), test,
                          EvalConfig(samples=samples, temperature=temperature, max_new_tokens=max_new_tokens))
    result.pop("examples")
    text = json.dumps(result, indent=2)
    if out:
        out.write_text(text + "\n")
    typer.echo(text)


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


RECIPES = {"demo": DemoConfig, "rl": RLConfig, "sft": SFTConfig}


@app.command()
def check(
    config: Path = typer.Argument(..., help="The YAML config of the run to check."),
    overrides: list[str] | None = OVERRIDES,
    recipe: str = typer.Option("auto", "--recipe", help="auto (from the file's sections), sft, rl or demo."),
    data: str | None = typer.Option(None, "--data", help="Training samples file/dir (sets data.train)."),
) -> None:
    """Preflight: processor, vision tokens, context length, batch sizes, names and data files — no weights loaded."""
    import yaml

    from vlrl.check import detect_recipe, preflight

    if recipe == "auto":
        try:
            raw = yaml.safe_load(config.read_text()) if config.is_file() else {}
        except yaml.YAMLError:
            raw = {}  # load_config below reports the YAML error with the file name
        recipe = detect_recipe(raw if isinstance(raw, dict) else {}, config)
    if recipe not in RECIPES:
        typer.secho(f"vlrl check: --recipe must be auto, sft, rl or demo (got {recipe!r})", fg="red", err=True)
        raise typer.Exit(2)
    typer.echo(f"vlrl check {config} (as a `vlrl {recipe}` config)")
    try:
        cfg = load_config(RECIPES[recipe], config, [*([f"data.train={data}"] if data else []), *(overrides or [])])
    except ConfigError as err:
        typer.secho("\n".join(f"  ✗ {line}" for line in str(err).splitlines()), fg="red")
        typer.secho("preflight: the config does not load", fg="red")
        raise typer.Exit(1) from None
    result = preflight(cfg)
    typer.secho(result.format(), fg=None if result.ok else "red")
    if not result.ok:
        raise typer.Exit(1)


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
