"""The `Sample` record: one prompt (with its images), its ground truth and how to verify it.

A Sample is what crosses from `vlrl.data` to rollout and SFT. Its jsonl form is documented in the README
("Data format"); `to_json` / `sample_from_json` are the only code that knows that form.

Messages follow the chat format that transformers' chat templates take: a list of
``{"role": "user" | "system" | "assistant", "content": str | list[part]}`` where a part is
``{"type": "text", "text": ...}``, ``{"type": "image"}`` or ``{"type": "video"}``. Image parts are placeholders,
matched in order to ``images``; video parts likewise to ``videos`` (a video file, or a list of frame images),
which `vlrl.data.video.frames_as_images` turns into sampled frames fed as image parts before anything else sees
the sample. A plain ``"prompt"`` string with ``<image>`` markers is accepted on input as a shorthand.
"""

from __future__ import annotations

import base64
import io
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from PIL import Image


@runtime_checkable
class DeferredImage(Protocol):
    """An image that stays where its dataset keeps it until it is used: a row of a memory-mapped Arrow table
    (`vlrl.data.sources.ArrowImage`). `open_image` asks it for its encoded bytes or path at that moment, so
    reading a large dataset decodes no image."""

    def image_source(self) -> str | bytes: ...


# An image source: a path on disk, encoded bytes (PNG/JPEG/...), an already decoded PIL image, or an image read
# from its dataset only when used (`DeferredImage`).
ImageSource = str | bytes | Image.Image | DeferredImage
# A video source: a video file's path (decoded with PyAV), or its frames as a list of image sources.
VideoSource = str | list[ImageSource]

_TAG_PAIR = re.compile(r"<([A-Za-z_]{1,32})></\1>")  # an empty tag pair a prompt asks the answer in: <answer></answer>

IMAGE_MARKER = "<image>"
VIDEO_MARKER = "<video>"
_DATA_URL = re.compile(r"^data:image/[a-zA-Z0-9.+-]+;base64,")


class SampleError(ValueError):
    """A sample that cannot be used; the message names the field (the reader adds file and line)."""


