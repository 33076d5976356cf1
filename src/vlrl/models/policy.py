"""A policy = a transformers model + its tokenizer (+ image processor) + the family adapter.

`load_policy` takes a tiny preset name (``tiny-qwen2-vl``), a local directory written by `save_pretrained`,
or a hub id (when a hub is reachable); `Policy.save` writes the transformers layout (safetensors) that
plain transformers, vLLM and SGLang load.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vlrl.models.adapters import TextAdapter, adapter_for

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class LoadOptions:
    """How a checkpoint is loaded (``model.attn_implementation`` / ``revision`` / ``trust_remote_code`` /
    ``chat_template_kwargs``). Every command that loads a model passes them (`LoadOptions.of` its model section).

    Attributes:
        attn_implementation: transformers' ``attn_implementation`` (eager, sdpa, flash_attention_2, ...); None:
            transformers' default (sdpa where the family supports it).
        revision: the hub revision (branch, tag, commit) of the config, weights, tokenizer and processor files.
        trust_remote_code: run the modelling code a checkpoint ships (``auto_map`` in its config.json). Off: such
            a checkpoint is refused with a message that says so.
        chat_template_kwargs: extra variables of every ``apply_chat_template`` (``{enable_thinking: false}``).
    """

    attn_implementation: str | None = None
    revision: str | None = None
    trust_remote_code: bool = False
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, model_cfg: Any) -> LoadOptions:
        """The options of a ``model`` config section (`vlrl.config.ModelConfig`)."""
        return cls(attn_implementation=getattr(model_cfg, "attn_implementation", None),
                   revision=getattr(model_cfg, "revision", None),
                   trust_remote_code=bool(getattr(model_cfg, "trust_remote_code", False)),
                   chat_template_kwargs=dict(getattr(model_cfg, "chat_template_kwargs", None) or {}))

    def hub(self) -> dict[str, Any]:
        """The keyword arguments every ``from_pretrained`` of the checkpoint's files gets."""
        return {"revision": self.revision, "trust_remote_code": self.trust_remote_code}


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
            # a copy: save_pretrained may pop the entries of the dict it is handed (the caller's stays whole)
            self.model.save_pretrained(out_dir, **({"state_dict": dict(state_dict)} if state_dict is not None else {}))
        self.tokenizer.save_pretrained(out_dir)
        if self.image_processor is not None:
            self.image_processor.save_pretrained(out_dir)
        if self.processor is not None:
            from vlrl.models.processor import save_processor_config

            save_processor_config(self.processor, out_dir)
        return out_dir


