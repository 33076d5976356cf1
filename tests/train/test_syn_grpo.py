"""Syn-GRPO in the RL recipes: the diversity reward shapes the rewards, chosen descriptions are synthesised and
swapped into later batches, and a dead synthesis server never stops (or stalls) training."""

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from vlrl.config import RLStage
from vlrl.data import generate
from vlrl.report import MetricsLogger
from vlrl.rollout import HFEngine
from vlrl.rollout.threaded_engine import ThreadedEngine
from vlrl.serving import ServerThread
from vlrl.synth.app import create_app
from vlrl.synth.client import AsyncSynthesizer
from vlrl.synth.schema import SynthSettings
from vlrl.synth.server import SynthService
from vlrl.train.loop import train_rl

from .fakes import train_async

KEY = "syn-grpo-test-key"


pytestmark = pytest.mark.usefixtures("one_thread")


class TemplateEngine:
    """Wraps an engine: a random tiny model cannot write the Syn-GRPO template, so every response's text is
    replaced by one (a random predicted diversity and description, the model's own text as the answer). The
    trained tokens are the model's; only what the verifiers and the workflow read changes."""

    def __init__(self, engine, *, on_update=None):
        self.engine, self.on_update = engine, on_update
        self.rng = random.Random(0)

    @property
    def weight_version(self):
        return self.engine.weight_version

    def encode(self, sample):
        return self.engine.encode(sample)

    def generate(self, requests, sampling):
        return self._rewrite(self.engine.generate(requests, sampling))

    async def agenerate(self, requests, sampling):
        return self._rewrite(await self.engine.agenerate(requests, sampling))

    def update_weights(self, *, version, state_dict=None):
        self.engine.update_weights(version=version, state_dict=state_dict)
        if self.on_update is not None:
            self.on_update(version)

    def close(self):
        if hasattr(self.engine, "close"):
            self.engine.close()

    def _rewrite(self, trajectories):
        for t in trajectories:
            words = self.rng.choice(["green grass", "ocean waves", "red bricks", "night city"])
            answer = self.rng.choice(["1", "2", "3", t.response_text[:5]])
            t.response_text = (f"<diversity>{self.rng.randint(0, 10) / 10}</diversity>"
                               f"<description>{words}</description><answer>{answer}</answer>")
        return trajectories


def _stage(**synth):
    return RLStage.model_validate({
        "optim": {"lr": 1e-3}, "rollout": {"n": 2, "max_new_tokens": 2},
        "train": {"steps": 3, "prompts_per_step": 2, "micro_batch_size": 4},
        "algo": {"reward_shaping": [{"name": "syn_diversity", "options": {"gamma": 0.7}}]},
        "synth": {"enabled": True, "template": "short", "poll_interval": 0.02, **synth},
    })


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture
def synth_url(monkeypatch):
    monkeypatch.setenv("VLRL_API_KEY", KEY)
    service = SynthService(SynthSettings(executor="thread", segmenter="border"))
    server = ServerThread(create_app(service, api_key=KEY))
    yield server.url
    server.stop()
    service.close()


def test_synthesised_samples_replace_their_sources_in_later_batches(tiny_vlm, tmp_path, synth_url):
    samples = generate("shapes", 4, tasks=["count"])
    logger = MetricsLogger(tmp_path / "metrics.jsonl", quiet=True)
    engine = TemplateEngine(HFEngine(tiny_vlm))
    stats = train_rl(tiny_vlm, engine, samples, _stage(server=synth_url, mode="sync"), logger=logger, seed=0)
    records = _records(tmp_path / "metrics.jsonl")
    assert stats.steps == 3 and [r["step"] for r in records] == [1, 2, 3]
    # epoch 0 (steps 1-2) draws the 4 originals and synthesises each (sync mode: done before the next step);
    # epoch 1 (step 3) draws only synthesised samples
    assert [r["synth/batch_synthetic_frac"] for r in records] == [0.0, 0.0, 1.0]
    assert records[1]["synth/dataset_synthetic_frac"] == 1.0 and records[-1]["synth/completed"] == 6
    assert records[-1]["synth/failed"] == 0 and records[-1]["synth/swapped"] == 6
    for key in ("shaping/syn_diversity/reward_mean", "shaping/syn_diversity/v_global", "diversity/v_batch",
                "diversity/template_frac", "synth/latency_mean"):
        assert key in records[-1], key
    assert records[-1]["diversity/template_frac"] == 1.0
    rows = [json.loads(line) for line in (tmp_path / "synth_gallery.jsonl").read_text().splitlines()]
    assert {r["generation"] for r in rows} == {1, 2} and all((tmp_path / r["result"]).exists() for r in rows)
    assert [s.id for s in samples] == [f"shapes-train-0-{i:06d}" for i in range(4)]  # the caller's list is untouched


