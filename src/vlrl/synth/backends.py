"""Generator back-ends of the synthesis server: one interface, foreground kept pixel-exact by construction.

A back-end is built by a factory in `GENERATORS` (``make(**options) -> Generator``) and implements

    generate(image (H, W, 3) uint8, keep (H, W) bool, description, *, seed) -> (H, W, 3) uint8, metadata

where ``keep`` marks the foreground to preserve (the labelled boxes, or masks). Whatever a back-end returns,
`synthesize` pastes the foreground back (``out[keep] = image[keep]``) and checks it, so a label that lives in
the foreground stays valid (Syn-GRPO seed §3.3.1, "Foreground consistency"): a diffusion model re-encodes the
whole image through its VAE and would otherwise shift every pixel.

- ``classical`` (default, no model, runs anywhere): the background is rebuilt from two parts — an outpainting
  of the foreground (scikit-image biharmonic inpainting on a ≤ 32-pixel working copy, upsampled), which
  carries the foreground's colours into its surroundings, and a procedural texture steered by the keywords
  of the description (`vlrl.synth.textures`) — blended by distance from the foreground: the outpainting
  dominates next to the objects (weight ``outpaint_weight``), the texture further away.
- ``diffusers``: an inpainting pipeline loaded from a local directory by ``AutoPipelineForInpainting`` (Stable
  Diffusion / SDXL inpainting, Kandinsky, ...; the seed's data server uses an SDXL ControlNet), prompted with
  the description, repainting everything outside ``keep``.

`BoxSegmenter`s (`vlrl.synth.segment`) optionally refine boxes into masks before generation.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np
from PIL import Image

from vlrl.registry import Registry
from vlrl.synth.textures import texture_for

Box = Sequence[float]


@runtime_checkable
class Generator(Protocol):
    name: str

    def generate(self, image: np.ndarray, keep: np.ndarray, description: str, *,
                 seed: int) -> tuple[np.ndarray, dict[str, Any]]: ...


GENERATORS: Registry = Registry("synthesis back-end", signature="make(**options) -> Generator")


def get_generator(name: str, **options: Any) -> Generator:
    """Build a back-end by registered name (``classical``, ``diffusers``) or dotted path ``pkg.mod:factory``."""
    return GENERATORS.get(name)(**options)


class ForegroundChanged(RuntimeError):
    """A back-end's output differs from the input inside the preserved foreground (a bug, never silent)."""


# ----------------------------------------------------------------------------------------------- foreground
def box_pixels(box: Box) -> tuple[int, int, int, int]:
    """The pixel range a box covers: every pixel it touches, [floor(x1), ceil(x2)) × [floor(y1), ceil(y2))."""
    x1, y1, x2, y2 = box
    return math.floor(x1), math.floor(y1), math.ceil(x2), math.ceil(y2)


def boxes_mask(size: tuple[int, int], boxes: Sequence[Box]) -> np.ndarray:
    """(H, W) bool: True inside any box (``size`` = (H, W)); see `box_pixels` for the pixels a box covers."""
    H, W = size
    keep = np.zeros((H, W), dtype=bool)
    for box in boxes:
        x1, y1, x2, y2 = box_pixels(box)
        keep[max(0, y1) : min(H, y2), max(0, x1) : min(W, x2)] = True
    return keep