@dataclass
class Sample:
    """One training or evaluation item.

    Attributes:
        id: unique id within its dataset.
        task: free-form task name used to group metrics (e.g. ``"shapes/count"``).
        messages: the prompt as chat messages (no final assistant turn).
        images: one source per ``{"type": "image"}`` part, in order of appearance.
        videos: one source per ``{"type": "video"}`` part, in order of appearance: a video file path or a list of
            frames. Readers replace them by sampled frames (`vlrl.data.video`), so training sees images only.
        answer: the ground truth handed to the verifier (string, number, list, or dict).
        reward: a verifier name (``"number"``) or weights of several (``{"bbox_iou": 0.8, "format": 0.2}``).
        response: a reference response for SFT (the assistant text), or None.
        metadata: anything else; passed to the verifier as keyword arguments under ``meta``.
        answer_format: the form a response must give its answer in (`vlrl.rewards.format.ANSWER_FORMATS`:
            ``answer``, ``think``, ``none``; a jsonl record's ``format``), which strict scoring requires; None: the form the prompt asks
            for (`declared_format`).
        source: ``file:line`` the sample was read from (not serialised), for error messages.
    """

    id: str
    task: str
    messages: list[dict[str, Any]]
    images: list[ImageSource] = field(default_factory=list)
    videos: list[VideoSource] = field(default_factory=list)
    answer: Any = None
    reward: str | dict[str, float] = ""
    response: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    answer_format: str | None = None
    source: str = field(default="", compare=False, repr=False)

    def num_image_parts(self) -> int:
        return sum(1 for m in self.messages for p in content_parts(m) if p.get("type") == "image")

    def num_video_parts(self) -> int:
        return sum(1 for m in self.messages for p in content_parts(m) if p.get("type") == "video")

    def validate(self) -> None:
        """Raise `SampleError` naming the field if the record is inconsistent."""
        if not isinstance(self.id, str) or not self.id:
            raise SampleError("field 'id': must be a non-empty string")
        if not isinstance(self.task, str) or not self.task:
            raise SampleError("field 'task': must be a non-empty string")
        if not isinstance(self.messages, list) or not self.messages:
            raise SampleError("field 'messages': must be a non-empty list of chat messages")
        for i, message in enumerate(self.messages):
            if not isinstance(message, dict) or message.get("role") not in ("system", "user", "assistant", "tool"):
                raise SampleError(f"field 'messages[{i}]': needs a 'role' of system/user/assistant/tool")
            content = message.get("content")
            if not isinstance(content, (str, list)):
                raise SampleError(f"field 'messages[{i}].content': must be a string or a list of parts")
            for j, part in enumerate(content_parts(message)):
                if part.get("type") not in ("text", "image", "video"):
                    raise SampleError(f"field 'messages[{i}].content[{j}].type': must be 'text', 'image' or 'video'")
                if part["type"] == "text" and not isinstance(part.get("text"), str):
                    raise SampleError(f"field 'messages[{i}].content[{j}].text': must be a string")
        if self.num_image_parts() != len(self.images):
            raise SampleError(
                f"field 'images': {len(self.images)} image(s) given but the messages hold "
                f"{self.num_image_parts()} image placeholder(s)"
            )
        if self.num_video_parts() != len(self.videos):
            raise SampleError(
                f"field 'videos': {len(self.videos)} video(s) given but the messages hold "
                f"{self.num_video_parts()} video placeholder(s)"
            )
        for k, video in enumerate(self.videos):
            if isinstance(video, list) and not video:
                raise SampleError(f"field 'videos[{k}]': a list of frames must hold at least one frame")
        if isinstance(self.reward, dict):
            if not self.reward or not all(isinstance(w, (int, float)) for w in self.reward.values()):
                raise SampleError("field 'reward': a dict must map verifier names to numeric weights")
        elif not isinstance(self.reward, str) or not self.reward:
            raise SampleError("field 'reward': must name a verifier (e.g. 'number') or map names to weights")
        if self.answer_format is not None:
            from vlrl.rewards.format import ANSWER_FORMATS  # the forms the scorer checks

            if self.answer_format not in ANSWER_FORMATS:
                raise SampleError(f"field 'format': {self.answer_format!r} is not an answer format "
                                  f"({', '.join(ANSWER_FORMATS)})")

    def declared_format(self) -> str:
        """The answer form strict scoring requires: ``answer_format`` when set, else the one the prompt asks for —
        ``answer`` when it asks for ``<answer></answer>``, ``think`` when it also asks for ``<think></think>``,
        ``none`` when it asks for neither or for other tags too (Syn-GRPO's template: its own verifier reads it)."""
        if self.answer_format is not None:
            return self.answer_format
        tags = set(_TAG_PAIR.findall(self.prompt_text()))
        if "answer" not in tags or tags - {"answer", "think"}:
            return "none"
        return "think" if "think" in tags else "answer"

    def reward_names(self) -> list[str]:
        return list(self.reward) if isinstance(self.reward, dict) else [self.reward]

    def prompt_text(self) -> str:
        """The text of all prompt messages, image parts shown as ``<image>`` (for logs and reports)."""
        out = []
        for m in self.messages:
            markers = {"image": IMAGE_MARKER, "video": VIDEO_MARKER}
            out.append("".join(p["text"] if p["type"] == "text" else markers[p["type"]] for p in content_parts(m)))
        return "\n".join(out)


def content_parts(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat message's content as a list of typed parts (a plain string is one text part)."""
    content = message.get("content")
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return [p if isinstance(p, dict) else {"type": None} for p in (content or [])]


def messages_from_prompt(prompt: str, role: str = "user") -> list[dict[str, Any]]:
    """Turn the shorthand ``"<image>How many ...?"`` into chat messages with image parts."""
    parts: list[dict[str, Any]] = []
    for k, chunk in enumerate(prompt.split(IMAGE_MARKER)):
        if k > 0:
            parts.append({"type": "image"})
        if chunk:
            parts.append({"type": "text", "text": chunk})
    return [{"role": role, "content": parts}]


IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "BMP", "GIF")
"""The image formats vlrl decodes (a JPEG that Pillow reads as ``MPO``, a camera's multi-picture JPEG, counts
as JPEG). Everything else — EPS (Ghostscript), PSD, TIFF, PPM, ... — is refused before any pixel is decoded."""
_PILLOW_FORMATS = (*IMAGE_FORMATS, "MPO")


