"""A NaN/Inf loss or gradient norm (issue 22: `optim.lr=.inf` trained on NaN and exported NaN weights): the one
optimizer step (`vlrl.train.common.clip_and_step`, shared by SFT, both RL recipes and the critic) refuses it
before the optimizer applies it — `train.on_nonfinite=stop` ends the run naming the step and the value,
`skip` drops the update (weights and AdamW state untouched) and counts it in `train/nonfinite_skipped`."""

import json
import math
import sys

import pytest
import torch

import forked_runs  # tests/ is on sys.path
from vlrl.config import OptimConfig, SFTStage
from vlrl.data import generate
from vlrl.models import load_policy
from vlrl.report import MetricsLogger
from vlrl.train.common import NonFiniteError, clip_and_step, make_optimizer
from vlrl.train.sft import train_sft
from vlrl.train.update import ppo_update

from .dist_helpers import quiet_env, write_rl_data
from .test_update import _batch, _settings, rollout  # noqa: F401  (the module's rollout fixture)

pytestmark = pytest.mark.usefixtures("one_thread")


def test_clip_and_step_refuses_a_nonfinite_gradient_or_loss_before_stepping():
    model = torch.nn.Linear(2, 1)
    optimizer, scheduler = make_optimizer(model, OptimConfig(lr=0.1))
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.tensor([[1.0, float("inf")]])).sum().backward()  # weight grad (1, inf): the norm is inf
    with pytest.raises(NonFiniteError, match="the grad norm is inf") as err:
        clip_and_step(model, optimizer, scheduler, 1.0)
    assert err.value.which == "grad norm" and math.isinf(err.value.value)
    assert all(p.grad is None for p in model.parameters())  # cleared: the next step starts clean
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert not optimizer.state  # AdamW never saw it
    model(torch.ones(1, 2)).sum().backward()
    with pytest.raises(NonFiniteError, match="the loss is nan"):
        clip_and_step(model, optimizer, scheduler, 1.0, loss=float("nan"))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def _nan_at(model, calls: set[int]):
    """A forward hook that turns the logits into NaN on the given forward calls (1-based): an injected fault."""
    count = [0]

    def hook(module, args, output):
        count[0] += 1
        if count[0] in calls:
            output.logits = output.logits * float("nan")
        return output

    return model.register_forward_hook(hook)


def test_sft_skip_drops_the_update_counts_it_and_trains_on(tmp_path):
    """3 steps of one micro-batch each; the forward of step 2 yields NaN. With skip: the weights after step 2 are
    those after step 1, step 3 trains again, the records count 0, 1, 0 skipped updates."""
    policy = load_policy("tiny-qwen2-vl")
    samples = generate("shapes", 8, tasks=["count"])
    stage = SFTStage.model_validate({"train": {"steps": 3, "batch_size": 2, "micro_batch_size": 2, "log_every": 1,
                                               "on_nonfinite": "skip"}})
    snapshots = []
    logger = MetricsLogger(None, quiet=True)
    original_log = logger.log

    def log(stage_name, step, metrics, **kw):
        snapshots.append({k: v.detach().clone() for k, v in policy.model.state_dict().items()})
        original_log(stage_name, step, metrics, **kw)

    logger.log = log
    handle = _nan_at(policy.model, {2})
    train_sft(policy, samples, stage, logger=logger, seed=0)
    handle.remove()
    assert [r["train/nonfinite_skipped"] for r in logger.records] == [0, 1, 0]
    assert str(logger.records[1]["sft/loss"]) == "nan" and "sft/grad_norm" not in logger.records[1]
    assert all(torch.equal(snapshots[0][k], snapshots[1][k]) for k in snapshots[0])  # step 2 applied nothing
    assert any(not torch.equal(snapshots[1][k], snapshots[2][k]) for k in snapshots[1])  # step 3 trained
    assert all(torch.isfinite(v).all() for v in snapshots[2].values())

    stop = SFTStage.model_validate({"train": {"steps": 3, "batch_size": 2, "micro_batch_size": 2}})
    handle = _nan_at(policy.model, {2})
    with pytest.raises(NonFiniteError, match=r"^sft step 2: the loss is nan — the run stopped before the optimizer"):
        train_sft(policy, samples, stop, logger=MetricsLogger(None, quiet=True), seed=0)
    handle.remove()


