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

What a family needs beyond that lives in its module (`vlrl.models.families`): where its model keeps its vision
tower and its parts (`vision_tower`, the adapter's ``module_groups``), its presets and their markup. Vision
inputs are `vlrl.models.vision_inputs.VisionInputs`; the shared-image path's pieces are in
`vlrl.models.shared_images`.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch
from PIL import Image

from vlrl.models.families import module_prefixes, vision_tower_names
from vlrl.models.introspect import (
    image_text_model_class,
    inner_model,
    is_wrapped,
    method_parameters,
    one_sequence_per_row,
)
from vlrl.models.shared_images import NotShareable, compared_output, join_outputs
from vlrl.models.vision_inputs import EncodedPrompt, VisionInputs

log = logging.getLogger(__name__)

# Processor outputs that are text, not vision inputs.
_TEXT_KEYS = {"input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids", "text_replacement_offsets"}


def vision_tower(model: torch.nn.Module) -> torch.nn.Module | None:
    """The vision encoder of a transformers VLM (``model.visual`` of Qwen / GLM, ``vision_tower`` of InternVL /
    Gemma 3 / LLaVA-OV, ``vision_model`` of SmolVLM: its family's `vlrl.models.families.Family.vision_tower`), or
    None for a text model."""
    inner = inner_model(model)
    config = getattr(getattr(model, "module", model), "config", None)
    names = vision_tower_names(getattr(config, "model_type", None))
    return next((getattr(inner, n) for n in names if isinstance(getattr(inner, n, None), torch.nn.Module)), None)


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
        params = method_parameters(type(getattr(model, "module", model)), "forward")
        return next((k for k in ("mm_token_type_ids", "token_type_ids") if k in params), None)

    @staticmethod
    def _rope_model(model: torch.nn.Module) -> torch.nn.Module | None:
        inner = inner_model(model)
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
        params = method_parameters(type(getattr(model, "module", model)), "forward")
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
            params = method_parameters(model_cls, "forward")
            types_key = next((k for k in ("mm_token_type_ids", "token_type_ids") if k in params), None)
            if types_key is not None:
                kwargs[types_key] = self.token_types(input_ids)
            if vision is not None:
                kwargs.update({k: v for k, v in vision.expanded().tensors.items() if k in params})
        return kwargs

    _model_cls: type | None = None  # the model class (set by `adapter_for`): which kwargs its forward takes

    # ------------------------------------------------------------------------------------------- shared images
    def _feature_keys(self, model: torch.nn.Module) -> frozenset[str]:
        return method_parameters(type(inner_model(model)), "get_image_features")

    def _shared_kwargs(self, model: torch.nn.Module, vision: VisionInputs) -> dict[str, Any]:
        """``mm_encoder_outputs``: every distinct part's images encoded once, the features joined in row order;
        plus the vision inputs the encoder does not take (in per-row form)."""
        inner = inner_model(model)
        keys = self._feature_keys(model)
        outputs = [inner.get_image_features(**{k: v for k, v in part.tensors.items() if k in keys}, return_dict=True)
                   for part in vision.parts]
        joined = join_outputs([outputs[k] for k in vision.part_index])
        params = method_parameters(type(getattr(model, "module", model)), "forward")
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
        if is_wrapped(model) or not callable(getattr(inner_model(model), "get_image_features", None)):
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
        if "logits_to_keep" in method_parameters(type(getattr(model, "module", model)), "forward"):
            extra["logits_to_keep"] = keep
        try:
            shared = compared_output(model(**kwargs, **self._shared_kwargs(model, vision), **extra))
        except (NotShareable, TypeError, ValueError, RuntimeError) as err:
            log.info("%s: the shared-image path is not used (%s)", self.family, err)
            return False
        per_row = compared_output(model(**kwargs, **self._vision_kwargs(model, vision), **extra))
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
        params = method_parameters(model_cls, "forward") if model_cls is not None else frozenset()
        types_key = next((k for k in ("mm_token_type_ids", "token_type_ids") if k in params), None)
        if types_key is not None:
            kwargs[types_key] = self.token_types(input_ids)
        if vision is not None:
            kwargs.update({k: v for k, v in vision.expanded().tensors.items() if k in params})
        return kwargs


def _config_id(config: Any, *names: str) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


def module_groups(model: torch.nn.Module | None, model_type: str | None) -> dict[str, tuple[str, ...]]:
    """Parameter-name prefixes of the vision tower, the projector and the language model: those of the family's
    `vlrl.models.families.Family.module_prefixes` that some parameter of the model starts with (the most specific
    prefix wins: `vlrl.train.modules`)."""
    if model is None:
        return {}
    names = [n for n, _ in model.named_parameters()]
    groups: dict[str, tuple[str, ...]] = {}
    for group, candidates in module_prefixes(model_type).items():
        found = tuple(c for c in candidates if any(n.startswith(c) for n in names))
        if found:
            groups[group] = found
    return groups


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
        adapter.module_groups = module_groups(model, model_config.model_type)
    else:
        adapter._model_cls = image_text_model_class(model_config)
    adapter.one_sequence_per_row = one_sequence_per_row(model_config, adapter._model_cls)
    return adapter

