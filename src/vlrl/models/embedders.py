"""Embedders for concept balancing (`vlrl.data.balance`): images and concept words in one space.

``clip``: transformers' ``CLIPModel`` (also MetaCLIP checkpoints, which use the CLIP architecture) loaded from
a local directory with its tokenizer and the PIL image processor (no torchvision). open_clip is not used: it
needs torchvision. Any other encoder plugs in as ``pkg.mod:factory`` (`EMBEDDERS`: ``factory(path, **options)``
returning a `vlrl.data.balance.Embedder`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from PIL import Image

from vlrl.registry import Registry

EMBEDDERS: Registry[Callable[..., Any]] = Registry(
    "embedder", signature="factory(path, **options) -> Embedder (embed_images(images) -> (N, D), embed_texts(texts) -> (K, D))"
)


def get_embedder(name: str) -> Callable[..., Any]:
    """A registered embedder factory (``clip``) or a dotted path ``pkg.mod:factory``."""
    return EMBEDDERS.get(name)


class CLIPEmbedder:
    """``embed_images`` / ``embed_texts`` of a transformers CLIP model; rows L2-normalised.

    Args:
        path: a local directory with a CLIP (or MetaCLIP / SigLIP-style CLIP-architecture) checkpoint.
        device: torch device.
        template: wraps every text, e.g. ``"a photo of {}."`` (CLIP's zero-shot prompt); ``"{}"`` (default) leaves
            it as is (`balance_samples` already puts concepts in their prompt).
        batch_size: images or texts per forward pass.
    """

    def __init__(self, path: str, *, device: str = "cpu", template: str = "{}", batch_size: int = 64) -> None:
        from transformers import AutoTokenizer, CLIPImageProcessorPil, CLIPModel

        self.model = CLIPModel.from_pretrained(path).to(device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.image_processor = CLIPImageProcessorPil.from_pretrained(path)
        self.device, self.template, self.batch_size = device, template, batch_size
        self.max_length = int(self.model.config.text_config.max_position_embeddings)

    @torch.no_grad()
    def embed_images(self, images: list[Image.Image]) -> np.ndarray:
        out = []
        for start in range(0, len(images), self.batch_size):
            pixels = self.image_processor(images=images[start : start + self.batch_size], return_tensors="pt")
            features = self.model.get_image_features(pixel_values=pixels["pixel_values"].to(self.device))
            out.append(_normalise(_tensor(features)))
        return np.concatenate(out) if out else np.zeros((0, self.model.config.projection_dim), np.float32)

    @torch.no_grad()
    def embed_texts(self, texts: list[str]) -> np.ndarray:
        out = []
        for start in range(0, len(texts), self.batch_size):
            chunk = [self.template.replace("{}", t) for t in texts[start : start + self.batch_size]]
            tokens = self.tokenizer(chunk, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt")
            features = self.model.get_text_features(input_ids=tokens["input_ids"].to(self.device),
                                                    attention_mask=tokens["attention_mask"].to(self.device))
            out.append(_normalise(_tensor(features)))
        return np.concatenate(out) if out else np.zeros((0, self.model.config.projection_dim), np.float32)


def _tensor(features) -> torch.Tensor:
    """transformers 5 returns a model output from get_*_features; older versions a tensor."""
    return features if isinstance(features, torch.Tensor) else features.pooler_output


def _normalise(x: torch.Tensor) -> np.ndarray:
    return torch.nn.functional.normalize(x.float(), dim=-1).cpu().numpy()


@EMBEDDERS.register("clip")
def clip_embedder(path: str, **options) -> CLIPEmbedder:
    """transformers CLIP from a local directory (options: device, template, batch_size)."""
    return CLIPEmbedder(path, **options)