def build_preset(name: str, *, seed: int = 0):
    """Build preset ``name`` with random weights (deterministic for ``seed``); returns a `Policy`."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from vlrl.models.presets import PRESETS, preset_tokenizer

    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; presets: {sorted(PRESETS)}")
    spec = PRESETS[name]
    tokenizer = preset_tokenizer(name)
    ids = dict(tokenizer.get_vocab())
    ids["__vocab__"] = len(tokenizer)
    config, image_processor, settings = spec.build(ids)
    torch.manual_seed(seed)
    auto = AutoModelForImageTextToText if image_processor is not None else AutoModelForCausalLM
    model = auto.from_config(config)
    if spec.post_init is not None:
        with torch.no_grad():
            spec.post_init(model)
    text = config.get_text_config()
    model.generation_config.eos_token_id = text.eos_token_id
    model.generation_config.pad_token_id = text.pad_token_id
    if image_processor is None:
        return Policy.from_parts(model, tokenizer, None, source=f"preset:{name}")
    from vlrl.models.processor import build_processor

    processor = build_processor(config, tokenizer, image_processor, **settings)
    return Policy.from_parts(model, tokenizer, image_processor, source=f"preset:{name}", processor=processor)


def load_policy(
    name_or_path: str, *, dtype: str = "float32", device: str = "cpu", seed: int = 0,
    min_pixels: int | None = None, max_pixels: int | None = None, options: LoadOptions | None = None,
) -> Policy:
    """Load a policy from a preset name, a local directory, or a hub id.

    ``min_pixels`` / ``max_pixels``: native-resolution bounds set on the image processor (`set_pixel_bounds`).
    ``options``: attention implementation, revision, remote code and chat-template variables (`LoadOptions`).
    """
    from vlrl.models.presets import PRESETS

    options = options or LoadOptions()
    if dtype not in DTYPES:
        raise ValueError(f"model.dtype: unknown dtype {dtype!r}; choose from {sorted(DTYPES)}")
    name = name_or_path.removeprefix("preset:")
    if name in PRESETS and not Path(name_or_path).exists():
        policy = build_preset(name, seed=seed)
        if options.attn_implementation is not None:
            _attention(options.attn_implementation, lambda impl: policy.model.set_attn_implementation(impl))
    else:
        policy = _load_pretrained(name_or_path, DTYPES[dtype], options)
    policy.model.to(device=device, dtype=DTYPES[dtype])
    set_pixel_bounds(policy.image_processor, min_pixels, max_pixels)
    policy.adapter.chat_template_kwargs = dict(options.chat_template_kwargs)
    return policy


def load_processor(
    name_or_path: str, *, seed: int = 0, min_pixels: int | None = None, max_pixels: int | None = None,
    options: LoadOptions | None = None,
) -> Policy:
    """The tokenizer, image processor and adapter of a model with no weights in memory: a preset is built on
    the ``meta`` device, a directory or hub id reads only its config, tokenizer and processor files. The
    returned `Policy` encodes and counts tokens; its model runs only once given weights (FSDP2's memory-lean
    start, `vlrl.train.distributed.shard`)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from vlrl.models.presets import PRESETS

    options = options or LoadOptions()
    name = name_or_path.removeprefix("preset:")
    with torch.device("meta"):  # parameters get shapes, no storage
        if name in PRESETS and not Path(name_or_path).exists():
            policy = build_preset(name, seed=seed)
            if options.attn_implementation is not None:  # as `load_policy` sets it (FSDP2's meta ranks match rank 0's)
                _attention(options.attn_implementation, lambda impl: policy.model.set_attn_implementation(impl))
        else:
            config, tokenizer, image_processor, processor = load_parts(name_or_path, options)
            is_vision = hasattr(config, "vision_config")
            extra = {"attn_implementation": options.attn_implementation} if options.attn_implementation else {}
            model = (AutoModelForImageTextToText if is_vision else AutoModelForCausalLM).from_config(
                config, trust_remote_code=options.trust_remote_code, **extra)
            model.eval()  # as from_pretrained leaves it
            if (Path(name_or_path) / "generation_config.json").is_file():  # EOS ids as `load_policy` reads them
                from transformers import GenerationConfig

                model.generation_config = GenerationConfig.from_pretrained(name_or_path, **options.hub())
            policy = Policy.from_parts(model, tokenizer, image_processor, source=str(name_or_path), processor=processor)
    set_pixel_bounds(policy.image_processor, min_pixels, max_pixels)
    policy.adapter.chat_template_kwargs = dict(options.chat_template_kwargs)
    return policy


def load_parts(path: str, options: LoadOptions | None = None) -> tuple[Any, Any, Any | None, Any | None]:
    """(config, tokenizer, image processor, processor) of a directory or hub id, no weights: what the preflight
    check and `load_processor` read. `remote_code_problem` refuses a checkpoint that needs its own code."""
    from transformers import AutoConfig, AutoTokenizer

    options = options or LoadOptions()
    _check_local(path)
    problem = remote_code_problem(path, options.trust_remote_code)
    if problem:
        raise ValueError(problem)
    with _remote_code_refusal(path):
        config = AutoConfig.from_pretrained(path, **options.hub())
        tokenizer = _saved_tokenizer(path, options) or AutoTokenizer.from_pretrained(path, **options.hub())
    if not hasattr(config, "vision_config"):
        return config, tokenizer, None, None
    from vlrl.models.processor import build_processor, load_processor_settings

    image_processor = load_image_processor(path, options)
    settings = load_processor_settings(path, revision=options.revision)
    return config, tokenizer, image_processor, build_processor(config, tokenizer, image_processor, **settings)


