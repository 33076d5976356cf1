"""The family layer: the only place that knows how a model family takes its inputs.

An adapter turns chat messages + images into prompt token ids and vision inputs, and turns a padded (or
packed) batch of token ids into the keyword arguments of the model's forward pass — position ids included,
so that a teacher-forced pass sees exactly the positions ``generate`` used. Everything above this file is
family-agnostic.

Adapters:

- `TextAdapter`: any causal LM (Qwen2, Llama, ...): 1-D positions from the attention mask.
- `VisionAdapter`: every vision-language family, driven by the family's own transformers processor and model
  (`vlrl.models.processor`), with no family code:

  * the chat template renders one placeholder per image (``processor.image_token``: ``<|image_pad|>``,
    ``<|image|>``, ``<IMG_CONTEXT>``, ``<start_of_image>``, ``<image>``, ...); the processor's own
    ``replace_image_token`` gives each image's expanded markup (a fixed-length run, a tile grid, an anyres
    count), and its outputs (``pixel_values``, ``image_grid_thw``, ``pixel_attention_mask``, ``image_sizes``,
    ``batch_num_images``, ...) are kept as they are and handed to the model as keyword arguments (those its
    ``forward`` takes);
  * token types (text 0, image 1, video 2 — the processor's ``image_token_ids`` / ``video_token_ids``) go to the
    model as ``mm_token_type_ids`` or ``token_type_ids``, whichever its ``forward`` takes (M-RoPE positions;
    Gemma 3's bidirectional attention over an image);
  * positions: the model's own ``get_rope_index`` where it has one (M-RoPE: Qwen2-VL ... Qwen3.5, GLM-4.xV),
    else 1-D from the attention mask;
  * tokens suppressed while sampling: the vision markup (every token of an expanded image, the config's vision
    token ids) and the tokenizer's other special tokens, never EOS;
  * rows that hold the same `VisionInputs` object (a GRPO group's n responses) encode their images once and
    hand the features to the model as ``mm_encoder_outputs`` — only when a check on the model has shown that
    this gives the same log-probs as the per-row path (`VisionAdapter.shares_images`).

Processors of one image differ in layout (patches × values, tiles × C × H × W, a per-sample batch of tiles,
images × padded anyres crops); `VisionInputs.concat` joins any of them along their first dimension, zero-padding
the others, which is how the families' own processors batch samples.
"""

from __future__ import annotations

import inspect
import logging
import weakref
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import torch
from PIL import Image

log = logging.getLogger(__name__)

# Processor outputs that are text, not vision inputs.
_TEXT_KEYS = {"input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids", "text_replacement_offsets"}


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


def _wrapped(model: torch.nn.Module) -> bool:
    """A DDP or FSDP2 module: its submodules must not be called outside its own forward."""
    from torch.distributed.fsdp import FSDPModule

    return hasattr(model, "module") or isinstance(model, FSDPModule)


