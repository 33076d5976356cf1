"""The trainer's non-blocking synthesis front: submit and drain never wait; every failure is counted."""

import time

import numpy as np
import pytest

from vlrl.serving import bind_socket
from vlrl.synth.backends import boxes_mask
from vlrl.synth.client import AsyncSynthesizer, SynthClient, SynthError, SynthRequest

from . import fakes
from .conftest import API_KEY, shapes_scene, synth_server


def _request(k=0, description="grass"):
    image, boxes = shapes_scene(seed=k)
    from PIL import Image

    return SynthRequest(Image.fromarray(image), boxes, description, seed=k, payload=f"sample-{k}")


def _until(predicate, timeout=20.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def test_outcomes_come_back_with_their_payload_and_the_foreground_intact():
    with synth_server() as (url, _):
        synth = AsyncSynthesizer(SynthClient(url, api_key=API_KEY), poll_interval=0.02)
        requests = [_request(k) for k in range(3)]
        t0 = time.perf_counter()
        assert all(synth.submit(r) for r in requests)
        assert time.perf_counter() - t0 < 0.05  # no network on the caller's thread
        assert synth.wait_idle(30)
        outcomes = sorted(synth.drain(), key=lambda o: o.request.payload)
        assert [o.request.payload for o in outcomes] == ["sample-0", "sample-1", "sample-2"]
        for outcome, request in zip(outcomes, requests, strict=True):
            assert outcome.ok and outcome.latency > 0 and outcome.job_id
            source = np.asarray(request.image)
            keep = boxes_mask(source.shape[:2], request.boxes)
            assert np.array_equal(np.asarray(outcome.image)[keep], source[keep])
        assert synth.drain() == [] and synth.counts["completed"] == 3 and synth.outstanding() == 0
        synth.close()


def test_a_server_that_is_down_costs_the_trainer_nothing_and_is_counted():
    sock = bind_socket("127.0.0.1", 0)  # a port nobody serves once closed
    port = sock.getsockname()[1]
    sock.close()
    synth = AsyncSynthesizer(SynthClient(f"http://127.0.0.1:{port}", timeout=1.0), poll_interval=0.02)
    t0 = time.perf_counter()
    for k in range(4):
        synth.submit(_request(k))
    assert time.perf_counter() - t0 < 0.05
    assert synth.wait_idle(20)
    outcomes = synth.drain()
    assert [o.error for o in outcomes] == ["unavailable"] * 4 and not any(o.ok for o in outcomes)
    assert synth.counts["failed_unavailable"] == 4 and synth.counts["failed"] == 4
    synth.close()


def test_busy_rejected_dropped_and_deadline_failures_are_counted_by_kind():
    fakes.GATE.clear()
    with synth_server(backend=f"{fakes.__name__}:make_gated", max_queued_jobs=1) as (url, service):
        synth = AsyncSynthesizer(SynthClient(url, api_key=API_KEY), max_in_flight=2, max_pending=1, deadline=1.5,
                                 poll_interval=0.02)
        synth.submit(_request(0))  # runs, and waits at the closed gate
        assert _until(lambda: service.health()["running"] == 1)
        synth.submit(_request(1))  # waits in the server's queue (its one place)
        assert _until(lambda: service.health()["queued"] == 1)
        synth.submit(_request(2))  # two in flight: stays in the local queue (its one place) ...
        assert synth.submit(_request(3)) is False  # ... so this one is dropped at once
        assert _until(lambda: synth.outstanding() == 0)  # 0 and 1 pass their deadline; 2 is then refused (429)
        assert sorted(o.error for o in synth.drain()) == ["busy", "deadline", "deadline", "dropped"]
        fakes.GATE.set()
        synth.submit(SynthRequest(_request().image, [[0, 0, 500, 500]], "x"))
        assert _until(lambda: synth.outstanding() == 0)
        [outcome] = synth.drain()
        assert outcome.error == "rejected" and "leaves the" in outcome.message
        assert {k: v for k, v in synth.counts.items() if k.startswith("failed_")} == {
            "failed_busy": 1, "failed_deadline": 2, "failed_dropped": 1, "failed_rejected": 1}
        synth.close()


def test_the_blocking_client_explains_errors():
    with synth_server() as (url, _):
        with pytest.raises(SynthError, match="401 unauthorised"):
            SynthClient(url, api_key="wrong").submit(_request().image, description="x", boxes=[[0, 0, 5, 5]])
        client = SynthClient(url, api_key=API_KEY)
        with pytest.raises(SynthError) as err:
            client.poll("nope")
        assert err.value.kind == "lost"
        job = client.submit(_request().image, description="stripes", boxes=[[0, 0, 5, 5]])
        assert client.wait(job).status == "done"
