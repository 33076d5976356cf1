"""A policy = a transformers model + its tokenizer (+ image processor) + the family adapter.

`load_policy` takes a tiny preset name (``tiny-qwen2-vl``), a local directory written by `save_pretrained`,
or a hub id (when a hub is reachable); `Policy.save` writes the transformers layout (safetensors) that
plain transformers, vLLM and SGLang load.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vlrl.models.adapters import TextAdapter, adapter_for

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Policy:
    model: torch.nn.Module
    tokenizer: Any
    image_processor: Any | None
    adapter: TextAdapter
    source: str
    lora: Any | None = None  # the peft model when model.lora is set (`vlrl.models.lora`); `model` is its base, adapters injected

    @classmethod
    def from_parts(cls, model, tokenizer, image_processor, *, source: str, processor: Any | None = None) -> Policy:
        """A policy from its parts; the family's processor is built from the tokenizer and image processor (with
        the settings of ``source``'s ``processor_config.json`` when it is a directory) unless given."""
        eos = model.generation_config.eos_token_id if getattr(model, "generation_config", None) is not None else None
        eos = [e for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if e is not None]
        adapter = adapter_for(model.config, tokenizer, image_processor, processor=processor,
                              source=None if source.startswith("preset:") else source, model=model,
                              eos_token_ids=eos or None)
        return cls(model, tokenizer, image_processor, adapter, source)

    @property
    def processor(self) -> Any | None:
        """The family's transformers processor (None for a text model)."""
        return getattr(self.adapter, "processor", None)

    @property
    def is_vision(self) -> bool:
        return self.image_processor is not None

    @property
    def eos_token_ids(self) -> list[int]:
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        return list(eos) if isinstance(eos, (list, tuple)) else [eos]

    @property
    def pad_token_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return pad if pad is not None else self.eos_token_ids[0]

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def save(self, out_dir: str | Path, *, state_dict: dict | None = None, adapter_state_dict: dict | None = None) -> Path:
        """Write model (safetensors), tokenizer and image processor in the transformers layout. With LoRA: the
        merged weights (base + adapters, which plain transformers loads) and the adapters alone in ``adapter/``.
        ``state_dict`` / ``adapter_state_dict``: the full weights (LoRA: merged) and adapters already gathered from
        sharded ranks (`vlrl.train.checkpoint.export_hf`); unset: taken from the model."""
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        if self.lora is not None:
            from vlrl.models.lora import ADAPTER_DIR, save_adapter, save_merged

            save_merged(self, out_dir, state_dict)
            save_adapter(self, out_dir / ADAPTER_DIR, adapter_state_dict)
        else:
            self.model.save_pretrained(out_dir, **({"state_dict": state_dict} if state_dict is not None else {}))
        self.tokenizer.save_pretrained(out_dir)
        if self.image_processor is not None:
            self.image_processor.save_pretrained(out_dir)
        if self.processor is not None:
            from vlrl.models.processor import save_processor_config

            save_processor_config(self.processor, out_dir)
        return out_dir


def load_policy(
    name_or_path: str, *, dtype: str = "float32", device: str = "cpu", seed: int = 0,
    min_pixels: int | None = None, max_pixels: int | None = None,
) -> Policy:
    """Load a policy from a preset name, a local directory, or a hub id.

    ``min_pixels`` / ``max_pixels``: native-resolution bounds set on the image processor (`set_pixel_bounds`).
    """
    from vlrl.models.presets import PRESETS, build_preset

    if dtype not in DTYPES:
        raise ValueError(f"model.dtype: unknown dtype {dtype!r}; choose from {sorted(DTYPES)}")
    name = name_or_path.removeprefix("preset:")
    if name in PRESETS and not Path(name_or_path).exists():
        policy = build_preset(name, seed=seed)
    else:
        policy = _load_pretrained(name_or_path, DTYPES[dtype])
    policy.model.to(device=device, dtype=DTYPES[dtype])
    set_pixel_bounds(policy.image_processor, min_pixels, max_pixels)
    return policy


