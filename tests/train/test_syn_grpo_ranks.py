"""Syn-GRPO with resumable checkpoints and under torchrun, through `vlrl rl --config configs/shapes_syn_grpo.yaml`.

The dataset is rewritten as the run trains, so a checkpoint holds the rewritten pool (`SynthState`: every swapped
sample with its image, the generations, the client's unanswered requests and counters) and a torchrun job keeps
one synthesis client (rank 0) whose outcomes every rank applies at the same step boundary. Both are proved by the
run's own records: ``synth/dataset_version`` (swaps applied) and ``synth/dataset_checksum`` (every slot's sample id
and every synthesised image's pixels; under torchrun the ranks compare theirs at every step and stop on a
mismatch).

The model is the tiny VLM SFT'd (`vlrl sft --data`) to write the Syn-GRPO template, so descriptions really go to
the synthesis server the recipe starts on loopback. ``synth.mode=sync`` (each step waits for its own jobs) makes
the swap points a function of the steps alone: what is swapped in after step k is decided at step k's boundary,
not by the server's timing — the determinism both comparisons need. 4 training prompts, 2 per step: steps 1-2 draw
the originals and synthesise each, steps 3-4 draw only synthesised samples (``synth/batch_synthetic_frac`` = 1).
"""

import dataclasses
import json
import random
import time
from pathlib import Path

import pytest

import forked_runs  # tests/ is on sys.path
import vlrl
from vlrl.data import generate, write_samples
from vlrl.synth.workflow import apply_syn_template

from .dist_helpers import kill_process_tree, quiet_env, run_checked, torchrun
from .test_resume import command, records

CONFIGS = Path(vlrl.__file__).parent / "configs"  # = the repository's configs/ (a symlink to it)
SYN_RESPONSE = "<diversity>0.5</diversity><description>a red brick wall</description><answer>[10, 10, 60, 60]</answer>"
STEPS = 4
ARGS = ["data.n_train=4", "data.n_test=2", f"train.steps={STEPS}", "train.prompts_per_step=2", "rollout.n=4",
        "train.log_every=1", "checkpoint.every=1", "synth.mode=sync", "synth.poll_interval=0.05", "eval.samples=1",
        "report.html=false", "check.enabled=false"]
TIMINGS = ("time", "synth/latency_mean", "synth/latency_max", "synth/client_cpu_seconds")


@pytest.fixture(scope="module")
def syn_model(tmp_path_factory, tiny_vlm_dir):
    """The tiny VLM after 80 SFT steps on 64 locate prompts in the short Syn-GRPO template, all answered with
    `SYN_RESPONSE`: it writes the template (and so a description) for every prompt of the runs below. After 40
    steps it did on one CPU and not on another (AVX-512: at steps 3-4 of the reference run 1 and 3 sampled responses
    had no description, so no swap and one dataset checksum fewer); 80 left none without on both kernels tried."""
    root = tmp_path_factory.mktemp("syn_sft")
    samples = [dataclasses.replace(apply_syn_template(s, template="short"), id=f"syn-{s.id}", response=SYN_RESPONSE)
               for s in generate("shapes", 64, split="train", seed=6, tasks=["locate"])]
    data = write_samples(samples, root / "data" / "train.jsonl")
    run_checked(command(1, "sft", "--config", str(CONFIGS / "shapes_sft.yaml"), "--data", str(data),
                        f"model.path={tiny_vlm_dir}", "train.steps=80", "train.batch_size=16",
                        "train.micro_batch_size=16", "optim.lr=3e-3", "train.log_every=20", "data.n_test=2",
                        "eval.samples=1", "report.html=false", f"out={root / 'run'}"), timeout=600)
    return root / "run" / "checkpoints" / "final"


def run_killed(cmd: list[str], run_dir, step: int, timeout: float = 600) -> None:
    """Start ``cmd`` in a session of its own; SIGKILL all of its processes (ranks, the synthesis server's
    workers) as soon as the checkpoint of ``step`` is complete — the resume then has a checkpoint to start from."""
    log = run_dir.with_name(f"{run_dir.name}.log")
    proc = forked_runs.popen(cmd, log=log, env=quiet_env())  # its own session; forked: tests/forked_runs.py
    deadline = time.time() + timeout
    try:
        while not (run_dir / "checkpoints" / f"step_{step:08d}" / "manifest.json").exists():
            if proc.poll() is not None:
                raise AssertionError(f"the run ended (exit {proc.returncode}) before it could be killed:\n"
                                     f"{log.read_text()[-3000:]}")
            assert time.time() < deadline, "no checkpoint in time"
            time.sleep(0.02)
        kill_process_tree(proc.pid)
    finally:
        kill_process_tree(proc.pid)
        proc.wait(timeout=60)
    assert proc.returncode == -9  # killed, not finished


def rl_args(model, out, *extra: str) -> list[str]:
    return ["--config", str(CONFIGS / "shapes_syn_grpo.yaml"), f"model.path={model}", *ARGS, *extra, f"out={out}"]


def assert_swaps_happened(got: list[dict]) -> None:
    """Steps 1-2 swap synthesised samples in (sync mode: before the next draw), steps 3-4 train on them."""
    assert got[1]["synth/dataset_version"] >= 2 and got[-1]["synth/swapped"] == got[-1]["synth/dataset_version"]
    assert got[-1]["synth/batch_synthetic_frac"] == 1.0 and got[-1]["synth/failed"] == 0
    assert len({r["synth/dataset_checksum"] for r in got}) == STEPS  # a new dataset version at every step


