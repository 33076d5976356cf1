"""What the commands share: the common options, loading a run's config with its numerics pinned, running a
recipe with the user's mistakes reported without a traceback, the preflight's failure, the progress bars."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

from vlrl.check.options import load_run_config as load_config  # (the config with its plug-in options checked)
from vlrl.config import ConfigError, DemoConfig, RLConfig, SFTConfig

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


def load_options(command: str, attn: str | None, revision: str | None, trust: bool | None, template_kwargs: str | None,
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


def pin_numerics(command: str, mode: str) -> None:
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


def extra_overrides(data: str | None, resume: str | None, test: str | None = None) -> list[str]:
    return [*([f"data.train={data}"] if data else []), *([f"data.test={test}"] if test else []),
            *([f"checkpoint.resume={resume}"] if resume else [])]


def load_run(cls, config: Path | None, overrides: list[str] | None, extra: list[str]):
    """The run's config, with its ``numerics`` pinned before anything computes (`vlrl.numerics`)."""
    from vlrl.numerics import NumericsError, apply_numerics

    try:
        return load_config(cls, config, [*extra, *(overrides or [])], prepare=lambda cfg: apply_numerics(cfg.numerics))
    except (ConfigError, NumericsError) as err:
        typer.secho(str(err), fg="red", err=True)
        raise typer.Exit(2) from None


def run_recipe(command: str, cfg) -> None:
    """Run the recipe of ``command`` (`vlrl.recipes.RECIPES`: ``demo``, ``rl``, ``sft``). What the user can fix ends the command with its message and exit 1, without a traceback:
    a failed preflight check (every problem in one list; nothing was loaded), or a data file / name / plan
    that fails once the run is under way (then the preflight lists every problem it can find)."""
    from vlrl.check import PreflightError, preflight
    from vlrl.data import DataError
    from vlrl.data.packing import PackingError
    from vlrl.recipes import RECIPES
    from vlrl.registry import RegistryError
    from vlrl.train.checkpoint import CheckpointError
    from vlrl.train.common import NonFiniteError, RunDirBusy

    try:
        RECIPES[command](cfg)
    except PreflightError as err:
        preflight_failed(command, str(cfg.out), err.report)
    except (CheckpointError, NonFiniteError, RunDirBusy) as err:  # a corrupt checkpoint, a NaN, a busy out=
        typer.secho(f"vlrl {command}: {err}", fg="red", err=True)
        raise typer.Exit(1) from None
    except (DataError, RegistryError, PackingError, FileNotFoundError) as err:
        report = preflight(cfg) if cfg.check.enabled else None  # every bad record, not only the first
        if report is not None and not report.ok:
            preflight_failed(command, str(cfg.out), report)
        typer.secho(f"vlrl {command}: {err}", fg="red", err=True)
        raise typer.Exit(1) from None


def preflight_failed(command: str, what: str, report) -> None:
    typer.secho(f"vlrl {command}: the preflight check failed for {what}:\n{report.format()}", fg="red", err=True)
    typer.secho("(`vlrl check` runs the same check alone; check.enabled=false skips it)", err=True)
    raise typer.Exit(1)


def recipe_of(config: Path, recipe: str) -> str:
    """``recipe``, or with ``auto`` the one ``config`` is written for (`vlrl.check.detect_recipe`); a config that
    cannot be read counts as empty here — loading it later reports the error with the file name."""
    if recipe != "auto":
        return recipe
    from vlrl.check import detect_recipe
    from vlrl.safe_yaml import YamlRefused, load_file

    try:
        raw = load_file(config) if config.is_file() else {}
    except YamlRefused:
        raw = {}
    return detect_recipe(raw if isinstance(raw, dict) else {}, config)


def first_line(err: Exception) -> str:
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__


def progress_bars():
    """Progress bars on stderr (only when it is a terminal)."""
    from rich.console import Console

    from vlrl.report.progress import LiveProgress

    return LiveProgress(Console(file=sys.stderr))


RECIPES = {"demo": DemoConfig, "rl": RLConfig, "sft": SFTConfig}
