"""Conformance with SGLang 0.5.23's own contract (`sglang_contract`: its schema, loaded from the released wheel).

Every request body vlrl's client sends — ``/generate`` for text-only prompts, one image, several images, mixed
batches in both orders, multi-turn contexts, every sampling key; every weight and pause call — must pass SGLang's
schema or match its request struct; every answer of ``vlrl serve`` must parse with SGLang's response schema; and
``vlrl serve`` must refuse what SGLang refuses, so the project's own tests cannot pass where SGLang would answer 400.
The bodies are the ones the client really sends (recorded on the way to a ``vlrl serve`` that answers them).
"""

import dataclasses
import json
from urllib.parse import urlsplit

import httpx
import pytest
from PIL import Image

from vlrl.config import RolloutConfig
from vlrl.data import Sample, generate
from vlrl.models import load_policy
from vlrl.rollout import HFEngine, SamplingParams, Status
from vlrl.rollout.agent import RolloutEngine, build_rollout
from vlrl.rollout.http_engine import HTTPEngine, encode_image
from vlrl.rollout.http_settings import ClientSettings, SyncSettings
from vlrl.rollout.teacher_client import ScoreRequest, ScoringClient

from .conftest import API_KEY, running_server
from .sglang_contract import SGLANG_VERSION, WheelUnavailable, load_contract

pytestmark = pytest.mark.usefixtures("one_thread")
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="session")
def contract():
    try:
        return load_contract()
    except WheelUnavailable as err:  # offline, nothing cached: skipped, saying why
        pytest.skip(str(err))


@pytest.fixture(scope="module")
def policy():
    return load_policy("tiny-qwen2-vl")


@pytest.fixture(scope="module")
def served(policy):
    with running_server(policy) as served:
        yield served


@pytest.fixture(scope="module")
def engine(policy, served, tmp_path_factory):
    engine = HTTPEngine(policy, [served.url], SyncSettings(tmp_path_factory.mktemp("weights")), ClientSettings(api_key=API_KEY))
    yield engine
    engine.close()


@pytest.fixture
def recorded(engine):
    """Every POST the client makes from now on: (path, body as JSON, status, answer)."""
    calls = []
    original = engine.pool.client.post

    async def post(url, *args, json=None, **kwargs):
        response = await original(url, *args, json=json, **kwargs)
        is_json = response.headers.get("content-type", "").startswith("application/json")
        calls.append((urlsplit(url).path, _as_json(json), response.status_code, response.json() if is_json else None))
        return response

    engine.pool.client.post = post
    yield calls
    engine.pool.client.post = original


def _as_json(body):
    return json.loads(json.dumps(body))  # what goes over the wire


def _text_sample(i=0):
    return Sample(id=f"text-{i}", task="count", messages=[{"role": "user", "content": "How many shapes are there?"}],
                  answer="1", reward="number")


