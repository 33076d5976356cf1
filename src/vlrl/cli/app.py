"""The `vlrl` Typer app and its `data` group; the command modules of `vlrl.cli` add their commands to them."""

from __future__ import annotations

import typer

from vlrl.cli.reward import app as reward_app
from vlrl.synth.cli import app as synth_app

app = typer.Typer(add_completion=False, no_args_is_help=True, help="vlrl: RL from verifiable rewards for VLMs and LLMs.")
data_app = typer.Typer(no_args_is_help=True, help="Generate and inspect data.")
app.add_typer(data_app, name="data")
app.add_typer(reward_app, name="reward")
app.add_typer(synth_app, name="synth")


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
