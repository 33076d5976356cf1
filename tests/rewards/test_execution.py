import json
import os
import threading
import time
from types import SimpleNamespace

import pytest

from vlrl.rewards import RewardExecutor, RewardItem, RewardSpec, score_trajectories, summarize


def sleepy(response, answer, **meta):
    time.sleep(float(meta.get("sleep", 30)))
    return 1.0


def crash(response, answer, **meta):
    os._exit(3)  # a worker dying under a verifier (segfault, OOM kill)


def broken(response, answer, **meta):
    raise RuntimeError("verifier bug")


def not_a_number(response, answer, **meta):
    return float("nan")


sleepy.reward_spec = RewardSpec(mode="pool", deadline=0.5)
crash.reward_spec = RewardSpec(mode="pool", deadline=5.0)
HERE = "tests.rewards.test_execution"


def _items(responses, reward, answer="3", **meta):
    return [RewardItem(r, answer, reward, meta, f"id{k}", "t") for k, r in enumerate(responses)]


def test_inline_verifiers_do_not_start_the_pool():
    with RewardExecutor() as ex:
        outputs, report = ex.score(_items(["<answer>3</answer>", "<answer>4</answer>"], {"number": 0.8, "format": 0.2}))
        assert ex._pool is None
    assert [o.overall for o in outputs] == [pytest.approx(0.8), 0.0]
    assert report.counts["inline_units"] == 4 and report.counts["pool_units"] == 0


def test_pool_timeout_gets_the_fallback_and_is_logged(executor, tmp_path):
    failures = tmp_path / "run" / "reward_failures.jsonl"
    items = _items(["<answer>3</answer>", "slow"], {"number": 0.5, f"{HERE}:sleepy": 0.5})
    items[0].meta = {"sleep": 0}
    start = time.perf_counter()
    outputs, report = executor.score(items, fallback=-0.5, failures_path=failures)
    assert time.perf_counter() - start < 4  # the 30 s unit is cut at its 0.5 s deadline
    assert outputs[0].overall == pytest.approx(1.0)
    assert outputs[1].overall == -0.5 and outputs[1].parts == {"reward_failed": 1.0}
    assert report.counts["timeouts"] == 1 and report.failures == [("id1", f"{HERE}:sleepy: no result within 0.5 s")]
    (record,) = [json.loads(line) for line in failures.read_text().splitlines()]
    assert record["id"] == "id1" and record["kind"] == "timeout" and record["response"] == "slow"
    assert record["reward"] == {"number": 0.5, f"{HERE}:sleepy": 0.5}


def test_dead_worker_is_counted_and_replaced(executor):
    outputs, report = executor.score(_items(["x"], f"{HERE}:crash"))
    assert outputs[0].parts == {"reward_failed": 1.0} and report.counts["worker_deaths"] == 1
    outputs, report = executor.score(_items(["\\boxed{3}"], "math"))  # the pool still works
    assert outputs[0].overall == 1.0 and not report.failures


def test_inline_errors_and_non_finite_scores_are_failures():
    with RewardExecutor() as ex:
        outputs, report = ex.score(_items(["a", "b"], f"{HERE}:broken") + _items(["c"], f"{HERE}:not_a_number"))
    assert [o.overall for o in outputs] == [0.0, 0.0, 0.0]
    assert report.counts["errors"] == 3
    assert report.failures[0] == ("id0", f"{HERE}:broken: RuntimeError: verifier bug")
    assert "non-finite" in report.failures[2][1]


def test_too_long_scores_each_verifiers_minimum():
    with RewardExecutor(max_chars=10) as ex:
        items = _items(["<answer>3</answer>" + "x" * 20], {"number": 1.0, "overlong": 1.0},
                       max_length=100, cache_length=10, response_length=500)
        outputs, report = ex.score(items)
    # number's minimum 0, overlong's −1: 1·0 + 1·(−1)
    assert outputs[0].overall == -1.0 and outputs[0].parts["too_long"] == 1.0 and outputs[0].parts["accuracy"] == 0.0
    assert report.counts["too_long"] == 1 and not report.failures


def test_task_rewards_override_the_sample_reward():
    with RewardExecutor(task_rewards={"t": "answer_format"}) as ex:
        outputs, _ = ex.score(_items(["<answer>4</answer>"], "number"))
    assert outputs[0].overall == 1.0  # format, not the wrong number


def test_deadlines_hold_when_scoring_from_another_thread(executor):
    result = {}

    def work():
        result["out"] = executor.score(_items(["a"], f"{HERE}:sleepy"))

    thread = threading.Thread(target=work)
    start = time.perf_counter()
    thread.start()
    thread.join(10)
    assert not thread.is_alive() and time.perf_counter() - start < 4
    outputs, report = result["out"]
    assert report.counts["timeouts"] == 1 and outputs[0].overall == 0.0


def test_mixed_batch_meets_every_deadline(executor):
    """A small version of the benchmark's 10,000-item batch: honest and hostile items of every kind."""
    from vlrl.rewards.probes import probes

    hostile = [p for p in probes() if p.reward in ("math", "svg", "html", "number", "ovd_map")]
    honest = _items(["<answer>3</answer>", "\\boxed{3}", "<answer>4</answer>"] * 30, "number") \
        + _items(["\\boxed{\\frac{6}{2}}"] * 10, "math")
    items = honest + [RewardItem(p.response, p.answer, p.reward, p.meta, p.name, "probe") for p in hostile]
    outputs, report = executor.score(items)
    assert len(outputs) == len(items) and report.counts["worker_deaths"] == 0
    from tests.rewards.conftest import TEST_DEADLINES

    for verifier, worst in report.max_seconds.items():
        assert worst <= TEST_DEADLINES.get(verifier, 1.0) + 0.5, verifier  # pool: enforced; inline: measured
    assert [o.overall for o in outputs[:3]] == [1.0, 1.0, 0.0] and outputs[95].overall == 1.0


