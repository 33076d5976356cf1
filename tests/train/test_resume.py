"""Exact resume after SIGKILL: a run killed at a random step and resumed with ``--resume auto`` logs the same
per-step metrics, and ends with the same weights, as the same run left alone — on 1 process and on 2 ranks."""

import json
import random
import subprocess
import sys
import time

import pytest
from safetensors.torch import load_file

from .dist_helpers import kill_process_tree, quiet_env, run_checked, torchrun

SFT_ARGS = ["data.n_train=48", "data.n_test=2", "data.tasks=[count,ocr]", "train.steps=6", "train.batch_size=8",
            "train.micro_batch_size=4", "train.log_every=1", "checkpoint.every=1", "report.html=false",
            "check.enabled=false", "eval.samples=1", "eval.max_new_tokens=2"]
COMPARED = {"sft": ("sft/loss", "sft/grad_norm", "sft/lr")}


def command(nproc: int, recipe: str, *args: str) -> list[str]:
    if nproc == 1:
        return [sys.executable, "-m", "vlrl.cli", recipe, *args]
    return torchrun(nproc, "-m", "vlrl.cli", recipe, *args)


def records(run_dir, stage):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["stage"] == stage]


def run_killed(cmd: list[str], run_dir, stage: str, kill_after: int, timeout: float = 300) -> None:
    """Start ``cmd`` in a session of its own; SIGKILL all of its processes once ``kill_after`` steps are logged."""
    proc = subprocess.Popen(cmd, env=quiet_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.time() + timeout
    try:
        while time.time() < deadline:
            if (run_dir / "metrics.jsonl").exists() and len(records(run_dir, stage)) >= kill_after:
                kill_process_tree(proc.pid)
                break
            if proc.poll() is not None:
                raise AssertionError(f"the run ended (exit {proc.returncode}) before it could be killed:\n"
                                     f"{proc.stderr.read()[-3000:]}")
            time.sleep(0.02)
        else:
            raise AssertionError("the run logged no steps in time")
    finally:
        kill_process_tree(proc.pid)
        proc.wait(timeout=60)
    assert proc.returncode == -9  # killed, not finished


@pytest.mark.e2e
@pytest.mark.parametrize("nproc", [1, 2])
def test_sft_killed_at_a_random_step_resumes_exactly(tiny_vlm_dir, tmp_path, nproc):
    args = [f"model.path={tiny_vlm_dir}", *SFT_ARGS] + (["dist.strategy=fsdp"] if nproc > 1 else [])
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    run_checked(command(nproc, "sft", *args, f"out={reference}"))
    kill_after = random.randint(1, 4)
    run_killed(command(nproc, "sft", *args, f"out={resumed}"), resumed, "sft", kill_after)
    assert not (resumed / "summary.json").exists()
    run_checked(command(nproc, "sft", "--resume", "auto", *args, f"out={resumed}"))

    expected, got = records(reference, "sft"), records(resumed, "sft")
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5, 6], f"killed after step {kill_after}"
    for a, b in zip(expected, got, strict=True):
        assert {k: a[k] for k in COMPARED["sft"]} == {k: b[k] for k in COMPARED["sft"]}, \
            f"step {a['step']} differs after a kill at step {kill_after}"
    weights_a = load_file(reference / "checkpoints" / "final" / "model.safetensors")
    weights_b = load_file(resumed / "checkpoints" / "final" / "model.safetensors")
    assert all((weights_a[k] == weights_b[k]).all() for k in weights_a)
    assert json.loads((resumed / "summary.json").read_text())["train"]["steps"] == 6
