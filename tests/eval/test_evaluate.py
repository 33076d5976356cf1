"""Held-out evaluation scored strictly (issue 52): right, well-formed for the task's answer form, and ended."""

from tests.train.fakes import ScriptedEngine

from vlrl.config import EvalConfig
from vlrl.data import Sample
from vlrl.eval import evaluate

ASK = "How many shapes are there? Put ONLY your final answer within <answer></answer>."


def _sample(k, responses, greedy, *, truncated=(), task="shapes/count"):
    return Sample(id=f"q{k}", task=task, messages=[{"role": "user", "content": ASK}], answer="3", reward="number",
                  metadata={"responses": list(responses), "greedy": greedy, "truncated": list(truncated)})


def test_answers_that_run_on_or_are_cut_score_zero_strict():
    """The seed-0 policy's answers (``<answer>3</answer>3</answer>3``) and a truncated answer are right by the
    number verifier and 0 strictly; a well-formed right answer is right both ways. Per prompt, 4 samples:
    q0 all hack → accuracy 1, strict 0; q1 two good + two truncated → accuracy 1, strict 0.5, well-formed 0.5;
    q2 all good → 1, 1. Means over the three prompts (one task): accuracy 1, strict 0.5, well-formed 0.5."""
    hack, good, cut = "<answer>3</answer>3</answer>3", "<answer>3</answer>", "<answer>3</answer> "
    samples = [_sample(0, [hack], hack), _sample(1, [good, cut], cut, truncated=[cut]), _sample(2, [good], good)]
    result = evaluate(ScriptedEngine(), samples, EvalConfig(samples=4, max_new_tokens=8))
    assert result.accuracy["mean"] == 1.0 and result.greedy["mean"] == 1.0
    assert result.strict["mean"] == 0.5 and result.well_formed["mean"] == 0.5
    assert result.strict_greedy["mean"] == round(1 / 3, 4) and result.well_formed_greedy["mean"] == round(1 / 3, 4)
    out = result.to_dict(examples=False)
    assert {"strict", "strict_greedy", "well_formed", "well_formed_greedy"} <= set(out)
    assert result.metrics()["strict/shapes/count"] == 0.5


def test_a_policy_of_broken_answers_scores_zero_strict_on_every_task():
    hack = "<answer>1</answer>1</answer>1</answer>1"
    samples = [_sample(k, [hack], hack, task=f"t{k % 2}") for k in range(4)]
    for s in samples:
        s.answer = "1"
    result = evaluate(ScriptedEngine(), samples, EvalConfig(samples=2, max_new_tokens=8))
    assert result.accuracy == {"t0": 1.0, "t1": 1.0, "mean": 1.0}
    assert result.strict == {"t0": 0.0, "t1": 0.0, "mean": 0.0} and result.strict_greedy["mean"] == 0.0
    assert result.well_formed["mean"] == 0.0
