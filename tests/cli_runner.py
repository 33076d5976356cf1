"""`in_process`: a `vlrl` command run by the ``vlrl`` app in the test's own process (typer's runner), for tests that
check what a run writes and prints, not what a process of its own does (exit signals, environment, kernels chosen at
start: those keep a subprocess). A process of its own pays ~5 CPU-s for its imports of torch, transformers and vlrl
before the run's own seconds (a 2-step tiny `vlrl rl`: 7.3 CPU-s as a process); in the test's process they are paid
once per pytest worker."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def invoke(*args: str, env: dict[str, str] | None = None):
    """``vlrl ARGS`` through the ``vlrl`` app in this process (typer's runner), at one torch thread, offline (the
    recipes name hub models; model.path points at their tiny presets), from the repository, with ``env``'s
    variables set for the run: typer's Result (exit_code, stdout, stderr, output, exception)."""
    import torch
    from typer.testing import CliRunner

    from vlrl.cli import app

    threads, cwd = torch.get_num_threads(), os.getcwd()
    extra = {"HF_HUB_OFFLINE": "1", **(env or {})}
    saved = {name: os.environ.get(name) for name in extra}
    torch.set_num_threads(1)
    os.environ.update(extra)
    os.chdir(REPO)
    try:
        return CliRunner().invoke(app, list(args))
    finally:
        os.chdir(cwd)
        torch.set_num_threads(threads)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def in_process(*args: str, env: dict[str, str] | None = None) -> str:
    """``vlrl ARGS`` by `invoke`, which must succeed, as the subprocess ran it: a process of its own paid ~5 CPU-s for
    its imports of torch, transformers and vlrl before the run's own ~3 (measured: 8.4 CPU-s a run as a process) —
    the imports are now paid once per worker. The run writes the same files; the checks read them. Returns what it
    printed, stdout and stderr, its whitespace collapsed."""
    result = invoke(*args, env=env)
    if result.exit_code != 0:
        import traceback

        trace = "".join(traceback.format_exception(result.exception)) if result.exception else ""
        raise AssertionError(f"vlrl {' '.join(args)} failed ({result.exit_code}):\n{result.output[-4000:]}\n{trace[-4000:]}")
    return " ".join(result.output.split())  # stdout and stderr as printed (rich wraps long lines)
