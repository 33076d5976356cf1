"""Optional foreground segmentation: refine labelled boxes into masks before the background is regenerated.

The seed's data server removes the background inside the boxes too, with a foreground segmentation model
(BEN2), so that the new background reaches the object's outline (Syn-GRPO seed §3.3.1). A segmenter maps
(image, boxes) to a (H, W) bool mask that lies inside the union of the boxes; the synthesis keeps exactly
those pixels. A box whose refined mask is empty (or tiny) falls back to the whole box — never to nothing,
which would let the generator repaint the labelled object — and the fallbacks are counted.

- ``border`` (no model): inside each box, pixels close in colour to the box's border (its background) are
  background; the rest, with holes filled and dilated by one pixel (anti-aliased edges), is foreground.
  Good for objects on a plain background (vlrl's shapes).
- ``model``: a transformers semantic-segmentation model (``AutoModelForSemanticSegmentation`` and its image
  processor) from a local directory, run on a crop around each box; the foreground probability is the sum
  of the ``foreground_labels`` classes (default: every class but 0), or the sigmoid of a single-channel
  output (a matting model).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from vlrl.registry import Registry
from vlrl.synth.backends import Box, box_pixels, boxes_mask


class Segmenter(Protocol):
    name: str

    def refine(self, image: np.ndarray, boxes: Sequence[Box]) -> tuple[np.ndarray, dict[str, Any]]: ...


SEGMENTERS: Registry = Registry("segmenter", signature="make(**options) -> Segmenter")


def get_segmenter(name: str, **options: Any) -> Segmenter:
    return SEGMENTERS.get(name)(**options)


def _refine_boxes(image: np.ndarray, boxes: Sequence[Box], box_mask, *, min_fraction: float) -> tuple[np.ndarray, dict]:
    """Apply ``box_mask(crop) -> (h, w) bool`` to every box; fall back to the whole box when the mask covers
    less than ``min_fraction`` of it."""
    H, W = image.shape[:2]
    keep = np.zeros((H, W), dtype=bool)
    fallbacks = 0
    for box in boxes:
        x1, y1, x2, y2 = box_pixels(box)
        x1, y1, x2, y2 = max(0, x1), max(0, y1), min(W, x2), min(H, y2)
        if x2 <= x1 or y2 <= y1:
            continue
        mask = box_mask(image[y1:y2, x1:x2])
        if mask.mean() < min_fraction:
            mask = np.ones_like(mask)
            fallbacks += 1
        keep[y1:y2, x1:x2] |= mask
    assert not (keep & ~boxes_mask((H, W), boxes)).any(), "a refined mask left its boxes"
    return keep, {"segmenter_fallbacks": fallbacks, "refined_fraction": float(keep.sum() / max(1, boxes_mask((H, W), boxes).sum()))}


class BorderSegmenter:
    """Foreground = pixels of a box unlike its border colour (Euclidean RGB distance > ``tolerance``)."""

    name = "border"

    def __init__(self, *, tolerance: float = 40.0, dilate: int = 1, min_fraction: float = 0.02) -> None:
        self.tolerance, self.dilate, self.min_fraction = tolerance, dilate, min_fraction

    def refine(self, image: np.ndarray, boxes: Sequence[Box]) -> tuple[np.ndarray, dict[str, Any]]:
        return _refine_boxes(image, boxes, self._mask, min_fraction=self.min_fraction)

    def _mask(self, crop: np.ndarray) -> np.ndarray:
        from scipy import ndimage

        border = np.concatenate([crop[0], crop[-1], crop[:, 0], crop[:, -1]]).astype(np.float32)  # (n, 3)
        background = np.median(border, axis=0)
        distance = np.linalg.norm(crop.astype(np.float32) - background, axis=-1)  # (h, w)
        mask = ndimage.binary_fill_holes(distance > self.tolerance)
        if self.dilate and mask.any():
            mask = ndimage.binary_dilation(mask, iterations=self.dilate)
        return mask


class ModelSegmenter:
    """A transformers semantic-segmentation model from ``path`` (see the module docstring).

    Args:
        path: local directory with the model and its image processor (``save_pretrained`` layout).
        foreground_labels: class ids counted as foreground (default: all but 0, the background).
        threshold: foreground probability above which a pixel is kept.
        margin: context around each box given to the model (fraction of the box's size).
        min_fraction: a mask covering less of its box falls back to the whole box.
    """

    name = "model"

    def __init__(self, *, path: str, foreground_labels: Sequence[int] | None = None, threshold: float = 0.5,
                 margin: float = 0.1, min_fraction: float = 0.02, device: str = "cpu") -> None:
        from transformers import AutoImageProcessor, AutoModelForSemanticSegmentation

        self.processor = AutoImageProcessor.from_pretrained(path, local_files_only=True)
        self.model = AutoModelForSemanticSegmentation.from_pretrained(path, local_files_only=True).to(device).eval()
        self.foreground_labels = None if foreground_labels is None else list(foreground_labels)
        self.threshold, self.margin, self.min_fraction, self.device = threshold, margin, min_fraction, device

    def refine(self, image: np.ndarray, boxes: Sequence[Box]) -> tuple[np.ndarray, dict[str, Any]]:
        H, W = image.shape[:2]
        keep = np.zeros((H, W), dtype=bool)
        fallbacks = 0
        for box in boxes:
            mask, fell_back = self._box(image, box)
            keep |= mask
            fallbacks += fell_back
        refined = float(keep.sum() / max(1, boxes_mask((H, W), boxes).sum()))
        return keep, {"segmenter_fallbacks": fallbacks, "refined_fraction": refined}

    def _box(self, image: np.ndarray, box: Box) -> tuple[np.ndarray, int]:
        import torch
        from PIL import Image

        H, W = image.shape[:2]
        x1, y1, x2, y2 = box_pixels(box)
        x1, y1, x2, y2 = max(0, x1), max(0, y1), min(W, x2), min(H, y2)
        out = np.zeros((H, W), dtype=bool)
        if x2 <= x1 or y2 <= y1:
            return out, 0
        mx, my = round((x2 - x1) * self.margin), round((y2 - y1) * self.margin)
        cx1, cy1, cx2, cy2 = max(0, x1 - mx), max(0, y1 - my), min(W, x2 + mx), min(H, y2 + my)
        crop = Image.fromarray(image[cy1:cy2, cx1:cx2])
        inputs = self.processor(images=crop, return_tensors="pt").to(self.device)
        with torch.no_grad():
            logits = self.model(**inputs).logits  # (1, C, h, w)
        logits = torch.nn.functional.interpolate(logits.float(), size=(cy2 - cy1, cx2 - cx1), mode="bilinear",
                                                 align_corners=False)[0]  # (C, ch, cw)
        if logits.shape[0] == 1:
            probability = logits[0].sigmoid()
        else:
            labels = self.foreground_labels or list(range(1, logits.shape[0]))
            probability = logits.softmax(0)[labels].sum(0)
        crop_mask = (probability >= self.threshold).cpu().numpy()
        inner = crop_mask[y1 - cy1 : y2 - cy1, x1 - cx1 : x2 - cx1]  # only inside the box
        if inner.mean() < self.min_fraction:
            out[y1:y2, x1:x2] = True
            return out, 1
        out[y1:y2, x1:x2] = inner
        return out, 0


@SEGMENTERS.register("border")
def make_border(**options: Any) -> BorderSegmenter:
    return BorderSegmenter(**options)


@SEGMENTERS.register("model")
def make_model(**options: Any) -> ModelSegmenter:
    if "path" not in options:
        raise ValueError("segmenter 'model': needs the option path (a local model directory)")
    return ModelSegmenter(**options)
