"""Partial rollout in the asynchronous recipe (``rollout.servers.on_weight_update=partial``): a generation caught by a
weight update keeps its tokens and goes on from there on the new weights, every token tagged with the version that
sampled it. At η = 0 nothing is in flight at an update, so the run equals the synchronous recipe bit for bit; through
``vlrl rl`` a run whose generations straddle updates logs ``staleness/…`` from the per-token versions and records
them in samples.jsonl."""

import json

import pytest
import torch

from vlrl.models import load_policy
from vlrl.report import MetricsLogger
from vlrl.rollout import HFEngine
from vlrl.rollout.batcher import ContinuousBatcher
from vlrl.train.loop import train_rl

from .test_async_grpo import _run_async, _samples, _stage

pytestmark = pytest.mark.usefixtures("one_thread")


def test_eta_zero_with_partial_rollout_equals_the_sync_recipe():
    """η = 0: the rollout admits one batch at a time and it is drawn after the last update, so no update ever
    interrupts a generation — the weights after 4 steps equal the synchronous recipe's bit for bit, and no
    sample spans two versions."""
    stage = _stage(staleness={"eta": 0, "apply_behaviour_weight": False},
                   rollout={"servers": {"on_weight_update": "partial"}})
    samples = _samples()
    sync_policy = load_policy("tiny-qwen2-vl")
    torch.manual_seed(0)
    train_rl(sync_policy, HFEngine(sync_policy), samples, stage, logger=MetricsLogger(None, quiet=True), seed=0)
    async_policy, records, _, _ = _run_async(stage, samples, engine_options={"on_weight_update": "partial"})
    assert [r["staleness/mixed_frac"] for r in records] == [0.0] * 4
    assert [r["staleness/token_mean"] for r in records] == [0.0] * 4
    for (name, a), b in zip(sync_policy.model.named_parameters(), async_policy.model.parameters(), strict=True):
        assert torch.equal(a, b), name


def _slow_decode(monkeypatch, seconds: float) -> None:
    """Every decode step of the in-process rollout takes ``seconds`` more, so a generation outlasts a training step
    and each weight update finds one in flight."""
    real = ContinuousBatcher._on_step

    def on_step(self, owners):
        step = real(self, owners)

        def slow(requests):
            import time

            time.sleep(seconds)
            return step(requests)

        return slow

    monkeypatch.setattr(ContinuousBatcher, "_on_step", on_step)


def _vlrl(*args: str) -> None:
    """``vlrl ARGS`` through the ``vlrl`` app in this process (as tests/test_shipped_configs.py runs ``vlrl rl``)."""
    from typer.testing import CliRunner

    from vlrl.cli import app

    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, (result.output[-3000:], result.exception)


PARTIAL_RUN = ("rl", "--config", "configs/shapes_grpo.yaml", "train.steps=4", "train.prompts_per_step=2", "rollout.n=4",
               "data.n_train=8", "data.n_test=2", "eval.samples=1", "eval.max_new_tokens=4", "train.log_every=1",
               "report.html=false", "rollout.max_new_tokens=24", "rollout.mode=async", "staleness.eta=2",
               "rollout.servers.on_weight_update=partial", "report.rl_snapshots=4")


def test_generations_straddling_updates_carry_per_token_versions_through_vlrl_rl(tmp_path, monkeypatch):
    """``vlrl rl`` (shapes_grpo, rollout.mode=async in-process, η = 2, on_weight_update=partial), decoding slowed so
    that updates land mid-generation: some trained samples span two versions (``staleness/mixed_frac`` > 0), the
    token-level staleness is at most the oldest token's, and samples.jsonl's training snapshots record each
    response's versions as runs ``[version, count]`` covering its tokens, oldest first, tagged with the oldest."""
    _slow_decode(monkeypatch, 0.05)
    _vlrl(*PARTIAL_RUN, f"out={tmp_path}")
    _check_partial_run(tmp_path)


def test_generations_straddling_updates_on_a_vlrl_serve_server_through_vlrl_rl(tmp_path, monkeypatch):
    """The same run against a `vlrl serve` server (its app on a thread of this process, decoding slowed): the client
    pauses it with vlrl's ``partial`` before each disk update, the server continues the interrupted answers from their
    kept tokens on the new weights and reports their spans, and the run's records carry them as in process."""
    from vlrl.rollout.batcher import private_copy
    from vlrl.rollout.server import create_app
    from vlrl.serving import ServerThread

    _slow_decode(monkeypatch, 0.05)
    monkeypatch.setenv("VLRL_API_KEY", "partial-test")
    batcher = ContinuousBatcher(private_copy(load_policy("tiny-qwen2-vl")), batch_window=0.01)
    modes, real_pause = [], batcher.pause
    batcher.pause = lambda mode: modes.append(mode) or real_pause(mode)
    server = ServerThread(create_app(batcher, api_key="partial-test"))
    try:
        _vlrl(*PARTIAL_RUN, f"rollout.servers.urls=[{server.url}]", f"out={tmp_path}")
    finally:
        server.stop()
        batcher.close()
    assert modes and set(modes) == {"partial"}
    _check_partial_run(tmp_path)


def _check_partial_run(tmp_path):
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "staleness/mixed_frac" in r]
    assert len(steps) == 4
    assert any(r["staleness/mixed_frac"] > 0 for r in steps)
    for r in steps:
        assert 0 <= r["staleness/token_mean"] <= r["staleness/max"] <= 2
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    trained = [r for r in rows if r["sampling"].startswith("train")]
    assert any(len(r["token_versions"]) > 1 for r in trained)  # a recorded response spans two versions
    for r in trained:
        versions = [v for v, _ in r["token_versions"]]
        assert sum(count for _, count in r["token_versions"]) == r["length"]
        assert versions == sorted(versions) and r["weight_version"] == versions[0]


def test_a_checkpointed_group_keeps_the_versions_of_its_tokens(tmp_path):
    """An undrained group goes into a checkpoint as a `GroupRecord` (carry-over file, no pickle) and comes back with
    each response's per-token versions, so a resumed run counts its staleness from the same oldest token."""
    from vlrl.data import generate
    from vlrl.feed.groups import Draw, Group
    from vlrl.feed.records import GroupRecord
    from vlrl.rollout import Trajectory
    from vlrl.train.carry import read_carry_over, write_carry_over

    sample = generate("shapes", 1)[0]
    mixed = Trajectory(sample=sample, prompt_ids=torch.tensor([1, 2]), response_ids=torch.tensor([5, 6, 7]),
                       loss_mask=torch.ones(3, dtype=torch.long), behaviour_logp=torch.zeros(3), weight_version=3,
                       token_versions=torch.tensor([3, 3, 4]))
    plain = Trajectory(sample=sample, prompt_ids=torch.tensor([1, 2]), response_ids=torch.tensor([5]),
                       loss_mask=torch.ones(1, dtype=torch.long), behaviour_logp=torch.zeros(1), weight_version=4)
    record = GroupRecord.of(Group([mixed, plain], Draw(7, sample, 0)))
    write_carry_over(record, tmp_path / "c.json", tmp_path / "c.safetensors")
    back = read_carry_over(tmp_path / "c.json", tmp_path / "c.safetensors").restore()
    assert back.trajectories[0].versions.tolist() == [3, 3, 4] and back.trajectories[0].weight_version == 3
    assert back.trajectories[1].token_versions is None and back.trajectories[1].versions.tolist() == [4]
