"""Videos as sampled frames (`vlrl.data.video`): frame sampling from a file written with PyAV and from frame
lists, where the frames land among a sample's images, the per-sample budgets, and the jsonl round trip."""

import json

import av
import pytest
from PIL import Image

from vlrl.data import DataError, MediaLimits, Sample, generate, prepare_media, read_samples, write_samples
from vlrl.data.sample import SampleError
from vlrl.data.video import _even_indices, decode_video, frames_as_images, sample_times


def write_mp4(path, frames, fps: int) -> None:
    """A clip of ``frames`` (PIL images) at ``fps`` frames per second, MPEG-4 in an .mp4."""
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height = frames[0].size
        stream.pix_fmt = "yuv420p"
        for image in frames:
            for packet in stream.encode(av.VideoFrame.from_image(image)):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def grey_ramp(n: int, size: int = 32) -> list[Image.Image]:
    """Frame k is a flat grey of level 40·k, so a decoded frame tells which source frame it is (±codec noise)."""
    return [Image.new("RGB", (size, size), (40 * k,) * 3) for k in range(n)]


def frame_number(image: Image.Image) -> int:
    return round(image.getpixel((8, 8))[0] / 40)


def test_sample_times_every_1_over_fps_or_max_frames_spread_over_the_clip():
    assert sample_times(3.0, fps=2, max_frames=8) == [0, 0.5, 1.0, 1.5, 2.0, 2.5]
    assert sample_times(10.0, fps=2, max_frames=4) == [0, 2.5, 5.0, 7.5]  # 20 frames at 2 fps > 4: k·10/4
    assert sample_times(0.2, fps=2, max_frames=4) == [0]  # a clip shorter than one period still gives a frame
    assert _even_indices(10, 4) == [0, 3, 6, 9]  # round(k·9/3)
    assert _even_indices(3, 8) == [0, 1, 2]


def test_decode_an_mp4_written_with_pyav(tmp_path):
    # 6 frames at 2 fps = 3 s; frame k is on screen during [k/2, (k+1)/2)
    write_mp4(tmp_path / "clip.mp4", grey_ramp(6), fps=2)
    clip = str(tmp_path / "clip.mp4")
    assert [frame_number(f) for f in decode_video(clip, fps=2, max_frames=8)] == [0, 1, 2, 3, 4, 5]
    assert [frame_number(f) for f in decode_video(clip, fps=1, max_frames=8)] == [0, 2, 4]  # t = 0, 1, 2 s
    # 4 fps would give 12 > max 5: t = k·3/5 = 0, 0.6, 1.2, 1.8, 2.4 s → frames 0, 1, 2, 3, 4
    assert [frame_number(f) for f in decode_video(clip, fps=4, max_frames=5)] == [0, 1, 2, 3, 4]
    assert all(f.mode == "RGB" and f.size == (32, 32) for f in decode_video(clip, fps=2, max_frames=2))


def test_bad_video_files_name_the_file(tmp_path):
    with pytest.raises(SampleError, match="video file not found: .*nope.mp4"):
        decode_video(str(tmp_path / "nope.mp4"), fps=1, max_frames=2)
    (tmp_path / "junk.mp4").write_bytes(b"not a video")
    with pytest.raises(SampleError, match="cannot decode video .*junk.mp4"):
        decode_video(str(tmp_path / "junk.mp4"), fps=1, max_frames=2)


def test_video_parts_become_image_parts_in_place():
    a, b = Image.new("RGB", (8, 8), "red"), Image.new("RGB", (8, 8), "blue")
    frames = grey_ramp(5, size=8)
    sample = Sample(id="s", task="t", reward="number", answer="1",
                    messages=[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "then"},
                                                            {"type": "video"}, {"type": "image"}]}],
                    images=[a, b], videos=[frames])
    sample.validate()
    out = frames_as_images(sample, fps=2, max_frames=3)
    # 5 frames thinned to 3: indices round(k·4/2) = 0, 2, 4, placed between the two images
    assert out.images == [a, frames[0], frames[2], frames[4], b]
    assert [p["type"] for p in out.messages[0]["content"]] == ["image", "text", "image", "image", "image", "image"]
    assert out.videos == [] and out.metadata["video_frames"] == [3]
    out.validate()
    assert sample.videos == [frames] and len(sample.images) == 2  # the input is not modified


def test_the_video_placeholder_count_is_checked():
    sample = Sample(id="s", task="t", reward="number", messages=[{"role": "user", "content": [{"type": "video"}]}])
    with pytest.raises(SampleError, match="field 'videos': 0 video"):
        sample.validate()


