"""vlrl's rollout server: SGLang's response shape, auth, 4xx errors, continuous batching, weight swaps."""

import threading
import time

import httpx
import pytest
import torch

from vlrl.data import generate
from vlrl.rollout import HFEngine, SamplingParams, Status
from vlrl.rollout.batcher import ContinuousBatcher, QueueFullError, private_copy
from vlrl.rollout.image_url import encode_image
from vlrl.rollout.server import create_app
from vlrl.rollout.weights import weight_checksum
from vlrl.serving import ServerThread

from .conftest import API_KEY, running_server

pytestmark = pytest.mark.usefixtures("one_thread")

AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture
def served(tiny_vlm):
    with running_server(tiny_vlm) as served:
        with httpx.Client(base_url=served.url, headers=AUTH, timeout=60) as client:
            yield client, served.batcher


def _prompt(policy):
    request = HFEngine(policy).encode(generate("shapes", 1, tasks=["count"])[0])
    return request, {"input_ids": request.prompt_ids, "image_data": [encode_image(im) for im in request.images]}


def test_generate_answers_in_sglangs_shape(served, tiny_vlm):
    client, _ = served
    request, body = _prompt(tiny_vlm)
    one = client.post("/generate", json={**body, "return_logprob": True,
                                         "sampling_params": {"max_new_tokens": 5, "temperature": 0}}).json()
    assert set(one) == {"text", "output_ids", "meta_info"}
    meta = one["meta_info"]
    assert [pair[1] for pair in meta["output_token_logprobs"]] == one["output_ids"]
    assert all(pair[0] <= 0 and pair[2] is None for pair in meta["output_token_logprobs"])
    assert meta["finish_reason"]["type"] in ("stop", "length") and meta["weight_version"] == "0"
    assert meta["prompt_tokens"] == len(request.prompt_ids) and meta["completion_tokens"] == len(one["output_ids"])
    many = client.post("/generate", json={**body, "sampling_params": {"n": 3, "max_new_tokens": 4}}).json()
    assert isinstance(many, list) and len(many) == 3
    assert all("output_token_logprobs" not in m["meta_info"] for m in many)  # only with return_logprob


def test_text_prompt_with_one_placeholder_per_image_equals_expanded_ids(served, tiny_vlm):
    client, _ = served
    sample = generate("shapes", 1, tasks=["color"])[0]
    request, body = _prompt(tiny_vlm)
    text = tiny_vlm.adapter.render(sample.messages)  # one <|image_pad|> per image, as a chat template writes it
    greedy = {"max_new_tokens": 6, "temperature": 0}
    images = [encode_image(im) for im in HFEngine(tiny_vlm).encode(sample).images]
    by_text = client.post("/generate", json={"text": text, "image_data": images, "sampling_params": greedy}).json()
    by_ids = client.post("/generate", json={"input_ids": HFEngine(tiny_vlm).encode(sample).prompt_ids,
                                            "image_data": images, "sampling_params": greedy}).json()
    assert by_text["output_ids"] == by_ids["output_ids"] and by_text["meta_info"]["prompt_tokens"] > 16


def test_auth_is_required_except_for_health(served):
    client, _ = served
    bare = httpx.Client(base_url=str(client.base_url))
    assert bare.get("/health").status_code == 200
    assert bare.get("/get_model_info").status_code == 401
    assert bare.post("/generate", json={"input_ids": [1]}, headers={"Authorization": "Bearer wrong"}).status_code == 401
    info = client.get("/get_model_info").json()
    assert info["weight_version"] == "0" and info["dtype"] == "float32" and info["server"] == "vlrl"


@pytest.mark.parametrize("body, message", [
    ({"sampling_params": {"max_new_tokens": 2}}, "exactly one of 'text' or 'input_ids'"),
    ({"input_ids": [1, 2], "text": "hi"}, "exactly one of 'text' or 'input_ids'"),
    ({"input_ids": [1, 2], "sampling_params": {"max_tokens": 2}}, "field 'sampling_params.max_tokens': not supported"),
    ({"input_ids": [1, 2], "sampling_params": {"temperature": "hot"}}, "field 'sampling_params.temperature'"),
    ({"input_ids": [1, 2], "sampling_params": {"n": 0}}, "field 'sampling_params.n'"),
    ({"input_ids": [1, 10**9]}, "field 'input_ids': token ids must lie in"),
    ({"input_ids": [1, 2], "image_data": "not-base64!"}, "field 'image_data[0]': neither a data URL nor valid base64"),
    ({"input_ids": [1, 2], "image_data": "https://example.com/a.png"}, "URLs are not fetched"),
    ({"input_ids": [1, 2], "stream": True}, "streaming is not supported"),
    ({"input_ids": [1, 2], "lora_path": "x"}, "field 'lora_path': not supported"),
])
def test_malformed_requests_get_a_400_naming_the_field(served, body, message):
    client, _ = served
    response = client.post("/generate", json=body)
    assert response.status_code == 400 and message in response.json()["error"], response.text