def open_image(source: ImageSource) -> Image.Image:
    """Open an image source without decoding its pixels, accepting only `IMAGE_FORMATS`; `SampleError` names
    the file and what is wrong (a refused format by name, a missing file, undecodable bytes).

    The one place vlrl opens untrusted images: `load_image` and `image_size` (data files, engines, the rollout
    server's ``image_data``, the synthesis server's jobs) all come through here."""
    if isinstance(source, Image.Image):
        return source
    if isinstance(source, DeferredImage):
        source = source.image_source()
        if isinstance(source, Image.Image):
            return source
    where = source if isinstance(source, str) and not _DATA_URL.match(source) and len(source) < 300 else "<bytes>"
    try:
        if isinstance(source, bytes):
            handle: Any = io.BytesIO(source)
        elif isinstance(source, str) and _DATA_URL.match(source):
            handle = io.BytesIO(base64.b64decode(_DATA_URL.sub("", source, count=1)))
        elif isinstance(source, str):
            if not Path(source).is_file():
                raise SampleError(f"image file not found: {source}")
            handle = open(source, "rb")  # noqa: SIM115  (the image owns it; closed with the image)
        else:
            raise SampleError(f"unsupported image source of type {type(source).__name__}")
    except SampleError:
        raise
    except Exception as err:  # noqa: BLE001  (base64 errors, unreadable files)
        raise SampleError(f"cannot read image {where}: {err}") from err
    try:
        return Image.open(handle, formats=_PILLOW_FORMATS)
    except Exception:  # noqa: BLE001  (not one of ours: name the format if Pillow knows it)
        handle.seek(0)
        try:
            with Image.open(handle) as other:  # header only: nothing of a refused format is decoded
                found = other.format
        except Exception:  # noqa: BLE001
            found = None
        handle.close()
        if found:
            raise SampleError(f"image {where}: format {found} is not accepted (accepted: {', '.join(IMAGE_FORMATS)})") from None
        raise SampleError(f"cannot decode image {where}: not a {', '.join(IMAGE_FORMATS)} image") from None


def load_image(source: ImageSource, *, max_pixels: int | None = None, mode: str = "RGB") -> Image.Image:
    """Decode an image source into a PIL image of ``mode`` (RGB by default), turned upright by its EXIF orientation
    (as a viewer shows it) and, if 16-bit, scaled to 8 bits; raise `SampleError` saying what is wrong. Only
    `IMAGE_FORMATS` are decoded (see `open_image`); with ``max_pixels``, an image with more pixels is refused from
    its header, before its pixels are decoded."""
    if isinstance(source, Image.Image):
        return source if source.mode == mode else source.convert(mode)
    if isinstance(source, DeferredImage):
        source = source.image_source()
    image = open_image(source)
    where = source if isinstance(source, str) and not _DATA_URL.match(source) and len(source) < 300 else "<bytes>"
    try:
        width, height = image.size
        if max_pixels is not None and width * height > max_pixels:
            raise SampleError(f"image {where}: {width}x{height} has more than {max_pixels} pixels")
        turn = _ORIENTATIONS.get(header_orientation(image))
        image.load()
        return _as_mode(image.transpose(turn) if turn is not None else image, mode)
    except SampleError:
        raise
    except Exception as err:  # PIL raises many types for corrupt data
        raise SampleError(f"cannot decode image {where}: {err}") from err
    finally:
        image.close()


def image_size(source: ImageSource) -> tuple[int, int]:
    """(width, height) of an image source as `load_image` gives it — from its header alone (no pixel decoding),
    turned by its EXIF orientation; `SampleError` if unreadable or not one of `IMAGE_FORMATS`."""
    if isinstance(source, Image.Image):
        return source.size
    with open_image(source) as image:
        width, height = image.size
        turned = header_orientation(image) in (5, 6, 7, 8)  # a quarter turn (or a transpose)
        return (height, width) if turned else (width, height)


def header_orientation(image: Image.Image) -> int:
    """The EXIF orientation (1-8) an opened image's header holds, 1 if none — read without decoding a pixel (a
    PNG's ``eXIf`` chunk after its pixels is not looked for: `load_image` and `image_size` agree either way)."""
    raw = image.info.get("exif")
    if not raw:
        return 1
    try:
        exif = Image.Exif()
        exif.load(raw)
        value = exif.get(_EXIF_ORIENTATION, 1)
    except Exception:  # noqa: BLE001  (a broken EXIF block is ignored, as viewers do)
        return 1
    return value if isinstance(value, int) and 1 <= value <= 8 else 1


_EXIF_ORIENTATION = 0x0112
_ORIENTATIONS = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180, 4: Image.Transpose.FLIP_TOP_BOTTOM,
                 5: Image.Transpose.TRANSPOSE, 6: Image.Transpose.ROTATE_270, 7: Image.Transpose.TRANSVERSE,
                 8: Image.Transpose.ROTATE_90}  # as ImageOps.exif_transpose turns them
_WIDE_MODES = {"I;16": 8, "I;16L": 8, "I;16B": 8, "I;16N": 8, "I": 8}  # bits to shift down to 8


