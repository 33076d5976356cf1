"""Issue 47, item 5 and the image items: pixel bounds from the headers on the data path by default (the server's),
16-bit PNGs and EXIF orientation read as a viewer shows them. Small files: a 1-bit PNG of 4500² compresses to ~3 KB."""

from __future__ import annotations

import io
import json

import numpy as np
from PIL import Image
from typer.testing import CliRunner

from vlrl.cli import app
from vlrl.data import read_samples
from vlrl.data.sample import image_size, load_image


def test_vlrl_check_refuses_a_pixel_bomb_from_its_header_by_default(tmp_path):
    """Before: the data path had no pixel limit by default (only Pillow's bomb check, which a 1-bit 12000² image is
    under): a 17.6 KB PNG named 6 times in one sample took > 5.9 GB in `vlrl check`. Now data.max_image_pixels
    defaults to the server's 16,777,216 and the image is refused from its header."""
    Image.new("1", (4500, 4500)).save(tmp_path / "bomb.png")
    assert (tmp_path / "bomb.png").stat().st_size < 10_000
    record = {"id": "q0", "task": "t", "prompt": "<image>" * 6 + "What is it?", "images": ["bomb.png"] * 6,
              "answer": "4", "reward": "string_match"}
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps(record) + "\n")
    config = tmp_path / "rl.yaml"
    config.write_text(f"model: {{path: tiny-qwen2-vl}}\ndata: {{train: {data}, test: {data}}}\n"
                      "check: {samples_per_task: 1}\n")
    result = CliRunner().invoke(app, ["check", str(config), "--recipe", "rl"])
    problems = [line for line in result.output.splitlines() if line.startswith("  ✗")]
    assert result.exit_code == 1 and problems[0] == (f"  ✗ {data}:1: field 'images[0]': 4500x4500 = 20250000 pixels "
                                                     "exceed data.max_image_pixels = 16777216"), result.output
    # and per sample: nine images each within the per-image bound, over the sample's 128 Mi pixels in all
    Image.new("1", (4096, 4096)).save(tmp_path / "bomb.png")
    record["images"], record["prompt"] = ["bomb.png"] * 9, "<image>" * 9
    data.write_text(json.dumps(record) + "\n")
    report = read_samples(data, on_error="skip")
    assert report.skipped == [(f"{data}:1", "9 images hold 150994944 pixels in all, over data.max_sample_pixels = "
                                            "134217728")]


def test_a_16_bit_png_is_scaled_to_8_bits_not_clipped_to_white(tmp_path):
    """Before: Pillow's I;16 → RGB conversion clipped every value over 255, so a 16-bit PNG became white."""
    ramp = (np.arange(16, dtype=np.uint16).reshape(4, 4) * 4096 + 255)  # 255 .. 61695
    buffer = io.BytesIO()
    Image.fromarray(ramp).save(buffer, format="PNG")
    decoded = np.asarray(load_image(buffer.getvalue()))
    assert decoded.shape == (4, 4, 3)
    assert (decoded[..., 0] == (ramp >> 8)).all() and (decoded[..., 0] == decoded[..., 2]).all()
    assert decoded[0, 0, 0] == 0 and decoded[3, 3, 0] == 240  # not 255 everywhere


def test_exif_orientation_turns_the_image_and_its_header_size(tmp_path):
    """A phone photo stored landscape with EXIF orientation 6 (show it turned 90° clockwise) is portrait: the
    decoded pixels and the size the token count is made from (read from the header) agree."""
    pixels = np.zeros((10, 20, 3), np.uint8)
    pixels[:, :10] = (255, 0, 0)  # stored: left half red
    exif = Image.Exif()
    exif[0x0112] = 6
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG", exif=exif.tobytes(), quality=95)
    raw = buffer.getvalue()
    image = load_image(raw)
    assert image.size == (10, 20) == image_size(raw)
    top, bottom = np.asarray(image)[2, 5], np.asarray(image)[17, 5]
    assert top[0] > 200 and top[1] < 60 and bottom[0] < 60  # turned clockwise: the red half is on top
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")  # no EXIF, already RGB: a usable image all the same
    plain = load_image(buffer.getvalue())
    assert plain.size == (20, 10) and np.array_equal(np.asarray(plain), pixels)