def test_image_count_mismatch_and_invalid_json(served, tiny_vlm):
    client, _ = served
    request, body = _prompt(tiny_vlm)
    response = client.post("/generate", json={**body, "image_data": body["image_data"] * 2})
    assert response.status_code == 400 and "image" in response.json()["error"]
    response = client.post("/generate", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 400 and "JSON" in response.json()["error"]
    response = client.post("/generate", data={"text": "hi"})  # form-encoded, as `curl -d` sends it
    assert response.status_code == 400 and "Content-Type: application/json" in response.json()["error"]


class _Gate:
    """Blocks the batcher's worker inside its next batch until released (to make timing deterministic)."""

    def __init__(self, batcher):
        self.entered, self.release = threading.Event(), threading.Event()
        engine = batcher._active
        original = engine.generate

        def gated(requests, sampling, **options):
            self.entered.set()
            self.release.wait(30)
            return original(requests, sampling, **options)

        engine.generate = gated


def test_requests_arriving_during_a_batch_join_the_next_one(tiny_vlm):
    batcher = ContinuousBatcher(private_copy(tiny_vlm), max_batch_size=64)
    gate = _Gate(batcher)
    request = HFEngine(tiny_vlm).encode(generate("shapes", 1)[0])
    sampling = SamplingParams(n=2, max_new_tokens=4)
    first = batcher.submit([request], sampling)
    assert gate.entered.wait(30)  # the first batch is decoding …
    later = [batcher.submit([request], sampling) for _ in range(5)]  # … while five more requests arrive
    gate.release.set()
    assert len(first.result(30)) == 2 and all(len(f.result(30)) == 2 for f in later)
    assert batcher.batches == 2  # the five joined one batch
    batcher.close()


def test_a_burst_of_requests_gathers_into_one_batch(tiny_vlm):
    """With a batch window, requests arriving less than the window apart decode together; without it the
    first request of the burst would start alone."""
    batcher = ContinuousBatcher(private_copy(tiny_vlm), max_batch_size=64, batch_window=0.5)
    request = HFEngine(tiny_vlm).encode(generate("shapes", 1)[0])
    sampling = SamplingParams(max_new_tokens=3)
    futures = []
    for _ in range(4):
        futures.append(batcher.submit([request], sampling))
        time.sleep(0.02)  # 20 ms apart, well inside the 0.5 s window
    assert all(len(f.result(30)) == 1 for f in futures)
    assert batcher.batches == 1 and batcher.rows == 4
    batcher.close()


def test_bounded_queue_and_503(tiny_vlm):
    batcher = ContinuousBatcher(private_copy(tiny_vlm), max_queued_requests=2)
    gate = _Gate(batcher)
    request = HFEngine(tiny_vlm).encode(generate("shapes", 1)[0])
    sampling = SamplingParams(max_new_tokens=2)
    futures = [batcher.submit([request], sampling)]
    assert gate.entered.wait(30)
    futures += [batcher.submit([request], sampling) for _ in range(2)]  # queue now full
    with pytest.raises(QueueFullError):
        batcher.submit([request], sampling)
    server = ServerThread(create_app(batcher, api_key=None))
    try:
        response = httpx.post(f"{server.url}/generate", json={"input_ids": request.prompt_ids[:8]}, timeout=30)
        assert response.status_code == 503 and response.headers["retry-after"] == "1"
    finally:
        gate.release.set()
        assert all(f.result(30) for f in futures)
        server.stop()
        batcher.close()


def _moved(policy):
    moved = private_copy(policy)
    with torch.no_grad():
        for p in moved.model.parameters():
            p.add_(0.05)
    return moved


def test_a_weight_load_never_waits_and_the_decoding_batch_keeps_its_version(tiny_vlm):
    batcher = ContinuousBatcher(private_copy(tiny_vlm))
    gate = _Gate(batcher)
    request = HFEngine(tiny_vlm).encode(generate("shapes", 1)[0])
    sampling = SamplingParams(n=2, max_new_tokens=3)
    old = batcher.submit([request], sampling)
    assert gate.entered.wait(30)
    new_weights = _moved(tiny_vlm)
    checksum = batcher.load(new_weights, version=1)  # returns while the old batch is still decoding
    assert checksum == weight_checksum(new_weights.model) and batcher.version == (1, checksum)
    queued = batcher.submit([request], sampling)
    gate.release.set()
    assert {t.weight_version for t in old.result(30)} == {0}  # finished on the old weights, tagged so
    assert {t.weight_version for t in queued.result(30)} == {1}
    batcher.close()


def test_abort_on_load_answers_queued_and_decoding_requests_as_aborted(tiny_vlm):
    batcher = ContinuousBatcher(private_copy(tiny_vlm))
    gate = _Gate(batcher)
    request = HFEngine(tiny_vlm).encode(generate("shapes", 1)[0])
    sampling = SamplingParams(n=2, max_new_tokens=3)
    decoding = batcher.submit([request], sampling)
    assert gate.entered.wait(30)
    queued = batcher.submit([request], sampling)
    batcher.load(_moved(tiny_vlm), version=1, abort=True)
    assert all(t.status is Status.ABORTED for t in queued.result(30))  # answered at once
    gate.release.set()
    assert all(t.status is Status.ABORTED and len(t.response_ids) == 0 for t in decoding.result(30))
    after = batcher.submit([request], sampling).result(30)
    assert all(t.status is not Status.ABORTED and t.weight_version == 1 for t in after)
    batcher.close()


def test_update_weights_from_disk(served, tiny_vlm, tmp_path):
    client, batcher = served
    moved = _moved(tiny_vlm)
    moved.model.save_pretrained(tmp_path / "v7")
    answer = client.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "v7"), "weight_version": "7"}).json()
    assert answer["success"] and answer["weight_version"] == "7"
    assert answer["weight_checksum"] == weight_checksum(moved.model)
    assert client.get("/get_weight_version").json() == {"weight_version": "7"}
    request, body = _prompt(tiny_vlm)
    out = client.post("/generate", json={**body, "sampling_params": {"max_new_tokens": 2}}).json()
    assert out["meta_info"]["weight_version"] == "7"
    missing = client.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "nope")})
    assert missing.status_code == 400 and not missing.json()["success"]
    assert client.get("/get_weight_version").json() == {"weight_version": "7"}  # unchanged