def _as_mode(image: Image.Image, mode: str) -> Image.Image:
    """``image`` in ``mode``. A 16-bit grayscale image (PNG's 16-bit depth: Pillow's ``I;16``, or ``I``) is scaled
    to 8 bits first — Pillow's own conversion clips every value over 255 to white."""
    if image.mode in _WIDE_MODES and mode != image.mode:
        import numpy as np

        values = np.asarray(image).astype(np.uint32) >> _WIDE_MODES[image.mode]  # 0..65535 → 0..255
        image = Image.fromarray(np.clip(values, 0, 255).astype(np.uint8), mode="L")
    return image.convert(mode)  # (a new image even in the same mode: `load_image` closes the one it opened)


def image_to_png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def sample_from_json(record: Any, base_dir: Path) -> Sample:
    """Build a Sample from one decoded jsonl object; relative image paths resolve against ``base_dir``."""
    if not isinstance(record, dict):
        raise SampleError(f"expected a JSON object, got {type(record).__name__}")
    known = {"id", "task", "messages", "prompt", "images", "videos", "answer", "reward", "response", "metadata",
             "format"}
    unknown = sorted(set(record) - known)
    if unknown:
        raise SampleError(f"unknown field(s) {unknown}; known fields: {sorted(known)}")
    if "messages" in record and "prompt" in record:
        raise SampleError("give either 'messages' or 'prompt', not both")
    if "messages" in record:
        messages = record["messages"]
    elif isinstance(record.get("prompt"), str):
        messages = messages_from_prompt(record["prompt"])
    else:
        raise SampleError("field 'messages' (or the shorthand 'prompt' string) is required")
    response = record.get("response")
    if (
        response is None
        and isinstance(messages, list)
        and messages
        and isinstance(messages[-1], dict)
        and messages[-1].get("role") == "assistant"
    ):
        # The common SFT layout: the last assistant turn is the reference response.
        last = messages[-1]
        messages = messages[:-1]
        response = last["content"] if isinstance(last.get("content"), str) else "".join(
            p.get("text", "") for p in content_parts(last)
        )
    images = [_image_source(image, base_dir, f"images[{k}]") for k, image in enumerate(record.get("images") or [])]
    videos: list[VideoSource] = []
    for k, video in enumerate(record.get("videos") or []):
        if isinstance(video, list):
            videos.append([_image_source(frame, base_dir, f"videos[{k}][{f}]") for f, frame in enumerate(video)])
        elif isinstance(video, str) and not _DATA_URL.match(video):
            videos.append(_resolve(video, base_dir))
        else:
            raise SampleError(f"field 'videos[{k}]': expected a video file path or a list of frame images")
    if "id" not in record:
        raise SampleError("field 'id' is required")
    sample = Sample(
        id=str(record["id"]),
        task=record.get("task", ""),
        messages=messages,
        images=images,
        videos=videos,
        answer=record.get("answer"),
        reward=record.get("reward", ""),
        response=response,
        metadata=record.get("metadata") or {},
        answer_format=record.get("format"),
    )
    sample.validate()
    return sample


def _resolve(path: str, base_dir: Path) -> str:
    return str(Path(path) if Path(path).is_absolute() else base_dir / path)


def _image_source(image: Any, base_dir: Path, name: str) -> ImageSource:
    """One image of a jsonl record: a path (relative ones resolve against ``base_dir``) or a data URL; a source a
    dataset reader already resolved (encoded bytes, a PIL image, a `DeferredImage`) passes through."""
    if isinstance(image, (bytes, Image.Image, DeferredImage)):
        return image
    if isinstance(image, str):
        return image if _DATA_URL.match(image) else _resolve(image, base_dir)
    raise SampleError(f"field '{name}': expected a path or a data:image/...;base64 URL")


def sample_to_json(sample: Sample, image_paths: list[str], video_paths: list[Any] | None = None) -> dict[str, Any]:
    """The jsonl object for ``sample`` with its images already written at ``image_paths`` (relative), and its
    videos at ``video_paths`` (a file path, or a list of frame paths, per video)."""
    record: dict[str, Any] = {
        "id": sample.id,
        "task": sample.task,
        "messages": sample.messages,
        "images": image_paths,
        **({"videos": video_paths} if video_paths else {}),
        "answer": sample.answer,
        "reward": sample.reward,
    }
    if sample.response is not None:
        record["response"] = sample.response
    if sample.metadata:
        record["metadata"] = sample.metadata
    if sample.answer_format is not None:
        record["format"] = sample.answer_format
    return record