def test_rl_update_skip_and_stop(rollout):  # noqa: F811
    """NaN advantages make every minibatch's loss NaN: stop names the RL step (logged step = step + 1) and the
    loss; skip leaves the weights as they were and counts the 2 dropped optimizer steps."""
    policy, trajectories = rollout
    batch = _batch(policy, trajectories)
    batch.advantages = batch.advantages * float("nan")
    optimizer, scheduler = make_optimizer(policy.model, OptimConfig(lr=0.1))
    before = {k: v.detach().clone() for k, v in policy.model.state_dict().items()}
    with pytest.raises(NonFiniteError, match=r"^rl step 4: the loss is nan"):
        ppo_update(policy, batch, _settings("token_mean", 6), optimizer, scheduler, seed=0, step=3)
    stats = ppo_update(policy, batch, _settings("token_mean", 3, minibatches=2, on_nonfinite="skip"), optimizer,
                       scheduler, seed=0, step=3)
    assert stats.metrics()["train/nonfinite_skipped"] == 2 and "policy/grad_norm" not in stats.metrics()
    assert all(torch.equal(before[k], v) for k, v in policy.model.state_dict().items())
    assert not optimizer.state


# ----------------------------------------------------------------------------------------------- through the CLI
def _run(recipe, tmp_path, *args):
    out = tmp_path / recipe
    done = forked_runs.run([sys.executable, "-m", "vlrl.cli", recipe, *args, f"out={out}", "report.html=false"],
                           env=quiet_env(), timeout=600)
    return done, out


def _steps(out, stage):
    lines = (out / "metrics.jsonl").read_text().splitlines() if (out / "metrics.jsonl").exists() else []
    return [r["step"] for r in map(json.loads, lines) if r["stage"] == stage]


@pytest.mark.e2e
def test_cli_sft_with_a_huge_learning_rate_stops_at_step_2_without_exporting(tmp_path):
    """lr = 1e30: step 1's AdamW update (≈ lr per weight) is applied while still finite; step 2's loss is NaN."""
    done, out = _run("sft", tmp_path, "data.n_train=16", "data.n_test=4", "train.steps=3", "train.batch_size=4",
                     "train.micro_batch_size=4", "train.log_every=1", "optim.lr=1e30")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "vlrl sft: sft step 2: the loss is nan — the run stopped before the optimizer applied it" in done.stderr
    assert _steps(out, "sft") == [1]
    assert not (out / "checkpoints" / "final").exists()  # no NaN weights exported


NAN_LOSS = """
import dataclasses
from vlrl.algos.losses import ppo_clip

def nan_loss(inputs, **options):
    out = ppo_clip(inputs, **options)  # finite weights, finite sampling: only the loss is poisoned
    return dataclasses.replace(out, per_token_loss=out.per_token_loss * float("nan"))
"""


@pytest.mark.e2e
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_cli_rl_with_a_nan_loss_stops_at_step_1_or_skips_every_update(tmp_path, mode):
    """A policy-loss plug-in (`algo.policy_loss=nanplug:nan_loss`) whose loss is NaN. stop: the run ends at rl step
    1 naming the loss, nothing exported. skip: every update is dropped and counted, the run finishes, and the
    exported weights are the initial ones (no NaN applied)."""
    (tmp_path / "nanplug.py").write_text(NAN_LOSS)
    env = quiet_env(PYTHONPATH=f"{tmp_path}:{quiet_env().get('PYTHONPATH', '')}")
    data = write_rl_data(tmp_path / "data" / "train.jsonl")
    args = [f"data.train={data}", f"data.test={data}", "train.steps=2", "train.prompts_per_step=2", "rollout.n=2",
            "rollout.max_new_tokens=4", "train.log_every=1", "algo.policy_loss=nanplug:nan_loss", f"rollout.mode={mode}",
            "report.html=false"]

    def run(name, *extra):
        out = tmp_path / name
        return forked_runs.run([sys.executable, "-m", "vlrl.cli", "rl", *args, *extra, f"out={out}"], env=env,
                               timeout=600), out

    done, out = run("stop")
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "vlrl rl: rl step 1: the loss is nan — the run stopped before the optimizer applied it" in done.stderr
    assert _steps(out, "rl") == [] and not (out / "checkpoints" / "final").exists()

    done, out = run("skip", "train.on_nonfinite=skip")
    assert done.returncode == 0, done.stderr[-2000:]
    records = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["stage"] == "rl"]
    assert [r["train/nonfinite_skipped"] for r in records] == [1, 1]  # 1 minibatch × 1 epoch per step
    exported = load_policy(str(out / "checkpoints" / "final")).model.state_dict()
    initial = load_policy("tiny-qwen2-vl").model.state_dict()
    assert exported.keys() == initial.keys()
    assert all(torch.equal(exported[k], initial[k]) for k in exported)  # nothing applied: the initial weights
