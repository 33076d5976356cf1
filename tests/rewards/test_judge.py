from types import SimpleNamespace

import pytest

from vlrl.data import Sample
from vlrl.rewards import RewardExecutor, RewardItem, get_reward, score_trajectories
from vlrl.rewards.judge import parse_verdict
from vlrl.rollout.judge import JudgeReward

from .fakes import FakeJudgeEngine


@pytest.mark.parametrize("text,expected", [
    ("True", 1.0), ("false.", 0.0), ("Yes, it is", 1.0), ("The response is not correct", 0.0),
    ("Score: 8/10", 0.8), ("0.25", 0.25), ("I cannot tell", None), ("42", None),
])
def test_parse_verdict(text, expected):
    assert parse_verdict(text) == expected


def test_judge_reward_direct_and_probability():
    engine = FakeJudgeEngine(p=0.9)
    judge = JudgeReward(engine)
    assert get_reward("critic")("7", "7", judge=judge).overall == 1.0
    assert judge("6", "7").overall == 0.0
    prob = JudgeReward(engine, use_logprob=True)
    assert prob("7", "7").overall == pytest.approx(0.9)  # P(True) = exp(logp of "True")
    assert prob("6", "7").overall == pytest.approx(0.1)  # 1 − P(False)
    with pytest.raises(ValueError, match="no judge"):
        get_reward("critic")("7", "7")


def test_template_fields_and_truncation():
    judge = JudgeReward(FakeJudgeEngine(), template="{question}|{answer}|{response}|{missing}", max_response_chars=3)
    assert judge.prompt("abcdef", 7, {"question": "q?"}) == "q?|7|abc|"


def test_executor_batches_judge_calls():
    engine = FakeJudgeEngine()
    items = [RewardItem(r, "7", {"critic": 0.5, "number": 0.5}, {}, f"i{k}", "t") for k, r in enumerate(["7", "6", "7"])]
    with RewardExecutor(judge=JudgeReward(engine)) as ex:
        outputs, report = ex.score(items)
    assert engine.calls == [(3, 0.0, 8)]  # one greedy generate call for the whole batch
    assert [o.overall for o in outputs] == [1.0, 0.0, 1.0]
    assert report.counts["judge_units"] == 3 and not report.failures


def test_score_trajectories_gives_the_judge_the_question():
    sample = Sample(id="q", task="t", messages=[{"role": "user", "content": "What is 3+4?"}], answer="7",
                    reward="critic")
    trajectory = SimpleNamespace(sample=sample, response_text="7", response_length=1, reward=None, reward_parts={},
                                 status="completed")
    engine = FakeJudgeEngine()
    with RewardExecutor(judge=JudgeReward(engine)) as ex:
        report = score_trajectories([trajectory], executor=ex)
    assert trajectory.reward == 1.0 and not report.failures
    assert "Question: What is 3+4?\nReference answer: 7\nResponse: 7" in engine.prompts[0]