def _two_image_sample():
    images = [Image.new("RGB", (56, 56), "red"), Image.new("RGB", (84, 56), "blue")]
    content = [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Which is larger?"}]
    return Sample(id="two-images", task="count", messages=[{"role": "user", "content": content}], images=images,
                  answer="1", reward="number")


def _image_samples(n=2):
    return generate("shapes", n, tasks=["count"])


CASES = {
    "text-only": lambda: [_text_sample(0), _text_sample(1)],
    "one image": lambda: _image_samples(1),
    "several images": lambda: [_two_image_sample()],
    "mixed, text first": lambda: [_text_sample(), *_image_samples(1)],  # SGLang 0.5.23 refuses [None, [image]]
    "mixed, images first": lambda: [*_image_samples(1), _text_sample(), _two_image_sample()],
}


def _generate_bodies(calls):
    return [(body, status, answer) for path, body, status, answer in calls if path == "/generate"]


def _check_generate(contract, calls, expected_prompts):
    """Each /generate body passes SGLang's gate; vlrl serve answered each, in SGLang's response shape."""
    bodies = _generate_bodies(calls)
    assert sum(len(body["input_ids"]) for body, _, _ in bodies) == expected_prompts
    for body, status, answer in bodies:
        assert contract.generate_error(body) is None, (contract.generate_error(body), body.get("image_data"))
        assert status == 200, answer
        for item in answer if isinstance(answer, list) else [answer]:
            parsed = contract.api.GenerateResponse.from_json_value(item)
            assert parsed.meta_info.prompt_tokens > 0 and parsed.meta_info.weight_version is not None


@pytest.mark.parametrize("case", list(CASES))
def test_every_generate_body_passes_sglangs_schema_and_vlrl_serve_answers_in_sglangs_shape(
        case, contract, engine, recorded):
    samples = CASES[case]()
    requests = [engine.encode(s) for s in samples]
    out = engine.generate(requests, SamplingParams(n=2, max_new_tokens=3))
    assert len(out) == 2 * len(samples)
    _check_generate(contract, recorded, len(samples))
    (body, _, _), = _generate_bodies(recorded)
    if any(s.images for s in samples):  # one list per prompt, [] for a text-only one: the form SGLang reads
        assert [len(entry) for entry in body["image_data"]] == [len(s.images) for s in samples]
    else:
        assert "image_data" not in body


def test_every_sampling_key_passes_sglangs_schema(contract, engine, policy, recorded):
    """The keys `SamplingParams` maps to (and the client's own: EOS as stop_token_ids, the vision markup and other
    special tokens banned by logit_bias, as the in-process engine suppresses them)."""
    every_key = SamplingParams(n=2, temperature=0.7, top_p=0.9, top_k=5, max_new_tokens=3, stop=["<answer>"],
                               stop_token_ids=[7], logit_bias={11: -5.0})
    out = engine.generate([engine.encode(s) for s in _image_samples(1)], every_key)
    assert len(out) == 2
    _check_generate(contract, recorded, 1)
    (body, _, _), = _generate_bodies(recorded)
    params = contract.api.SamplingParams.from_json_value(body["sampling_params"])
    assert (params.n, params.temperature, params.top_p, params.top_k, params.max_new_tokens) == (2, 0.7, 0.9, 5, 3)
    assert params.stop == ["<answer>"] and set(params.stop_token_ids) == {7, *policy.eos_token_ids}
    assert params.logit_bias["11"] == -5.0
    vision = {policy.adapter.image_token_id, *policy.adapter.markup_token_ids}
    assert vision and all(params.logit_bias[str(t)] <= -1e4 for t in vision - set(policy.eos_token_ids))


def test_multi_turn_contexts_pass_sglangs_schema(contract, engine, recorded):
    """An agent's later turns send the whole context so far (prompt, answers, observations with new images) —
    beside text-only episodes in the same batch."""
    rollout = build_rollout(RolloutConfig(agent={"function": "multi_turn", "env": "shapes_feedback",
                                                 "env_kwargs": {"zoom": True}, "max_turns": 3}))
    wrapped = RolloutEngine.wrap(engine, rollout, codec=engine)
    samples = [_text_sample(), *_image_samples(2)]
    out = wrapped.generate([wrapped.encode(s) for s in samples], SamplingParams(n=1, max_new_tokens=4))
    assert len(out) == 3 and all(t.status is not Status.FAILED for t in out)
    bodies = _generate_bodies(recorded)
    assert len(bodies) >= 2  # a second turn was sent …
    assert any(len(entry) >= 2 for body, _, _ in bodies[1:] for entry in body.get("image_data", []))  # … with 2 images
    for body, status, answer in bodies:
        assert contract.generate_error(body) is None and status == 200, answer


def test_a_teachers_scoring_bodies_pass_sglangs_schema_and_vlrl_serve_answers_in_sglangs_shape(contract, served, policy):
    """On-policy distillation's teacher on a server (`vlrl.rollout.teacher_client`): its prefill-only bodies
    (``max_new_tokens: 0``, ``return_logprob``, ``logprob_start_len``; text and with images) pass SGLang's gate, and
    vlrl serve's answers — ``input_token_logprobs`` included — parse with SGLang's response schema."""
    image = _image_samples(1)[0]
    client = ScoringClient([served.url], ClientSettings(api_key=API_KEY))
    try:
        calls = []
        original = client.pool.client.post

        async def post(url, *args, json=None, **kwargs):
            response = await original(url, *args, json=json, **kwargs)
            calls.append((_as_json(json), response.status_code, response.json()))
            return response

        client.pool.client.post = post
        request = HFEngine(policy).encode(image)
        text_ids = policy.tokenizer.encode("How many shapes are there? 3")
        ids = [int(t) for t in request.prompt_ids] + text_ids[:3]
        scored = client.score([ScoreRequest(text_ids, [], 4),
                               ScoreRequest(ids, [encode_image(im) for im in request.images], len(request.prompt_ids) - 1)])
    finally:
        client.close()
    assert [len(values) for values in scored] == [len(text_ids) - 5, 3]
    assert len(calls) == 2
    for body, status, answer in calls:
        assert contract.generate_error(body) is None, contract.generate_error(body)
        assert body["sampling_params"]["max_new_tokens"] == 0 and status == 200, answer
        parsed = contract.api.GenerateResponse.from_json_value(answer)
        assert len(parsed.meta_info.input_token_logprobs) == len(body["input_ids"]) - body["logprob_start_len"]


@pytest.mark.parametrize("mode", ["finish", "abort", "retract", "in_place"])
def test_every_weight_call_matches_sglangs_request_structs(mode, contract, engine, recorded):
    """The disk path as sent (pause / flush / load / continue) in every ``rollout.servers.on_weight_update`` mode, and
    the distributed path's bodies (the session, join, each bucket, the last bucket, leave) as the client builds them.
    The cache is flushed before the load (none asked of the load then), except with requests held in place."""
    engine.weights.on_weight_update = mode
    try:
        engine.update_weights(version=engine.weight_version + 1)
    finally:
        engine.weights.on_weight_update = "finish"
    structs = {"/update_weights_from_disk": "UpdateWeightFromDiskReqInput", "/flush_cache": "FlushCacheReqInput",
               "/pause_generation": "PauseGenerationReqInput", "/continue_generation": "ContinueGenerationReqInput"}
    sent = [(path, body) for path, body, status, _ in recorded]
    expected = {"finish": ["/flush_cache", "/update_weights_from_disk"],
                "in_place": ["/pause_generation", "/update_weights_from_disk", "/continue_generation"]}.get(
        mode, ["/pause_generation", "/flush_cache", "/update_weights_from_disk", "/continue_generation"])
    assert [path for path, _ in sent] == expected
    for path, body in sent:
        assert contract.struct_problems(structs[path], body) == [], (path, body)
    assert all(status == 200 for _, _, status, _ in recorded)
    assert dict(sent)["/update_weights_from_disk"]["flush_cache"] is False  # (flushed before, or held in place)
    assert contract.struct_problems("BeginWeightUpdateReqInput", {}) == []
    assert contract.struct_problems("EndWeightUpdateReqInput", {}) == []

    server = engine.servers[0]
    live = [server, dataclasses.replace(server, url="http://other", ranks=2)]
    group = engine.weights.group
    for body in group.init_bodies(live, 29500, "g", "nccl"):
        assert contract.struct_problems("InitWeightsUpdateGroupReqInput", body) == []
    model = engine.policy.model
    entries = group.bucket_plan(engine.live_servers())[1]
    for last, flushed in ((False, True), (True, True), (True, False)):
        bucket = entries[-1] if last else entries[0]
        dtypes = [model.state_dict()[e.name].dtype for e in bucket]
        body = _as_json(group.bucket_body(3, bucket, dtypes, last=last, on_weight_update="finish", flushed=flushed))
        assert contract.struct_problems("UpdateWeightsFromDistributedReqInput", body) == []
        assert body["flush_cache"] == (last and not flushed)
    assert contract.struct_problems("DestroyWeightsUpdateGroupReqInput", {"group_name": "g"}) == []


# ----------------------------------------------------------------------------------------------- vlrl serve refuses
def _refused_bodies(prompt_ids, image):
    return {
        "mixed batch, text first": {"input_ids": [prompt_ids[:3], prompt_ids], "image_data": [None, [image]]},
        "a list after a single item": {"input_ids": [prompt_ids, prompt_ids], "image_data": [image, [image]]},
        "a single item after a list": {"input_ids": [prompt_ids, prompt_ids], "image_data": [[image], image]},
        "a token id as a string": {"input_ids": [["1", 2]]},
        "a float token id": {"input_ids": [1.0, 2.0]},
        "an unknown sampling key": {"input_ids": [1, 2], "sampling_params": {"beams": 2}},
        "n as a float": {"input_ids": [1, 2], "sampling_params": {"n": 2.0}},
        "max_new_tokens as a boolean": {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": True}},
        "temperature as a string": {"input_ids": [1, 2], "sampling_params": {"temperature": "1"}},
        "a non-numeric logit bias": {"input_ids": [1, 2], "sampling_params": {"logit_bias": {"3": "x"}}},
        "a float stop token id": {"input_ids": [1, 2], "sampling_params": {"stop_token_ids": [1.5]}},
        "text as a number": {"text": 5},
        "return_logprob as a string": {"input_ids": [1, 2], "return_logprob": "yes"},
        "logprob_start_len as a string": {"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": "0"},
        "logprob_start_len as a float": {"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 0.5},
    }


def test_vlrl_serve_refuses_what_sglang_refuses(contract, served, engine):
    encoded = engine.encode(_image_samples(1)[0])
    cases = _refused_bodies(list(encoded.prompt_ids), encode_image(encoded.images[0]))
    with httpx.Client(base_url=served.url, headers=AUTH, timeout=60) as client:
        for name, body in cases.items():
            assert contract.generate_error(body) is not None, f"{name}: SGLang {SGLANG_VERSION} admits it"
            answer = client.post("/generate", json=body)
            assert answer.status_code == 400, (name, answer.status_code, answer.text[:300])


def test_vlrl_serve_info_routes_parse_with_sglangs_schema(contract, served):
    with httpx.Client(base_url=served.url, headers=AUTH, timeout=30) as client:
        server_info = client.get("/server_info").json()
        model_info = client.get("/get_model_info").json()
    parsed = contract.api.GetServerInfoResponse.from_json_value(server_info)
    assert parsed.max_context_length > 0
    assert (server_info["tp_size"], server_info["dp_size"], server_info["pp_size"]) == (1, 1, 1)
    assert server_info["max_running_requests"] == served.batcher.max_batch_size
    assert contract.api.GetModelInfoResponse.from_json_value(model_info).weight_version == model_info["weight_version"]


def test_the_client_reads_server_facts_from_server_info_first(engine, served, monkeypatch):
    """/server_info is asked first (SGLang 0.5.23 deprecates /get_model_info, which lacks tp_size); a server without
    it is read from /get_model_info."""
    asked = []
    original = engine.pool.client.get

    async def get(url, *args, **kwargs):
        asked.append(urlsplit(url).path)
        if urlsplit(url).path == "/server_info" and "old" in asked:
            return httpx.Response(404, json={"detail": "Not Found"})
        return await original(url, *args, **kwargs)

    monkeypatch.setattr(engine.pool.client, "get", get)
    server = engine.servers[0]
    engine.pool.call(engine.pool.wait_ready(10))
    assert asked == ["/server_info"] and server.max_batch_size == served.batcher.max_batch_size
    asked[:] = ["old"]
    server.max_batch_size = server.dtype = None
    engine.pool.call(engine.pool.wait_ready(10))
    assert asked == ["old", "/server_info", "/get_model_info"]
    assert server.max_batch_size == served.batcher.max_batch_size and server.dtype == "float32"
