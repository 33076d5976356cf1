"""The asynchronous recipe against rollout servers over HTTP: a slow server's late groups are discarded by the η
filter (never trained on), and a server killed mid-run loses no prompt."""

import os
import subprocess
import sys
import threading
import time

import pytest

import vlrl.train.learner as learner
from vlrl.models import load_policy
from vlrl.report import MetricsLogger
from vlrl.rollout.batcher import ContinuousBatcher, private_copy
from vlrl.rollout.http_engine import HTTPEngine
from vlrl.rollout.http_settings import ClientSettings, SyncSettings
from vlrl.rollout.server import create_app
from vlrl.serving import ServerThread

from .fakes import train_async
from .test_async_grpo import _samples, _stage, accounted_for

pytestmark = pytest.mark.usefixtures("one_thread")
KEY = "test-key"



def _spy_staleness(monkeypatch):
    seen = []
    real_update = learner.ppo_update

    def spy_update(policy, batch, *args, step, **kwargs):
        seen.append([step - t.weight_version for t in batch.trajectories])
        return real_update(policy, batch, *args, step=step, **kwargs)

    monkeypatch.setattr(learner, "ppo_update", spy_update)
    return seen


def test_a_slow_servers_late_groups_are_discarded_not_trained(monkeypatch, tmp_path):
    """Two servers; the slow one holds each batch until the other has loaded weights two versions newer, so
    its groups reach the trainer 2 versions old: with η = 1 they are discarded (and their quota returned),
    and no batch reaching a loss holds a sample older than η."""
    seen = _spy_staleness(monkeypatch)
    policy = load_policy("tiny-qwen2-vl")
    batchers = [ContinuousBatcher(private_copy(policy)) for _ in range(2)]
    slow, fast = batchers

    finished = threading.Event()

    def slow_run(engine, jobs):
        while fast.version[0] < engine.weight_version + 2 and not finished.wait(0.02):
            pass
        ContinuousBatcher._run(slow, engine, jobs)

    slow._run = slow_run
    servers = [ServerThread(create_app(b, api_key=KEY)) for b in batchers]
    engine = HTTPEngine(policy, [s.url for s in servers], SyncSettings(tmp_path / "w"), ClientSettings(api_key=KEY))
    state = {}
    try:
        stats = train_async(policy, engine, _samples(), _stage(train={"steps": 6}, staleness={"eta": 1}),
                                 logger=MetricsLogger(None, quiet=True), seed=0, state_out=state)
    finally:
        finished.set()
        engine.close()
        for server, batcher in zip(servers, batchers, strict=True):
            server.stop()
            batcher.close()
    assert stats.steps == 6 and len(seen) == 6
    assert all(0 <= s <= 1 for batch in seen for s in batch)
    assert len(state["discarded"]) > 0 and stats.metrics["staleness/discarded_total"] == len(state["discarded"])
    assert accounted_for(state)


def _start_server(tmp_path, name):
    """`vlrl serve` in a subprocess on a free loopback port; returns (process, url)."""
    log = open(tmp_path / f"{name}.log", "w+")
    process = subprocess.Popen(
        [sys.executable, "-m", "vlrl.cli", "serve", "--model", "tiny-qwen2-vl", "--port", "0", "--threads", "1"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "VLRL_API_KEY": KEY},
    )
    return process, log


def _url(process, log, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        log.seek(0)
        for line in log.read().splitlines():
            if "listening on " in line:
                return line.split("listening on ")[1].split()[0]
        if process.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"vlrl serve exited: {log.read()}")
        time.sleep(0.2)
    raise TimeoutError("vlrl serve did not start")


@pytest.mark.e2e
def test_killing_one_of_two_servers_mid_run_loses_no_prompt(monkeypatch, tmp_path):
    seen = _spy_staleness(monkeypatch)
    started = [_start_server(tmp_path, f"server{i}") for i in range(2)]
    try:
        urls = [_url(process, log) for process, log in started]
        victim = started[0][0]

        class KillingLogger(MetricsLogger):
            def log(self, stage, step, metrics, **kwargs):
                super().log(stage, step, metrics, **kwargs)
                if step == 2:
                    victim.kill()  # SIGKILL: requests in flight on it fail, new connections are refused

        policy = load_policy("tiny-qwen2-vl")
        engine = HTTPEngine(policy, urls, SyncSettings(tmp_path / "w"),
                            ClientSettings(api_key=KEY, request_timeout=30, max_server_failures=1))
        state = {}
        try:
            stats = train_async(policy, engine, _samples(), _stage(train={"steps": 6}, staleness={"eta": 1}),
                                     logger=KillingLogger(None, quiet=True), seed=0, state_out=state)
        finally:
            engine.close()
        assert victim.poll() is not None  # really dead
        assert stats.steps == 6 and [s.url for s in engine.live_servers()] == [urls[1]]
        assert engine.dropped and engine.dropped[0].startswith(urls[0])
        assert all(0 <= s <= 1 for batch in seen for s in batch)
        assert accounted_for(state)  # every prompt drawn is trained, discarded, buffered or pending
        assert len(state["trained"]) == 6 * 4
    finally:
        for process, log in started:
            if process.poll() is None:
                process.terminate()
                process.wait(30)
            log.close()


def test_the_trainer_trains_on_while_servers_load_and_versions_stay_exact(monkeypatch, tmp_path):
    """Each weight load takes the server 0.4 s: the trainer does not wait for it (it trains its next step
    meanwhile), the rollout's version moves only on confirmation, and no trained sample is older than η or
    tagged with a version the server had not confirmed."""
    seen = _spy_staleness(monkeypatch)
    policy = load_policy("tiny-qwen2-vl")
    batcher = ContinuousBatcher(private_copy(policy))
    real_load = batcher.load_in_place
    confirmed = []

    def slow_load(weights, *, version, abort=False):
        time.sleep(0.4)
        checksum = real_load(weights, version=version, abort=abort)
        confirmed.append(version)
        return checksum

    batcher.load_in_place = slow_load
    server = ServerThread(create_app(batcher, api_key=KEY))
    engine = HTTPEngine(policy, [server.url], SyncSettings(tmp_path / "w"), ClientSettings(api_key=KEY))
    logger = MetricsLogger(None, quiet=True)
    state = {}
    try:
        stats = train_async(policy, engine, _samples(), _stage(train={"steps": 5}, staleness={"eta": 1}),
                                 logger=logger, seed=0, state_out=state)
    finally:
        engine.close()
        server.stop()
        batcher.close()
    assert stats.steps == 5 and engine.weight_version == 5 and confirmed[-1] == 5  # the last update confirmed too
    assert all(r["perf/sync_seconds"] < 0.4 for r in logger.records)  # never blocked on a server's load
    assert all(0 <= s <= 1 for batch in seen for s in batch)
    assert accounted_for(state)
