"""Data loading of the recipes: the held-out split of a training file (seeded by sample id, never the
procedural suite), and the per-sample check that every answer can score on its verifier."""

import hashlib
import json

import pytest

from vlrl.config import DataConfig
from vlrl.data import DataError, Sample
from vlrl.data.splits import load_splits, sample_check, split_held_out


def _samples(n):
    return [Sample(id=f"q{k}", task="t", messages=[{"role": "user", "content": "x"}], answer=str(k), reward="number")
            for k in range(n)]


def _write(path, n):
    path.write_text("".join(json.dumps({"id": f"q{k}", "task": "mine", "prompt": "How many?", "answer": str(k),
                                        "reward": "number", "response": f"<answer>{k}</answer>"}) + "\n"
                            for k in range(n)))
    return path


def test_held_out_share_is_seeded_by_id_and_bounded():
    samples = _samples(57)
    train, test = split_held_out(samples, DataConfig(train="x.jsonl"))
    assert len(test) == 6 and len(train) == 51  # round(0.1 × 57) = round(5.7) = 6
    # the rule, worked out independently: the 6 ids whose sha256("0:<id>") sort first
    expected = sorted((s.id for s in samples), key=lambda i: hashlib.sha256(f"0:{i}".encode()).hexdigest())[:6]
    assert sorted(s.id for s in test) == sorted(expected)
    assert not {s.id for s in train} & {s.id for s in test}
    reordered = split_held_out(list(reversed(samples)), DataConfig(train="x.jsonl"))[1]
    assert {s.id for s in reordered} == {s.id for s in test}  # the file's order does not matter
    other_seed = split_held_out(samples, DataConfig(train="x.jsonl", seed=1))[1]
    assert {s.id for s in other_seed} != {s.id for s in test}
    assert len(split_held_out(samples, DataConfig(train="x.jsonl", n_test=3))[1]) == 3  # at most n_test
    assert len(split_held_out(_samples(3), DataConfig(train="x.jsonl"))[1]) == 1  # at least 1 (0.3 rounds to 0)
    assert [len(x) for x in split_held_out(_samples(2), DataConfig(train="x.jsonl", test_fraction=0.9))] == [1, 1]


def test_load_splits_holds_out_of_the_file_and_never_generates(tmp_path):
    data = _write(tmp_path / "mine.jsonl", 20)
    train, test = load_splits(DataConfig(train=str(data)))
    assert len(train) == 18 and len(test) == 2 and {s.task for s in test} == {"mine"}
    given = _write(tmp_path / "test.jsonl", 3)
    train, test = load_splits(DataConfig(train=str(data), test=str(given)))
    assert len(train) == 20 and len(test) == 3
    with pytest.raises(DataError, match="data.test: unset, and data.test_fraction is 0"):
        load_splits(DataConfig(train=str(data), test_fraction=0))
    with pytest.raises(DataError, match="holds 1 sample"):
        load_splits(DataConfig(train=str(_write(tmp_path / "one.jsonl", 1))))
    with pytest.raises(DataError, match="packed by data.packing_plan"):
        load_splits(DataConfig(train=str(data), packing_plan="plan.npz"))
    train, test = load_splits(DataConfig(n_train=4, n_test=2))  # no files: the procedural suite, as before
    assert {s.task for s in test} <= {"shapes/count", "shapes/color"} and len(test) == 2


def test_sample_check_rejects_an_answer_its_verifier_cannot_score():
    ok = Sample(id="a", task="t", messages=[], answer="7", reward="number")
    sample_check(ok)
    with pytest.raises(ValueError, match="answer \"seven\" can never score on verifier 'number'"):
        sample_check(Sample(id="b", task="t", messages=[], answer="seven", reward="number"))
    with pytest.raises(KeyError, match="unknown reward"):
        sample_check(Sample(id="c", task="t", messages=[], answer="7", reward="numbr"))


def test_procedural_videos_become_frames_and_a_budget_names_the_sample():
    from vlrl.data.splits import generate_split

    data = DataConfig(suite="shapes", tasks=["video_count"], suite_options={"frames": 4, "image_size": 32})
    samples = generate_split(data, "train", 2)
    assert [s.metadata["video_frames"] for s in samples] == [[4], [4]] and all(len(s.images) == 4 for s in samples)
    thinned = generate_split(data.model_copy(update={"max_frames": 2}), "train", 1)[0]
    assert thinned.images == [samples[0].images[0], samples[0].images[3]]  # frames 0 and 3 of 4 (first and last)
    with pytest.raises(DataError, match=r"shapes sample shapes-train-0-000000: 4 images .* data.max_images = 3"):
        generate_split(data.model_copy(update={"max_images": 3}), "train", 1)

