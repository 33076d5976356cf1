"""Issue 47's probes against `vlrl serve`'s admission (items 3, 6, 7 and the text-only path), replayed on a server
started here on loopback on the tiny Qwen2-VL preset: a prompt whose vision tokens do not match its images is a 400
naming the field, a batch that fails anyway is decoded again job by job, the decoded pixels of queued requests have
one server-wide budget, a declared body length reserves nothing, and a text request never waits for an image."""

from __future__ import annotations

import concurrent.futures
import socket
import threading
import time

import pytest
from PIL import Image
from tests.rollout.test_server_hardening import KEY, _send_raw, _wait, data_url, png, serving

from vlrl.rollout.batcher import ContinuousBatcher, private_copy
from vlrl.rollout.server import ServeLimits
from vlrl.rollout.server.prompts import build_request
from vlrl.rollout.types import Request, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def policy():
    from vlrl.models import load_policy

    return load_policy("tiny-qwen2-vl")


# ----------------------------------------------------------------------------------------------- item 3: poison prompts
@pytest.mark.parametrize(("body", "words"), [
    ({"text": "hi <|video_pad|> x"}, "field 'text': the prompt holds 1 video token(s) (<|video_pad|>); this server "
                                     "takes images only"),
    ({"text": "<|image_pad|><|image_pad|>", "image_data": [data_url(png(56, 56))] * 2},
     "field 'text': the prompt's image markup does not fit its images"),
    ({"input_ids": [1, 2, 6, 3], "image_data": []}, "field 'input_ids': the prompt holds 1 video token(s)"),
])
def test_a_prompt_whose_vision_tokens_do_not_match_its_images_is_refused_at_admission(policy, body, words):
    """Before: admitted, then its whole decode batch failed (every normal client batched with it got a 500)."""
    with serving(policy) as (client, batcher, server):
        answer = client.post("/generate", json={**body, "sampling_params": {"max_new_tokens": 2}})
        assert answer.status_code == 400 and words in answer.json()["error"], answer.text
        assert batcher.batches == 0  # never reached the batcher


def test_a_batch_that_fails_is_decoded_again_job_by_job(policy):
    """A job the admission could not catch (here built by hand around it) fails alone; the good job decoded in the
    same batch gets its answer."""
    good = build_request(policy, "<|vision_start|><|image_pad|><|vision_end|> hi", None,
                         [Image.new("RGB", (56, 56))], "good")
    poison = Request(sample=good.sample, prompt_ids=[1, 2, policy.adapter.video_token_id, 3], vision=None, images=[])
    batcher = ContinuousBatcher(private_copy(policy), batch_window=0.5)
    try:
        sampling = SamplingParams(max_new_tokens=2, temperature=0.0)
        futures = [batcher.submit([good], sampling), batcher.submit([poison], sampling)]
        concurrent.futures.wait(futures, timeout=60)
        assert len(futures[0].result()) == 1 and futures[0].result()[0].response_ids.numel() > 0
        with pytest.raises(Exception):  # noqa: B017  (whatever the model raised on it)
            futures[1].result()
        assert batcher.retried_batches == 1 and batcher.batches == 1
    finally:
        batcher.close()


# ----------------------------------------------------------------------------------------------- item 6: queued pixels
def _model_info(client):
    return client.get("/get_model_info").json()


def test_the_decoded_pixels_of_queued_requests_have_one_server_wide_budget(policy, tmp_path):
    """Before: every request under the per-request bounds was admitted and kept its decoded images while queued
    (8 × 4096² grew the server 1.0 → 4.4 GB). Now a request's pixels (from the headers) are reserved before they
    are decoded, against --max-queued-pixels in all and a client's share of it (a client: its address, and on
    loopback its process): past either, 503 naming the setting; a client that goes away releases them."""
    import json
    import subprocess
    import sys

    side = 256 * 256
    body = {"text": "<|vision_start|><|image_pad|><|vision_end|> hi", "image_data": data_url(png(256, 256)),
            "sampling_params": {"max_new_tokens": 2}}
    limits = ServeLimits(max_queued_pixels=4 * side, max_queued_pixels_per_client=3 * side)
    (tmp_path / "body.json").write_text(json.dumps(body))
    other_client = ("import json, socket, sys, time; body = open(sys.argv[1], 'rb').read(); "
                    "host, port = sys.argv[2].removeprefix('http://').split(':'); "
                    "s = socket.create_connection((host, int(port))); "
                    "s.sendall(b'POST /generate HTTP/1.1\\r\\nHost: x\\r\\nContent-Type: application/json\\r\\n' + "
                    "f'Authorization: Bearer {sys.argv[3]}\\r\\nContent-Length: {len(body)}\\r\\n\\r\\n'.encode() + body); "
                    "print(s.recv(4096).split(b'\\r\\n')[0].decode(), flush=True); time.sleep(float(sys.argv[4]))")
    with serving(policy, limits) as (client, batcher, server):
        batcher.pause("in_place")  # nothing decodes: admitted requests stay queued
        waiting = [_send_raw(server.url, body) for _ in range(3)]  # this process: its whole share
        _wait(lambda: _model_info(client)["queued_pixels"] == 3 * side, timeout=30)
        mine = client.post("/generate", json=body)
        assert mine.status_code == 503 and "(vlrl serve --max-queued-pixels-per-client)" in mine.json()["error"]
        assert "Retry-After" in mine.headers
        command = [sys.executable, "-c", other_client, str(tmp_path / "body.json"), server.url, KEY]
        other = subprocess.Popen([*command, "60"], stdout=subprocess.PIPE, text=True)  # another process: its share
        try:
            _wait(lambda: _model_info(client)["queued_pixels"] == 4 * side, timeout=30)
            third = subprocess.run([*command, "0"], capture_output=True, text=True, timeout=30)  # the server is full
        finally:
            other.kill()
            other.wait()
        assert third.stdout.startswith("HTTP/1.1 503"), third  # (admitted, it would wait: a timeout)
        for sock in waiting:
            sock.close()
        _wait(lambda: _model_info(client)["queued_pixels"] == 0, timeout=30)
        batcher.resume()
        assert client.post("/generate", json=body).status_code == 200
        assert _model_info(client)["queued_pixels"] == 0