def _inner(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers base model: through a DDP wrapper (``.module``), then ``ForConditionalGeneration.model``."""
    model = getattr(model, "module", model)
    inner = getattr(model, "model", None)
    return inner if isinstance(inner, torch.nn.Module) else model


VISION_TOWERS = ("visual", "vision_tower", "vision_model")  # where the families keep their vision encoder


def vision_tower(model: torch.nn.Module) -> torch.nn.Module | None:
    """The vision encoder of a transformers VLM (``model.visual`` of Qwen / GLM, ``vision_tower`` of InternVL /
    Gemma 3 / LLaVA-OV, ``vision_model`` of SmolVLM), or None for a text model."""
    inner = _inner(model)
    return next((getattr(inner, n) for n in VISION_TOWERS if isinstance(getattr(inner, n, None), torch.nn.Module)), None)


@cache
def _parameters(cls: type, method: str) -> frozenset[str]:
    """Parameter names of a transformers method (which processor outputs a model's ``forward`` takes)."""
    fn = getattr(cls, method, None)
    return frozenset(inspect.signature(fn).parameters) if fn is not None else frozenset()


@dataclass
class EncodedPrompt:
    """A prompt ready for generation: token ids (image placeholders expanded) and vision inputs."""

    input_ids: list[int]
    vision: VisionInputs | None


# The fixed conversation an observation is rendered after (slime's DUMMY_MESSAGES): the observation's tokens
# are what the chat template adds after the dummy assistant turn has ended, so the system prompt and the
# tool preamble (which templates emit at the start) are never repeated.
_DUMMY_USER = "vlrl-dummy-user-turn"
_DUMMY_ASSISTANT = "vlrl-dummy-assistant-turn"
DUMMY_MESSAGES = [{"role": "user", "content": _DUMMY_USER}, {"role": "assistant", "content": _DUMMY_ASSISTANT}]


def message_images(messages: list[dict[str, Any]]) -> list[Image.Image]:
    """The images carried inline by ``{"type": "image", "image": PIL.Image}`` parts, in order."""
    images = []
    for i, message in enumerate(messages):
        content = message.get("content")
        for j, part in enumerate(content if isinstance(content, list) else []):
            if isinstance(part, dict) and part.get("type") == "image":
                if not isinstance(part.get("image"), Image.Image):
                    raise ValueError(f"observation message {i} part {j}: an image part needs a PIL image under 'image'")
                images.append(part["image"])
    return images


class TextAdapter:
    """Causal language models without vision input."""

    family = "text"
    # Parameter groups by name prefix, for freezing (`align` trains only the projector) and per-module learning
    # rates. A text model has no vision tower and no projector.
    module_groups: dict[str, tuple[str, ...]] = {"llm": ("model.", "lm_head.")}

    # Padding-free rows hold one sequence each (set by `adapter_for`, see `one_sequence_per_row`).
    one_sequence_per_row = False
    # Extra variables of every chat-template rendering (`model.chat_template_kwargs`, e.g. enable_thinking=False);
    # set by `load_policy` / `load_processor` and the preflight check.
    chat_template_kwargs: dict[str, Any] = {}  # noqa: RUF012  (replaced per instance, never mutated)

    def __init__(self, tokenizer: Any, eos_token_ids: list[int] | None = None) -> None:
        self.tokenizer = tokenizer
        # The end-of-turn markers generation stops at (the model's generation config, else the tokenizer's eos).
        self.eos_token_ids = list(eos_token_ids) if eos_token_ids else [tokenizer.eos_token_id]

    def observation_text(
        self, messages: list[dict[str, Any]], *, close_turn: bool = False, tools: list[dict] | None = None
    ) -> str:
        """The chat-template text that ``messages`` add after an assistant turn, ending with the generation
        prompt of the next assistant turn (slime's delta encoding over a fixed dummy conversation).

        The assistant turn ends at the first end-of-turn marker (an EOS token of the model: ``<|im_end|>``,
        ``<end_of_turn>``, or GLM's ``<|user|>``, which opens the next turn) after the dummy reply; the model
        sampled that marker itself, so the observation starts after it. ``close_turn``: also include the marker
        (for a turn the model did not end itself, e.g. cut by its token budget). Image parts render as the
        template's placeholders.
        """
        full = self.tokenizer.apply_chat_template(
            DUMMY_MESSAGES + list(messages), tokenize=False, add_generation_prompt=True,
            **({"tools": tools} if tools else {}), **self.chat_template_kwargs,
        )
        at = full.find(_DUMMY_ASSISTANT)
        markers = [m for m in self.tokenizer.convert_ids_to_tokens(self.eos_token_ids) if m]
        found = [(full.find(m, at), m) for m in markers] if at >= 0 else []
        found = [(i, m) for i, m in found if i >= 0]
        if not found:
            raise ValueError(
                f"cannot delta-encode an observation: the chat template does not end the assistant turn with the "
                f"tokenizer's eos_token {self.tokenizer.eos_token!r} (or another EOS id of the model: {markers}); "
                "set tokenizer.eos_token to the template's end-of-turn marker"
            )
        end, marker = min(found)
        delta = full[end:] if close_turn else full[end + len(marker):]
        if _DUMMY_USER in delta or _DUMMY_ASSISTANT in delta:
            raise ValueError("cannot delta-encode an observation: the chat template re-renders earlier turns")
        return delta

    def encode_observation(
        self, messages: list[dict[str, Any]], *, close_turn: bool = False, tools: list[dict] | None = None
    ) -> EncodedPrompt:
        """Token ids (image placeholders expanded) and vision inputs of an observation appended to a
        running conversation; images come inline in the messages' image parts (`message_images`)."""
        vision = self.encode_images(message_images(messages))
        text = self.expand_image_tokens(self.observation_text(messages, close_turn=close_turn, tools=tools), vision)
        return EncodedPrompt(self.encode_text(text), vision)

    def expand_image_tokens(self, text: str, vision: VisionInputs | None) -> str:
        return text

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **self.chat_template_kwargs
        )

    def encode_prompt(self, messages: list[dict[str, Any]], images: list[Image.Image]) -> EncodedPrompt:
        vision = self.encode_images(images)
        return EncodedPrompt(self.encode_text(self.expand_image_tokens(self.render(messages), vision)), vision)

    def encode_text(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def encode_images(self, images: list[Image.Image]) -> VisionInputs | None:
        if images:
            raise ValueError(f"a text-only model cannot take images ({len(images)} given)")
        return None

    def expand_ids(self, ids: list[int], vision: VisionInputs | None) -> list[int]:
        """Token ids whose image placeholders are already expanded pass through; a text model has none."""
        if vision is not None:
            raise ValueError("a text-only model cannot take images")
        return ids

    def forward_inputs(
        self, model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, vision: VisionInputs | None
    ) -> dict[str, Any]:
        """Keyword arguments for ``model(**kwargs)`` on a (B, L) batch, positions from the mask."""
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # (B, L)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}

    def generate_inputs(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, vision: VisionInputs | None
    ) -> dict[str, Any]:
        """Keyword arguments for ``model.generate`` (positions are derived by transformers itself)."""
        return {"input_ids": input_ids, "attention_mask": attention_mask}

    def special_token_ids(self) -> list[int]:
        """Token ids that sampling must never produce (the caller keeps EOS)."""
        return sorted(set(self.tokenizer.all_special_ids))

    # --- packing (vlrl.data.packing, vlrl.models.packed)
    def image_token_count(self, width: int, height: int) -> int:
        """Vision tokens of one ``width`` × ``height`` image."""
        raise ValueError("a text-only model cannot take images")

    def count_prompt_tokens(self, messages: list[dict[str, Any]], image_sizes: list[tuple[int, int]]) -> int:
        """``len(encode_prompt(messages, images).input_ids)`` from the images' sizes alone (no pixel decoding)."""
        if image_sizes:
            raise ValueError("a text-only model cannot take images")
        return len(self.encode_text(self.render(messages)))

    def segment_position_ids(self, model: torch.nn.Module, input_ids: torch.Tensor, vision: VisionInputs | None) -> torch.Tensor:
        """(1, L) positions of one sequence laid out alone in a packed row: 0, 1, ..., L − 1."""
        return torch.arange(len(input_ids)).unsqueeze(0)

    def packed_forward_inputs(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, vision: VisionInputs | None
    ) -> dict[str, Any]:
        """Forward kwargs of a packed (N, T) batch: positions restart at 0 for every sequence and there is no
        attention mask, so transformers builds a block-diagonal causal mask (sdpa/eager) or hands the
        boundaries to flash-attention varlen (``position_ids`` → ``cu_seqlens``)."""
        return {"input_ids": input_ids, "position_ids": position_ids[0]}  # (N, T)


class NotShareable(Exception):
    """Encoder outputs whose structure `_join_outputs` cannot replicate per row."""


def _join(values: list[Any]) -> Any:
    """Join one field of several encoder outputs in row order: tensors along dim 0, per-image lists by
    concatenation, lists of per-image lists (DeepStack's per-layer features) layer by layer."""
    first = values[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(values)
    if isinstance(first, (list, tuple)) and all(isinstance(v, type(first)) and len(v) == len(first) for v in values):
        if first and all(isinstance(x, torch.Tensor) for x in first):
            return type(first)(x for v in values for x in v)
        if first and all(isinstance(x, (list, tuple)) for x in first):
            return type(first)(_join(list(layer)) for layer in zip(*values, strict=True))
    raise NotShareable(f"an encoder output field of type {type(first).__name__}")


# Per-layer diagnostics of an encoder output (the encoder has already read what it needs from them): not handed on.
_DIAGNOSTIC_FIELDS = ("hidden_states", "attentions")


def _join_outputs(outputs: list[Any]) -> Any:
    """The encoder output of several rows from the outputs of each (a transformers ``ModelOutput``)."""
    first = outputs[0]
    keys = [k for k in first.keys() if k not in _DIAGNOSTIC_FIELDS]
    if any([k for k in o.keys() if k not in _DIAGNOSTIC_FIELDS] != keys for o in outputs):
        raise NotShareable("encoder outputs with different fields")
    return type(first)(**{k: _join([o[k] for o in outputs]) for k in keys})


class VisionAdapter(TextAdapter):
    """Any vision-language family whose transformers processor and model follow transformers' multimodal API."""

    def __init__(self, tokenizer: Any, processor: Any, model_config: Any, eos_token_ids: list[int] | None = None) -> None:
        super().__init__(tokenizer, eos_token_ids)
        self.processor = processor
        self.image_processor = processor.image_processor
        self.config = model_config
        self.family = model_config.model_type
        self.image_placeholder: str = processor.image_token
        self.image_placeholder_id = tokenizer.convert_tokens_to_ids(self.image_placeholder)
        # The token the model scatters image features into (Qwen: the placeholder itself; Gemma 3: the soft token).
        self.image_token_id = _config_id(model_config, "image_token_id", "image_token_index")
        self.video_token_id = _config_id(model_config, "video_token_id", "video_token_index")
        self.merge_size = getattr(self.image_processor, "merge_size", None)
        self._image_type_ids = [i for i in processor.image_token_ids if i is not None]
        self._video_type_ids = [i for i in getattr(processor, "video_token_ids", []) if i is not None]
        self._sharing: weakref.WeakKeyDictionary[torch.nn.Module, bool] = weakref.WeakKeyDictionary()
        self._replacement_by_size: dict[tuple, str] = {}
        self._markup_by_sizes: dict[tuple, list[str]] = {}
        self.module_groups: dict[str, tuple[str, ...]] = {}  # found in the model by `adapter_for`
        self.markup_token_ids = self._markup_token_ids()

    # ------------------------------------------------------------------------------------------- encoding
    def encode_images(self, images: list[Image.Image]) -> VisionInputs | None:
        """The processor's outputs for ``images`` (one sample holding all of them) and each one's markup."""
        if not images:
            return None
        with torch.device("cpu"):  # also when a preset is built on the meta device (`load_processor`)
            out = self.processor(text=[self.image_placeholder * len(images)], images=list(images), return_tensors="pt",
                                 add_special_tokens=False, return_text_replacement_offsets=True)
        replacements = [r["replacement"] for r in out["text_replacement_offsets"][0] if r["type"] == "image"]
        if len(replacements) != len(images):
            raise ValueError(f"{type(self.processor).__name__} expanded {len(replacements)} of {len(images)} image(s)")
        tensors = {k: v for k, v in out.items() if k not in _TEXT_KEYS and isinstance(v, torch.Tensor)}
        return VisionInputs(tensors, num_images=len(images), replacements=replacements)

    def expand_image_tokens(self, text: str, vision: VisionInputs | None) -> str:
        """Replace the k-th image placeholder of ``text`` by image k's expanded markup."""
        pieces = text.split(self.image_placeholder)
        n_images = 0 if vision is None else vision.num_images
        if len(pieces) - 1 != n_images:
            raise ValueError(f"the prompt holds {len(pieces) - 1} image placeholder(s) but {n_images} image(s) were given")
        out = [pieces[0]]
        for k in range(n_images):
            out.append(vision.replacements[k] + pieces[k + 1])
        return "".join(out)

    def expand_ids(self, ids: list[int], vision: VisionInputs | None) -> list[int]:
        """Token ids with the images' markup already expanded pass through; one placeholder id per image is
        replaced by that image's expanded markup (tokenized on its own)."""
        n_images = 0 if vision is None else vision.num_images
        scattered = self.image_token_id if self.image_token_id is not None else self.image_placeholder_id
        found = ids.count(self.image_placeholder_id)
        if n_images == 0:
            if found or scattered in ids:
                raise ValueError(f"'input_ids' hold {max(found, ids.count(scattered))} image token(s) but no image "
                                 "was given")
            return ids
        expanded = [self.encode_text(r) for r in vision.replacements[:n_images]]
        want = sum(e.count(scattered) for e in expanded)
        if ids.count(scattered) == want:
            return ids
        if found != n_images:
            raise ValueError(f"'input_ids' hold {ids.count(scattered)} image token(s); expected {want} (expanded) or "
                             f"{n_images} placeholder(s) (one per image) for {n_images} image(s)")
        out, k = [], 0
        for t in ids:
            if t == self.image_placeholder_id:
                out.extend(expanded[k])
                k += 1
            else:
                out.append(t)
        return out

    def count_prompt_tokens(self, messages: list[dict[str, Any]], image_sizes: list[tuple[int, int]]) -> int:
        """``len(encode_prompt(messages, images).input_ids)`` from the images' (width, height) alone: each image's
        markup depends only on its size, so it is the processor's markup for a blank image of that size (cached
        per size)."""
        text = self.render(messages)
        pieces = text.split(self.image_placeholder)
        if len(pieces) - 1 != len(image_sizes):
            raise ValueError(f"the prompt holds {len(pieces) - 1} image placeholder(s) but {len(image_sizes)} "
                             "image(s) were given")
        if len(image_sizes) > 1:  # the markup of an image can depend on how many share its sample (LLaVA-OV)
            key = (tuple(tuple(size) for size in image_sizes), repr(getattr(self.image_processor, "size", None)))
            if key not in self._markup_by_sizes:
                if len(self._markup_by_sizes) > 4096:
                    self._markup_by_sizes.clear()
                images = [Image.new("RGB", tuple(size)) for size in image_sizes]
                self._markup_by_sizes[key] = self.encode_images(images).replacements
            markup = self._markup_by_sizes[key]
        else:
            markup = [self._replacement(size) for size in image_sizes]
        out = [pieces[0]]
        for k, piece in enumerate(pieces[1:]):
            out.append(markup[k] + piece)
        return len(self.encode_text("".join(out)))

    def _replacement(self, size: tuple[int, int]) -> str:
        """The markup of one image of ``size`` (cached per size and image-processor bounds)."""
        key = (*size, repr(getattr(self.image_processor, "size", None)))
        if key not in self._replacement_by_size:
            self._replacement_by_size[key] = self.encode_images([Image.new("RGB", tuple(size))]).replacements[0]
        return self._replacement_by_size[key]

    def image_token_count(self, width: int, height: int) -> int:
        """Vision tokens (the ones the model scatters features into) of one ``width`` × ``height`` image."""
        scattered = self.image_token_id if self.image_token_id is not None else self.image_placeholder_id
        return self.encode_text(self._replacement((width, height))).count(scattered)

    def _markup_token_ids(self) -> list[int]:
        """The vision markup: the config's vision token ids, the processor's, and every special token of an
        expanded image (found by expanding a blank one)."""
        ids = {v for k, v in vars(self.config).items() if isinstance(v, int) and not isinstance(v, bool)
               and (k.endswith("_token_id") or k.endswith("_token_index"))
               and not any(s in k for s in ("bos", "eos", "pad", "sep", "decoder"))}
        ids |= set(self._image_type_ids) | set(self._video_type_ids) | {self.image_placeholder_id}
        expanded = self.encode_text(self._replacement((64, 64)))
        special = set(self.tokenizer.all_special_ids)
        ids |= {t for t in expanded if t in special or t in ids}
        return sorted(i for i in ids if i is not None and 0 <= i < len(self.tokenizer))

    def special_token_ids(self) -> list[int]:
        return sorted(set(self.markup_token_ids) | set(self.tokenizer.all_special_ids))

    # ------------------------------------------------------------------------------------------- the model's inputs
    def token_types(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(B, L) modality of every token: text 0, image 1, video 2 (the processor's token lists)."""
        types = torch.zeros_like(input_ids, dtype=torch.int32)
        if self._image_type_ids:
            types[torch.isin(input_ids, torch.tensor(self._image_type_ids, device=input_ids.device))] = 1
        if self._video_type_ids:
            types[torch.isin(input_ids, torch.tensor(self._video_type_ids, device=input_ids.device))] = 2
        return types

    @staticmethod
    def _types_key(model: torch.nn.Module) -> str | None:
        params = _parameters(type(getattr(model, "module", model)), "forward")
        return next((k for k in ("mm_token_type_ids", "token_type_ids") if k in params), None)

    @staticmethod
    def _rope_model(model: torch.nn.Module) -> torch.nn.Module | None:
        inner = _inner(model)
        return inner if callable(getattr(inner, "get_rope_index", None)) else None

    def _rope_positions(self, model, input_ids, attention_mask, vision: VisionInputs | None) -> torch.Tensor:
        """(3, B, L) M-RoPE positions from the model's own ``get_rope_index``."""
        grids = {} if vision is None else {"image_grid_thw": vision.occurrence("image_grid_thw"),
                                           "video_grid_thw": vision.occurrence("video_grid_thw")}
        positions, _ = self._rope_model(model).get_rope_index(
            input_ids, mm_token_type_ids=self.token_types(input_ids), attention_mask=attention_mask,
            **{k: v.to(input_ids.device) for k, v in grids.items() if v is not None},
        )
        return positions

    def _vision_kwargs(self, model: torch.nn.Module, vision: VisionInputs) -> dict[str, Any]:
        params = _parameters(type(getattr(model, "module", model)), "forward")
        return {k: v for k, v in vision.expanded().tensors.items() if k in params}

    def forward_inputs(self, model, input_ids, attention_mask, vision):
        kwargs: dict[str, Any] = {"input_ids": input_ids, "attention_mask": attention_mask}
        if self._rope_model(model) is not None:
            kwargs["position_ids"] = self._rope_positions(model, input_ids, attention_mask, vision)
        else:
            kwargs["position_ids"] = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # (B, L)
        types_key = self._types_key(model)
        if types_key is not None:
            kwargs[types_key] = self.token_types(input_ids)
        if vision is None:
            return kwargs
        if vision.parts is not None and self.shares_images(model, kwargs, vision):
            kwargs.update(self._shared_kwargs(model, vision))
        else:
            kwargs.update(self._vision_kwargs(model, vision))
        return kwargs

    def generate_inputs(self, input_ids, attention_mask, vision):
        kwargs: dict[str, Any] = {"input_ids": input_ids, "attention_mask": attention_mask}
        model_cls = self._model_cls
        if model_cls is not None:
            params = _parameters(model_cls, "forward")
            types_key = next((k for k in ("mm_token_type_ids", "token_type_ids") if k in params), None)
            if types_key is not None:
                kwargs[types_key] = self.token_types(input_ids)
            if vision is not None:
                kwargs.update({k: v for k, v in vision.expanded().tensors.items() if k in params})
        return kwargs

    _model_cls: type | None = None  # the model class (set by `adapter_for`): which kwargs its forward takes

    # ------------------------------------------------------------------------------------------- shared images
    def _feature_keys(self, model: torch.nn.Module) -> frozenset[str]:
        return _parameters(type(_inner(model)), "get_image_features")

    def _shared_kwargs(self, model: torch.nn.Module, vision: VisionInputs) -> dict[str, Any]:
        """``mm_encoder_outputs``: every distinct part's images encoded once, the features joined in row order;
        plus the vision inputs the encoder does not take (in per-row form)."""
        inner = _inner(model)
        keys = self._feature_keys(model)
        outputs = [inner.get_image_features(**{k: v for k, v in part.tensors.items() if k in keys}, return_dict=True)
                   for part in vision.parts]
        joined = _join_outputs([outputs[k] for k in vision.part_index])
        params = _parameters(type(getattr(model, "module", model)), "forward")
        rest = {k: vision.occurrence(k) for k in vision.tensors if k in params and k not in keys}
        return {"mm_encoder_outputs": {"image": joined}, **rest}

    def shares_images(self, model: torch.nn.Module, kwargs: dict[str, Any] | None = None,
                      vision: VisionInputs | None = None) -> bool | None:
        """Whether rows sharing images encode them once for ``model``.

        Decided by a check, once per model, on the first batch that shares images (``kwargs`` / ``vision``): the
        logits of the shared path must equal those of the per-row path (max |Δ| ≤ 1e-4); otherwise the per-row
        path is used from then on. A family whose vision features are more than what the shared path hands
        over (e.g. Qwen3-VL's DeepStack features, if they were dropped) fails the check. Never for a DDP / FSDP2
        module (its hooks run in the root's forward only) or inputs holding videos. None: not checked yet."""
        if _wrapped(model) or not callable(getattr(_inner(model), "get_image_features", None)):
            return False
        if model in self._sharing or vision is None:
            return self._sharing.get(model)
        if vision.num_videos or any(p.num_videos for p in vision.parts or []):
            return False
        self._sharing[model] = self._check_sharing(model, kwargs, vision)
        return self._sharing[model]

    @torch.no_grad()
    def _check_sharing(self, model, kwargs: dict[str, Any], vision: VisionInputs) -> bool:
        """Both paths on this batch: the log-probs of the last 16 positions (they see every image's features) of a
        language model, or the hidden states of a backbone without a head (the critic's), must agree to 1e-4."""
        keep = min(16, kwargs["input_ids"].shape[1])
        extra = {"use_cache": False}
        if "logits_to_keep" in _parameters(type(getattr(model, "module", model)), "forward"):
            extra["logits_to_keep"] = keep
        try:
            shared = _output(model(**kwargs, **self._shared_kwargs(model, vision), **extra))
        except (NotShareable, TypeError, ValueError, RuntimeError) as err:
            log.info("%s: the shared-image path is not used (%s)", self.family, err)
            return False
        per_row = _output(model(**kwargs, **self._vision_kwargs(model, vision), **extra))
        mask = kwargs["attention_mask"][:, -shared.shape[1]:].bool()
        diff = float((shared - per_row)[mask].abs().max())
        if diff > 1e-4:
            log.warning("%s: encoding a shared image once changes the model's output by %.3g; using the per-row path",
                        self.family, diff)
            return False
        return True

    # ------------------------------------------------------------------------------------------- packing
    def segment_position_ids(self, model, input_ids, vision):
        """Positions of one sequence laid out alone in a packed row: (1, L) 0 .. L − 1, or for M-RoPE families
        (4, L): those text positions (which transformers reads to find the sequence boundaries of a packed row)
        then the sequence's own (t, h, w) positions from the model's ``get_rope_index``."""
        text = torch.arange(len(input_ids)).unsqueeze(0)  # (1, L)
        if self._rope_model(model) is None:
            return text
        ids = input_ids.unsqueeze(0)  # (1, L)
        rope = self._rope_positions(model, ids, None, vision)  # (3, 1, L)
        return torch.cat([text.to(rope.device), rope[:, 0]], dim=0)

    def packed_forward_inputs(self, input_ids, position_ids, vision):
        rope = position_ids.shape[0] > 1
        kwargs: dict[str, Any] = {"input_ids": input_ids, "position_ids": position_ids if rope else position_ids[0]}
        model_cls = self._model_cls
        params = _parameters(model_cls, "forward") if model_cls is not None else frozenset()
        types_key = next((k for k in ("mm_token_type_ids", "token_type_ids") if k in params), None)
        if types_key is not None:
            kwargs[types_key] = self.token_types(input_ids)
        if vision is not None:
            kwargs.update({k: v for k, v in vision.expanded().tensors.items() if k in params})
        return kwargs


def _output(out: Any) -> torch.Tensor:
    """What the sharing check compares: log-softmax of the logits, or a backbone's last hidden state."""
    logits = getattr(out, "logits", None)
    if logits is not None:
        return logits.float().log_softmax(-1)
    return out.last_hidden_state.float()


def _config_id(config: Any, *names: str) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


def _module_groups(model: torch.nn.Module | None) -> dict[str, tuple[str, ...]]:
    """Parameter-name prefixes of the vision tower, the projector and the language model, found in the model."""
    if model is None:
        return {}
    names = [n for n, _ in model.named_parameters()]
    groups: dict[str, tuple[str, ...]] = {}
    for group, candidates in _GROUP_CANDIDATES.items():
        found = tuple(c for c in candidates if any(n.startswith(c) for n in names))
        if found:
            groups[group] = found
    return groups


# Where the families keep their parts (the most specific prefix wins: `vlrl.train.modules`).
_GROUP_CANDIDATES = {
    "projector": ("model.visual.merger.", "model.visual.deepstack_merger_list.", "model.multi_modal_projector.",
                  "model.connector.", "model.mlp1."),
    "vision": ("model.visual.", "model.vision_tower.", "model.vision_model."),
    "llm": ("model.language_model.", "model.text_model.", "lm_head."),
}


def Qwen2VLAdapter(tokenizer: Any, image_processor: Any, model_config: Any) -> VisionAdapter:  # noqa: N802
    """A `VisionAdapter` for a Qwen2-VL-style config from its tokenizer and image processor (kept for callers
    that build an adapter by hand)."""
    return adapter_for(model_config, tokenizer, image_processor)


def adapter_for(model_config: Any, tokenizer: Any, image_processor: Any | None, *, processor: Any | None = None,
                source: str | None = None, model: torch.nn.Module | None = None,
                eos_token_ids: list[int] | None = None) -> TextAdapter:
    """The adapter of a transformers model config: `VisionAdapter` for any config with a vision tower (its
    processor built from ``tokenizer`` and ``image_processor`` with the settings in ``source``'s
    ``processor_config.json`` unless given), `TextAdapter` otherwise."""
    if not hasattr(model_config, "vision_config"):
        adapter = TextAdapter(tokenizer, eos_token_ids)
        adapter.one_sequence_per_row = one_sequence_per_row(model_config, type(model) if model is not None else None)
        return adapter
    if processor is None:
        if image_processor is None:
            raise ValueError(f"{model_config.model_type} needs an image processor next to the model "
                             "(preprocessor_config.json)")
        from vlrl.models.processor import build_processor, load_processor_settings

        settings = load_processor_settings(source) if source is not None else {}
        processor = build_processor(model_config, tokenizer, image_processor, **settings)
    adapter = VisionAdapter(tokenizer, processor, model_config, eos_token_ids)
    if model is not None:
        adapter._model_cls = type(model)
        adapter.module_groups = _module_groups(model)
    else:
        adapter._model_cls = _model_class(model_config)
    adapter.one_sequence_per_row = one_sequence_per_row(model_config, adapter._model_cls)
    return adapter


_ATTENTION_LAYERS = {"full_attention", "sliding_attention", "chunked_attention", "attention"}


def one_sequence_per_row(model_config: Any, model_cls: type | None) -> bool:
    """Whether padding-free rows must hold one sequence each for this model to be exact:

    - recurrent layers (Qwen3.5's Gated DeltaNet, Mamba, ...; a text config's ``layer_types`` other than
      attention) carry their state from one sequence into the next in a packed row — only varlen kernels
      (flash-linear-attention with ``cu_seqlens``) would stop it, and transformers' PyTorch fallback has none;
    - an attention mask that depends on token types (Gemma 3's bidirectional attention within an image, its
      forward takes ``token_type_ids``): transformers 5 applies the image blocks of sliding-window layers at
      positions remapped for packing, so an image of a second sequence in the row attends to the wrong tokens.
    """
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    layer_types = set(getattr(text, "layer_types", None) or [])
    if layer_types - _ATTENTION_LAYERS:
        return True
    return model_cls is not None and "token_type_ids" in _parameters(model_cls, "forward")


def _model_class(model_config: Any) -> type | None:
    from transformers import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING  # the table of AutoModelForImageTextToText

    try:
        return MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING[type(model_config)]
    except KeyError:
        return None