def test_a_batched_generate_decodes_as_one_batch_answered_prompt_major(served, tiny_vlm):
    """SGLang's list form: three prompts of different lengths, n = 2 → six answers, prompt 0's two first."""
    client, batcher = served
    samples = generate("shapes", 3, tasks=["count", "color"])
    requests = [HFEngine(tiny_vlm).encode(s) for s in samples]
    body = {"input_ids": [r.prompt_ids[: 30 + 5 * i] if not r.images else r.prompt_ids for i, r in enumerate(requests)],
            "image_data": [[encode_image(im) for im in r.images] or None for r in requests],
            "sampling_params": {"n": 2, "max_new_tokens": 3}, "return_logprob": True}
    batches = batcher.batches
    out = client.post("/generate", json=body).json()
    deadline = time.time() + 10
    while batcher.batches == batches and time.time() < deadline:  # counted just after the answers are sent
        time.sleep(0.01)
    time.sleep(0.1)
    assert len(out) == 6 and batcher.batches == batches + 1  # one job, one batch
    lengths = [len(ids) for ids in body["input_ids"]]
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [n for n in lengths for _ in range(2)]
    one = client.post("/generate", json={"input_ids": [requests[0].prompt_ids], "image_data": [body["image_data"][0]],
                                         "sampling_params": {"max_new_tokens": 2}}).json()
    assert isinstance(one, list) and len(one) == 1  # a batch of one is still answered as a list
    wrong = client.post("/generate", json={**body, "image_data": body["image_data"][:2]})
    assert wrong.status_code == 400 and "image_data" in wrong.json()["error"] and "3 prompts" in wrong.json()["error"]


