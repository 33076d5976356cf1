"""The `Engine` contract, written once and run against every engine: the in-process `HFEngine`, the
`HTTPEngine` against vlrl's server, and the in-process `ThreadedEngine` (the server's batcher without HTTP)."""

import pytest
import torch

from vlrl.data import generate
from vlrl.models import collate, response_logprobs
from vlrl.rollout import Engine, HFEngine, SamplingParams, Status
from vlrl.rollout.threaded_engine import ThreadedEngine

pytestmark = pytest.mark.usefixtures("one_thread")

ENGINES = ["hf", "http", "threaded"]


@pytest.fixture(params=ENGINES)
def engine(request, tiny_vlm, http_engine_factory):
    if request.param == "hf":
        yield HFEngine(tiny_vlm, max_batch_size=5)
    elif request.param == "http":
        yield http_engine_factory(tiny_vlm, batcher_options={"max_batch_size": 5})[0]
    else:
        engine = ThreadedEngine(tiny_vlm, max_batch_size=5)
        yield engine
        engine.close()


def _teacher_forced(policy, trajectories, temperature):
    tokens = collate([t.prompt_ids for t in trajectories], [t.response_ids for t in trajectories],
                     [t.vision for t in trajectories], pad_token_id=policy.pad_token_id)
    with torch.no_grad():
        return response_logprobs(policy.model, policy.adapter, tokens, temperature=temperature)[0]


def test_is_an_engine(engine):
    assert isinstance(engine, Engine)


def test_n_samples_per_prompt_in_request_order(engine, tiny_vlm):
    samples = generate("shapes", 3)
    trajectories = engine.generate([engine.encode(s) for s in samples], SamplingParams(n=4, max_new_tokens=6))
    assert len(trajectories) == 12
    assert [t.group_index for t in trajectories] == [0] * 4 + [1] * 4 + [2] * 4
    assert [t.sample.id for t in trajectories] == [s.id for s in samples for _ in range(4)]
    for t in trajectories:
        assert len(t.response_ids) == len(t.loss_mask) == len(t.behaviour_logp) <= 6
        assert torch.all(t.behaviour_logp <= 0)
        eos_seen = t.response_ids[-1].item() in tiny_vlm.eos_token_ids
        assert (t.status is Status.COMPLETED) == eos_seen
        assert t.status is Status.COMPLETED or len(t.response_ids) == 6
        assert t.response_text == tiny_vlm.tokenizer.decode(t.response_ids, skip_special_tokens=True)


def test_behaviour_logp_equals_teacher_forced_recompute(engine, tiny_vlm):
    """Log-probs recorded while sampling (here: possibly on another process's copy of the weights) equal a
    teacher-forced pass of the trainer's model — which also checks the images were processed identically."""
    requests = [engine.encode(s) for s in generate("shapes", 4, tasks=["count", "locate"])]
    trajectories = engine.generate(requests, SamplingParams(n=3, temperature=0.7, max_new_tokens=10))
    logp = _teacher_forced(tiny_vlm, trajectories, 0.7)
    for i, t in enumerate(trajectories):
        assert torch.allclose(logp[i, : len(t.response_ids)], t.behaviour_logp, atol=1e-4)


def test_greedy_equals_the_in_process_engine(engine, tiny_vlm):
    requests = [engine.encode(s) for s in generate("shapes", 4)]
    greedy = SamplingParams(temperature=0, max_new_tokens=10)
    reference = HFEngine(tiny_vlm).generate(requests, greedy)
    got = engine.generate(requests, greedy)
    assert [t.response_ids.tolist() for t in got] == [t.response_ids.tolist() for t in reference]
    assert [t.status for t in got] == [t.status for t in reference]


def test_stop_strings(engine, tiny_vlm):
    """Greedy without a stop string, then again stopping at a piece of that response: the response ends at
    the stop string (inclusive), shorter, and COMPLETED."""
    request = engine.encode(generate("shapes", 1, tasks=["count"])[0])
    free = engine.generate([request], SamplingParams(temperature=0, max_new_tokens=12))[0]
    ids = free.response_ids.tolist()
    k = next(k for k in range(1, len(ids)) if tiny_vlm.tokenizer.decode(ids[k : k + 1]).strip())
    stop = tiny_vlm.tokenizer.decode(ids[k : k + 1]).strip()
    stopped = engine.generate([request], SamplingParams(temperature=0, max_new_tokens=12, stop=[stop]))[0]
    assert stopped.status is Status.COMPLETED
    assert stop in stopped.response_text
    assert len(stopped.response_ids) <= k + 1 < len(ids) or free.status is Status.COMPLETED
    assert stopped.response_ids.tolist() == ids[: len(stopped.response_ids)]


def test_text_only_model(tiny_lm, http_engine_factory):
    engine, _ = http_engine_factory(tiny_lm)
    requests = [engine.encode(s) for s in generate("arith", 3)]
    trajectories = engine.generate(requests, SamplingParams(n=2, max_new_tokens=8))
    logp = _teacher_forced(tiny_lm, trajectories, 1.0)
    for i, t in enumerate(trajectories):
        assert torch.allclose(logp[i, : len(t.response_ids)], t.behaviour_logp, atol=1e-4)


def test_update_weights_tags_versions_and_changes_samples(engine, tiny_vlm):
    requests = [engine.encode(s) for s in generate("shapes", 3)]
    greedy = SamplingParams(temperature=0, max_new_tokens=8)
    before = engine.generate(requests, greedy)
    assert all(t.weight_version == engine.weight_version for t in before)
    with torch.no_grad():  # the trainer moves its weights …
        for p in tiny_vlm.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    engine.update_weights(version=3)  # … and publishes them
    after = engine.generate(requests, greedy)
    assert engine.weight_version == 3 and all(t.weight_version == 3 for t in after)
    assert [t.response_ids.tolist() for t in after] == [t.response_ids.tolist() for t in HFEngine(tiny_vlm).generate(requests, greedy)]
    logp = _teacher_forced(tiny_vlm, after, 1.0)
    for i, t in enumerate(after):
        assert torch.allclose(logp[i, : len(t.response_ids)], t.behaviour_logp, atol=1e-4)