def _video_line(tmp_path, **fields):
    record = {"id": "v", "task": "t", "prompt": "How many?", "answer": "1", "reward": "number",
              "messages": [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "How many?"}]}]}
    record.pop("prompt")
    record.update(fields)
    return json.dumps(record)


def test_read_a_jsonl_with_a_video_file_and_a_frame_list(tmp_path):
    write_mp4(tmp_path / "clip.mp4", grey_ramp(6), fps=2)
    for k, frame in enumerate(grey_ramp(3)):
        frame.save(tmp_path / f"f{k}.png")
    path = tmp_path / "d.jsonl"
    path.write_text(_video_line(tmp_path, id="file", videos=["clip.mp4"]) + "\n"
                    + _video_line(tmp_path, id="frames", videos=[["f0.png", "f1.png", "f2.png"]]) + "\n")
    by_id = {s.id: s for s in read_samples(path, media=MediaLimits(video_fps=1, max_frames=8)).samples}
    assert [frame_number(f) for f in by_id["file"].images] == [0, 2, 4]  # 3 s at 1 fps
    assert by_id["frames"].images == [str(tmp_path / f"f{k}.png") for k in range(3)]
    assert all(s.num_image_parts() == len(s.images) and not s.videos for s in by_id.values())


def test_budgets_name_the_line_or_skip_and_count(tmp_path):
    big = Image.new("RGB", (64, 64))
    big.save(tmp_path / "big.png")
    for k, frame in enumerate(grey_ramp(4)):
        frame.save(tmp_path / f"f{k}.png")
    frames = [f"f{k}.png" for k in range(4)]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join([
        _video_line(tmp_path, id="ok", videos=[frames[:2]]),
        _video_line(tmp_path, id="many", videos=[frames]),  # 4 frames > max_images 3
        json.dumps({"id": "huge", "task": "t", "prompt": "<image>?", "images": ["big.png"], "answer": "1",
                    "reward": "number"}),  # 64·64 = 4096 > 2000 pixels
        _video_line(tmp_path, id="sum", videos=[frames[:3]]),  # 3 · 32·32 = 3072 > 3000 in all
    ]) + "\n")
    limits = MediaLimits(max_frames=8, max_images=3, max_image_pixels=2000, max_sample_pixels=3000)
    with pytest.raises(DataError, match=r"d\.jsonl:2: 4 images \(video frames included\) exceed data.max_images = 3"):
        read_samples(path, media=limits)
    report = read_samples(path, media=limits, on_error="skip")
    assert [s.id for s in report.samples] == ["ok"]
    assert [w for w, _ in report.skipped] == [f"{path}:2", f"{path}:3", f"{path}:4"]
    assert "64x64 = 4096 pixels exceed data.max_image_pixels = 2000" in report.skipped[1][1]
    assert "3072 pixels in all, over data.max_sample_pixels = 3000" in report.skipped[2][1]
    # frames are thinned to max_frames before the budget: 4 frames, max_frames 2 → 2 images ≤ max_images 3, and
    # without pixel budgets every record is kept
    kept = read_samples(path, media=MediaLimits(max_frames=2, max_images=3)).samples
    assert [len(s.images) for s in kept] == [2, 2, 1, 2]


def test_shapes_video_count_written_and_read_back(tmp_path):
    samples = generate("shapes", 4, tasks=["video_count"], image_size=32, frames=3)
    for sample in samples:
        shown = sum(1 for o in sample.metadata["objects"])
        assert sample.answer == str(shown) and len(sample.videos[0]) == 3
        assert {o["frame"] for o in sample.metadata["objects"]} <= {0, 1, 2}
    path = write_samples(samples, tmp_path / "train.jsonl")
    assert json.loads(path.read_text().splitlines()[0])["videos"] == [[f"images/shapes-train-0-000000_v0_{f}.png"
                                                                       for f in range(3)]]
    back = read_samples(path).samples
    expected = [prepare_media(s, MediaLimits()) for s in samples]
    assert [s.answer for s in back] == [s.answer for s in samples]
    assert [len(s.images) for s in back] == [3] * 4 and back[0].messages == expected[0].messages
    assert Image.open(back[0].images[1]).convert("RGB").tobytes() == samples[0].videos[0][1].tobytes()
    with pytest.raises(DataError, match="videos are written to .jsonl"):
        write_samples(samples, tmp_path / "train.parquet")
