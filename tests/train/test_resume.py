"""Exact resume after SIGKILL: a run killed at a random step and resumed with ``--resume auto`` logs the same
per-step metrics (loss, grad norm, reward, …) and ends with the same weights as the same run left alone — for
SFT and GRPO, on 1 process and on 2 ranks (SFT with FSDP2, GRPO with DDP and a KL reference).

The killed run is always a `vlrl` process tree of its own, SIGKILLed mid-run (every process group of it): processes
forked from the already-imported zygote (tests/forked_runs.py; a 2-rank run is an agent and its two ranks). The
uninterrupted 2-rank runs come from the shared torchrun job (`dist_worker.py`, which calls the recipes exactly
as `vlrl sft|rl` does); the 1-process reference and resumed runs run in this process (one torch thread, like
the subprocess), which saves two interpreter start-ups per test.
"""

import json
import random
import sys
import time
from contextlib import contextmanager

import pytest
import torch
from safetensors.torch import load_file

import forked_runs  # tests/ is on sys.path
from vlrl.config import RLConfig, SFTConfig, load_config
from vlrl.recipes import run_rl, run_sft

from .dist_helpers import (
    COMPARED,
    kill_process_tree,
    quiet_env,
    run_args,
    run_checked,
    torchrun,
    write_rl_data,
)

RECIPES = {"sft": (SFTConfig, run_sft, 5), "rl": (RLConfig, run_rl, 4)}  # config, recipe, steps (dist_helpers)


def command(nproc: int, recipe: str, *args: str) -> list[str]:
    if nproc == 1:
        return [sys.executable, "-m", "vlrl.cli", recipe, *args]
    return torchrun(nproc, "-m", "vlrl.cli", recipe, *args)


def records(run_dir, stage):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["stage"] == stage]


@contextmanager
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the subprocesses run (OMP_NUM_THREADS=1): same kernels, same rounding
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def in_process(recipe: str, args: list[str]) -> None:
    config, run, _ = RECIPES[recipe]
    with one_thread():
        run(load_config(config, None, args))


def run_killed(cmd: list[str], run_dir, stage: str, kill_after: int, timeout: float = 600) -> None:
    """Start ``cmd`` in a session of its own; SIGKILL all of its processes once ``kill_after`` steps are logged."""
    log = run_dir.with_name(f"{run_dir.name}.log")
    proc = forked_runs.popen(cmd, log=log, env=quiet_env())  # its own session; forked: tests/forked_runs.py
    deadline = time.time() + timeout
    try:
        while time.time() < deadline:
            if (run_dir / "metrics.jsonl").exists() and len(records(run_dir, stage)) >= kill_after:
                kill_process_tree(proc.pid)
                break
            if proc.poll() is not None:
                raise AssertionError(f"the run ended (exit {proc.returncode}) before it could be killed:\n"
                                     f"{log.read_text()[-3000:]}")
            time.sleep(0.02)
        else:
            raise AssertionError("the run logged no steps in time")
    finally:
        kill_process_tree(proc.pid)
        proc.wait(timeout=60)
    assert proc.returncode == -9  # killed, not finished


@pytest.mark.e2e
@pytest.mark.parametrize("recipe", ["sft", "rl"])
@pytest.mark.parametrize("nproc", [1, 2])
def test_killed_at_a_random_step_resumes_exactly(two_ranks, tiny_vlm_dir, tmp_path, nproc, recipe):
    out, _ = two_ranks
    steps = RECIPES[recipe][2]
    args = run_args(recipe, tiny_vlm_dir, out / "rl_data" / "train.jsonl" if recipe == "rl" else None, nproc=nproc)
    resumed = tmp_path / "resumed"
    if nproc == 1:
        reference = tmp_path / "reference"
        in_process(recipe, [*args, f"out={reference}"])
    else:
        reference = out / f"reference_{recipe}"
    kill_after = random.randint(1, steps - 2)
    run_killed(command(nproc, recipe, *args, f"out={resumed}"), resumed, recipe, kill_after)
    assert not (resumed / "summary.json").exists()
    assert (resumed / "checkpoints").is_dir()
    if nproc == 1:
        in_process(recipe, [*args, f"out={resumed}", "checkpoint.resume=auto"])
    else:
        run_checked(command(nproc, recipe, "--resume", "auto", *args, f"out={resumed}"))

    expected, got = records(reference, recipe), records(resumed, recipe)
    assert [r["step"] for r in got] == list(range(1, steps + 1)), f"killed after step {kill_after}"
    for a, b in zip(expected, got, strict=True):
        assert {k: a[k] for k in COMPARED[recipe]} == {k: b[k] for k in COMPARED[recipe]}, \
            f"{recipe} step {a['step']} differs after a kill at step {kill_after}"
    weights_a = load_file(reference / "checkpoints" / "final" / "model.safetensors")
    weights_b = load_file(resumed / "checkpoints" / "final" / "model.safetensors")
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)
    assert json.loads((resumed / "summary.json").read_text())["train"]["steps"] == steps


