"""The vision inputs of a sequence: a family processor's outputs for its images, kept as the processor made them.

Processors of one image differ in layout (patches × values, tiles × C × H × W, a per-sample batch of tiles,
images × padded anyres crops); `VisionInputs.concat` joins any of them along their first dimension, zero-padding
the others, which is how the families' own processors batch samples.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def _cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate along dim 0, zero-padding every other dimension to the largest (how processors batch)."""
    if len(tensors) == 1:
        return tensors[0]
    first = tensors[0]
    if all(t.shape[1:] == first.shape[1:] for t in tensors):
        return torch.cat(tensors)
    if any(t.dim() != first.dim() for t in tensors):
        raise ValueError(f"cannot join vision inputs of shapes {[tuple(t.shape) for t in tensors]}")
    shape = [sum(t.shape[0] for t in tensors)] + [max(t.shape[d] for t in tensors) for d in range(1, first.dim())]
    out = first.new_zeros(shape)
    start = 0
    for t in tensors:
        out[(slice(start, start + t.shape[0]), *(slice(0, s) for s in t.shape[1:]))] = t
        start += t.shape[0]
    return out


@dataclass
class VisionInputs:
    """Processor outputs of the images (and videos) of one sequence, all turns, in order of appearance.

    Attributes:
        tensors: the processor's vision outputs by name (``pixel_values``, ``image_grid_thw``, ...).
        num_images / num_videos: how many images / videos they hold.
        replacements: the expanded markup of each image then each video (what its placeholder becomes).
        parts / part_index: set by `concat_shared` when rows share inputs (a GRPO group's n responses): the
            distinct inputs (``tensors`` then holds each once) and, per row holding vision, which part it shows.
    """

    tensors: dict[str, torch.Tensor]
    num_images: int = 0
    num_videos: int = 0
    replacements: list[str] = field(default_factory=list)
    parts: list[VisionInputs] | None = None
    part_index: list[int] | None = None

    @property
    def pixel_values(self) -> torch.Tensor | None:
        return self.tensors.get("pixel_values")

    @property
    def image_grid_thw(self) -> torch.Tensor | None:
        return self.tensors.get("image_grid_thw")

    @property
    def video_grid_thw(self) -> torch.Tensor | None:
        return self.tensors.get("video_grid_thw")

    def to(self, device) -> VisionInputs:
        parts = [p.to(device) for p in self.parts] if self.parts is not None else None
        return VisionInputs({k: v.to(device) for k, v in self.tensors.items()}, self.num_images, self.num_videos,
                            self.replacements, parts, self.part_index)

    @staticmethod
    def concat(items: list[VisionInputs | None]) -> VisionInputs | None:
        """The inputs of several sequences (or turns) in order, as the processor batches them."""
        present = [v.expanded() for v in items if v is not None]
        if not present:
            return None
        if len(present) == 1:
            return present[0]
        keys = list(dict.fromkeys(k for v in present for k in v.tensors))
        return VisionInputs(
            {k: _cat([v.tensors[k] for v in present if k in v.tensors]) for k in keys},
            sum(v.num_images for v in present), sum(v.num_videos for v in present),
            [r for v in present for r in v.replacements],
        )

    def expanded(self) -> VisionInputs:
        """One copy per row (``part_index`` resolved): what `concat` would have built."""
        if self.parts is None:
            return self
        return VisionInputs.concat([self.parts[k] for k in self.part_index])

    def patches(self, patch_size: int) -> int:
        """The patches the vision tower encodes for these inputs: rows of Qwen-style ``(patches, values)`` pixels,
        or tiles × (H / p) × (W / p) of ``(tiles, C, H, W)`` images (InternVL, Gemma 3), of ``(images, crops, C, H,
        W)`` (LLaVA-OneVision) and of ``(1, tiles, C, H, W)`` (SmolVLM), padding included; ``patch_size`` p."""
        pixels = self.expanded().pixel_values if self.parts is not None else self.pixel_values
        if pixels is None:
            return 0
        if pixels.dim() == 2:
            return int(pixels.shape[0])
        tiles = int(torch.tensor(pixels.shape[:-3]).prod())
        return tiles * (pixels.shape[-2] // patch_size) * (pixels.shape[-1] // patch_size)

    def occurrence(self, key: str) -> torch.Tensor | None:
        """``tensors[key]`` with one copy per row (cheap for small tensors such as ``image_grid_thw``)."""
        if self.parts is None:
            return self.tensors.get(key)
        pieces = [self.parts[k].tensors[key] for k in self.part_index if key in self.parts[k].tensors]
        return _cat(pieces) if pieces else None

    @staticmethod
    def concat_shared(items: list[VisionInputs | None]) -> VisionInputs | None:
        """`concat`, but rows holding the same `VisionInputs` object (the n responses of one prompt) contribute
        it once, with ``part_index`` mapping every row to it; plain `concat` when none repeat."""
        present = [v for v in items if v is not None]
        unique: dict[int, int] = {}  # id → part
        parts: list[VisionInputs] = []
        index: list[int] = []
        for v in present:
            if id(v) not in unique:
                unique[id(v)] = len(parts)
                parts.append(v.expanded())
            index.append(unique[id(v)])
        if len(parts) == len(present):
            return VisionInputs.concat(items)
        joined = VisionInputs.concat(parts)
        return VisionInputs(joined.tensors, joined.num_images, joined.num_videos, joined.replacements, parts, index)


@dataclass
class EncodedPrompt:
    """A prompt ready for generation: token ids (image placeholders expanded) and vision inputs."""

    input_ids: list[int]
    vision: VisionInputs | None