# ----------------------------------------------------------------------------------------------- item 7: declared lengths
def _answer(sock: socket.socket) -> bytes:
    """An HTTP answer read whole from a raw socket (its head and its JSON body may arrive apart)."""
    data = b""
    while not data.endswith(b"}"):
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return data


def test_a_declared_length_reserves_nothing_and_a_silent_body_is_dropped_at_its_first_byte_deadline(policy):
    """Before: eight idle connections, each declaring Content-Length: 33554432 and sending nothing, reserved the whole
    256 MB in-flight cap on the declaration: every other client got 503 for 60 s, renewable. Now bytes are reserved
    as they arrive (here a 1 MB cap, eight declarations of 1 MB): a normal client is served at once, and the idle
    connections get 408 at the first-byte deadline (1 s), not the body deadline (20 s)."""
    limits = ServeLimits(max_body_bytes=1 << 20, max_inflight_body_bytes=1 << 20, body_timeout=20.0,
                         first_byte_timeout=1.0)
    with serving(policy, limits) as (client, batcher, server):
        host, port = server.url.removeprefix("http://").split(":")
        head = (b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Authorization: Bearer {KEY}\r\nContent-Length: {1 << 20}\r\n\r\n".encode())
        idle = []
        for _ in range(8):
            sock = socket.create_connection((host, int(port)), timeout=10)
            sock.sendall(head)
            idle.append(sock)
        time.sleep(0.2)  # the declarations have been read
        started = time.monotonic()
        answer = client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}})
        assert answer.status_code == 200, answer.text
        lines = [_answer(sock).split(b"\r\n") for sock in idle]
        waited = time.monotonic() - started
        for sock in idle:
            sock.close()
        assert server.app.state.body_bytes.peak < 1 << 20  # (the normal body only)
    assert [line[0].split()[1] for line in lines] == [b"408"] * 8
    assert all(b"the first byte of the request body did not arrive within 1 s" in line[-1] for line in lines)
    assert waited < 10, waited  # the first-byte deadline, not the 20 s body deadline


# ----------------------------------------------------------------------------------------------- text-only requests
def test_a_text_request_never_waits_on_the_image_thread(policy, monkeypatch):
    """Before: every request went through the one image thread, so text requests waited behind image decoding (p99
    5-9 s in the probe). Here the image thread is held inside an image decode; a text request is answered
    meanwhile."""
    from vlrl.rollout.server import prompts

    entered, release = threading.Event(), threading.Event()
    decode = prompts.load_image

    def held(*args, **kwargs):
        entered.set()
        release.wait(30)
        return decode(*args, **kwargs)

    monkeypatch.setattr(prompts, "load_image", held)
    image = {"text": "<|vision_start|><|image_pad|><|vision_end|> hi", "image_data": data_url(png(56, 56)),
             "sampling_params": {"max_new_tokens": 2}}
    with serving(policy) as (client, batcher, server):
        pending = concurrent.futures.ThreadPoolExecutor(1).submit(client.post, "/generate", json=image)
        assert entered.wait(30)
        try:
            answer = client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}}, timeout=10)
        finally:
            release.set()
        assert answer.status_code == 200, answer.text
        assert pending.result(timeout=30).status_code == 200


def test_the_image_thread_takes_the_smallest_request_first_and_skips_abandoned_ones(policy, monkeypatch):
    """While the image thread is held: a 1024² request whose client then goes away, a 512² and a 56² one wait. Once
    released: the 56² request is decoded before the 512², and the abandoned one is never decoded (its pixels are
    released at once)."""
    from vlrl.rollout.server import prompts

    entered, release, decoded = threading.Event(), threading.Event(), []
    decode = prompts.load_image

    def held(source, **kwargs):
        image = decode(source, **kwargs)
        decoded.append(image.size[0])
        if len(decoded) == 1:
            entered.set()
            release.wait(30)
        return image

    monkeypatch.setattr(prompts, "load_image", held)

    def body(side):
        return {"text": "<|vision_start|><|image_pad|><|vision_end|> hi", "image_data": data_url(png(side, side)),
                "sampling_params": {"max_new_tokens": 2}}

    with serving(policy) as (client, batcher, server):
        first = _send_raw(server.url, body(64))  # holds the image thread
        assert entered.wait(30)
        abandoned = _send_raw(server.url, body(1024))
        _wait(lambda: _model_info(client)["queued_pixels"] == 64 * 64 + 1024 * 1024, timeout=30)
        pool = concurrent.futures.ThreadPoolExecutor(2)
        larger = pool.submit(client.post, "/generate", json=body(512))
        _wait(lambda: _model_info(client)["queued_pixels"] == 64 * 64 + 1024 * 1024 + 512 * 512, timeout=30)
        smaller = pool.submit(client.post, "/generate", json=body(56))
        _wait(lambda: _model_info(client)["queued_pixels"] == 64 * 64 + 1024 * 1024 + 512 * 512 + 56 * 56, timeout=30)
        abandoned.close()
        _wait(lambda: _model_info(client)["queued_pixels"] == 64 * 64 + 512 * 512 + 56 * 56, timeout=30)
        release.set()
        assert smaller.result(timeout=60).status_code == 200 and larger.result(timeout=60).status_code == 200
        first.close()
    assert decoded == [64, 56, 512]
