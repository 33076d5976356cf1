"""The synthesis server's contract: submit / poll / result, back-pressure, authentication, input validation,
timeouts, failures and the result-size cap."""

import base64
import io
import time

import httpx
import numpy as np
import pytest
from PIL import Image

from vlrl.synth.backends import boxes_mask
from vlrl.synth.client import SynthClient, png_data_url

from . import fakes
from .conftest import API_KEY, shapes_scene, synth_server

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _body(image=None, boxes=None, **extra):
    if image is None:
        image, scene_boxes = shapes_scene()
        boxes = scene_boxes if boxes is None else boxes
    return {"image": png_data_url(image), "boxes": boxes if boxes is not None else [[0, 0, 10, 10]],
            "description": "a striped red wall", "seed": 1, **extra}


def _wait(url, job_id, timeout=30.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        data = httpx.get(f"{url}/jobs/{job_id}", headers=AUTH).json()
        if data["status"] in ("done", "failed"):
            return data
        time.sleep(0.02)
    raise AssertionError(f"job {job_id} did not finish")


def test_submit_poll_and_fetch_the_result():
    image, boxes = shapes_scene(seed=2)
    with synth_server() as (url, service):
        response = httpx.post(f"{url}/jobs", json=_body(image, boxes), headers=AUTH)
        assert response.status_code == 202 and response.headers["location"] == f"/jobs/{response.json()['id']}"
        job_id = response.json()["id"]
        done = _wait(url, job_id)
        assert done["status"] == "done" and done["error"] is None and done["seconds"] >= 0
        assert done["metadata"]["backend"] == "classical" and done["metadata"]["keywords"] == ["striped", "red", "wall"]
        result = np.asarray(Image.open(io.BytesIO(base64.b64decode(done["image"].split(",", 1)[1]))).convert("RGB"))
        keep = boxes_mask(image.shape[:2], boxes)
        assert np.array_equal(result[keep], image[keep]) and not np.array_equal(result, image)
        png = httpx.get(f"{url}/jobs/{job_id}/image", headers=AUTH)
        assert png.headers["content-type"] == "image/png"
        assert np.array_equal(np.asarray(Image.open(io.BytesIO(png.content)).convert("RGB")), result)
        assert httpx.get(f"{url}/jobs/{job_id}?image=false", headers=AUTH).json()["image"] is None
        statuses = httpx.get(f"{url}/jobs", params={"ids": f"{job_id},nope"}, headers=AUTH).json()["jobs"]
        assert [s["status"] for s in statuses] == ["done", "unknown"]
        health = httpx.get(f"{url}/health").json()  # no token needed
        assert health["completed"] == 1 and health["queued"] == 0 and health["results_bytes"] == len(png.content)


def test_a_full_queue_answers_429_and_drains_when_the_workers_free_up():
    fakes.GATE.clear()
    with synth_server(backend=f"{fakes.__name__}:make_gated", workers=1, max_queued_jobs=2,
                      max_queued_per_client=2) as (url, service):
        ids = [httpx.post(f"{url}/jobs", json=_body(), headers=AUTH).json()["id"]]
        for _ in range(50):  # the worker takes the first job, then waits at the gate
            if service.health()["running"] == 1:
                break
            time.sleep(0.02)
        ids += [httpx.post(f"{url}/jobs", json=_body(), headers=AUTH).json()["id"] for _ in range(2)]
        busy = httpx.post(f"{url}/jobs", json=_body(), headers=AUTH)
        assert busy.status_code == 429 and busy.headers["retry-after"] == "1" and "queue" in busy.json()["error"]
        assert httpx.get(f"{url}/jobs/{ids[2]}", headers=AUTH).json()["status"] == "queued"
        fakes.GATE.set()
        assert [_wait(url, i)["status"] for i in ids] == ["done"] * 3
        assert service.health()["rejected_busy"] == 1


def test_the_token_is_required_except_for_health():
    with synth_server() as (url, _):
        assert httpx.post(f"{url}/jobs", json=_body()).status_code == 401
        assert httpx.get(f"{url}/jobs/x", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(f"{url}/health").status_code == 200


def _encoded(fmt: str) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (20, 20)).save(buffer, format=fmt)
    return base64.b64encode(buffer.getvalue()).decode()


@pytest.mark.parametrize("change, message", [
    ({"image": "not base64!"}, "field 'image': not valid base64"),
    ({"image": base64.b64encode(b"garbage").decode()}, "field 'image': not a decodable image"),
    ({"image": _encoded("EPS")}, "field 'image': format EPS is not accepted (accepted: PNG, JPEG, WEBP, BMP, GIF)"),
    ({"image": _encoded("TIFF")}, "field 'image': format TIFF is not accepted"),
    ({"image": png_data_url(np.zeros((4, 30, 3), np.uint8)), "boxes": [[0, 0, 1, 1]]}, "size 30x4 outside the limits"),
    ({"boxes": [[0, 0, 10]]}, "field 'boxes[0]': expected 4 numbers"),
    ({"boxes": [[5, 5, 150, 20]]}, "field 'boxes[0]': [5.0, 5.0, 150.0, 20.0] leaves the 112x112 image"),
    ({"boxes": [[10, 5, 10, 20]]}, "field 'boxes[0]': needs x1 < x2"),
    ({"boxes": [], "masks": []}, "give the foreground to preserve"),
    ({"masks": [png_data_url(np.zeros((8, 8), np.uint8))]}, "field 'masks[0]': size 8x8 differs"),
    ({"description": "  "}, "field 'description': must not be empty"),
    ({"description": "x" * 3000}, "at most 2000"),
    ({"seed": -1}, "field 'seed'"),
    ({"colour": "red"}, "field 'colour': not a field"),
    ({"boxes": "left"}, "field 'boxes'"),
])
def test_bad_input_gets_a_400_naming_the_field(change, message):
    with synth_server() as (url, service):
        response = httpx.post(f"{url}/jobs", json={**_body(), **change}, headers=AUTH)
        assert response.status_code == 400, response.text
        assert message in response.json()["error"]
        assert service.health()["queued"] == 0 and "submitted" not in service.counts


def test_limits_unknown_jobs_and_masks():
    with synth_server(max_body_bytes=10_000) as (url, _):
        big = {**_body(), "image": png_data_url((np.random.default_rng(0).random((200, 200, 3)) * 255).astype(np.uint8))}
        assert httpx.post(f"{url}/jobs", json=big, headers=AUTH).status_code == 413
        assert httpx.get(f"{url}/jobs/nope", headers=AUTH).status_code == 404
    image, _ = shapes_scene()
    mask = np.zeros(image.shape[:2], np.uint8)
    mask[10:30, 40:90] = 255
    with synth_server() as (url, _):
        job = httpx.post(f"{url}/jobs", json={**_body(image, []), "masks": [png_data_url(mask)]}, headers=AUTH).json()
        done = _wait(url, job["id"])
        result = np.asarray(Image.open(io.BytesIO(base64.b64decode(done["image"].split(",", 1)[1]))).convert("RGB"))
        assert np.array_equal(result[mask > 0], image[mask > 0]) and done["metadata"]["foreground_pixels"] == 1000


def test_failures_are_reported_per_job_and_the_server_goes_on():
    with synth_server(backend=f"{fakes.__name__}:make_sleeper", job_timeout=0.3,
                      backend_options={"seconds": 0.6}) as (url, service):
        failing = httpx.post(f"{url}/jobs", json={**_body(), "description": "fail"}, headers=AUTH).json()["id"]
        slow = httpx.post(f"{url}/jobs", json={**_body(), "description": "sleep"}, headers=AUTH).json()["id"]
        fine = httpx.post(f"{url}/jobs", json={**_body(), "description": "ok"}, headers=AUTH).json()["id"]
        error = _wait(url, failing)["error"]
        assert error["kind"] == "error" and "broke on purpose" in error["message"]
        assert _wait(url, slow)["error"]["kind"] == "timeout"  # thread executor: marked, result discarded
        assert _wait(url, fine)["metadata"]["inverted"] is True
        assert service.counts["failed_error"] == 1 and service.counts["failed_timeout"] == 1


def test_process_workers_are_killed_at_the_timeout_and_replaced():
    with synth_server(backend=f"{fakes.__name__}:make_sleeper", executor="process", job_timeout=1.0) as (url, service):
        slow = httpx.post(f"{url}/jobs", json={**_body(), "description": "sleep"}, headers=AUTH).json()["id"]
        t0 = time.monotonic()
        assert _wait(url, slow)["error"]["kind"] == "timeout"
        assert time.monotonic() - t0 < 10  # not the 30 s the job would sleep
        fine = httpx.post(f"{url}/jobs", json={**_body(), "description": "ok"}, headers=AUTH).json()["id"]
        assert _wait(url, fine)["status"] == "done"


def test_a_back_end_that_cannot_start_fails_at_start_up():
    with pytest.raises(ValueError, match="model_path"):
        with synth_server(backend="diffusers"):
            pass


def test_results_past_the_size_cap_are_evicted_oldest_first(tmp_path):
    with synth_server(results_dir=str(tmp_path)) as (url, service):
        client = SynthClient(url, api_key=API_KEY)
        image, boxes = shapes_scene()
        first = client.wait(client.submit(image, boxes=boxes, description="grass"))
        service.settings.max_results_bytes = int(service.results_bytes * 1.5)  # room for one result, not two
        second = client.wait(client.submit(image, boxes=boxes, description="grass", seed=5))
        assert second.status == "done" and second.image is not None
        response = httpx.get(f"{url}/jobs/{first.id}", headers=AUTH)
        assert response.status_code == 410 and "size cap" in response.json()["error"]
        assert [p.name for p in tmp_path.iterdir()] == [f"{second.id}.png"]
        assert service.results_bytes == (tmp_path / f"{second.id}.png").stat().st_size
        assert service.counts["evicted"] == 1
    assert tmp_path.exists()  # a results directory the user gave is kept


# ----------------------------------------------------------------------------------------------- issue 22
def test_a_chunked_body_over_the_limit_is_refused_before_it_is_parsed():
    """The issue: the 413 read only Content-Length, and a chunked 73 MB body was parsed. The limit now counts the
    bytes as they arrive."""
    import json

    limit = 100_000
    big = json.dumps({**_body(), "description": "x" * 300_000}).encode()

    def chunks():
        for start in range(0, len(big), 16384):
            yield big[start : start + 16384]

    with synth_server(max_body_bytes=limit) as (url, service):
        chunked = httpx.post(f"{url}/jobs", content=chunks(), headers={**AUTH, "content-type": "application/json"})
        declared = httpx.post(f"{url}/jobs", content=big, headers={**AUTH, "content-type": "application/json"})
        assert "submitted" not in service.counts
    assert chunked.request.headers["transfer-encoding"] == "chunked"
    for response in (chunked, declared):
        assert response.status_code == 413
        assert f"exceeds the server's limit of {limit} bytes (max_body_bytes; vlrl synth serve --max-body-mb)" in \
            response.json()["error"]


def test_a_body_of_millions_of_values_is_refused_and_health_keeps_answering():
    """Millions of tiny JSON values cost seconds to parse (2.4 s for 5M empty lists, all of it holding the GIL):
    they are parsed in the body parser's worker process and refused by count, while /health answers."""
    import statistics
    import threading

    body = b'{"image": "x", "description": "d", "boxes": [' + b"[]," * 3_000_000 + b"[]]}"
    with synth_server() as (url, _):
        latencies, stop = [], threading.Event()

        def probe():
            with httpx.Client(base_url=url) as client:
                while not stop.is_set():
                    t0 = time.perf_counter()
                    client.get("/health")
                    latencies.append(time.perf_counter() - t0)
                    time.sleep(0.02)

        prober = threading.Thread(target=probe)
        prober.start()
        try:
            response = httpx.post(f"{url}/jobs", content=body, headers={**AUTH, "content-type": "application/json"},
                                  timeout=120)
        finally:
            stop.set()
            prober.join()
    assert response.status_code == 400 and "JSON values" in response.json()["error"]
    assert len(latencies) >= 5 and statistics.median(latencies) < 0.1, sorted(latencies)


def test_unexpected_errors_answer_500_with_an_id_and_surrogates_a_400():
    import json

    with synth_server() as (url, service):
        def broken(*args, **kwargs):
            raise RuntimeError("/root/secret path")

        service.submit = broken
        response = httpx.post(f"{url}/jobs", json=_body(), headers=AUTH)
        assert response.status_code == 500 and response.json()["error"].startswith("internal server error (id ")
        assert "secret" not in response.text
        raw = json.dumps({**_body(), "description": "a \ud800 wall"}).encode()  # (json escapes it: "\\ud800")
        surrogate = httpx.post(f"{url}/jobs", content=raw, headers={**AUTH, "content-type": "application/json"})
    assert surrogate.status_code == 400
    assert surrogate.json()["error"].startswith("field 'description': not valid Unicode")


def test_a_flooding_client_gets_its_share_of_the_queue_and_the_others_are_still_served():
    """Issue 38: one client's flood earned every other client 429s (the queue was first come, first served). Now a
    client — its token and address; here two hosts sharing one key, 127.0.0.1 and 127.0.0.2 — may hold a quarter
    of the queue (8 → 2 jobs), the others are still admitted, and the worker takes jobs round-robin across clients,
    so the other client's first job runs before the flooder's second."""
    fakes.GATE.clear()
    with synth_server(backend=f"{fakes.__name__}:make_gated", workers=1, max_queued_jobs=8) as (url, service):
        flood, other = (httpx.Client(base_url=url, headers=AUTH, transport=httpx.HTTPTransport(local_address=host))
                        for host in ("127.0.0.1", "127.0.0.2"))
        with flood, other:
            running = flood.post("/jobs", json=_body()).json()["id"]
            assert _until(lambda: service.health()["running"] == 1)
            answers = [flood.post("/jobs", json=_body()) for _ in range(20)]
            assert [a.status_code for a in answers] == [202] * 2 + [429] * 18
            assert "this client has 2 jobs queued (its share: max_queued_per_client = 2)" in answers[-1].json()["error"]
            theirs = [other.post("/jobs", json=_body()) for _ in range(2)]
            assert [a.status_code for a in theirs] == [202, 202]
            health = service.health()
            assert (health["queued"], health["clients_queued"], health["rejected_client_share"]) == (4, 2, 18)
            fakes.GATE.set()
            flooded = [a.json()["id"] for a in answers[:2]]
            served = [a.json()["id"] for a in theirs]
            done = {i: _wait(url, i) for i in [running, *flooded, *served]}
            assert all(d["status"] == "done" for d in done.values())
            started = sorted(done, key=lambda i: done[i]["started"])
            assert started == [running, flooded[0], served[0], flooded[1], served[1]]  # round-robin


def _until(condition, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.02)
    return False


def test_two_local_processes_sharing_one_key_are_two_clients(tmp_path):
    """Issue 47: the server told clients apart by token and host, so with one key every loopback client was one
    client (20/20 of a second process's jobs got 429 behind a flood). On loopback it now sees the peer process
    (its PID, read from /proc): a second process still gets its own share while this one holds its whole share."""
    import json
    import subprocess
    import sys

    fakes.GATE.clear()
    with synth_server(backend=f"{fakes.__name__}:make_gated", workers=1, max_queued_jobs=8) as (url, service):
        with httpx.Client(base_url=url, headers=AUTH) as flood:
            flood.post("/jobs", json=_body())
            assert _until(lambda: service.health()["running"] == 1)
            answers = [flood.post("/jobs", json=_body()) for _ in range(6)]
            assert [a.status_code for a in answers] == [202] * 2 + [429] * 4
            (tmp_path / "body.json").write_text(json.dumps(_body()))
            other = subprocess.run(
                [sys.executable, "-c", "import httpx, json, sys; body = json.load(open(sys.argv[1])); "
                 "print([httpx.post(sys.argv[2] + '/jobs', json=body, headers={'Authorization': sys.argv[3]})"
                 ".status_code for _ in range(3)])", str(tmp_path / "body.json"), url, AUTH["Authorization"]],
                capture_output=True, text=True, timeout=60)
            assert other.stdout.strip() == "[202, 202, 429]", other.stderr
            assert service.health()["clients_queued"] == 2
            fakes.GATE.set()


def test_masks_are_bounded_and_checked_from_their_headers_before_any_is_decoded(monkeypatch):
    """Issue 47: 400 empty masks took 40 s to refuse (every one decoded, then 'no foreground'). Now their number
    (max_masks) and each one's size are checked from the headers first — nothing decoded — and an empty mask is
    refused by name at the first one."""
    from vlrl.synth import schema

    image, _ = shapes_scene()
    empty = png_data_url(np.zeros(image.shape[:2], np.uint8))
    decoded = []
    real = schema.load_image
    monkeypatch.setattr(schema, "load_image", lambda *a, **k: decoded.append(1) or real(*a, **k))
    with synth_server() as (url, service):
        start = time.monotonic()
        many = httpx.post(f"{url}/jobs", json={**_body(image, []), "masks": [empty] * 400}, headers=AUTH)
        assert many.status_code == 400 and many.json()["error"] == "field 'masks': 400 masks, at most 16"
        assert time.monotonic() - start < 5 and decoded == [1]  # the image only
        wrong = png_data_url(np.zeros((8, 8), np.uint8))
        decoded.clear()
        sized = httpx.post(f"{url}/jobs", json={**_body(image, []), "masks": [empty] * 3 + [wrong]}, headers=AUTH)
        assert sized.status_code == 400 and "field 'masks[3]': size 8x8 differs" in sized.json()["error"]
        assert decoded == [1]  # sizes from the headers: no mask decoded
        nothing = httpx.post(f"{url}/jobs", json={**_body(image, []), "masks": [empty] * 3}, headers=AUTH)
        assert nothing.status_code == 400 and nothing.json()["error"] == (
            "field 'masks[0]': empty (no non-zero pixel); a mask marks the foreground to keep")
        assert service.health()["queued"] == 0
