"""`vlrl report`, `vlrl env`, `vlrl check`: what a run wrote, the environment, a config's preflight."""

from __future__ import annotations

from pathlib import Path

import typer

from vlrl.check.options import load_run_config as load_config  # (the config with its plug-in options checked)
from vlrl.cli.app import app
from vlrl.cli.common import OVERRIDES, RECIPES, TEST, extra_overrides, recipe_of
from vlrl.config import ConfigError


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


@app.command()
def check(
    config: Path = typer.Argument(..., help="The YAML config of the run to check."),
    overrides: list[str] | None = OVERRIDES,
    recipe: str = typer.Option("auto", "--recipe", help="auto (from the file's sections), sft, rl or demo."),
    data: str | None = typer.Option(None, "--data", help="Training samples file/dir (sets data.train)."),
    test: str | None = TEST,
) -> None:
    """Preflight: processor, vision tokens, context length, batch sizes, names and data files — no weights loaded."""
    from vlrl.check import preflight

    recipe = recipe_of(config, recipe)
    if recipe not in RECIPES:
        typer.secho(f"vlrl check: --recipe must be auto, sft, rl or demo (got {recipe!r})", fg="red", err=True)
        raise typer.Exit(2)
    typer.echo(f"vlrl check {config} (as a `vlrl {recipe}` config)")
    try:
        cfg = load_config(RECIPES[recipe], config, [*extra_overrides(data, None, test), *(overrides or [])])
    except ConfigError as err:
        typer.secho("\n".join(f"  ✗ {line}" for line in str(err).splitlines()), fg="red")
        typer.secho("preflight: the config does not load", fg="red")
        raise typer.Exit(1) from None
    result = preflight(cfg)
    typer.secho(result.format(), fg=None if result.ok else "red")
    if not result.ok:
        raise typer.Exit(1)