def synthesize(generator: Generator, image: np.ndarray, keep: np.ndarray, description: str, *,
               seed: int) -> tuple[np.ndarray, dict[str, Any]]:
    """Run ``generator`` and paste the foreground back; raises `ForegroundChanged` if it still differs."""
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
        raise ValueError(f"synthesize: expected an (H, W, 3) uint8 image, got {image.shape} {image.dtype}")
    if keep.shape != image.shape[:2]:
        raise ValueError(f"synthesize: keep mask {keep.shape} does not match the image {image.shape[:2]}")
    out, meta = generator.generate(image, keep, description, seed=seed)
    out = np.asarray(out)
    if out.shape != image.shape or out.dtype != np.uint8:
        raise ValueError(f"back-end {generator.name!r} returned {out.shape} {out.dtype}, expected {image.shape} uint8")
    out = out.copy()
    out[keep] = image[keep]
    if not np.array_equal(out[keep], image[keep]):  # pragma: no cover - the assignment above guarantees it
        raise ForegroundChanged(f"back-end {generator.name!r} changed the preserved foreground")
    changed = float(np.any(out != image, axis=-1)[~keep].mean()) if (~keep).any() else 0.0
    return out, {**meta, "backend": generator.name, "foreground_fraction": float(keep.mean()),
                 "background_changed_fraction": changed}


