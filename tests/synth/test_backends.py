"""Generator back-ends and segmenters: every one leaves the preserved foreground pixel-exact."""

import numpy as np
import pytest

from vlrl.registry import RegistryError
from vlrl.synth.backends import boxes_mask, get_generator, synthesize
from vlrl.synth.segment import get_segmenter
from vlrl.synth.textures import parse_description, texture_for

from . import fakes
from .conftest import shapes_scene


def test_boxes_cover_every_pixel_they_touch():
    keep = boxes_mask((6, 8), [[1.5, 0, 3, 2.2], [7, 5, 8, 6]])
    # x 1.5..3 → columns 1, 2; y 0..2.2 → rows 0, 1, 2; the second box is the bottom-right pixel
    expected = np.zeros((6, 8), dtype=bool)
    expected[0:3, 1:3] = True
    expected[5, 7] = True
    assert (keep == expected).all()


def test_descriptions_steer_the_texture_and_are_deterministic():
    spec = parse_description("A red striped wall")
    assert spec.pattern == "stripes" and spec.palette[0] == (200, 40, 40)
    assert spec.keywords == ("red", "striped", "wall")
    assert parse_description("grassy night").dark and parse_description("busy city").busy
    assert parse_description("ocean").pattern == "waves" and parse_description("oceans").pattern == "waves"
    one, _ = texture_for("foggy harbour", (40, 50), seed=1)
    assert one.shape == (40, 50, 3) and 0 <= one.min() and one.max() <= 1
    assert np.array_equal(one, texture_for("foggy harbour", (40, 50), seed=1)[0])
    assert not np.array_equal(one, texture_for("foggy harbour", (40, 50), seed=2)[0])
    assert not np.array_equal(one, texture_for("quiet meadow", (40, 50), seed=1)[0])
    dark, _ = texture_for("dark red", (20, 20), seed=0)
    bright, _ = texture_for("bright red", (20, 20), seed=0)
    assert dark.mean() < bright.mean()


@pytest.mark.parametrize("description", ["a striped blue background", "dark busy city street at night", "xyzzy quux"])
def test_classical_keeps_the_boxes_pixel_exact_and_rebuilds_the_rest(description):
    image, boxes = shapes_scene(seed=3)
    keep = boxes_mask(image.shape[:2], boxes)
    out, meta = synthesize(get_generator("classical"), image, keep, description, seed=7)
    assert out.shape == image.shape and out.dtype == np.uint8
    assert np.array_equal(out[keep], image[keep])
    assert meta["background_changed_fraction"] > 0.9 and meta["backend"] == "classical"
    again, _ = synthesize(get_generator("classical"), image, keep, description, seed=7)
    assert np.array_equal(out, again)  # same inputs and seed → same image


def test_classical_on_a_large_photo_like_image():
    rng = np.random.default_rng(0)
    image = (rng.random((300, 448, 3)) * 255).astype(np.uint8)
    keep = boxes_mask((300, 448), [[10.5, 20, 140, 200], [400, 250, 448, 300]])
    out, _ = synthesize(get_generator("classical", outpaint_weight=0.8), image, keep, "sandy beach", seed=0)
    assert np.array_equal(out[keep], image[keep]) and (out[~keep] != image[~keep]).any(axis=-1).mean() > 0.9


def test_a_back_end_that_breaks_the_shape_is_refused():
    image, boxes = shapes_scene()
    with pytest.raises(ValueError, match="expected"):
        synthesize(get_generator(f"{fakes.__name__}:make_resizer"), image, boxes_mask(image.shape[:2], boxes), "x", seed=0)
    with pytest.raises(RegistryError, match="classical"):
        get_generator("nonexistent")


def test_a_back_end_that_paints_over_the_foreground_gets_it_pasted_back():
    image, boxes = shapes_scene()
    keep = boxes_mask(image.shape[:2], boxes)
    out, _ = synthesize(get_generator(f"{fakes.__name__}:make_sleeper"), image, keep, "invert", seed=0)
    assert np.array_equal(out[keep], image[keep]) and np.array_equal(out[~keep], 255 - image[~keep])


def test_diffusers_tiny_pipeline_on_cpu_keeps_the_foreground(tiny_inpaint_dir):
    image, boxes = shapes_scene(seed=5)
    image = image[:, :100]  # not a multiple of 8: resized for the pipeline and back
    keep = boxes_mask(image.shape[:2], [b for b in boxes if b[2] <= 100] or [[0, 0, 20, 20]])
    generator = get_generator("diffusers", model_path=tiny_inpaint_dir, steps=2)
    out, meta = synthesize(generator, image, keep, "a red barn in the snow", seed=1)
    assert out.shape == image.shape
    assert np.array_equal(out[keep], image[keep])
    assert meta["pipeline"] == "StableDiffusionInpaintPipeline" and meta["size"] == [96, 112]
    assert (out[~keep] != image[~keep]).any(axis=-1).mean() > 0.5  # the random model repainted the background
    with pytest.raises(ValueError, match="model_path"):
        get_generator("diffusers")


def test_border_segmenter_refines_boxes_to_the_shapes_and_stays_inside_them():
    image, boxes = shapes_scene(seed=3)
    box_keep = boxes_mask(image.shape[:2], boxes)
    keep, meta = get_segmenter("border").refine(image, boxes)
    assert not (keep & ~box_keep).any()  # inside the boxes
    coloured = (image != 255).any(axis=-1) & box_keep  # every shape pixel (the background is white)
    assert (keep[coloured]).all()
    assert keep.sum() < box_keep.sum()  # the white corners of circles and triangles are released
    out, _ = synthesize(get_generator("classical"), image, keep, "grass", seed=0)
    assert np.array_equal(out[keep], image[keep])


def test_border_segmenter_falls_back_to_the_box_when_it_finds_nothing():
    image = np.full((20, 20, 3), 255, dtype=np.uint8)
    keep, meta = get_segmenter("border").refine(image, [[2, 2, 10, 10]])
    assert meta["segmenter_fallbacks"] == 1 and keep.sum() == 64


def test_model_segmenter_from_a_local_directory(tiny_segformer_dir):
    image, boxes = shapes_scene(seed=1)
    segmenter = get_segmenter("model", path=tiny_segformer_dir, threshold=0.5)
    keep, meta = segmenter.refine(image, boxes)
    box_keep = boxes_mask(image.shape[:2], boxes)
    assert not (keep & ~box_keep).any() and keep.any()
    assert 0 < meta["refined_fraction"] <= 1
    out, _ = synthesize(get_generator("classical"), image, keep, "stone", seed=0)
    assert np.array_equal(out[keep], image[keep])
    with pytest.raises(ValueError, match="path"):
        get_segmenter("model")