def load_processor(
    name_or_path: str, *, seed: int = 0, min_pixels: int | None = None, max_pixels: int | None = None
) -> Policy:
    """The tokenizer, image processor and adapter of a model with no weights in memory: a preset is built on
    the ``meta`` device, a directory or hub id reads only its config, tokenizer and processor files. The
    returned `Policy` encodes and counts tokens; its model runs only once given weights (FSDP2's memory-lean
    start, `vlrl.train.distributed.shard`)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    from vlrl.models.presets import PRESETS, build_preset

    name = name_or_path.removeprefix("preset:")
    with torch.device("meta"):  # parameters get shapes, no storage
        if name in PRESETS and not Path(name_or_path).exists():
            policy = build_preset(name, seed=seed)
        else:
            _check_local(name_or_path)
            config = AutoConfig.from_pretrained(name_or_path)
            is_vision = hasattr(config, "vision_config")
            model = (AutoModelForImageTextToText if is_vision else AutoModelForCausalLM).from_config(config)
            model.eval()  # as from_pretrained leaves it
            if (Path(name_or_path) / "generation_config.json").is_file():  # EOS ids as `load_policy` reads them
                from transformers import GenerationConfig

                model.generation_config = GenerationConfig.from_pretrained(name_or_path)
            tokenizer = AutoTokenizer.from_pretrained(name_or_path)
            image_processor = _load_image_processor(name_or_path) if is_vision else None
            policy = Policy.from_parts(model, tokenizer, image_processor, source=str(name_or_path))
    set_pixel_bounds(policy.image_processor, min_pixels, max_pixels)
    return policy


def set_pixel_bounds(image_processor: Any | None, min_pixels: int | None, max_pixels: int | None) -> None:
    """Native resolution: images keep their aspect ratio and are resized only into [min_pixels, max_pixels]
    (Qwen2-VL's ``size = {shortest_edge: min_pixels, longest_edge: max_pixels}``). None keeps a bound as is."""
    if min_pixels is None and max_pixels is None:
        return
    if image_processor is None:
        raise ValueError("model.min_pixels / model.max_pixels: this model has no image processor")
    size = getattr(image_processor, "size", None)
    if size is None or "longest_edge" not in size or "shortest_edge" not in size:
        raise ValueError(f"model.min_pixels / model.max_pixels: {type(image_processor).__name__} has no "
                         "shortest_edge/longest_edge pixel bounds")
    from transformers.image_utils import SizeDict

    bounds = {k: v for k, v in dict(size).items() if v is not None}
    if min_pixels is not None:
        bounds["shortest_edge"] = int(min_pixels)
    if max_pixels is not None:
        bounds["longest_edge"] = int(max_pixels)
    image_processor.size = SizeDict(**bounds)


def _check_local(path: str) -> None:
    """A directory without config.json, or a path that exists nowhere and cannot be a hub id (``name`` or
    ``org/name``), is named as such — not passed to the hub client (``Repo id must be in the form …``)."""
    import re

    from vlrl.models.presets import PRESETS

    local = Path(path)
    if local.exists() and not (local / "config.json").is_file():
        raise FileNotFoundError(f"{path}: not a model directory (no config.json)")
    if not local.exists() and re.fullmatch(r"[A-Za-z0-9_][\w.-]*(/[\w.-]+)?", path) is None:
        raise FileNotFoundError(f"{path}: no such model directory (and not a preset: {', '.join(PRESETS)})")


def _load_pretrained(path: str, dtype: torch.dtype) -> Policy:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    _check_local(path)
    config = AutoConfig.from_pretrained(path)
    is_vision = hasattr(config, "vision_config")
    model_cls = AutoModelForImageTextToText if is_vision else AutoModelForCausalLM
    model = model_cls.from_pretrained(path, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(path)
    image_processor = None
    if is_vision:
        image_processor = _load_image_processor(path)
    return Policy.from_parts(model, tokenizer, image_processor, source=str(path))


def _load_image_processor(path: str):
    """The PIL image processor (no torchvision needed); falls back to AutoProcessor's."""
    from transformers import AutoImageProcessor

    try:
        return AutoImageProcessor.from_pretrained(path, use_fast=False)
    except (OSError, ValueError):
        from transformers import AutoProcessor

        return AutoProcessor.from_pretrained(path).image_processor
