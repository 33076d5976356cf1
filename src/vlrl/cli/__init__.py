"""The `vlrl` command. Each subcommand takes ``--config FILE`` and dotted overrides (``algo.clip_high=0.28``).

The Typer app is in `vlrl.cli.app`; the commands, by topic: `vlrl.cli.train` (demo, sft, rl), `vlrl.cli.serve`,
`vlrl.cli.evaluate` (eval), `vlrl.cli.report` (report, env, check), `vlrl.cli.launch` (launch, plan) and
`vlrl.cli.data` (the `data` group); what they share is in `vlrl.cli.common`. The modules are imported in the order
`vlrl --help` lists the commands.
"""

from __future__ import annotations

import logging
import sys

import typer

from vlrl.cli.app import app, data_app
from vlrl.config import ConfigError

# Each command module adds its commands to `app` as it is imported: this order is the order `vlrl --help` lists them.
# isort: off
from vlrl.cli import train  # noqa: E402, F401  demo, sft, rl
from vlrl.cli import serve  # noqa: E402, F401
from vlrl.cli import evaluate  # noqa: E402, F401  eval
from vlrl.cli import report  # noqa: E402, F401  report, env, check
from vlrl.cli import launch  # noqa: E402, F401  launch, plan
from vlrl.cli import data  # noqa: E402, F401  the `data` group's commands
# isort: on

__all__ = ["app", "data_app", "main"]


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        app()
    except ConfigError as err:
        typer.secho(str(err), fg="red", err=True)
        sys.exit(2)