@pytest.mark.e2e
def test_killed_syn_grpo_run_resumes_with_the_same_records(syn_model, tmp_path):
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    run_checked(command(1, "rl", *rl_args(syn_model, reference)), timeout=600)
    expected = records(reference, "rl")
    assert_swaps_happened(expected)
    kill_after = random.randint(1, STEPS - 2)
    run_killed(command(1, "rl", *rl_args(syn_model, resumed)), resumed, kill_after)
    assert not (resumed / "summary.json").exists()
    done = run_checked(command(1, "rl", "--resume", "auto", *rl_args(syn_model, resumed)), timeout=600)
    assert "resuming from" in done.stdout + done.stderr

    got = records(resumed, "rl")
    assert [r["step"] for r in got] == list(range(1, STEPS + 1)), f"killed after step {kill_after}"
    for a, b in zip(expected, got, strict=True):  # every logged number but the clocks: the same
        assert sorted(a) == sorted(b), a["step"]
        same = {k: a[k] for k in a if not k.startswith("perf/") and k not in TIMINGS}
        assert same == {k: b[k] for k in same}, f"step {a['step']} differs after a kill at step {kill_after}"
    gallery = (resumed / "synth_gallery.jsonl").read_text().splitlines()
    assert len(gallery) == expected[-1]["synth/swapped"]  # rows written after the checkpoint were cut back


@pytest.mark.e2e
def test_two_ranks_share_one_synthesis_client_and_equal_one_rank(syn_model, tmp_path):
    """Greedy decoding (rollout.top_k=1: no sampling stream, which differs per rank) makes the 2-rank run
    comparable with the 1-rank run on the same data; the 2-rank run is also SIGKILLed after a random step and
    resumed. Every record equals the 1-rank one up to float rounding, the dataset checksums exactly."""
    greedy = ("rollout.top_k=1", "dist.strategy=ddp")
    one, two = tmp_path / "one_rank", tmp_path / "two_ranks"
    run_checked(command(1, "rl", *rl_args(syn_model, one, *greedy)), timeout=600)
    kill_after = random.randint(1, STEPS - 2)
    run_killed(torchrun(2, "-m", "vlrl.cli", "rl", *rl_args(syn_model, two, *greedy)), two, kill_after)
    done = run_checked(torchrun(2, "-m", "vlrl.cli", "rl", "--resume", "auto", *rl_args(syn_model, two, *greedy)),
                       timeout=600)
    assert "resuming from" in done.stdout + done.stderr

    expected, got = records(one, "rl"), records(two, "rl")
    assert [r["step"] for r in got] == list(range(1, STEPS + 1)), f"killed after step {kill_after}"
    assert_swaps_happened(got)
    for a, b in zip(expected, got, strict=True):
        assert sorted(a) == sorted(set(b) - {"perf/rank_imbalance"}), a["step"]  # logged where there are ranks
        for key in ("synth/dataset_version", "synth/dataset_checksum", "synth/batch_synthetic_frac",
                    "synth/submitted", "synth/swapped", "synth/skipped_no_description", "diversity/template_frac"):
            assert a[key] == b[key], (a["step"], key)  # rank 0's swaps, applied by both ranks at the same step
        for key in a:
            if not key.startswith("perf/") and key not in TIMINGS and isinstance(a[key], float | int):
                assert abs(a[key] - b[key]) <= 1e-4 * max(1.0, abs(a[key])), (a["step"], key, a[key], b[key])
    carry = json.loads((two / "checkpoints" / f"step_{STEPS:08d}" / "carry_over" / "rank_00001.json").read_text())
    assert carry["value"]["fields"]["feed"]["fields"]["synth"]["fields"]["holder"] is False  # rank 0 alone stores the pool


def test_reward_shaping_on_two_ranks_sees_the_whole_batch(tmp_path):
    """syn_diversity's V_k^batch_avg and its EMA depend on the batch: on 2 ranks the chain runs on the gathered
    batch (`GlobalRewardShaping`), so each rank's shaped rewards, the metrics and the state (the same on both
    ranks) equal one process's on the whole batch — where each half alone would give other numbers."""
    import sys

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import dist_shaping_worker as worker

    out = tmp_path / "shaping.pt"
    run_checked(torchrun(2, str(Path(__file__).resolve().parent / "dist_shaping_worker.py"), str(out)), timeout=300)
    two = torch.load(out, weights_only=False)
    whole, half = worker.chain(), worker.chain()
    for step in range(2):
        values, metrics = whole.apply(worker.shaping_inputs(worker.shaping_batch(step), step=step))
        assert torch.allclose(two["values"][step], values, atol=1e-6), step
        assert two["metrics"][step] == pytest.approx(metrics), step
        assert two["states"][step][0] == two["states"][step][1] == whole.states  # one EMA, on both ranks
        alone, _ = half.apply(worker.shaping_inputs(worker.shaping_batch(step)[:4], step=step))
    # rank 0's half shaped alone (prompts 0-1) would be wrong from step 1: its EMA V_global = 0.7·½ + 0.3·1 = 0.65
    # (V_batch ½ then 1) against the whole batch's 0.7·¼ + 0.3·¾ = 0.4, so its prompts' Ṽ = V·0.65/1 = 0.65, not
    # V·0.4/0.75 ≈ 0.533
    assert whole.states[0].global_avg == pytest.approx(0.4) and half.states[0].global_avg == pytest.approx(0.65)
    assert not torch.allclose(alone, values[:4], atol=1e-3)
