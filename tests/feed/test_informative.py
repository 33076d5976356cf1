"""DAPO's informative-group filter on its own (no engine, no buffer): the informative test, the two caps, the
starved rule and the world-size trim, and the ``sampling/…`` metrics each cap reports."""

import pytest

from train.fakes import fake_trajectories
from vlrl.config import DynamicSamplingConfig
from vlrl.feed.groups import Draw, Group
from vlrl.feed.informative import Cap, InformativeFilter, informative_filter, is_informative

_tickets = iter(range(10_000))


def group(rewards, accuracy=None):
    trajectories = fake_trajectories(rewards, [0] * len(rewards), [2] * len(rewards), accuracy=accuracy)
    return Group(trajectories, Draw(next(_tickets), trajectories[0].sample, 0))


def good():
    return group([1.0, 0.0])


def bad():
    return group([1.0, 1.0])


def _filter(counts, limit, *, P=2, world_size=1, **config):
    return InformativeFilter(DynamicSamplingConfig(enabled=True, **config), Cap(counts, limit), prompts_per_step=P,
                             world_size=world_size)


def test_informative_groups_by_reward_and_by_accuracy():
    assert is_informative(group([0.75, 0.5], [0, 0]))  # rewards differ
    assert not is_informative(group([0.75, 0.5], [0, 0]), "accuracy")  # both wrong
    assert is_informative(group([1.0, 1.0], [1, 0]), "accuracy") and not is_informative(group([1.0, 1.0], [1, 0]))


def test_the_config_gives_each_recipe_its_cap():
    config = DynamicSamplingConfig(enabled=True, max_extra_rounds=2)
    assert informative_filter(config, "rounds", prompts_per_step=4).cap == Cap("rounds", 3)  # 1 + 2 extra rounds
    assert informative_filter(config, "dropped", prompts_per_step=4).cap == Cap("dropped", 12)  # 3 × P groups
    assert informative_filter(DynamicSamplingConfig(), "rounds", prompts_per_step=4) is None  # off


def test_the_rounds_cap_counts_rounds_whatever_they_drop():
    f = _filter("rounds", 2, P=2, oversample=1.5)
    f.begin()
    assert f.round_size() == 3  # ceil(2 missing × 1.5)
    assert f.offer([bad(), good(), bad()]) != [] and not f.done()  # 1 round of 2: 1 kept, 2 dropped
    assert f.round_size() == 2  # ceil(1 × 1.5)
    f.offer([bad(), bad()])
    assert f.done() and len(f.kept) == 1  # 2 rounds spent, batch short
    out = f.finish()
    assert len(out.groups) == 1 and out.surplus == [] and len(out.dropped) == 4
    assert out.metrics == {"sampling/rounds": 2, "sampling/prompts_generated": 5, "sampling/samples_generated": 10,
                           "sampling/groups_dropped": 4, "sampling/prompts_used": 1, "sampling/carried_in": 0,
                           "sampling/carried_over": 0, "sampling/starved": 0.0}


def test_the_dropped_cap_counts_dropped_groups_whatever_the_batches():
    f = _filter("dropped", 3, P=2)
    f.begin()
    f.offer([bad(), bad()])
    assert not f.done() and f.missing == 2  # 2 dropped < 3
    f.offer([good(), bad()])
    assert f.done() and f.missing == 1  # 3 dropped: the cap
    out = f.finish()
    assert len(out.groups) == 1 and len(out.dropped) == 3
    assert out.metrics == {"sampling/groups_dropped": 3, "sampling/prompts_used": 1, "sampling/starved": 0.0}


def test_a_full_batch_stops_either_cap_and_the_surplus_is_returned():
    carried = [good()]
    f = _filter("rounds", 5, P=2, oversample=2.0)
    f.begin(carried)
    assert f.round_size() == 2 and not f.done()
    f.offer([good(), good()])
    assert f.done()
    out = f.finish()
    assert out.groups[0] is carried[0] and len(out.surplus) == 1 and out.dropped == []
    m = out.metrics
    assert (m["sampling/carried_in"], m["sampling/carried_over"], m["sampling/prompts_used"]) == (1, 1, 2)


@pytest.mark.parametrize("counts", ["rounds", "dropped"])
def test_starved_trains_the_last_round_and_does_not_count_it_dropped(counts):
    # nothing informative: 2 rounds of 2 (cap: 2 rounds, or 4 dropped groups); the step trains the last round's 2
    f = _filter(counts, 2 if counts == "rounds" else 4, P=2)
    f.begin()
    first, last = [bad(), bad()], [bad(), bad()]
    f.offer(first)
    assert not f.done()
    f.offer(last)
    assert f.done()
    out = f.finish()
    assert out.groups == last and out.dropped == first and out.metrics["sampling/starved"] == 1.0
    assert out.metrics["sampling/groups_dropped"] == 2 and out.metrics["sampling/prompts_used"] == 2


def test_a_short_batch_is_cut_to_split_over_the_ranks():
    f = _filter("dropped", 2, P=4, world_size=2)
    f.begin()
    f.offer([good(), good(), good(), bad()])
    f.offer([bad()])
    out = f.finish()  # 3 informative over 2 ranks: 2 trained, 1 returned
    assert len(out.groups) == 2 and len(out.surplus) == 1 and out.metrics["sampling/prompts_used"] == 2


@pytest.mark.parametrize("counts", ["rounds", "dropped"])
def test_fewer_informative_groups_than_ranks_at_the_cap(counts):
    """1 informative group over 2 ranks at the cap, under either cap: the step trains it with the last round's other
    group (an even split), carries nothing over and drops nothing. (Before 2026-11-28 the sync sampler trained the
    group *and* carried it over, and the async buffer returned an empty batch the ranks could not train.)"""
    f = _filter(counts, 1, P=2, world_size=2)  # 1 round, or 1 dropped group
    f.begin()
    kept, dropped = good(), bad()
    f.offer([kept, dropped])
    assert f.done()
    out = f.finish()
    assert out.groups == [kept, dropped] and out.surplus == [] and out.dropped == []
    assert out.metrics["sampling/starved"] == 0.0 and out.metrics["sampling/groups_dropped"] == 0
    assert out.metrics["sampling/prompts_used"] == 2


def test_a_starved_batch_still_splits_over_the_ranks():
    """Nothing informative and a last round shorter than the batch (3 groups, 2 ranks): 2 of them are trained."""
    f = _filter("rounds", 2, P=4, world_size=2)
    f.begin()
    f.offer([bad(), bad(), bad(), bad()])
    last = [bad(), bad(), bad()]
    f.offer(last)
    out = f.finish()
    assert out.groups == last[:2] and out.metrics["sampling/starved"] == 1.0
    assert out.metrics["sampling/groups_dropped"] == 5 and out.dropped[-1] is last[2]
