import pytest

from vlrl.data import generate
from vlrl.data.tasks.shapes import COLORS
from vlrl.registry import RegistryError
from vlrl.rewards import compose


def test_generation_is_deterministic_and_splits_differ():
    a = generate("shapes", 12, split="train", seed=3)
    b = generate("shapes", 12, split="train", seed=3)
    c = generate("shapes", 12, split="test", seed=3)
    assert [s.answer for s in a] == [s.answer for s in b]
    assert a[0].images[0].tobytes() == b[0].images[0].tobytes()
    assert [s.metadata for s in a] != [s.metadata for s in c]


@pytest.mark.parametrize("suite", ["shapes", "arith", "embodied"])
def test_reference_responses_earn_full_reward(suite):
    for sample in generate(suite, 40):
        out = compose(sample.response, sample.answer, sample.reward, sample.metadata)
        assert out.overall == pytest.approx(1.0), (sample.id, sample.response, sample.answer)
        assert out.parts["accuracy"] == 1.0


def test_shapes_answers_match_the_drawing():
    for sample in generate("shapes", 40, tasks=["count", "color", "locate"]):
        objects = sample.metadata["objects"]
        image = sample.images[0]
        if sample.task == "shapes/count":
            assert int(sample.answer) == len(objects)
        for obj in objects:  # the centre pixel of every shape has the shape's colour
            x1, y1, x2, y2 = obj["box"]
            assert image.getpixel(((x1 + x2) // 2, (y1 + 2 * y2) // 3)) == COLORS[obj["color"]]
        if sample.task == "shapes/locate":
            kinds = [o["kind"] for o in objects]
            target = next(o for o in objects if kinds.count(o["kind"]) == 1 and o["box"] == sample.answer)
            assert target["kind"] in sample.prompt_text()


def test_unknown_suite_and_task():
    with pytest.raises(RegistryError, match="unknown task suite"):
        generate("nope", 1)
    with pytest.raises(ValueError, match="unknown task"):
        generate("shapes", 1, tasks=["juggle"])
