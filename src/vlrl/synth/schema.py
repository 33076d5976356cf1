"""The synthesis server's settings and requests (`vlrl.synth.server`): `SynthSettings` (its limits and back-ends), the
``POST /jobs`` body (`JobBody`), its checks against the settings (`parse_job`, `decode_image`, `check_boxes`) and the
two errors the server answers with (`BadRequest` → 400, `QueueFull` → 429).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from vlrl.data.sample import SampleError, image_size, load_image


@dataclasses.dataclass
class SynthSettings:
    """Everything `SynthService` needs (the CLI flags of `vlrl synth serve`).

    Attributes:
        backend / backend_options: generator back-end (``classical``, ``diffusers`` or ``pkg.mod:factory``) and
            its keyword options (e.g. ``{"model_path": ...}`` for diffusers).
        segmenter / segmenter_options: optional box → mask refinement (``border``, ``model``; None = boxes).
        workers: jobs run at once. executor: ``process`` (killable timeouts) or ``thread``.
        max_queued_jobs: accepted jobs waiting for a worker; more get 429.
        max_queued_per_client: queued jobs one client (token + address, + process on loopback) may hold; more get
            429. None: a quarter of ``max_queued_jobs`` (at least 1).
        job_timeout: seconds one job may run.
        results_dir: where result PNGs go (None: a temporary directory removed at shutdown).
        max_results_bytes: size cap of the results; the oldest are deleted beyond it.
        max_jobs: finished jobs remembered (older ones are forgotten: 404).
        max_image_side / min_image_side / max_image_pixels / max_boxes / max_masks / max_description_chars /
        max_body_bytes: input limits (400 / 413 beyond them; the body limit counts the bytes received, so it holds
        for chunked bodies too).
        drain_seconds: on SIGTERM, HTTP requests in flight get this long before they are cancelled; queued jobs
        then fail with "the server shut down".
    """

    backend: str = "classical"
    backend_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    segmenter: str | None = None
    segmenter_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    workers: int = 1
    executor: Literal["process", "thread"] = "process"
    max_queued_jobs: int = 64
    max_queued_per_client: int | None = None
    job_timeout: float = 60.0
    results_dir: str | None = None
    max_results_bytes: int = 512 << 20
    max_jobs: int = 10_000
    max_image_side: int = 4096
    min_image_side: int = 8
    max_image_pixels: int = 16 << 20
    max_boxes: int = 256
    max_masks: int = 16
    max_description_chars: int = 2000
    max_body_bytes: int = 64 << 20
    drain_seconds: float = 10.0


class BadRequest(ValueError):
    """A malformed job; the message names the field."""


class QueueFull(RuntimeError):
    """The job queue is full; retry later."""


class JobBody(BaseModel):
    """``POST /jobs``."""

    model_config = ConfigDict(extra="forbid")
    image: str | bytes = Field(description="The source image: base64 or a data URL (PNG, JPEG, WEBP, BMP or GIF; "
                               "decoded to bytes by the body parser).")
    boxes: list[list[float]] = Field(default_factory=list, description="Foreground boxes [x1, y1, x2, y2] in pixels.")
    masks: list[str | bytes] = Field(default_factory=list, description="Foreground masks (base64 PNG, image-sized; "
                                     "non-zero = keep).")
    description: str = Field(description="The new image description the background is generated from.")
    seed: int = Field(0, description="Seed of the generation (same inputs and seed → same image).")
    refine: bool = Field(True, description="Refine boxes into masks with the server's segmenter, if it has one.")


def decode_image(data: str | bytes, field: str, settings: SynthSettings, *, mode: str = "RGB") -> np.ndarray:
    """A base64 / data-URL image (or its bytes) → (H, W, 3) uint8 (or (H, W) for ``mode="L"``): only `IMAGE_FORMATS`
    (`vlrl.data.sample.load_image`, the one image loader), size checked from the header before decoding."""
    raw = image_bytes(data, field)
    header_size(raw, field, settings)
    try:
        image = load_image(raw, max_pixels=settings.max_image_pixels, mode=mode)
    except SampleError as err:
        raise BadRequest(f"field '{field}': truncated or corrupt image ({_reason(err)})") from None
    return np.asarray(image, dtype=np.uint8)


def image_bytes(data: str | bytes, field: str) -> bytes:
    """The encoded image of a base64 / data-URL field (bytes pass through)."""
    if isinstance(data, bytes):
        return data
    payload = data.split(",", 1)[1] if data.startswith("data:") and "," in data else data
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise BadRequest(f"field '{field}': not valid base64 (send base64 or a data URL)") from None


def header_size(raw: bytes, field: str, settings: SynthSettings) -> tuple[int, int]:
    """(width, height) of an encoded image from its header, within the server's side and pixel limits."""
    try:
        W, H = image_size(raw)
    except SampleError as err:
        reason = _reason(err)
        raise BadRequest(f"field '{field}': " + (reason if "is not accepted" in reason else
                                                 f"not a decodable image ({reason})")) from None
    if min(W, H) < settings.min_image_side or max(W, H) > settings.max_image_side or W * H > settings.max_image_pixels:
        raise BadRequest(f"field '{field}': size {W}x{H} outside the limits (sides {settings.min_image_side}.."
                         f"{settings.max_image_side} px, at most {settings.max_image_pixels} pixels)")
    return W, H


