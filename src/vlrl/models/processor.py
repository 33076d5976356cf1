"""A model family's own transformers processor, built from its tokenizer and PIL image processor.

vlrl expands image placeholders, builds the model's vision inputs and finds the vision markup tokens with the
family's processor class (``Qwen2VLProcessor``, ``InternVLProcessor``, ``Gemma3Processor``, ...): the class
transformers maps the model type to. Two things stop ``AutoProcessor`` from doing that here:

- the video processors of transformers 5 need torchvision (which vlrl never installs), and most processor
  classes refuse ``video_processor=None`` in their type check — `build_processor` subclasses the class with that
  one check relaxed, so images go through the family's own code and videos through `vlrl.models.video`;
- ``AutoImageProcessor`` defaults to the torchvision backend; vlrl loads the PIL one (``backend="pil"``).

The processor's own settings (``image_seq_length`` of InternVL / Gemma 3, ``num_image_tokens`` of
LLaVA-OneVision, ``image_seq_len`` of SmolVLM, ...) are read from ``processor_config.json`` and written back by
`save_processor_config`, so a saved directory loads back with the same expansion.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

PROCESSOR_CONFIG = "processor_config.json"


@cache
def _relaxed(cls: type) -> type:
    """``cls`` with ``video_processor=None`` (or any absent optional sub-processor) accepted."""

    def check_argument_for_proper_class(self, argument_name, argument):
        if argument is None and argument_name != "tokenizer":
            return None
        return cls.check_argument_for_proper_class(self, argument_name, argument)

    return type(cls.__name__, (cls,), {"check_argument_for_proper_class": check_argument_for_proper_class,
                                       "__module__": cls.__module__})


def processor_class(model_config: Any) -> type | None:
    """The processor class transformers maps this config's model type to (None: none registered)."""
    from transformers import PROCESSOR_MAPPING  # the table of AutoProcessor (exported by transformers)

    try:
        return PROCESSOR_MAPPING[type(model_config)]
    except KeyError:
        return None


def build_processor(model_config: Any, tokenizer: Any, image_processor: Any, *, video_processor: Any = None,
                    **settings: Any) -> Any:
    """The family's processor from its parts; ``settings`` are the processor's own keyword arguments."""
    cls = processor_class(model_config)
    if cls is None:
        raise ValueError(f"model type {model_config.model_type!r} has no processor class in transformers")
    parts = {"image_processor": image_processor, "tokenizer": tokenizer, "video_processor": video_processor}
    args = [parts.get(name) for name in cls.get_attributes()]
    unknown = [name for name in cls.get_attributes() if name not in parts]
    if unknown:
        raise ValueError(f"{cls.__name__} needs sub-processor(s) {unknown} that vlrl does not build")
    return _relaxed(cls).from_args_and_dict(args, dict(settings))


def load_processor_settings(path: str | Path, *, revision: str | None = None) -> dict[str, Any]:
    """The processor's own settings from ``processor_config.json`` of a model directory (or hub id, at
    ``revision``)."""
    local = Path(path)
    if local.is_dir():
        file = local / PROCESSOR_CONFIG
        if not file.is_file():
            return {}
        try:
            settings = json.loads(file.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{file}: not valid JSON ({err})") from None
    else:
        from transformers import ProcessorMixin

        try:
            settings, _ = ProcessorMixin.get_processor_dict(str(path), **({"revision": revision} if revision else {}))
        except OSError:
            return {}
    return {k: v for k, v in settings.items() if k not in _NOT_SETTINGS and not isinstance(v, dict)}


_NOT_SETTINGS = {"processor_class", "auto_map", "image_processor", "video_processor", "tokenizer", "chat_template"}


def save_processor_config(processor: Any, out_dir: str | Path) -> Path:
    """Write the processor's own settings (not its tokenizer / image processor, saved on their own)."""
    settings = {k: v for k, v in processor.to_dict().items() if k not in _NOT_SETTINGS and not isinstance(v, dict)}
    settings["processor_class"] = type(processor).__name__
    file = Path(out_dir) / PROCESSOR_CONFIG
    file.write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")
    return file
