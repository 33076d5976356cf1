"""Issue 47's probes against `vlrl serve`'s admission (items 3, 6, 7 and the text-only path), replayed on a server
started here on loopback on the tiny Qwen2-VL preset: a prompt whose vision tokens do not match its images is a 400
naming the field, a batch that fails anyway is decoded again job by job, the decoded pixels of queued requests have
one server-wide budget, a declared body length reserves nothing, and a text request never waits for an image."""

from __future__ import annotations

import concurrent.futures

import pytest
from PIL import Image
from tests.rollout.test_server_hardening import data_url, png, serving

from vlrl.rollout.batcher import ContinuousBatcher, private_copy
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