def _reason(err: SampleError) -> str:
    """`load_image`'s message without its "image <bytes>:" prefix."""
    message = str(err)
    return message.split(": ", 1)[1] if message.startswith(("image <bytes>", "cannot decode image <bytes>")) else message


def check_boxes(boxes: Sequence[Sequence[float]], size: tuple[int, int], settings: SynthSettings) -> list[list[float]]:
    """Every box is 4 finite numbers with 0 ≤ x1 < x2 ≤ W and 0 ≤ y1 < y2 ≤ H (``size`` = (H, W))."""
    H, W = size
    if len(boxes) > settings.max_boxes:
        raise BadRequest(f"field 'boxes': {len(boxes)} boxes, at most {settings.max_boxes}")
    out = []
    for k, box in enumerate(boxes):
        where = f"field 'boxes[{k}]'"
        if len(box) != 4:
            raise BadRequest(f"{where}: expected 4 numbers [x1, y1, x2, y2], got {len(box)}")
        if not all(np.isfinite(box)):
            raise BadRequest(f"{where}: coordinates must be finite")
        x1, y1, x2, y2 = box
        if not (x1 < x2 and y1 < y2):
            raise BadRequest(f"{where}: needs x1 < x2 and y1 < y2, got {list(box)}")
        if x1 < 0 or y1 < 0 or x2 > W or y2 > H:
            raise BadRequest(f"{where}: {list(box)} leaves the {W}x{H} image (0 ≤ x ≤ {W}, 0 ≤ y ≤ {H})")
        out.append([float(v) for v in box])
    return out


def parse_job(body: JobBody, settings: SynthSettings) -> tuple[np.ndarray, np.ndarray, list[list[float]]]:
    """(image, keep mask, boxes) of a job body, or `BadRequest` naming the field."""
    from vlrl.synth.backends import boxes_mask

    description = body.description.strip()
    if not description:
        raise BadRequest("field 'description': must not be empty")
    try:
        description.encode("utf-8")
    except UnicodeEncodeError as err:
        raise BadRequest(f"field 'description': not valid Unicode (a lone surrogate at character {err.start})") from None
    if len(description) > settings.max_description_chars:
        raise BadRequest(f"field 'description': {len(description)} characters, at most {settings.max_description_chars}")
    if not 0 <= body.seed < 2**32:
        raise BadRequest(f"field 'seed': must lie in [0, 2^32), got {body.seed}")
    image = decode_image(body.image, "image", settings)
    H, W = image.shape[:2]
    boxes = check_boxes(body.boxes, (H, W), settings)
    keep = boxes_mask((H, W), boxes)
    for mask in _masks(body.masks, (W, H), settings):
        keep |= mask
    if not keep.any():
        raise BadRequest("field 'boxes' / 'masks': give the foreground to preserve (at least one box or a non-empty mask)")
    return image, keep, boxes


def _masks(masks: Sequence[str | bytes], size: tuple[int, int], settings: SynthSettings) -> list[np.ndarray]:
    """Each mask as a boolean (H, W) array. Their number (``max_masks``) and each one's size (the image's) are
    checked from the headers before any is decoded; a mask that keeps nothing is refused at the first one."""
    W, H = size
    if len(masks) > settings.max_masks:
        raise BadRequest(f"field 'masks': {len(masks)} masks, at most {settings.max_masks}")
    raws = [image_bytes(data, f"masks[{k}]") for k, data in enumerate(masks)]
    for k, raw in enumerate(raws):
        width, height = header_size(raw, f"masks[{k}]", settings)
        if (width, height) != (W, H):
            raise BadRequest(f"field 'masks[{k}]': size {width}x{height} differs from the image's {W}x{H}")
    out = []
    for k, raw in enumerate(raws):
        mask = decode_image(raw, f"masks[{k}]", settings, mode="L") > 0
        if not mask.any():
            raise BadRequest(f"field 'masks[{k}]': empty (no non-zero pixel); a mask marks the foreground to keep")
        out.append(mask)
    return out
