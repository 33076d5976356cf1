"""Videos as sampled frames, and the per-sample media budgets.

vlrl feeds a video to the model as its sampled frames, each an ordinary image part: every family that takes
several images then takes video, and training is exact by construction (frames-as-images is a valid input of
every such model, and the sampler and the trainer see the same images). Native video tokens (Qwen's temporal
patch merge, ``pixel_values_videos``) are not used: transformers' video processors need torchvision.

`frames_as_images` is the one place a sample's ``videos`` become images: the readers (`read_samples`) and the
procedural suites' loader (`vlrl.data.splits.load_split`) call it through `prepare_media`, so every room after
`vlrl.data` sees images only. Frames:

- a video file (``"clip.mp4"``, decoded with PyAV — ``pip install 'vlrl[video]'``): one frame every
  ``1 / video_fps`` seconds from the start; a clip that would give more than ``max_frames`` gives ``max_frames``
  frames spread evenly over its whole duration;
- a list of frame images: taken as already sampled; more than ``max_frames`` are thinned to ``max_frames``
  evenly spaced ones (first and last kept).

The budgets (`MediaLimits`) refuse, with a message naming the field, a sample with too many images (frames
count), an image with too many pixels (read from its header, before decoding), or too many pixels in all.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from PIL import Image

from vlrl.data.sample import ImageSource, Sample, SampleError, VideoSource, content_parts, image_size


@dataclass(frozen=True)
class MediaLimits:
    """How videos are sampled and what one sample may hold (the ``data.*`` fields of the same names)."""

    video_fps: float = 2.0
    max_frames: int = 8
    max_images: int | None = 32
    max_image_pixels: int | None = 16 << 20  # `vlrl serve`'s --max-image-pixels
    max_sample_pixels: int | None = 128 << 20  # `vlrl serve`'s --max-request-pixels
    max_record_bytes: int = 64 << 20  # one jsonl line / parquet row, checked by the reader while it reads
    max_source_bytes: int = 1 << 30  # the text of one source once decoded, checked before (or while) it is read


def prepare_media(sample: Sample, limits: MediaLimits) -> Sample:
    """``sample`` with its videos turned into frame images (`frames_as_images`), then checked against the
    budgets (`check_budgets`); raises `SampleError` naming the field."""
    sample = frames_as_images(sample, fps=limits.video_fps, max_frames=limits.max_frames)
    check_budgets(sample, limits)
    return sample


def frames_as_images(sample: Sample, *, fps: float, max_frames: int) -> Sample:
    """A copy of ``sample`` whose every ``{"type": "video"}`` part is replaced by one ``{"type": "image"}`` part per
    sampled frame, the frames inserted into ``images`` at that place; ``metadata["video_frames"]`` records the
    frames taken per video. A sample without videos is returned unchanged."""
    if not sample.videos:
        return sample
    sources = iter(sample.images)
    videos = iter(enumerate(sample.videos))
    images: list[ImageSource] = []
    taken: list[int] = []
    messages = []
    for message in sample.messages:
        if isinstance(message.get("content"), str):
            messages.append(message)
            continue
        content = []
        for part in content_parts(message):
            if part.get("type") == "image":
                images.append(next(sources))
                content.append(part)
            elif part.get("type") == "video":
                k, video = next(videos)
                try:
                    frames = sample_frames(video, fps=fps, max_frames=max_frames)
                except SampleError as err:
                    raise SampleError(f"field 'videos[{k}]': {err}") from err
                images.extend(frames)
                taken.append(len(frames))
                content.extend({"type": "image"} for _ in frames)
            else:
                content.append(part)
        messages.append({**message, "content": content})
    return replace(sample, messages=messages, images=images, videos=[],
                   metadata={**sample.metadata, "video_frames": taken})


def sample_frames(video: VideoSource, *, fps: float, max_frames: int) -> list[ImageSource]:
    """The frames vlrl feeds for one video (see the module docstring for the rule)."""
    if isinstance(video, list):
        return [video[i] for i in _even_indices(len(video), max_frames)]
    return decode_video(video, fps=fps, max_frames=max_frames)


def _even_indices(n: int, m: int) -> list[int]:
    """``min(n, m)`` indices in ``0..n-1`` spread evenly, first and last included (n=10, m=4: 0, 3, 6, 9)."""
    if n <= m:
        return list(range(n))
    if m == 1:
        return [0]
    return [round(k * (n - 1) / (m - 1)) for k in range(m)]


def sample_times(duration: float, *, fps: float, max_frames: int) -> list[float]:
    """Seconds at which frames are taken from a clip of ``duration`` seconds: every ``1 / fps`` from 0, or, when
    that gives more than ``max_frames``, ``max_frames`` times spread evenly (``k · duration / max_frames``).
    E.g. 3 s at 2 fps: 0, 0.5, …, 2.5 (6 frames); 10 s at 2 fps, max 4: 0, 2.5, 5, 7.5."""
    count = max(1, int(duration * fps + 1e-9))
    if count <= max_frames:
        return [k / fps for k in range(count)]
    return [k * duration / max_frames for k in range(max_frames)]


def decode_video(path: str, *, fps: float, max_frames: int) -> list[Image.Image]:
    """Decode the frames of the video file at ``path`` shown at `sample_times` (the frame on screen at each
    time: the last one starting at or before it) as RGB images, with PyAV; `SampleError` names the file."""
    try:
        import av
    except ImportError as err:
        raise SampleError(f"video {path}: decoding video files needs PyAV: pip install 'vlrl[video]'") from err
    try:
        with av.open(path) as container:
            if not container.streams.video:
                raise SampleError(f"video {path}: no video stream")
            stream = container.streams.video[0]
            duration = _duration(container, stream)
            if duration is None:  # no duration in the header: a first pass reads the frame times
                duration = max(frame.time or 0.0 for frame in container.decode(stream)) + 1 / float(stream.average_rate or 1)
                container.seek(0)
            return _frames_at(container.decode(stream), sample_times(duration, fps=fps, max_frames=max_frames))
    except SampleError:
        raise
    except FileNotFoundError:
        raise SampleError(f"video file not found: {path}") from None
    except Exception as err:  # noqa: BLE001  (PyAV raises its own error types for corrupt or unknown files)
        raise SampleError(f"cannot decode video {path}: {err}") from err


def _duration(container: Any, stream: Any) -> float | None:
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:
        return container.duration / 1_000_000  # av.time_base
    return None


def _frames_at(frames: Any, times: list[float]) -> list[Image.Image]:
    """From decoded ``frames`` (in order), the one on screen at each of ``times`` (ascending)."""
    picked: list[Image.Image] = []
    previous = None
    for frame in frames:
        start = frame.time if frame.time is not None else 0.0
        while len(picked) < len(times) and previous is not None and start > times[len(picked)] + 1e-6:
            picked.append(previous.to_image().convert("RGB"))  # `previous` was on screen at that time
        if len(picked) == len(times):
            break
        previous = frame
    while previous is not None and len(picked) < len(times):  # times within the last frame's display
        picked.append(previous.to_image().convert("RGB"))
    if not picked:
        raise SampleError("no frames decoded")
    return picked


def check_budgets(sample: Sample, limits: MediaLimits) -> None:
    """Refuse a sample over a budget, naming the ``data.*`` field: more than ``max_images`` images (video frames
    included), an image over ``max_image_pixels`` or images over ``max_sample_pixels`` in all (sizes from the
    headers; nothing is decoded)."""
    if limits.max_images is not None and len(sample.images) > limits.max_images:
        raise SampleError(f"{len(sample.images)} images (video frames included) exceed data.max_images = {limits.max_images}")
    if limits.max_image_pixels is None and limits.max_sample_pixels is None:
        return
    total = 0
    for k, image in enumerate(sample.images):
        try:
            width, height = image_size(image)
        except SampleError as err:
            raise SampleError(f"field 'images[{k}]': {err}") from err
        if limits.max_image_pixels is not None and width * height > limits.max_image_pixels:
            raise SampleError(f"field 'images[{k}]': {width}x{height} = {width * height} pixels exceed "
                              f"data.max_image_pixels = {limits.max_image_pixels}")
        total += width * height
    if limits.max_sample_pixels is not None and total > limits.max_sample_pixels:
        raise SampleError(f"{len(sample.images)} images hold {total} pixels in all, over data.max_sample_pixels = "
                          f"{limits.max_sample_pixels}")