# ----------------------------------------------------------------------------------------------- classical
class ClassicalGenerator:
    """Outpainting of the foreground (biharmonic, scikit-image) blended with a keyword-steered texture.

    Args:
        outpaint_weight: weight of the outpainted colours right next to the foreground (0 = texture only).
        falloff: distance (fraction of the longer image side) over which that weight decays by e.
        work_side: longer side of the working copy the biharmonic inpainting runs on (cost grows ~ side³).
    """

    name = "classical"

    def __init__(self, *, outpaint_weight: float = 0.35, falloff: float = 0.08, work_side: int = 32) -> None:
        if not 0.0 <= outpaint_weight <= 1.0:
            raise ValueError(f"classical: outpaint_weight must lie in [0, 1], got {outpaint_weight}")
        if falloff <= 0 or work_side < 4:
            raise ValueError("classical: falloff must be > 0 and work_side ≥ 4")
        self.outpaint_weight, self.falloff, self.work_side = outpaint_weight, falloff, work_side

    def generate(self, image: np.ndarray, keep: np.ndarray, description: str, *,
                 seed: int) -> tuple[np.ndarray, dict[str, Any]]:
        H, W = keep.shape
        texture, spec = texture_for(description, (H, W), seed)  # (H, W, 3) in [0, 1]
        weight = np.zeros((H, W), dtype=np.float32)
        outpainted = texture
        if keep.any() and self.outpaint_weight > 0:
            outpainted, distance = self._outpaint(image, keep)
            weight = self.outpaint_weight * np.exp(-distance / (self.falloff * max(H, W)))
        background = weight[..., None] * outpainted + (1.0 - weight[..., None]) * texture
        out = np.where(keep[..., None], image, np.round(np.clip(background, 0, 1) * 255).astype(np.uint8))
        return out.astype(np.uint8), {"pattern": spec.pattern, "keywords": list(spec.keywords),
                                      "palette": [list(c) for c in spec.palette]}

    def _outpaint(self, image: np.ndarray, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(outpainted colours (H, W, 3) in [0, 1], distance to the foreground (H, W) in pixels), both
        computed on a small working copy and upsampled (bilinear)."""
        from scipy import ndimage
        from skimage.restoration import inpaint_biharmonic

        H, W = keep.shape
        factor = min(1.0, self.work_side / max(H, W))
        h, w = max(2, round(H * factor)), max(2, round(W * factor))
        small = np.asarray(Image.fromarray(image).resize((w, h), Image.BOX), dtype=np.float64) / 255.0
        small_keep = np.asarray(Image.fromarray(keep.astype(np.uint8) * 255).resize((w, h), Image.BOX)) >= 128
        if not small_keep.any():  # a foreground smaller than one working pixel: use its mean colour
            colour = image[keep].mean(axis=0) / 255.0
            filled = np.broadcast_to(colour, (h, w, 3)).copy()
        else:
            filled = inpaint_biharmonic(small, ~small_keep, channel_axis=-1)
        distance = ndimage.distance_transform_edt(~small_keep) / factor if small_keep.any() else \
            ndimage.distance_transform_edt(~keep)
        up = np.stack([np.asarray(Image.fromarray(filled[..., c].astype(np.float32), mode="F").resize((W, H), Image.BILINEAR))
                       for c in range(3)], axis=-1)
        if distance.shape != (H, W):
            distance = np.asarray(Image.fromarray(distance.astype(np.float32), mode="F").resize((W, H), Image.BILINEAR))
        return np.clip(up, 0.0, 1.0), distance


@GENERATORS.register("classical")
def make_classical(**options: Any) -> ClassicalGenerator:
    return ClassicalGenerator(**options)


# ----------------------------------------------------------------------------------------------- diffusers
class DiffusersGenerator:
    """A diffusers inpainting pipeline from a local directory, prompted with the description.

    The image is resized so both sides are multiples of 8 (and the longer side at most ``max_side``), the
    mask marks everything outside the foreground for repainting, and the output is resized back.

    Args:
        model_path: a directory saved by ``pipeline.save_pretrained`` (``model_index.json`` + components).
        steps, guidance_scale, strength, negative_prompt: the pipeline's sampling settings.
        device, dtype: where and in which precision the pipeline runs (``float16`` on GPUs).
        max_side: longest side the pipeline sees.
    """

    name = "diffusers"

    def __init__(self, *, model_path: str, steps: int = 30, guidance_scale: float = 7.5, strength: float = 1.0,
                 negative_prompt: str | None = None, device: str = "cpu", dtype: str = "float32",
                 max_side: int = 1024) -> None:
        import torch
        from diffusers import AutoPipelineForInpainting
        from diffusers.utils import logging as diffusers_logging

        dtypes = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
        if dtype not in dtypes:
            raise ValueError(f"diffusers: dtype must be one of {sorted(dtypes)}, got {dtype!r}")
        diffusers_logging.disable_progress_bar()
        self.pipeline = AutoPipelineForInpainting.from_pretrained(model_path, dtype=dtypes[dtype], local_files_only=True)
        self.pipeline.to(device)
        self.pipeline.set_progress_bar_config(disable=True)
        self.device, self.steps, self.guidance_scale = device, steps, guidance_scale
        self.strength, self.negative_prompt, self.max_side = strength, negative_prompt, max_side
        self.model_path = model_path

    def generate(self, image: np.ndarray, keep: np.ndarray, description: str, *,
                 seed: int) -> tuple[np.ndarray, dict[str, Any]]:
        import torch

        H, W = keep.shape
        factor = min(1.0, self.max_side / max(H, W))
        w, h = max(8, int(W * factor) // 8 * 8), max(8, int(H * factor) // 8 * 8)
        source = Image.fromarray(image).resize((w, h), Image.BICUBIC)
        repaint = Image.fromarray(np.where(keep, 0, 255).astype(np.uint8)).resize((w, h), Image.NEAREST)
        generator = torch.Generator(device="cpu").manual_seed(seed)
        result = self.pipeline(prompt=description, image=source, mask_image=repaint, height=h, width=w,
                               num_inference_steps=self.steps, guidance_scale=self.guidance_scale,
                               strength=self.strength, negative_prompt=self.negative_prompt, generator=generator,
                               output_type="np")
        frame = np.asarray(result.images[0])  # (h, w, 3) float in [0, 1]
        frame = np.nan_to_num(frame, nan=0.0)
        out = Image.fromarray(np.round(np.clip(frame, 0, 1) * 255).astype(np.uint8)).resize((W, H), Image.BICUBIC)
        return np.asarray(out, dtype=np.uint8), {"pipeline": type(self.pipeline).__name__, "steps": self.steps,
                                                 "model_path": self.model_path, "size": [w, h]}


@GENERATORS.register("diffusers")
def make_diffusers(**options: Any) -> DiffusersGenerator:
    if "model_path" not in options:
        raise ValueError("diffusers: needs the option model_path (a local pipeline directory)")
    return DiffusersGenerator(**options)
