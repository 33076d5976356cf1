"""Steps 1–3 of the sync recipe without a model: DAPO dynamic sampling (drop, back-fill, cap, carry-over) and
ReMax's greedy baseline, on a scripted engine whose responses are fixed per prompt."""

import pytest
import torch

from vlrl.config import DynamicSamplingConfig
from vlrl.rollout import SamplingParams
from vlrl.train.common import PromptCursor
from vlrl.train.sampling import GroupSampler

from .fakes import ScriptedEngine, scripted_samples

ALL_RIGHT = ("a", ["a", "a"], "a")
ALL_WRONG = ("a", ["b", "c"], "b")
MIXED = ("a", ["a", "b"], "a")


def _sampler(specs, *, prompts=2, greedy_baseline=False, **dynamic):
    engine = ScriptedEngine()
    sampler = GroupSampler(engine, PromptCursor(scripted_samples(specs), seed=0), SamplingParams(n=2, max_new_tokens=4),
                           prompts_per_step=prompts, dynamic=DynamicSamplingConfig(**dynamic),
                           greedy_baseline=greedy_baseline)
    return sampler, engine


def _groups(batch):
    return [[t.reward for t in batch.trajectories if t.group_index == g] for g in range(len(batch.trajectories) // 2)]


def test_without_dynamic_sampling_every_group_is_kept():
    sampler, engine = _sampler([ALL_RIGHT, ALL_WRONG, MIXED, MIXED])
    batch = sampler.next_batch()
    assert len(batch.trajectories) == 4 and engine.prompts_generated == 2 and batch.metrics == {}
    assert [t.group_index for t in batch.trajectories] == [0, 0, 1, 1]


def test_dynamic_sampling_drops_all_equal_groups_and_back_fills():
    # 3 uninformative prompts, 3 informative: whatever the cursor order, the batch holds 2 informative groups
    sampler, engine = _sampler([ALL_RIGHT, ALL_WRONG, ALL_RIGHT, MIXED, MIXED, MIXED], enabled=True, max_extra_rounds=10)
    for _ in range(3):
        batch = sampler.next_batch()
        groups = _groups(batch)
        assert len(groups) == 2 and all(len(set(g)) > 1 for g in groups)  # no zero-advantage group left
        m = batch.metrics
        assert m["sampling/prompts_used"] == 2
        assert m["sampling/samples_generated"] == 2 * m["sampling/prompts_generated"]
        # every generated group is used, dropped, or carried over
        assert m["sampling/prompts_generated"] + m["sampling/carried_in"] == \
            2 + m["sampling/groups_dropped"] + m["sampling/carried_over"]
    assert engine.prompts_generated > 6  # it did over-sample: half the prompts are useless


def test_dynamic_sampling_round_sizes_by_hand():
    # only uninformative prompts and a cap of 2 extra rounds: rounds of 2, 2, 2 prompts (missing × 1.0), then stop
    sampler, engine = _sampler([ALL_RIGHT, ALL_WRONG], enabled=True, max_extra_rounds=2)
    with pytest.raises(RuntimeError, match="max_extra_rounds"):
        sampler.next_batch()
    assert engine.prompts_generated == 6
    # oversample 1.5 with 1 informative prompt in 2: round 1 asks ceil(2 × 1.5) = 3 prompts
    sampler, engine = _sampler([MIXED, MIXED, MIXED], enabled=True, oversample=1.5)
    batch = sampler.next_batch()
    assert engine.prompts_generated == 3 and batch.metrics["sampling/rounds"] == 1
    assert batch.metrics["sampling/carried_over"] == 1  # the 3rd informative group waits for the next step
    batch = sampler.next_batch()  # 1 carried in, 1 missing → ceil(1 × 1.5) = 2 prompts, 1 of them carried over again
    assert batch.metrics["sampling/carried_in"] == 1 and engine.prompts_generated == 5
    assert batch.metrics["sampling/carried_over"] == 1 and len(_groups(batch)) == 2


def test_dynamic_sampling_on_the_accuracy_part():
    # ocr reward: 1 − Levenshtein / length = .75 for "abcd" and .5 for "abxy" against "abcz" — the rewards differ,
    # but both are wrong (accuracy 0): informative for metric=reward, dropped for metric=accuracy (DAPO's
    # "accuracy 0 or 1")
    spec = [("abcz", ["abcd", "abxy"], "abcd")]
    sampler, _ = _sampler(spec, enabled=True, prompts=1)
    sampler.cursor.samples[0].reward = "ocr"
    assert [t.reward for t in sampler.next_batch().trajectories] == [0.75, 0.5]
    sampler, _ = _sampler(spec, enabled=True, prompts=1, metric="accuracy", max_extra_rounds=1)
    sampler.cursor.samples[0].reward = "ocr"
    with pytest.raises(RuntimeError, match="equal rewards"):
        sampler.next_batch()


def test_greedy_baseline_for_remax():
    sampler, engine = _sampler([("a", ["a", "b"], "a"), ("a", ["b", "a"], "c")], greedy_baseline=True)
    batch = sampler.next_batch()
    # each response carries its prompt's greedy reward: 1 for the prompt whose greedy answer is right, 0 otherwise
    by_prompt = {t.sample.id: float(b) for t, b in zip(batch.trajectories, batch.baseline_rewards, strict=True)}
    assert by_prompt == {"q0": 1.0, "q1": 0.0}
    assert engine.prompts_generated == 4  # 2 sampled + 2 greedy requests
    state = sampler.state()
    assert state["carry"] == [] and state["cursor"]["position"] == 2


def test_sampler_state_holds_the_carried_groups_as_plain_data():
    sampler, _ = _sampler([MIXED, MIXED, MIXED], enabled=True, oversample=1.5)
    sampler.next_batch()
    carry = sampler.state()["carry"]
    assert len(carry) == 1 and len(carry[0]["trajectories"]) == 2
    assert all(isinstance(t["response_ids"], list) for t in carry[0]["trajectories"])
    assert torch.tensor([t["reward"] for t in carry[0]["trajectories"]]).tolist() == [1.0, 0.0]
