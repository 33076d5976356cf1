"""WatchedEngine and the rollout statistics it notes: worked by hand on tiny fake trajectories."""

import concurrent.futures
import json
import math
from types import SimpleNamespace

import torch
from PIL import Image

from vlrl.data import Sample
from vlrl.report import MetricsLogger
from vlrl.report.samples import SampleLog
from vlrl.report.watch import WatchedEngine, generation_prob, snapshot_steps, unique_fraction
from vlrl.rollout.types import AsyncEngine, WeightPublisher, capability


def _traj(group, text, logp, task="t/a", reward=None):
    sample = Sample(id=f"s{group}", task=task, messages=[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "q"}]}],
                    images=[Image.new("RGB", (8, 8), "red")], answer="1", reward="number")
    return SimpleNamespace(sample=sample, group_index=group, response_text=text, behaviour_logp=torch.tensor(logp),
                           loss_mask=torch.ones(len(logp), dtype=torch.long), response_ids=torch.zeros(len(logp)),
                           images=list(sample.images), reward=reward, reward_parts={}, status="completed", weight_version=0,
                           well_formed=None, versions=torch.zeros(len(logp), dtype=torch.long))


def test_generation_probability_and_diversity_by_hand():
    batch = [_traj(0, "a", [math.log(0.5), math.log(0.25)]), _traj(0, "a", [math.log(1.0)]),
             _traj(1, "b", [math.log(0.25)]), _traj(1, "c", [])]
    # tokens: 0.5, 0.25, 1.0, 0.25 → mean 0.5
    assert generation_prob(batch) == 0.5
    # group 0: 1 distinct of 2 = 0.5; group 1: 2 of 2 = 1.0 → mean 0.75
    assert unique_fraction(batch) == 0.75
    assert math.isnan(generation_prob([])) and math.isnan(unique_fraction([]))


def test_snapshot_steps():
    assert snapshot_steps(10, 4) == {1, 4, 7, 10}
    assert snapshot_steps(3, 4) == {1, 2, 3}
    assert snapshot_steps(5, 1) == {5} and snapshot_steps(5, 0) == set() and snapshot_steps(0, 3) == set()


class FakeEngine:
    """Two prompts × 2 responses per call; ``extra`` stands for anything else a real engine has, outside its protocols."""

    weight_version = 0
    extra = "forwarded"

    def encode(self, sample):
        return sample

    def generate(self, requests, sampling):
        return [_traj(g, f"r{g}{k}", [math.log(0.5)], task=f"t/{g}") for g in range(2) for k in range(2)]

    def update_weights(self, *, version, state_dict=None):
        self.weight_version = version


def test_training_notes_metrics_and_records_the_scored_batch(tmp_path):
    logger = MetricsLogger(None, quiet=True)
    engine = WatchedEngine(FakeEngine(), logger, SampleLog(tmp_path, per_task=1))
    sampling = SimpleNamespace(temperature=1.0, n=2)
    with engine.training("rl", total_steps=3, snapshots=2):  # snapshots at steps 1 and 3
        for step in (1, 2, 3):
            batch = engine.generate([None, None], sampling)
            for t in batch:  # the loop scores in place before publishing the weights
                t.reward = 1.0
            engine.update_weights(version=step)
            logger.log("rl", step, {"reward/mean": 1.0})
    assert engine.weight_version == 3 and not hasattr(engine, "extra")  # the Engine protocol, nothing forwarded
    assert logger.records[0]["rollout/gen_prob"] == 0.5 and logger.records[0]["rollout/unique_frac"] == 1.0
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert sorted({(r["stage"], r["step"]) for r in rows}) == [("rl", 1), ("rl", 3)]
    assert len(rows) == 2 * 2 * 2  # 2 snapshots × 2 tasks (1 prompt each) × 2 responses
    assert all(r["reward"] == 1.0 and r["sampling"] == "train t=1" for r in rows)
    assert (tmp_path / rows[0]["images"][0]).is_file()


def test_time_budget_stop_still_records_the_last_batch(tmp_path):
    engine = WatchedEngine(FakeEngine(), MetricsLogger(None, quiet=True), SampleLog(tmp_path, per_task=1))
    with engine.training("rl", total_steps=100, snapshots=2):  # planned snapshots 1 and 100; stopped at 2
        for step in (1, 2):
            engine.generate([None, None], SimpleNamespace(temperature=1.0, n=2))
            engine.update_weights(version=step)
    steps = {json.loads(line)["step"] for line in (tmp_path / "samples.jsonl").read_text().splitlines()}
    assert steps == {1, 2}


def test_capture_collects_eval_batches_without_noting_metrics():
    logger = MetricsLogger(None, quiet=True)
    engine = WatchedEngine(FakeEngine(), logger)
    with engine.capture() as batches:
        engine.generate([None], SimpleNamespace(temperature=0.0, n=1))
        engine.generate([None], SimpleNamespace(temperature=0.7, n=2))
    assert [label for label, _ in batches] == ["greedy", "t=0.7"]
    logger.log("eval/x", 0, {"a": 1.0})
    assert "rollout/gen_prob" not in logger.records[0]  # eval batches are not training statistics


class FakePublisher(FakeEngine):
    """An engine whose weights live on servers (`WeightPublisher`)."""

    world_size = 1

    def publish(self, *, version, state_dict=None):
        self.update_weights(version=version)
        done = concurrent.futures.Future()
        done.set_result(version)
        return done

    def join_trainer_ranks(self, rank, world_size):
        self.world_size = world_size


def test_the_watched_engines_capabilities_are_passed_on_through_their_protocols():
    """A recipe asks the watched engine for a capability (`capability`); the watcher passes on its engine's own,
    unwatched, and offers none the engine lacks."""
    inner = FakePublisher()
    engine = WatchedEngine(inner, MetricsLogger(None, quiet=True))
    assert capability(engine, WeightPublisher) is inner and capability(engine, AsyncEngine) is None
    assert capability(WatchedEngine(FakeEngine(), MetricsLogger(None, quiet=True)), WeightPublisher) is None
    assert capability(engine, WeightPublisher).publish(version=2).result() == 2 and engine.weight_version == 2
