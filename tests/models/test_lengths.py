"""Token counts from image headers equal what SFT encodes, at native resolution."""

from PIL import Image

from vlrl.data import generate
from vlrl.data.sample import image_size
from vlrl.models.lengths import TokenCounter
from vlrl.models.policy import load_processor, set_pixel_bounds
from vlrl.train.sft import encode_sft


def _varied_sizes(samples):
    sizes = [(112, 112), (300, 200), (57, 500), (640, 480), (29, 31)]
    for k, sample in enumerate(samples):
        sample.images = [Image.new("RGB", sizes[k % len(sizes)], (k * 40 % 255, 90, 200))]
    return samples


def test_counts_equal_encoded_lengths_at_native_resolution(tiny_vlm):
    set_pixel_bounds(tiny_vlm.image_processor, 56 * 56, 448 * 448)
    counter = TokenCounter(tiny_vlm)
    samples = _varied_sizes(generate("shapes", 10, tasks=["count", "color", "locate", "ocr"]))
    for sample in samples:
        example = encode_sft(tiny_vlm, sample)
        assert counter(sample) == (len(example.prompt_ids), example.length)
    # the image tokens vary with the size. 640 × 480 = 307,200 px > 448² = 200,704: scale by β = √(307200 / 200704)
    # = 1.2372, round down to multiples of 28: 480 / β = 388 → 364, 640 / β = 517 → 504; (364 / 14)(504 / 14) / 2²
    # = 26 · 36 / 4 = 234 tokens. 112 × 112 → (8 · 8) / 4 = 16 tokens.
    assert tiny_vlm.adapter.image_token_count(640, 480) == 234
    assert tiny_vlm.adapter.image_token_count(112, 112) == 16


def test_text_model_counts(tiny_lm):
    counter = TokenCounter(tiny_lm)
    for sample in generate("arith", 4):
        assert counter(sample)[1] == encode_sft(tiny_lm, sample).length


def test_processor_without_weights_counts_the_same(tiny_vlm, tmp_path):
    """A saved checkpoint's processor, loaded without weights (meta device), counts as the live policy."""
    set_pixel_bounds(tiny_vlm.image_processor, 3136, 200_000)
    tiny_vlm.save(tmp_path / "ckpt")
    processor = load_processor(str(tmp_path / "ckpt"))
    assert next(processor.model.parameters()).device.type == "meta"
    samples = _varied_sizes(generate("shapes", 5))
    assert [TokenCounter(processor)(s) for s in samples] == [TokenCounter(tiny_vlm)(s) for s in samples]


def test_image_size_reads_the_header(tmp_path):
    path = tmp_path / "a.png"
    Image.new("RGB", (37, 21)).save(path)
    assert image_size(str(path)) == (37, 21) and image_size(path.read_bytes()) == (37, 21)
