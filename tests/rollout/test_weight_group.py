"""The distributed update's safety rules (`vlrl.rollout.weight_group`, `vlrl.rollout.publish`): no collective before
every server accepted the update, no collective that can hang the trainer, a failed update by disk once and loudly,
then the run goes on or stops as configured. gloo stands in for NCCL here: NCCL's own blocking — its communicator is
created inside the first collective, which waits for every rank — is played by a broadcast that never returns."""

import logging
import threading
import time

import httpx
import pytest
import torch

from vlrl.models import load_policy
from vlrl.rollout import dist_sync
from vlrl.rollout.http_engine import HTTPEngine
from vlrl.rollout.http_settings import ClientSettings, SyncSettings
from vlrl.rollout.server.weight_routes import WeightRoutes
from vlrl.rollout.weights import WeightSyncError, weight_checksum

from .conftest import API_KEY, running_server, vlrl_serve

pytestmark = pytest.mark.usefixtures("one_thread")
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _nudge(model, amount):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(amount)


def _info(url):
    return httpx.get(f"{url}/server_info", headers=AUTH, timeout=30).json()


def _engine(policy, url, tmp_path, **sync):
    return HTTPEngine(policy, [url], SyncSettings(tmp_path / "weights", method="distributed", **sync),
                      ClientSettings(api_key=API_KEY))


@pytest.fixture
def collectives(monkeypatch):
    """Every group formation and bucket broadcast the trainer enters, recorded."""
    entered = []
    real_open, real_broadcast = dist_sync.open_group, dist_sync.broadcast

    def open_group(*args, rank, **kwargs):
        entered.append(("open_group", rank)) if rank == 0 else None
        return real_open(*args, rank=rank, **kwargs)

    def broadcast(*args, **kwargs):
        entered.append(("broadcast",))
        return real_broadcast(*args, **kwargs)

    monkeypatch.setattr(dist_sync, "open_group", open_group)
    monkeypatch.setattr(dist_sync, "broadcast", broadcast)
    return entered


@pytest.mark.parametrize("on_failure", ["disk", "stop"])
def test_a_server_that_refuses_the_update_gets_no_collective_and_the_update_goes_by_disk_once(
        tiny_vlm, tmp_path, monkeypatch, caplog, collectives, on_failure):
    """A receiver that refuses the update (its /begin_weight_update answers 400): the trainer forms no group and
    broadcasts nothing — on NCCL a bucket broadcast to a server that will not receive it waits forever — and loads
    that version by disk, with a warning naming the refusal; then ``on_failure=disk`` goes on (the next update tries
    the group again, refused again, by disk again) and ``stop`` raises, the servers holding the trainer's weights."""
    async def refuse(self, request):
        return self.answer({"success": False, "message": "refused by this test"}, 400)

    monkeypatch.setattr(WeightRoutes, "begin_session", refuse)
    with running_server(tiny_vlm) as served:
        engine = _engine(tiny_vlm, served.url, tmp_path, on_failure=on_failure)
        try:
            for version in (1, 2):
                _nudge(tiny_vlm.model, 0.01)
                with caplog.at_level(logging.WARNING, logger="vlrl.rollout.publish"):
                    if on_failure == "stop":
                        with pytest.raises(WeightSyncError, match="refused by this test.*on_failure=stop stops the run"):
                            engine.update_weights(version=version)
                    else:
                        engine.update_weights(version=version)
                assert collectives == []  # no group formed, no bucket broadcast
                assert engine.weights.fallbacks[-1].startswith(f"SessionRefused: {served.url}/begin_weight_update: "
                                                               "HTTP 400: refused by this test")
                assert f"distributed weight update {version} failed (SessionRefused" in caplog.text
                info = _info(served.url)  # loaded by disk all the same
                assert info["weight_version"] == str(version)
                assert info["weight_checksum"] == weight_checksum(tiny_vlm.model)
                assert engine.last_sync.method == "disk" and len(engine.weights.fallbacks) == version
                if on_failure == "stop":
                    break
        finally:
            engine.close()


@pytest.fixture(scope="module")
def served_process(tiny_vlm_dir, tmp_path_factory):
    """One `vlrl serve` process (a group cannot join another in the same process: torch names groups per process).
    Its receives give up after 6 s (``--join-timeout``: its group's timeout), as an NCCL server's at its own timeout."""
    with vlrl_serve(str(tiny_vlm_dir), tmp_path_factory.mktemp("serve"), args=("--join-timeout", "6")) as (url,):
        yield url


def test_a_collective_that_never_returns_cannot_hang_the_update(tiny_vlm_dir, served_process, tmp_path, monkeypatch,
                                                               caplog):
    """The trainer's broadcast call itself never returns (NCCL's first collective creates the communicator and waits
    there for every rank; a server that refused its bucket never comes). The call runs off the trainer's thread: the
    update is abandoned at its deadline (2 s; the bucket timeout is 120 s), the group torn down, the server's receive
    ends at its own timeout (6 s), the version is loaded by disk — and once broadcasts return again the next update
    goes over a new group. Before the fix the update's own thread sat in the call for good."""
    released = threading.Event()
    real = dist_sync.dist.broadcast

    def broadcast(tensor, src=0, group=None, async_op=False):  # (this process is the trainer's only)
        released.wait()
        raise RuntimeError("released by the test")

    policy = load_policy(str(tiny_vlm_dir))
    engine = _engine(policy, served_process, tmp_path, timeout=120, deadline=2, bucket_mb=0.5)
    monkeypatch.setattr(dist_sync.dist, "broadcast", broadcast)
    try:
        _nudge(policy.model, 0.01)
        done = threading.Thread(target=engine.update_weights, kwargs={"version": 1}, daemon=True)
        started = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="vlrl.rollout.publish"):
            done.start()
            done.join(60)
        assert not done.is_alive(), "the update hung in a collective"
        assert time.monotonic() - started < 60  # the deadline and the server's timeout, not the bucket timeout
        assert "distributed weight update 1 failed (Abandoned" in caplog.text
        assert engine.last_sync.method == "disk" and engine.weights.group.group is None
        info = _info(served_process)
        assert info["weight_version"] == "1" and info["weight_checksum"] == weight_checksum(policy.model)
        assert info["weight_groups"] == [] and info["paused"] is None
        released.set()
        monkeypatch.setattr(dist_sync.dist, "broadcast", real)
        _nudge(policy.model, 0.01)
        engine.update_weights(version=2)
        assert engine.last_sync.method == "distributed"
        assert _info(served_process)["weight_checksum"] == weight_checksum(policy.model)
    finally:
        released.set()
        engine.close()


def test_a_session_left_open_is_ended_and_begun_again(tiny_vlm_dir, served_process, tmp_path):
    """A trainer that died mid-update left its session open on the server (SGLang then refuses every begin): the next
    trainer ends it and begins again, and its update goes over the group."""
    assert httpx.post(f"{served_process}/begin_weight_update", json={}, headers=AUTH).status_code == 200
    policy = load_policy(str(tiny_vlm_dir))
    engine = _engine(policy, served_process, tmp_path)
    try:
        _nudge(policy.model, 0.02)
        engine.update_weights(version=3)
        assert engine.last_sync.method == "distributed" and engine.weights.fallbacks == []
        assert _info(served_process)["weight_checksum"] == weight_checksum(policy.model)
        again = httpx.post(f"{served_process}/begin_weight_update", json={}, headers=AUTH)
        assert again.status_code == 200  # the update closed its session
        assert httpx.post(f"{served_process}/end_weight_update", json={}, headers=AUTH).status_code == 200
    finally:
        engine.close()