def _trajectory(response, reward="number", answer="3", task="t", length=5, status="completed", form="answer"):
    sample = SimpleNamespace(id=f"s-{response}", task=task, answer=answer, reward=reward, metadata={"tolerance": 0},
                             declared_format=lambda: form)
    return SimpleNamespace(sample=sample, response_text=response, response_length=length, reward=None, reward_parts={},
                           status=status)


def test_score_trajectories_fills_rewards_and_summaries():
    trajectories = [_trajectory("<answer>3</answer>"), _trajectory("<answer>2</answer>"),
                    _trajectory("x", reward={"overlong": 1.0}, task="u", length=95)]
    trajectories[2].sample.metadata = {"max_length": 100, "cache_length": 10}
    report = score_trajectories(trajectories)
    assert [t.reward for t in trajectories] == [1.0, 0.0, -0.5]  # overlong: (90 − 95) / 10 with the token length
    assert trajectories[0].reward_parts == {"accuracy": 1.0, "well_formed": 1.0} and not report.failures
    assert summarize(trajectories) == {"reward/t": 0.5, "reward/t/accuracy": 0.5, "reward/t/well_formed": 1.0,
                                       "reward/u": -0.5, "reward/u/well_formed": 0.0}  # "x" is not an <answer> block


def test_strict_scoring_refuses_what_a_parser_refuses():
    """Issue 52: the demo's RL policy at seed 0 answered ``<answer>1</answer>1</answer>1…`` to the token budget; the
    number verifier reads the first block and called it right. Strict scoring gives a response that is not in its
    answer form, or did not end, its correctness verifiers' minimum; accuracy keeps the verifier's word."""
    hack, truncated, good = "<answer>3</answer>3</answer>3", "<answer>3</answer>", "<answer>3</answer>"
    batch = [_trajectory(hack), _trajectory(truncated, status="truncated"), _trajectory(good)]
    score_trajectories(batch, strict=True)
    assert [t.reward for t in batch] == [0.0, 0.0, 1.0]
    assert [t.accuracy for t in batch] == [1.0, 1.0, 1.0]  # the verifier itself is unchanged
    assert [t.well_formed for t in batch] == [False, False, True]
    lenient = [_trajectory(hack), _trajectory(truncated, status="truncated")]
    score_trajectories(lenient)  # strict=False: the verifier alone decides (the old behaviour)
    assert [t.reward for t in lenient] == [1.0, 1.0] and [t.well_formed for t in lenient] == [False, False]


def test_strict_scoring_leaves_shape_verifiers_their_score():
    """A format or length verifier (no ``accuracy`` part) scores the response's shape: strict scoring does not set it
    to its minimum. Here 0.5 · number (refused: truncated → 0) + 1 · overlong ((90 − 95) / 10 = −0.5) = −0.5; the
    free form (``none``) of an ended response is well-formed whatever its text."""
    t = _trajectory("<answer>3</answer>", reward={"number": 0.5, "overlong": 1.0}, length=95, status="truncated")
    t.sample.metadata = {"max_length": 100, "cache_length": 10}
    free = _trajectory("3 apples", form="none")
    score_trajectories([t, free], strict=True)
    assert t.reward == -0.5 and t.reward_parts["number"] == 0.0 and t.reward_parts["overlong"] == -0.5
    assert free.well_formed and free.reward == 1.0


def _namespaces() -> bool:
    from vlrl.rewards.sandbox import SandboxUnavailable, isolation

    try:
        return isolation("namespaces") != "none"
    except SandboxUnavailable:
        return False


@pytest.mark.skipif(not _namespaces(), reason="no namespaces here: nothing to tell `none` apart from")
def test_pool_workers_follow_the_sandbox_setting_of_each_batch(executor, monkeypatch):
    """Issue 38: a run sets `sandbox.isolation` (as VLRL_SANDBOX_ISOLATION) after the worker pool may have started;
    each unit carries the caller's setting, so a worker never runs a program under an isolation it was not asked
    for. Under namespaces the program's directory is in the private /tmp/work; under `none` it is on the host."""
    from vlrl.rewards.sandbox import isolation

    program = "```python\nimport os\nprint(os.getcwd().startswith('/tmp/work/'))\n```"
    items = _items([program], "code", answer=[{"input": "", "output": "True"}])
    monkeypatch.delenv("VLRL_SANDBOX_ISOLATION", raising=False)
    outputs, report = executor.score(items)
    assert not report.failures and outputs[0].overall == 1.0 and isolation() != "none"
    monkeypatch.setenv("VLRL_SANDBOX_ISOLATION", "none")
    outputs, report = executor.score(items)
    assert not report.failures and outputs[0].overall == 0.0
    monkeypatch.setenv("VLRL_SANDBOX_ISOLATION", "chroot")  # not a setting: refused in the worker, counted, named
    outputs, report = executor.score(items)
    assert outputs[0].parts == {"reward_failed": 1.0}
    assert "SandboxUnavailable: VLRL_SANDBOX_ISOLATION='chroot': expected one of" in report.failures[0][1]
