"""`HTTPEngine` reliability: load balancing, retries, dropping dead or stalled servers, weight-sync checks."""

import dataclasses

import pytest
import torch

from vlrl.data import generate
from vlrl.rollout import SamplingParams, Status
from vlrl.rollout.http_engine import HTTPEngine, NoServersLeft, RolloutRequestError
from vlrl.rollout.server import WeightSyncError

from .test_server import _Gate

pytestmark = pytest.mark.usefixtures("one_thread")


def _requests(engine, n=6):
    return [engine.encode(s) for s in generate("shapes", n, tasks=["count"])]


def test_load_is_balanced_across_servers(tiny_vlm, http_engine_factory):
    engine, _ = http_engine_factory(tiny_vlm, n_servers=2)
    trajectories = engine.generate(_requests(engine, 8), SamplingParams(n=2, max_new_tokens=4))
    assert len(trajectories) == 16
    assert all(s.served > 0 for s in engine.servers)


def test_a_dead_server_is_retried_then_dropped_and_no_prompt_is_lost(tiny_vlm, http_engine_factory, caplog):
    engine, servers = http_engine_factory(tiny_vlm, n_servers=2, max_server_failures=1)
    dead = engine.servers[0]
    servers[0].thread.stop()  # connections to the first server are refused from now on
    requests = _requests(engine)
    trajectories = engine.generate(requests, SamplingParams(n=2, max_new_tokens=4))
    assert [t.sample.id for t in trajectories] == [r.sample.id for r in requests for _ in range(2)]
    assert all(t.status is not Status.ABORTED for t in trajectories)
    assert not dead.alive and engine.live_servers() == [engine.servers[1]]
    assert any("dropping rollout server" in r.message for r in caplog.records)
    engine.update_weights(version=1)  # the dropped server is not asked, the live one confirms
    assert engine.weight_version == 1


def test_a_stalled_server_times_out_and_is_dropped(tiny_vlm, http_engine_factory):
    engine, servers = http_engine_factory(tiny_vlm, n_servers=2, request_timeout=1.0, max_server_failures=1)
    stalled = engine.servers[0]
    gate = _Gate(servers[0].batcher)  # the first server's worker blocks inside its next batch
    try:
        trajectories = engine.generate(_requests(engine, 4), SamplingParams(max_new_tokens=3))
    finally:
        gate.release.set()
    assert len(trajectories) == 4 and all(t.status is not Status.ABORTED for t in trajectories)
    assert not stalled.alive and "ReadTimeout" in engine.dropped[0]


def test_every_server_gone_is_an_error(tiny_vlm, http_engine_factory):
    engine, servers = http_engine_factory(tiny_vlm, n_servers=1, max_server_failures=1, max_retries=1)
    servers[0].thread.stop()
    with pytest.raises((NoServersLeft, RolloutRequestError)):
        engine.generate(_requests(engine, 1), SamplingParams(max_new_tokens=2))
    assert engine.live_servers() == []


def test_a_rejected_request_raises_instead_of_retrying(tiny_vlm, http_engine_factory):
    engine, _ = http_engine_factory(tiny_vlm)
    bad = dataclasses.replace(_requests(engine, 1)[0], prompt_ids=[10**9])
    with pytest.raises(RolloutRequestError, match="400"):
        engine.generate([bad], SamplingParams(max_new_tokens=2))
    assert engine.servers[0].alive and engine.servers[0].failures == 0


def test_checksum_mismatch_stops_the_sync(tiny_vlm, http_engine_factory):
    engine, servers = http_engine_factory(tiny_vlm)
    batcher = servers[0].batcher
    real_load = batcher.load
    batcher.load = lambda policy, *, version, abort=False: real_load(policy, version=version, abort=abort)[::-1]
    with pytest.raises(WeightSyncError, match="checksum"):
        engine.update_weights(version=1)
    assert engine.weight_version == 0  # never bumped


def test_versions_bump_only_after_every_server_loaded(tiny_vlm, http_engine_factory):
    engine, servers = http_engine_factory(tiny_vlm, n_servers=2)
    with torch.no_grad():
        next(tiny_vlm.model.parameters()).add_(1.0)
    engine.update_weights(version=4)
    assert engine.weight_version == 4
    assert [s.batcher.version[0] for s in servers] == [4, 4]
    assert all(t.weight_version == 4 for t in engine.generate(_requests(engine, 2), SamplingParams(max_new_tokens=2)))


def test_wrong_api_key_fails_at_start(tiny_vlm, http_engine_factory, tmp_path):
    _, servers = http_engine_factory(tiny_vlm)
    with pytest.raises(RolloutRequestError, match="401"):
        HTTPEngine(tiny_vlm, [servers[0].url], weights_dir=tmp_path, api_key="wrong", startup_timeout=5)
