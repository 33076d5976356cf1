"""``rollout.engine.compile``: the decode loop against a static KV cache with one compiled decode step
(`vlrl.rollout.decode.CompiledStep`) gives the eager loop's greedy ids and behaviour log-probs.

The family-wide tests trace the step with ``backend="aot_eager"`` (dynamo's graph of the model's forward over the
static cache, run by the eager kernels: the static-cache semantics without minutes of code generation on 2 cores);
one test compiles with the default inductor backend, as `vlrl rl … rollout.engine.compile=true` does on a CPU — its
time here (2026-11-28, 2 shared cores): 123 s with a cold inductor cache on a loaded machine (load average ~14: the
C++ kernels' build), 7.5 s once inductor's on-disk cache holds them; the whole file 40 s with a warm cache."""

from __future__ import annotations

import logging

import pytest
import torch

from vlrl.data import generate
from vlrl.models import load_policy
from vlrl.rollout import HFEngine, SamplingParams, decode

pytestmark = pytest.mark.usefixtures("one_thread")


def _engines(name: str, backend: str = "aot_eager"):
    torch.manual_seed(0)
    policy = load_policy(name)
    compiled = HFEngine(policy)
    compiled.compiled = decode.CompiledStep(backend=backend)
    return HFEngine(policy), compiled


def _requests(engine, k: int = 2):
    samples = generate("shapes", k, tasks=["count", "locate"]) if engine.policy.is_vision else generate("arith", k)
    return [engine.encode(s) for s in samples]


def _assert_same(eager, compiled, *, atol=1e-5):
    assert len(eager) == len(compiled)
    for a, b in zip(eager, compiled, strict=True):
        assert torch.equal(a.response_ids, b.response_ids), (a.response_ids, b.response_ids)
        assert a.status == b.status
        torch.testing.assert_close(b.behaviour_logp, a.behaviour_logp, rtol=0, atol=atol)


@pytest.mark.parametrize("name", ["tiny-qwen2-vl", "tiny-qwen3-vl", "tiny-qwen2"])  # M-RoPE + images, DeepStack, text
def test_the_compiled_step_decodes_greedily_as_the_eager_loop(name):
    eager, compiled = _engines(name)
    requests = _requests(eager)
    greedy = SamplingParams(n=3, temperature=0.0, max_new_tokens=10)
    expected = eager.generate(requests, greedy)
    got = compiled.generate(requests, greedy)
    _assert_same(expected, got)
    assert compiled.compiled.compiles == 1 and compiled.last_stats.compactions == 0  # static: no row leaves
    # a second batch of the same shape reuses the static cache (no new compile) and stays exact
    _assert_same(eager.generate(requests, greedy), compiled.generate(requests, greedy))
    assert compiled.compiled.compiles == 1


def test_rows_that_end_early_stay_exact_while_the_others_decode():
    eager, compiled = _engines("tiny-qwen2-vl")
    requests = _requests(eager, 3)
    # greedy from a random model rarely stops: make a token one prompt's greedy response holds and another's does
    # not an EOS id
    plain = [t.response_ids.tolist() for t in eager.generate(requests, SamplingParams(temperature=0.0, max_new_tokens=8))]
    eos = next(t for row in plain for t in row[1:] if any(t not in other for other in plain))
    for engine in (eager, compiled):
        engine.policy.model.generation_config.eos_token_id = [*eager.policy.eos_token_ids, eos]
    try:
        greedy = SamplingParams(n=2, temperature=0.0, max_new_tokens=8)
        expected, got = eager.generate(requests, greedy), compiled.generate(requests, greedy)
    finally:
        eager.policy.model.generation_config.eos_token_id = eager.policy.eos_token_ids[:-1]
    lengths = [len(t.response_ids) for t in expected]
    assert min(lengths) < 8 and max(lengths) == 8, lengths  # some rows end early, others run on
    _assert_same(expected, got)


def test_a_model_with_linear_attention_decodes_eagerly_and_says_so(caplog):
    eager, compiled = _engines("tiny-qwen3.5")
    requests = _requests(eager)
    greedy = SamplingParams(n=2, temperature=0.0, max_new_tokens=6)
    with caplog.at_level(logging.WARNING, logger="vlrl.rollout.decode"):
        got = compiled.generate(requests, greedy)
    assert compiled.compiled.compiles == 0
    assert any("rollout.engine.compile" in r.message and "decodes eagerly" in r.message for r in caplog.records)
    _assert_same(eager.generate(requests, greedy), got, atol=0)  # the eager loop itself


def test_rollout_compile_reaches_the_in_process_engine():
    from vlrl.config import RolloutConfig
    from vlrl.rollout.build import build_engine

    policy = load_policy("tiny-qwen2")
    assert build_engine(RolloutConfig(engine={"compile": True}), policy).compiled is not None
    assert build_engine(RolloutConfig(), policy).compiled is None


def test_inductor_compiles_the_step_once_and_matches_the_eager_loop():
    """The default backend, as a run on this CPU uses it (the slow one: C++ code generation)."""
    eager, compiled = _engines("tiny-qwen2", backend="inductor")
    requests = _requests(eager)
    greedy = SamplingParams(n=2, temperature=0.0, max_new_tokens=6)
    _assert_same(eager.generate(requests, greedy), compiled.generate(requests, greedy))
    _assert_same(eager.generate(requests, greedy), compiled.generate(requests, greedy))
    assert compiled.compiled.compiles == 1
