"""Steps 1–3 of the sync recipe without a model: DAPO dynamic sampling (drop, back-fill, cap, carry-over) and
ReMax's greedy baseline, on a scripted engine whose responses are fixed per prompt."""

import torch

from train.fakes import ScriptedEngine, scripted_samples
from vlrl.config import DynamicSamplingConfig
from vlrl.data.cursor import PromptCursor
from vlrl.feed.groups import flatten
from vlrl.feed.informative import is_informative, starved_warning
from vlrl.feed.records import GroupRecord
from vlrl.feed.sync import GroupSampler
from vlrl.rollout import SamplingParams

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
    return [[t.reward for t in g.trajectories] for g in batch.groups]


def test_without_dynamic_sampling_every_group_is_kept():
    sampler, engine = _sampler([ALL_RIGHT, ALL_WRONG, MIXED, MIXED])
    batch = sampler.next_batch()
    trajectories, baselines = flatten(batch.groups)
    assert len(trajectories) == 4 and engine.prompts_generated == 2 and batch.metrics == {} and baselines is None
    assert [t.group_index for t in trajectories] == [0, 0, 1, 1]
    assert [g.draw.ticket for g in batch.groups] == [0, 1] and sampler.drawn == 2


def test_dynamic_sampling_drops_all_equal_groups_and_back_fills():
    # 3 uninformative prompts, 3 informative: whatever the cursor order, the batch holds 2 informative groups
    sampler, engine = _sampler([ALL_RIGHT, ALL_WRONG, ALL_RIGHT, MIXED, MIXED, MIXED], enabled=True, max_extra_rounds=10)
    for _ in range(3):
        batch = sampler.next_batch()
        groups = _groups(batch)
        assert len(groups) == 2 and all(len(set(g)) > 1 for g in groups)  # no zero-advantage group left
        m = batch.metrics
        assert m["sampling/prompts_used"] == 2 and m["sampling/starved"] == 0.0
        assert m["sampling/samples_generated"] == 2 * m["sampling/prompts_generated"]
        # every generated group is used, dropped, or carried over
        assert m["sampling/prompts_generated"] + m["sampling/carried_in"] == \
            2 + m["sampling/groups_dropped"] + m["sampling/carried_over"]
    assert engine.prompts_generated > 6  # it did over-sample: half the prompts are useless


def test_dynamic_sampling_round_sizes_by_hand():
    # only uninformative prompts and a cap of 2 extra rounds: rounds of 2, 2, 2 prompts (missing × 1.0), then the
    # step goes on with the last round's 2 groups (zero advantage), flagged starved; the 4 before are dropped
    sampler, engine = _sampler([ALL_RIGHT, ALL_WRONG], enabled=True, max_extra_rounds=2)
    batch = sampler.next_batch()
    assert engine.prompts_generated == 6 and [g.draw.ticket for g in batch.groups] == [4, 5]
    assert all(not is_informative(g) for g in batch.groups) and sampler.carry == []
    m = batch.metrics
    assert (m["sampling/starved"], m["sampling/rounds"], m["sampling/groups_dropped"]) == (1.0, 3, 4)
    assert m["sampling/prompts_used"] == 2 and m["sampling/prompts_generated"] == 6  # 6 = 2 used + 4 dropped
    warning = starved_warning(7, m, prompts_per_step=2)
    assert warning.startswith("step 7: dynamic sampling found no group with differing rewards in 6 groups")
    for knob in ("algo.dynamic_sampling.max_extra_rounds", "rollout.n", "rollout.temperature", "vlrl data select"):
        assert knob in warning
    assert "\n" not in warning
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
    (group,) = sampler.next_batch().groups
    assert [t.reward for t in group.trajectories] == [0.75, 0.5] and [t.accuracy for t in group.trajectories] == [0, 0]
    sampler, _ = _sampler(spec, enabled=True, prompts=1, metric="accuracy", max_extra_rounds=1)
    sampler.cursor.samples[0].reward = "ocr"
    batch = sampler.next_batch()
    assert batch.metrics["sampling/starved"] == 1.0 and batch.metrics["sampling/groups_dropped"] == 1


def test_greedy_baseline_for_remax():
    sampler, engine = _sampler([("a", ["a", "b"], "a"), ("a", ["b", "a"], "c")], greedy_baseline=True)
    trajectories, baselines = flatten(sampler.next_batch().groups)
    # each response carries its prompt's greedy reward: 1 for the prompt whose greedy answer is right, 0 otherwise
    by_prompt = {t.sample.id: float(b) for t, b in zip(trajectories, baselines, strict=True)}
    assert by_prompt == {"q0": 1.0, "q1": 0.0}
    assert engine.prompts_generated == 4  # 2 sampled + 2 greedy requests
    assert sampler.carry == [] and sampler.cursor.state()["position"] == 2


def test_carried_groups_round_trip_through_their_typed_record():
    """Dynamic sampling's surplus group, as a checkpoint holds it (`GroupRecord`: tensors, numbers, strings), comes
    back as the same group: ticket, tokens, behaviour log-probs, rewards and accuracy."""
    sampler, _ = _sampler([MIXED, MIXED, MIXED], enabled=True, oversample=1.5)
    sampler.next_batch()
    (carried,) = sampler.carry
    record = GroupRecord.of(carried)
    assert all(isinstance(r.response_ids, torch.Tensor) for r in record.responses)
    assert [r.reward for r in record.responses] == [1.0, 0.0] and [r.accuracy for r in record.responses] == [1.0, 0.0]
    back = record.restore()
    assert back.draw == carried.draw and back.draw.ticket == 2
    for a, b in zip(back.trajectories, carried.trajectories, strict=True):
        assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.behaviour_logp, b.behaviour_logp)
        assert (a.reward, a.accuracy, a.weight_version, a.status) == (b.reward, b.accuracy, b.weight_version, b.status)

