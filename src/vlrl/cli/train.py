"""`vlrl demo`, `vlrl sft`, `vlrl rl`: the recipes."""

from __future__ import annotations

from pathlib import Path

import typer

from vlrl.cli.app import app
from vlrl.cli.common import CONFIG, OVERRIDES, RESUME, TEST, extra_overrides, load_run, run_recipe
from vlrl.config import DemoConfig, RLConfig, SFTConfig


@app.command()
def demo(
    config: Path | None = CONFIG,
    out: str | None = typer.Option(None, "--out", help="Run directory (default runs/demo)."),
    overrides: list[str] | None = OVERRIDES,
) -> None:
    """The main job: tiny VLM, shapes data, SFT warm start, eval, GRPO, eval, and an SFT control with the RL stage's FLOPs."""
    default = Path(__file__).parent.parent / "configs" / "demo.yaml"
    cfg = load_run(DemoConfig, config or default, overrides, [f"out={out or 'runs/demo'}"])
    # imported after the config: a bad config or override is refused without importing torch and transformers
    from vlrl.train.recipes import run_demo

    run_recipe("demo", run_demo, cfg)


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
    cfg = load_run(SFTConfig, config, overrides, extra_overrides(data, resume, test))
    # imported after the config: a bad config or override is refused without importing torch and transformers
    from vlrl.train.recipes import run_sft

    if stages is not None:
        wanted = [s.strip() for s in stages.split(",") if s.strip()]
        known = [s.name for s in cfg.stages]
        unknown = [s for s in wanted if s not in known]
        if unknown or not wanted:
            typer.secho(f"--stages: unknown stage(s) {unknown or wanted}; the config's stages: {known or 'none'}",
                        fg="red", err=True)
            raise typer.Exit(2)
        cfg.stages = [s for s in cfg.stages if s.name in wanted]
    run_recipe("sft", run_sft, cfg)


@app.command()
def rl(
    config: Path | None = CONFIG,
    data: str | None = typer.Option(None, "--data", help="Training prompts file/dir (sets data.train)."),
    test: str | None = TEST,
    resume: str | None = RESUME,
    overrides: list[str] | None = OVERRIDES,
) -> None:
    """GRPO-family RL with verifiable rewards (synchronous, or asynchronous with rollout.mode=async)."""
    cfg = load_run(RLConfig, config, overrides, extra_overrides(data, resume, test))
    # imported after the config: a bad config or override is refused without importing torch and transformers
    from vlrl.train.recipes import run_rl

    run_recipe("rl", run_rl, cfg)