def _saved_tokenizer(path: str, options: LoadOptions) -> Any | None:
    """A local checkpoint whose tokenizer_config.json names transformers' generic backend (``TokenizersBackend``,
    what a tokenizer built from its tokenizer.json alone saves as — the tiny presets') loads as that class, from its
    tokenizer.json. `AutoTokenizer` would take the model type's own class instead (Qwen2Tokenizer for a tiny-qwen2
    checkpoint), whose pre-tokenizer splits numbers into digits: a saved arith checkpoint then read "17" as two
    tokens it was never trained on (0.486 strict in memory, 0.127 reloaded, the same weights). None otherwise."""
    file = Path(path) / "tokenizer_config.json"
    if not file.is_file() or not (Path(path) / "tokenizer.json").is_file():
        return None
    try:
        named = json.loads(file.read_text(encoding="utf-8")).get("tokenizer_class")
    except (OSError, ValueError):
        return None
    if named not in ("TokenizersBackend", "PreTrainedTokenizerFast"):
        return None
    import transformers

    return getattr(transformers, named).from_pretrained(path, **options.hub())


def remote_code_problem(path: str, trust_remote_code: bool) -> str | None:
    """Why a local checkpoint cannot load without ``model.trust_remote_code``: its config.json maps its classes
    to modelling code it ships (``auto_map``) for a model type transformers does not know. None otherwise (a hub
    id is checked by transformers itself; `_remote_code_refusal` words its refusal the same way)."""
    if trust_remote_code:
        return None
    file = Path(path) / "config.json"
    if not file.is_file():
        return None
    try:
        config = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    auto_map = config.get("auto_map") if isinstance(config, dict) else None
    if not auto_map:
        return None
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if config.get("model_type") in CONFIG_MAPPING:
        return None  # transformers has the family's own code: the shipped code is not needed
    return _remote_code_message(path, ", ".join(sorted({str(v).split(".")[0] + ".py" for v in auto_map.values()})))


def _remote_code_message(path: str, files: str) -> str:
    return (f"model.path {path}: this checkpoint ships its own modelling code ({files}), which transformers would "
            "import and run; vlrl does not run it unless you set model.trust_remote_code=true (`vlrl serve "
            "--trust-remote-code`) — read that code first, or use a checkpoint transformers supports natively")


class _remote_code_refusal:
    """transformers' "contains custom code which must be executed" refusal, reworded with the field to set."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, err, tb) -> bool:
        if err is not None and isinstance(err, ValueError) and "trust_remote_code" in str(err):
            raise ValueError(_remote_code_message(self.path, "auto_map in its config.json")) from None
        return False


def _attention(impl: str | None, apply) -> Any:
    """``apply(impl)`` (set ``model.attn_implementation``, or load with it); transformers' refusals of the
    implementation (an unknown name, a kernel package that is not installed) reworded with the field."""
    try:
        return apply(impl)
    except ImportError as err:
        if impl is None:
            raise
        raise ValueError(f"model.attn_implementation={impl}: {_first_line(err)} (sdpa and eager need nothing "
                         "installed; flash_attention_2 needs the flash-attn package on a CUDA GPU)") from None
    except ValueError as err:
        if impl is None or "attn_implementation" not in str(err):
            raise
        raise ValueError(f"model.attn_implementation={impl}: {_first_line(err)}") from None


def _first_line(err: Exception) -> str:
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__


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


def _load_pretrained(path: str, dtype: torch.dtype, options: LoadOptions) -> Policy:
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    config, tokenizer, image_processor, processor = load_parts(path, options)
    model_cls = AutoModelForImageTextToText if hasattr(config, "vision_config") else AutoModelForCausalLM
    extra = {"attn_implementation": options.attn_implementation} if options.attn_implementation else {}
    with _remote_code_refusal(path):
        model = _attention(options.attn_implementation,
                           lambda _: model_cls.from_pretrained(path, dtype=dtype, **options.hub(), **extra))
    return Policy.from_parts(model, tokenizer, image_processor, source=str(path), processor=processor)


def load_image_processor(path: str, options: LoadOptions | None = None):
    """The PIL image processor (no torchvision needed); falls back to AutoProcessor's."""
    from transformers import AutoImageProcessor

    hub = (options or LoadOptions()).hub()
    try:
        return AutoImageProcessor.from_pretrained(path, backend="pil", **hub)
    except (OSError, ValueError):
        from transformers import AutoProcessor

        return AutoProcessor.from_pretrained(path, **hub).image_processor