def _start_synth_server(tmp_path):
    log = open(tmp_path / "synth.log", "w+")
    process = subprocess.Popen([sys.executable, "-m", "vlrl.cli", "synth", "serve", "--port", "0", "--executor", "thread"],
                               stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "VLRL_API_KEY": KEY},
                               start_new_session=True)
    deadline = time.time() + 120
    while time.time() < deadline:
        log.seek(0)
        for line in log.read().splitlines():
            if "listening on " in line:
                return process, line.split("listening on ")[1].split()[0]
        if process.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"vlrl synth serve exited: {log.read()}")
        time.sleep(0.1)
    raise TimeoutError("vlrl synth serve did not start")


def test_killing_the_synthesis_server_mid_run_costs_no_step_and_is_counted(tiny_vlm, tmp_path, monkeypatch):
    monkeypatch.setenv("VLRL_API_KEY", KEY)
    process, url = _start_synth_server(tmp_path)
    clients = []  # the run's AsyncSynthesizer, to kill the server once it has taken a job (not after a fixed time:
    original = AsyncSynthesizer.__init__  # a tiny step is ~0.2 s, a first POST from a busy process can take longer)

    def recording(self, *args, **kwargs):
        original(self, *args, **kwargs)
        clients.append(self)

    monkeypatch.setattr(AsyncSynthesizer, "__init__", recording)
    try:
        def kill(version):
            if version == 3:
                deadline = time.time() + 60
                while clients[0].counts["submitted"] < 1 and time.time() < deadline:
                    time.sleep(0.05)
                os.kill(process.pid, signal.SIGKILL)
                process.wait(10)

        logger = MetricsLogger(tmp_path / "metrics.jsonl", quiet=True)
        engine = TemplateEngine(HFEngine(tiny_vlm), on_update=kill)
        stage = _stage(server=url, deadline=2.0)
        stage.train.steps = 6
        stats = train_rl(tiny_vlm, engine, generate("shapes", 8, tasks=["count"]), stage, logger=logger, seed=0)
    finally:
        if process.poll() is None:
            process.kill()
    records = _records(tmp_path / "metrics.jsonl")
    assert stats.steps == 6 and len(records) == 6  # the run finished every step
    last = records[-1]
    assert last["synth/submitted"] >= 1  # the server worked before it was killed ...
    failed = {k: v for k, v in last.items() if k.startswith("synth/failed_")}
    assert last["synth/failed"] >= 1 and sum(failed.values()) == last["synth/failed"], failed  # ... then failures, by kind
    assert set(failed) <= {"synth/failed_unavailable", "synth/failed_deadline", "synth/failed_lost"}
    assert last["synth/completed"] + last["synth/failed"] + last["synth/in_flight"] >= last["synth/submitted"]
    # no step waited on the dead server (the client's timeouts run on its own thread)
    assert max(r["perf/step_seconds"] for r in records[3:]) < 30


def test_the_asynchronous_recipe_swaps_synthesised_samples_too(tiny_vlm, tmp_path, synth_url):
    stage = _stage(server=synth_url, mode="sync")
    stage.staleness.eta = 1
    stage.train.steps = 4  # prompts are drawn up to η + 1 steps ahead: the swaps show from the 4th step
    engine = TemplateEngine(ThreadedEngine(tiny_vlm))
    logger = MetricsLogger(tmp_path / "metrics.jsonl", quiet=True)
    try:
        stats = train_async(tiny_vlm, engine, generate("shapes", 4, tasks=["count"]), stage, logger=logger, seed=0)
    finally:
        engine.close()
    records = _records(tmp_path / "metrics.jsonl")
    assert stats.steps == 4 and records[-1]["synth/swapped"] >= 2 and records[-1]["synth/failed"] == 0
    assert max(r["synth/batch_synthetic_frac"] for r in records) > 0  # later draws hit synthesised samples