def test_updates_from_disk_copy_in_place_into_the_spare_copy(served, tiny_vlm, tmp_path, monkeypatch):
    """No model is built per update: version 1 goes into a new spare copy, version 2 into the weights version 1
    retired, and each answer carries its version and the checksum of exactly what was written."""
    import vlrl.rollout.server.weight_routes as server_module

    client, batcher = served
    monkeypatch.setattr(server_module, "_load_weights", lambda *a: pytest.fail("from_pretrained was called"))
    request, body = _prompt(tiny_vlm)
    original = batcher.policy.model
    models = []
    for version in (1, 2):
        moved = _moved(tiny_vlm)
        moved.model.save_pretrained(tmp_path / f"v{version}")
        answer = client.post("/update_weights_from_disk",
                             json={"model_path": str(tmp_path / f"v{version}"), "weight_version": str(version)}).json()
        assert answer["success"] and answer["weight_checksum"] == weight_checksum(moved.model)
        out = client.post("/generate", json={**body, "sampling_params": {"max_new_tokens": 2}}).json()
        assert out["meta_info"]["weight_version"] == str(version)  # the swap happened at this batch
        models.append(batcher.policy.model)
        tiny_vlm = moved
    assert models[0] is not original and models[1] is original  # two copies, alternating


def test_an_in_place_load_never_writes_the_weights_a_batch_is_decoding_with(tiny_vlm):
    """While a batch decodes on version 1, versions 2 and 3 are loaded: both go into the spare copy (3
    overwrites the not-yet-used 2), never into the decoding weights, which keep version 1's values."""
    batcher = ContinuousBatcher(private_copy(tiny_vlm))
    request = HFEngine(tiny_vlm).encode(generate("shapes", 1)[0])
    sampling = SamplingParams(n=2, max_new_tokens=3)
    state = {k: v.clone() for k, v in tiny_vlm.model.state_dict().items()}
    batcher.load_in_place({k: v + 0.01 for k, v in state.items()}, version=1)
    batcher.submit([request], sampling).result(30)  # version 1 is active now
    decoding_weights = batcher.policy.model
    v1 = weight_checksum(decoding_weights)
    gate = _Gate(batcher)
    decoding = batcher.submit([request], sampling)
    assert gate.entered.wait(30)
    batcher.load_in_place({k: v + 0.02 for k, v in state.items()}, version=2)
    v3 = batcher.load_in_place({k: v + 0.03 for k, v in state.items()}, version=3)
    assert weight_checksum(decoding_weights) == v1  # untouched while decoding
    gate.release.set()
    assert {t.weight_version for t in decoding.result(30)} == {1}
    assert {t.weight_version for t in batcher.submit([request], sampling).result(30)} == {3}
    assert batcher.version == (3, v3) and batcher.policy.model is not decoding_weights
    batcher.close()


# ----------------------------------------------------------------------------------------------- SGLang's pause
@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
def test_a_paused_batcher_starts_no_batch_and_treats_the_decoding_one_by_its_mode(tiny_vlm, mode):
    """/pause_generation's modes as vlrl serve applies them (a batch decoding 40 tokens is caught mid-way, a request
    arrives during the pause, version 1 is loaded, generation continues): ``abort`` answers the decoding batch as
    aborted; ``retract`` decodes it again from its prompt on version 1; ``in_place`` holds it at its decode step and
    finishes it on version 0. The request that arrived while paused starts only after the pause, on version 1."""
    from .test_server_hardening import never_ends

    batcher = ContinuousBatcher(private_copy(tiny_vlm))
    never_ends(batcher)
    request = HFEngine(tiny_vlm).encode(generate("shapes", 1)[0])
    sampling = SamplingParams(n=2, max_new_tokens=40)
    try:
        decoding = batcher.submit([request], sampling)
        deadline = time.time() + 30
        while batcher.decode_steps < 3 and time.time() < deadline:
            time.sleep(0.005)
        batcher.pause(mode)
        arrived = batcher.submit([request], SamplingParams(n=1, max_new_tokens=3))
        time.sleep(0.3)
        steps, batches = batcher.decode_steps, batcher.batches
        time.sleep(0.3)
        assert not arrived.done() and batcher.batches == batches
        if mode == "in_place":
            assert batcher.decode_steps == steps and not decoding.done()  # held at its decode step
        batcher.load(_moved(tiny_vlm), version=1)
        batcher.resume()
        out, later = decoding.result(30), arrived.result(30)
    finally:
        batcher.close()
    assert {t.weight_version for t in later} == {1} and all(t.status is not Status.ABORTED for t in later)
    if mode == "abort":
        assert all(t.status is Status.ABORTED for t in out)
    else:
        assert {t.weight_version for t in out} == {1 if mode == "retract" else 0}
        assert all(t.status is not Status.ABORTED and len(t.response_ids) == 40 for t in out)
    assert any(s.why == "retracted" for s in batcher.early_stops) == (mode == "retract")