def test_dynamic_sampling_carry_and_the_critic_resume_exactly(tiny_vlm_dir, tmp_path):
    """The sync recipe's state beyond weights and cursor — dynamic sampling's carried-over groups and the critic
    (weights, AdamW) — is in the checkpoint: k steps, then a resume to 4, equals the 4 steps run at once, where k
    is the first step of the uninterrupted run after which groups were carried over (oversample=2 on a dense
    reward leaves surplus informative groups; which step first has them depends on the sampler's random stream,
    so it is read from the reference run rather than fixed)."""
    data = write_rl_data(tmp_path / "data" / "train.jsonl")
    args = [*run_args("rl", tiny_vlm_dir, data, nproc=1), "algo.kl_coef=0", "algo.advantage=gae",
            "algo.dynamic_sampling.enabled=true", "algo.dynamic_sampling.oversample=2"]
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    in_process("rl", [*args, f"out={reference}"])
    expected = records(reference, "rl")
    carried = [r["step"] - 1 for r in expected[1:] if r["sampling/carried_in"] > 0]  # steps that left groups over
    assert carried, [r["sampling/carried_in"] for r in expected]  # else this test checks no carried state
    stop = carried[0]
    in_process("rl", [*args, f"out={resumed}", f"train.steps={stop}"])
    in_process("rl", [*args, f"out={resumed}", "checkpoint.resume=auto"])

    got = records(resumed, "rl")
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    assert got[stop]["sampling/carried_in"] > 0  # the first resumed step trains the groups the checkpoint carried
    keys = (*COMPARED["rl"][:-2], "response/length_mean", "critic/value_loss", "critic/grad_norm",
            "sampling/carried_in", "sampling/prompts_generated")
    for a, b in zip(expected, got, strict=True):
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}, f"step {a['step']}"
    weights_a = load_file(reference / "checkpoints" / "final" / "model.safetensors")
    weights_b = load_file(resumed / "checkpoints" / "final" / "model.safetensors")
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)


def test_lora_run_killed_at_a_random_step_resumes_exactly(tiny_vlm_dir, tmp_path):
    """`vlrl rl` with model.lora, SIGKILLed after a random step's checkpoint and resumed with
    ``checkpoint.resume=auto``: the same per-step metrics, the same adapter directory and the same merged export
    as the run left alone (the checkpoints hold the adapters, their AdamW moments and the RNG/cursor state)."""
    data = write_rl_data(tmp_path / "data" / "train.jsonl")
    args = [*run_args("rl", tiny_vlm_dir, data, nproc=1), "model.lora.r=4", "model.lora.alpha=8", "optim.lr=1e-2"]
    steps = RECIPES["rl"][2]
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    in_process("rl", [*args, f"out={reference}"])
    kill_after = random.randint(1, steps - 2)
    run_killed(command(1, "rl", *args, f"out={resumed}"), resumed, "rl", kill_after)
    assert not (resumed / "summary.json").exists()
    in_process("rl", [*args, f"out={resumed}", "checkpoint.resume=auto"])

    expected, got = records(reference, "rl"), records(resumed, "rl")
    assert [r["step"] for r in got] == list(range(1, steps + 1)), f"killed after step {kill_after}"
    assert all(r["policy/grad_norm"] > 0 for r in expected)  # the adapters are trained at every step
    assert 0 < expected[0]["policy/trainable_params"] < 0.2 * 1.06e6  # only the r = 4 adapters (of 1.06M)
    for a, b in zip(expected, got, strict=True):
        assert {k: a[k] for k in COMPARED["rl"]} == {k: b[k] for k in COMPARED["rl"]}, \
            f"LoRA step {a['step']} differs after a kill at step {kill_after}"
    final_a, final_b = reference / "checkpoints" / "final", resumed / "checkpoints" / "final"
    adapter_a = load_file(final_a / "adapter" / "adapter_model.safetensors")
    adapter_b = load_file(final_b / "adapter" / "adapter_model.safetensors")
    assert adapter_a.keys() == adapter_b.keys() and all(torch.equal(adapter_a[k], adapter_b[k]) for k in adapter_a)
    assert any(".lora_B." in k and adapter_a[k].abs().max() > 0 for k in adapter_a)  # B left 0: the adapters moved
    merged_a = load_file(final_a / "model.safetensors")
    merged_b = load_file(final_b / "model.safetensors")
    assert merged_a.keys() == merged_b.keys() and all(torch.equal(merged_a[k], merged_b[k]) for k in merged_a)
