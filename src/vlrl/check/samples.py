"""The preflight's look at the samples through the model's own processor (`vlrl.check.preflight`): the processor
(or a preset's) loaded without weights, a few samples per task encoded as the run would, their lengths held to the
context and the batch sizes, their images' sizes and vision tokens to what the model's tower makes of them.
Also whether a model path names something loadable (`model_path_problem`)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlrl.check.report import Budget, CheckReport
from vlrl.data import Sample, load_image


def sample_location(sample: Sample, split: str) -> str:
    """Where a sample came from, as a problem names it: its source, else its split and id."""
    return sample.source or f"{split} sample {sample.id!r}"


@dataclass
class _Processor:
    """Everything about the model that is needed without its weights."""

    config: Any
    tokenizer: Any
    adapter: Any
    source: str


def load_processor(report: CheckReport, model) -> _Processor | None:
    """Config, tokenizer, image processor and adapter of ``model.path`` (with ``model.revision``,
    ``model.trust_remote_code`` and ``model.chat_template_kwargs``); no weights are materialised."""
    import torch

    from vlrl.models import PRESETS, build_preset
    from vlrl.models.adapters import adapter_for
    from vlrl.models.policy import LoadOptions, load_parts, set_pixel_bounds

    options = LoadOptions.of(model)
    path = model.path
    name = path.removeprefix("preset:")
    if name in PRESETS and not Path(path).exists():
        with torch.device("meta"):  # parameters get shapes, no storage: nothing is loaded onto a device
            policy = build_preset(name, seed=model.init_seed)
        set_pixel_bounds(policy.image_processor, model.min_pixels, model.max_pixels)
        policy.adapter.chat_template_kwargs = dict(options.chat_template_kwargs)
        return _Processor(policy.model.config, policy.tokenizer, policy.adapter, f"preset {name}")
    local = Path(path)
    problem = model_path_problem(path)
    if problem:
        report.problem("model.path", problem)
        return None
    try:
        config, tokenizer, image_processor, processor = load_parts(path, options)
        set_pixel_bounds(image_processor, model.min_pixels, model.max_pixels)
        adapter = adapter_for(config, tokenizer, image_processor, processor=processor, source=path)
        adapter.chat_template_kwargs = dict(options.chat_template_kwargs)
    except Exception as err:  # OSError (missing files, no hub), ValueError (unsupported family, remote code), ...
        if "trust_remote_code" in str(err):
            report.problem("model.trust_remote_code", str(err))
            return None
        where = "" if local.exists() else f"no such directory, not a preset ({', '.join(PRESETS)}), and as a hub id: "
        report.problem("model.path", f"cannot load the config/tokenizer/processor of {path!r}: {where}{_first_line(err)}")
        return None
    return _Processor(config, tokenizer, adapter, str(path))


def model_path_problem(path: str) -> str | None:
    """Why ``path`` cannot name a model, before anything is read: a directory without ``config.json``, one whose
    weights are pickle files only (no ``*.safetensors``: loading them would unpickle), or a path that exists
    nowhere and cannot be a preset or a hub id (``org/name``); None otherwise."""
    from vlrl.models import PRESETS

    local = Path(path)
    if path.removeprefix("preset:") in PRESETS and not local.exists():
        return None
    if local.exists() and not (local / "config.json").is_file():
        return f"{path}: not a model directory (no config.json)"
    if local.is_dir() and not any(local.glob("*.safetensors")):
        pickles = sorted(f.name for f in local.iterdir() if f.suffix in PICKLE_SUFFIXES)
        if pickles:
            return (f"{path}: its weights are pickle files only ({', '.join(pickles[:3])}{', …' if len(pickles) > 3 else ''}); "
                    "a pickle can run code when loaded, so vlrl refuses it — re-save the model where you trust it "
                    "(from_pretrained, then save_pretrained writes model.safetensors)")
    if not local.exists() and not looks_like_hub_id(path):
        return f"{path}: no such directory (and not a preset: {', '.join(PRESETS)})"
    return None


PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")  # torch.save / pickle weight files


def looks_like_hub_id(path: str) -> bool:
    """``name`` or ``org/name`` (what the hub accepts); a path with more parts, or starting with ``.``, ``/`` or
    ``~``, or whose first part is a directory here (``mymodels/qwen`` beside ``mymodels/``), is a local path."""
    return re.fullmatch(r"[A-Za-z0-9_][\w.-]*(/[\w.-]+)?", path) is not None and not (
        "/" in path and Path(path.split("/", 1)[0]).is_dir())


def _context_length(config: Any) -> int | None:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    value = getattr(text, "max_position_embeddings", None)
    return int(value) if value else None


def _first_line(err: Exception) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"


def check_samples(report: CheckReport, proc: _Processor, picks: dict[str, list[Sample]], sft,
                   budgets: list[Budget]) -> int | None:
    """Encode the picked samples and check them (module docstring); returns the shortest encoded training prompt
    (tokens), None when none was encoded."""
    context = _context_length(proc.config)
    shortest: int | None = None
    longest: dict[str, tuple[int, Sample]] = {}
    longest_sft: tuple[int, Sample] | None = None
    n_images = 0
    resized: list[tuple[str, tuple[int, int], tuple[int, int]]] = []  # (where, original, what the model sees)
    for split, samples in picks.items():
        for sample in samples:
            where = sample_location(sample, split)
            try:
                images = [load_image(src) for src in sample.images]
                encoded = proc.adapter.encode_prompt(sample.messages, images)
            except Exception as err:
                report.problem(where, f"cannot encode the prompt for {proc.source}: {err}")
                continue
            n_images += _check_vision_tokens(report, proc, encoded, where)
            resized += [(where, image.size, size) for image, size in zip(images, _seen_sizes(proc, encoded), strict=False)
                        if size is not None and size != image.size]
            length = len(encoded.input_ids)
            if split == "train":
                shortest = length if shortest is None else min(shortest, length)
            if length > longest.get(split, (-1, None))[0]:
                longest[split] = (length, sample)
            if split == "train" and sft and sample.response is not None:
                total = length + len(proc.adapter.encode_text(sample.response)) + 1  # + EOS
                if longest_sft is None or total > longest_sft[0]:
                    longest_sft = (total, sample)
    checked = sum(len(s) for s in picks.values())
    report.facts.append(f"model {proc.source}: family {proc.adapter.family}, context {context or '?'} tokens")
    report.facts.append(f"encoded {checked} sample(s) ({n_images} image(s)); longest prompt: "
                        + ", ".join(f"{split} {n} tokens" for split, (n, _) in longest.items()))
    _warn_resized(report, resized, n_images)
    if context is None:
        report.warn("model.path", "the model config states no max_position_embeddings: context length not checked")
        return shortest
    too_long: set[str] = set()
    for split, field_name, new_tokens in budgets:
        if split not in longest or longest[split][0] + new_tokens <= context:
            continue
        length, sample = longest[split]
        if length >= context:  # the prompt alone: no budget fixes it
            if sample_location(sample, split) in too_long:
                continue
            too_long.add(sample_location(sample, split))
            report.problem(sample_location(sample, split), f"the prompt is {length} tokens, longer than the model context of "
                           f"{context} tokens (and {field_name} = {new_tokens} more must fit)")
        else:
            report.problem(field_name, f"a {length}-token prompt ({sample_location(sample, split)}) + {new_tokens} new tokens "
                           f"= {length + new_tokens} exceeds the model context of {context} tokens")
    if longest_sft is not None and longest_sft[0] > context:
        total, sample = longest_sft
        report.problem(sample_location(sample, "train"), f"prompt + reference response = {total} tokens exceeds the model "
                       f"context of {context} tokens (SFT)")
    return shortest


def _seen_sizes(proc: _Processor, encoded) -> list[tuple[int, int] | None]:
    """(width, height) of each image as the vision tower receives it, from the processor's output: a patch grid
    (``image_grid_thw`` × ``patch_size``), or the pixel tensor of a fixed-size processor; None when unknown."""
    vision = encoded.vision
    if vision is None:
        return []
    grids = getattr(vision, "image_grid_thw", None)
    patch = getattr(getattr(proc.adapter, "image_processor", None), "patch_size", None)
    if grids is not None and isinstance(patch, int):
        return [(int(g[2]) * patch, int(g[1]) * patch) for g in grids]
    pixels = getattr(vision, "pixel_values", None)
    if pixels is not None and pixels.dim() == 4:  # (images, channels, height, width)
        return [(int(pixels.shape[3]), int(pixels.shape[2]))] * int(pixels.shape[0])
    return []


def _warn_resized(report: CheckReport, resized: list, n_images: int) -> None:
    """One warning: how many of the checked images the processor resizes, from what to what."""
    if not resized:
        return
    pairs = list(dict.fromkeys(f"{a[0]}×{a[1]} → {b[0]}×{b[1]}" for _, a, b in resized))
    down = any(b[0] * b[1] < a[0] * a[1] for _, a, b in resized)
    where = "model.max_pixels" if down else "model.min_pixels"
    example = resized[0][0]
    report.warn(where, f"{len(resized)} of {n_images} checked image(s) will be resized by the image processor before "
                f"the model sees them: {', '.join(pairs[:3])}{' …' if len(pairs) > 3 else ''} (first: {example}); "
                f"{'raise model.max_pixels to keep more detail' if down else 'set model.min_pixels / model.max_pixels to change it'}")


def _check_vision_tokens(report: CheckReport, proc: _Processor, encoded, where: str) -> int:
    """Image tokens in the prompt vs features the model's vision tower outputs; returns the image count."""
    from vlrl.models.families import tower_features  # each family's own arithmetic, found by model_type

    vision = encoded.vision
    token_id = getattr(proc.adapter, "image_token_id", None)
    if vision is None or token_id is None:
        return 0
    counted = tower_features(proc.config, vision, processor_merge_size=getattr(proc.adapter, "merge_size", None))
    if counted is None:
        report.warn(where, f"vision tokens not checked: no feature arithmetic for model family {proc.adapter.family!r}")
        return vision.num_images
    features, how = counted
    tokens = sum(1 for t in encoded.input_ids if t == token_id)
    grids = vision.image_grid_thw
    if grids is not None and vision.pixel_values is not None and vision.pixel_values.dim() == 2:
        patches = int(vision.pixel_values.shape[0])
        if patches != sum(int(g.prod()) for g in grids):
            report.problem(where, f"the image processor returned {patches} patches but its grids hold "
                           f"{sum(int(g.prod()) for g in grids)}")
            return vision.num_images
    if tokens != features:
        report.problem(where, f"{tokens} image tokens in the prompt but the vision tower outputs {features} features "
                       f"for {vision.num_images} image(s) ({how}): the forward pass would fail with "
                       "'Image features and image tokens do not match'")
    return vision.num_images