def test_logit_bias_and_stop_token_ids_are_honoured(served, tiny_vlm):
    """SGLang's ``logit_bias`` (token ids as strings) shifts the sampling logits; ``stop_token_ids`` end a response
    like EOS. A bias of +100 on one token makes it the only choice; naming it a stop token ends the answer there."""
    client, _ = served
    _, body = _prompt(tiny_vlm)
    token = 42
    answer = client.post("/generate", json={**body, "return_logprob": True, "sampling_params": {
        "max_new_tokens": 6, "logit_bias": {str(token): 100.0}, "stop_token_ids": [token]}}).json()
    assert answer["output_ids"] == [token] and answer["meta_info"]["finish_reason"] == {"type": "stop", "matched": token}
    assert answer["meta_info"]["output_token_logprobs"][0][0] < 0  # behaviour log-prob of the raw logits, unbiased
    for bias, field in (({"x": 1.0}, "logit_bias"), ({"99999999": 1.0}, "logit_bias")):
        bad = client.post("/generate", json={**body, "sampling_params": {"logit_bias": bias}})
        assert bad.status_code == 400 and f"sampling_params.{field}" in bad.json()["error"]
    bad = client.post("/generate", json={**body, "sampling_params": {"stop_token_ids": [-1]}})
    assert bad.status_code == 400 and "stop_token_ids" in bad.json()["error"]


def test_partial_pause_keeps_the_tokens_and_continues_them_on_the_new_weights(tiny_vlm):
    """Partial rollout (pause mode ``partial``): a batch decoding 40 tokens is caught mid-way, version 1 is loaded,
    generation resumes. Every row keeps the tokens it had (tagged 0) and goes on from there on version 1 — no token is
    sampled twice, the answer spans both versions and is tagged with the oldest (0). The behaviour log-prob of every
    token equals a teacher-forced pass of the weights of its own version."""
    from .test_engine_contract import _teacher_forced
    from .test_server_hardening import never_ends

    batcher = ContinuousBatcher(private_copy(tiny_vlm))
    never_ends(batcher)
    request = HFEngine(tiny_vlm).encode(generate("shapes", 1)[0])
    sampling = SamplingParams(n=2, max_new_tokens=40)
    new_weights = _moved(tiny_vlm)
    try:
        decoding = batcher.submit([request], sampling)
        deadline = time.time() + 30
        while batcher.decode_steps < 3 and time.time() < deadline:
            time.sleep(0.005)
        batcher.pause("partial")
        batcher.load(new_weights, version=1)
        batcher.resume()
        out = decoding.result(30)
    finally:
        batcher.close()
    assert [t.group_index for t in out] == [0, 0]
    stop = next(s for s in batcher.early_stops if s.why == "interrupted")
    for t in out:
        versions = t.versions.tolist()
        kept = versions.count(0)
        assert len(t.response_ids) == 40 and t.status is Status.TRUNCATED and t.weight_version == 0
        assert 3 <= kept < 40 and versions == [0] * kept + [1] * (40 - kept)  # the old tokens first, then the new
        assert kept <= stop.stopped_step
        old_logp = _teacher_forced(tiny_vlm, [t], 1.0)[0, :kept]
        new_logp = _teacher_forced(new_weights, [t], 1.0)[0, kept:40]
        assert torch.allclose(t.behaviour_logp[:kept], old_logp, atol=1e-4)
        assert torch.allclose(t.behaviour_logp[kept:], new_logp, atol=1e-4)
        assert t.response_text == tiny_vlm.tokenizer.decode(t.response_ids, skip_special_tokens=True)
