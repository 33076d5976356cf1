"""`vlrl serve` scores input tokens as SGLang 0.5.23 does (``return_logprob`` with ``logprob_start_len``;
``max_new_tokens: 0`` prefills only): ``meta_info.input_token_logprobs`` is ``[logprob, token id, text]`` for the
tokens ``input_ids[logprob_start_len:]``, the first one's logprob ``None`` (SGLang's
``scheduler_components/logprob_result_processor.py``: ``[None] + input_token_logprobs[:-1]``), computed from the raw
logits — no temperature (its ``layers/logprob_processor.py``). The numbers are the model's own, the request is
bounded like any other."""

from types import SimpleNamespace

import httpx
import pytest
import torch

from vlrl.data import generate
from vlrl.models.forward import score
from vlrl.rollout import HFEngine
from vlrl.rollout.image_url import encode_image

from .conftest import API_KEY, running_server

pytestmark = pytest.mark.usefixtures("one_thread")

AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def policy():
    from vlrl.models import load_policy

    return load_policy("tiny-qwen2-vl")


@pytest.fixture(scope="module")
def served(policy):
    with running_server(policy, max_tokens_in_flight=4096) as served:
        with httpx.Client(base_url=served.url, headers=AUTH, timeout=60) as client:
            yield client


def _direct(policy, ids, vision=None) -> torch.Tensor:
    """log π(ids[j] | ids[:j]) for j ≥ 1 from one plain forward of the model (raw logits, temperature 1)."""
    inputs = {"input_ids": torch.tensor([ids])}
    if vision is not None:  # (Qwen2-VL's own forward: its M-RoPE positions from image_grid_thw)
        inputs.update(pixel_values=vision.pixel_values, image_grid_thw=vision.image_grid_thw)
    with torch.no_grad():
        logits = policy.model(**inputs).logits[0].float()
    return torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def test_prefill_only_scoring_in_sglangs_shape_equals_the_models_logprobs(served, policy):
    ids = policy.tokenizer.encode("a red square and two blue circles")
    body = {"input_ids": ids, "return_logprob": True, "logprob_start_len": 0, "sampling_params": {"max_new_tokens": 0}}
    answer = served.post("/generate", json=body).json()
    assert answer["output_ids"] == [] and answer["text"] == ""
    meta = answer["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 0} and meta["output_token_logprobs"] == []
    scored = meta["input_token_logprobs"]
    assert [entry[1] for entry in scored] == ids and scored[0][0] is None  # every input token, the first None
    assert all(entry[2] is None for entry in scored)  # (return_text_in_logprobs off)
    values = torch.tensor([entry[0] for entry in scored[1:]])
    assert torch.allclose(values, _direct(policy, ids), atol=1e-5)
    # logprob_start_len k: the tokens ids[k:], ids[k]'s None; the others the same numbers; temperature changes nothing
    later = served.post("/generate", json={**body, "logprob_start_len": 3, "sampling_params": {
        "max_new_tokens": 0, "temperature": 0.5}}).json()["meta_info"]["input_token_logprobs"]
    assert [entry[1] for entry in later] == ids[3:] and later[0][0] is None
    assert [entry[0] for entry in later[1:]] == [entry[0] for entry in scored[4:]]
    # the whole prompt's length: nothing scored; -1 (SGLang's default) too
    assert served.post("/generate", json={**body, "logprob_start_len": len(ids)}).json()["meta_info"][
        "input_token_logprobs"] == []
    assert served.post("/generate", json={**body, "logprob_start_len": -1}).json()["meta_info"][
        "input_token_logprobs"] == []


def test_scoring_beside_generation_a_batch_with_one_start_each_and_token_texts(served, policy):
    prompts = [policy.tokenizer.encode(t) for t in ("one two three", "four five six seven")]
    answers = served.post("/generate", json={
        "input_ids": prompts, "return_logprob": True, "logprob_start_len": [1, 0], "return_text_in_logprobs": True,
        "sampling_params": {"max_new_tokens": 2, "temperature": 0}}).json()
    assert len(answers) == 2 and all(len(a["output_ids"]) >= 1 for a in answers)
    first, second = (a["meta_info"]["input_token_logprobs"] for a in answers)
    assert [e[1] for e in first] == prompts[0][1:] and [e[1] for e in second] == prompts[1]
    assert torch.allclose(torch.tensor([e[0] for e in second[1:]]), _direct(policy, prompts[1]), atol=1e-5)
    assert [e[2] for e in second] == [policy.tokenizer.decode([t]) for t in prompts[1]]
    assert all(isinstance(e[2], str) for e in answers[0]["meta_info"]["output_token_logprobs"])


def test_an_image_prompt_is_scored_with_its_images(served, policy):
    """The student's prompt (image tokens expanded) and its images, as `HTTPEngine` sends them: the text after the
    images scored as the trainer's teacher-forced pass reads it with them (`vlrl.models.forward.score`) — and not as
    it reads them with another image."""
    request = HFEngine(policy).encode(generate("shapes", 1, tasks=["count"])[0])
    response = policy.tokenizer.encode(" 3 shapes")
    ids = [int(t) for t in request.prompt_ids] + response
    start = len(request.prompt_ids) - 1
    answer = served.post("/generate", json={
        "input_ids": ids, "image_data": [encode_image(im) for im in request.images], "return_logprob": True,
        "logprob_start_len": start, "sampling_params": {"max_new_tokens": 0}}).json()
    scored = answer["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in scored] == ids[start:] and scored[0][0] is None
    row = SimpleNamespace(prompt_ids=request.prompt_ids, response_ids=torch.tensor(response), vision=request.vision)
    trainer = score(policy.model, policy, [row], 1.0)[0]
    served_logp = torch.tensor([e[0] for e in scored[1:]])
    assert torch.allclose(served_logp, trainer, atol=1e-5)
    other = HFEngine(policy).encode(generate("shapes", 2, tasks=["count"])[1])  # another image, of the same size
    swapped = served.post("/generate", json={
        "input_ids": ids, "image_data": [encode_image(im) for im in other.images], "return_logprob": True,
        "logprob_start_len": start, "sampling_params": {"max_new_tokens": 0}}).json()["meta_info"]["input_token_logprobs"]
    assert (served_logp - torch.tensor([e[0] for e in swapped[1:]])).abs().max() > 1e-4  # the images were read


@pytest.mark.parametrize(("body", "field"), [
    ({"logprob_start_len": 99}, "logprob_start_len"),  # past the prompt: SGLang aborts it, naming the length
    ({"logprob_start_len": -2}, "logprob_start_len"),
    ({"logprob_start_len": [0, 1]}, "logprob_start_len"),  # a list for one prompt
    ({"sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
    ({"top_logprobs_num": 5}, "top_logprobs_num"),  # not computed: refused, not answered without them
])
def test_malformed_scoring_requests_are_refused_naming_the_field(served, policy, body, field):
    ids = policy.tokenizer.encode("one two three")
    answer = served.post("/generate", json={"input_ids": ids, "return_logprob": True,
                                            "sampling_params": {"max_new_tokens": 0}, **body})
    assert answer.status_code == 400 and field in answer.json()["error"], answer.text


def test_the_scored_tokens_count_against_the_admission_bounds(served, policy):
    """A prefill-only request holds its prompt's tokens in the server's budget (4096 here) and must fit the model's
    context: a prompt beyond either is refused at admission (400 naming the bound), not scored."""
    context = policy.model.config.get_text_config().max_position_embeddings
    ids = policy.tokenizer.encode("word " * (context + 8))[: context + 8]
    answer = served.post("/generate", json={"input_ids": ids, "return_logprob": True, "logprob_start_len": 0,
                                            "sampling_params": {"max_new_tokens": 0}})
    assert answer.status_code == 400 and "context" in answer.json()["error"], answer.text
    batch = [ids[:1000]] * 5  # 5 × 1000 tokens: more than the 4096 the server holds at once
    answer = served.post("/generate", json={"input_ids": batch, "return_logprob": True, "logprob_start_len": 0,
                                            "sampling_params": {"max_new_tokens": 0}})
    assert answer.status_code == 400 and "max_tokens_in_flight" in answer.json()["error"], answer.text
