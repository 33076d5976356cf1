"""Family adapters: the only place that knows a model family's quirks.

An adapter turns chat messages + images into prompt token ids and processor outputs, and turns a padded
batch of token ids into the keyword arguments of the model's forward pass (position ids included, so
that a teacher-forced pass sees exactly the positions `generate` used). Everything above this file is
family-agnostic.

Families:
- ``text``: any causal LM (Qwen2, Llama, ...): 1-D positions from the attention mask.
- ``qwen2_vl``: Qwen2-VL and Qwen2.5-VL: ``<|image_pad|>`` expanded to ``prod(grid_thw) / merge²`` tokens
  per image, M-RoPE 3-D positions from the model's own ``get_rope_index``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image


@dataclass
class VisionInputs:
    """Processor outputs of the images of one sequence (all turns, in order of appearance)."""

    pixel_values: torch.Tensor  # (num_patches, patch_dim)
    image_grid_thw: torch.Tensor  # (num_images, 3)
    # (num_occurrences,) which of the images above each image placeholder run shows, in order; None = one each.
    # Set by `concat_shared` when rows share images (a GRPO group's n responses), so each is encoded once.
    image_index: torch.Tensor | None = None

    def to(self, device) -> VisionInputs:
        index = self.image_index.to(device) if self.image_index is not None else None
        return VisionInputs(self.pixel_values.to(device), self.image_grid_thw.to(device), index)

    @staticmethod
    def concat(items: list[VisionInputs | None]) -> VisionInputs | None:
        present = [v for v in items if v is not None]
        if not present:
            return None
        return VisionInputs(
            pixel_values=torch.cat([v.pixel_values for v in present]),
            image_grid_thw=torch.cat([v.image_grid_thw for v in present]),
        )

    def expanded(self) -> VisionInputs:
        """The same images one copy per occurrence (``image_index`` resolved): what `concat` would have built."""
        if self.image_index is None:
            return self
        sizes = self.image_grid_thw.prod(-1).tolist()  # patches per image
        pieces = torch.split(self.pixel_values, sizes)
        index = self.image_index.tolist()
        return VisionInputs(torch.cat([pieces[k] for k in index]), self.image_grid_thw[self.image_index])

    @staticmethod
    def concat_shared(items: list[VisionInputs | None]) -> VisionInputs | None:
        """`concat`, but rows holding the same `VisionInputs` object (the n responses of one prompt) contribute
        its images once, with ``image_index`` mapping every occurrence to them; plain `concat` when none repeat."""
        present = [v for v in items if v is not None]
        unique: dict[int, tuple[int, VisionInputs]] = {}  # id → (index of its first image, inputs)
        index: list[int] = []
        n_images = 0
        for v in present:
            if id(v) not in unique:
                unique[id(v)] = (n_images, v)
                n_images += len(v.image_grid_thw)
            first = unique[id(v)][0]
            index.extend(range(first, first + len(v.image_grid_thw)))
        if len(unique) == len(present):
            return VisionInputs.concat(items)
        shared = VisionInputs.concat([v for _, v in unique.values()])
        return VisionInputs(shared.pixel_values, shared.image_grid_thw, torch.tensor(index, dtype=torch.long))


def _wrapped(model: torch.nn.Module) -> bool:
    """A DDP or FSDP2 module: its submodules must not be called outside its own forward."""
    from torch.distributed.fsdp import FSDPModule

    return hasattr(model, "module") or isinstance(model, FSDPModule)


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

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def observation_text(
        self, messages: list[dict[str, Any]], *, close_turn: bool = False, tools: list[dict] | None = None
    ) -> str:
        """The chat-template text that ``messages`` add after an assistant turn, ending with the generation
        prompt of the next assistant turn (slime's delta encoding over a fixed dummy conversation).

        ``close_turn``: also include the end-of-turn marker of the assistant turn (for a turn the model did
        not end itself, e.g. cut by its token budget). Image parts render as the template's placeholders.
        """
        eos = self.tokenizer.eos_token
        full = self.tokenizer.apply_chat_template(
            DUMMY_MESSAGES + list(messages), tokenize=False, add_generation_prompt=True,
            **({"tools": tools} if tools else {}),
        )
        at = full.find(_DUMMY_ASSISTANT)
        end = full.find(eos, at) if at >= 0 and eos else -1
        if end < 0:
            raise ValueError(
                f"cannot delta-encode an observation: the chat template does not end the assistant turn with the "
                f"tokenizer's eos_token {eos!r}; set tokenizer.eos_token to the template's end-of-turn marker"
            )
        delta = full[end:] if close_turn else full[end + len(eos):]
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
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def encode_prompt(self, messages: list[dict[str, Any]], images: list[Image.Image]) -> EncodedPrompt:
        if images:
            raise ValueError(f"a text-only model cannot take images ({len(images)} given)")
        return EncodedPrompt(self.encode_text(self.render(messages)), None)

    def encode_text(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def encode_images(self, images: list[Image.Image]) -> VisionInputs | None:
        if images:
            raise ValueError(f"a text-only model cannot take images ({len(images)} given)")
        return None

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
        return sorted(set(self.tokenizer.all_special_ids))

    # --- packing and staged training (vlrl.data.packing, vlrl.models.packed, vlrl.train.stages)
    # Parameter groups by name prefix, for freezing (`align` trains only the projector) and per-module learning
    # rates. A text model has no vision tower and no projector.
    module_groups: dict[str, tuple[str, ...]] = {"llm": ("model.", "lm_head.")}

    def image_token_count(self, width: int, height: int) -> int:
        """Vision tokens of one ``width`` × ``height`` image, by the processor's own arithmetic."""
        raise ValueError("a text-only model cannot take images")

    def count_prompt_tokens(self, messages: list[dict[str, Any]], image_sizes: list[tuple[int, int]]) -> int:
        """``len(encode_prompt(messages, images).input_ids)`` from the images' sizes alone (no pixel decoding):
        the rendered prompt holds one placeholder token per image, which expands to that image's count."""
        base = len(self.encode_text(self.render(messages)))
        return base + sum(self.image_token_count(w, h) - 1 for w, h in image_sizes)

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


class Qwen2VLAdapter(TextAdapter):
    """Qwen2-VL / Qwen2.5-VL (and any model with the same processor and M-RoPE interface)."""

    family = "qwen2_vl"

    def __init__(self, tokenizer: Any, image_processor: Any, model_config: Any) -> None:
        super().__init__(tokenizer)
        self.image_processor = image_processor
        self.image_token = "<|image_pad|>"
        self.image_token_id = model_config.image_token_id
        self.merge_size = image_processor.merge_size

    def encode_images(self, images: list[Image.Image]) -> VisionInputs | None:
        if not images:
            return None
        out = self.image_processor(images=images, return_tensors="pt")
        return VisionInputs(pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"])

    def expand_image_tokens(self, text: str, vision: VisionInputs | None) -> str:
        """Replace the k-th ``<|image_pad|>`` by as many copies as image k has vision tokens."""
        pieces = text.split(self.image_token)
        n_images = 0 if vision is None else len(vision.image_grid_thw)
        if len(pieces) - 1 != n_images:
            raise ValueError(f"the prompt holds {len(pieces) - 1} image placeholder(s) but {n_images} image(s) were given")
        out = [pieces[0]]
        for k in range(n_images):
            n_tokens = int(vision.image_grid_thw[k].prod()) // self.merge_size**2
            out.append(self.image_token * n_tokens + pieces[k + 1])
        return "".join(out)

    def encode_prompt(self, messages: list[dict[str, Any]], images: list[Image.Image]) -> EncodedPrompt:
        vision = self.encode_images(images)
        text = self.expand_image_tokens(self.render(messages), vision)
        return EncodedPrompt(self.encode_text(text), vision)

    def _mm_token_type_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return (input_ids == self.image_token_id).int()  # text 0, image 1

    def forward_inputs(self, model, input_ids, attention_mask, vision):
        if vision is None:
            position_ids = super().forward_inputs(model, input_ids, attention_mask, None)["position_ids"]
            return {"input_ids": input_ids, "attention_mask": attention_mask,
                    "position_ids": position_ids.unsqueeze(0).expand(3, -1, -1)}
        mm_token_type_ids = self._mm_token_type_ids(input_ids)
        if vision.image_index is not None and _wrapped(model):  # DDP / FSDP2 run their hooks in the root's forward
            vision = vision.expanded()  # only: let the model encode every copy itself
        model = getattr(model, "module", model)  # a DDP wrapper holds the transformers model in .module
        inner = model.model if hasattr(model, "model") else model
        grid = vision.image_grid_thw if vision.image_index is None else vision.image_grid_thw[vision.image_index]
        position_ids, _ = inner.get_rope_index(
            input_ids, mm_token_type_ids=mm_token_type_ids, image_grid_thw=grid, attention_mask=attention_mask,
        )  # (3, B, L)
        if vision.image_index is not None:  # shared images: encode each once, copy its features to every row
            features = inner.get_image_features(vision.pixel_values, vision.image_grid_thw).pooler_output  # per image
            copies = torch.cat([features[k] for k in vision.image_index.tolist()])  # (image tokens, D)
            embeds = inner.get_input_embeddings()(input_ids)  # (B, L, D)
            slots = (input_ids == self.image_token_id).unsqueeze(-1).expand_as(embeds)
            if int(slots[..., 0].sum()) != copies.shape[0]:
                raise ValueError(f"{int(slots[..., 0].sum())} image tokens in the batch but {copies.shape[0]} image features")
            return {"inputs_embeds": embeds.masked_scatter(slots, copies.to(embeds.dtype)), "attention_mask": attention_mask,
                    "position_ids": position_ids}
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "pixel_values": vision.pixel_values,
            "image_grid_thw": vision.image_grid_thw,
            "mm_token_type_ids": mm_token_type_ids,
        }

    # Qwen2-VL / Qwen2.5-VL: the vision tower is ``model.visual`` (its ``merger`` is the projector into the LLM).
    module_groups = {"projector": ("model.visual.merger.",), "vision": ("model.visual.",),
                     "llm": ("model.language_model.", "lm_head.")}

    def image_token_count(self, width: int, height: int) -> int:
        return self.image_processor.get_number_of_image_patches(height, width) // self.merge_size**2

    def segment_position_ids(self, model, input_ids, vision):
        """(4, L): the text positions 0..L − 1 (which transformers reads to find the sequence boundaries of a
        packed row), then the sequence's own M-RoPE (t, h, w) positions from the model's `get_rope_index`."""
        text = torch.arange(len(input_ids)).unsqueeze(0)  # (1, L)
        if vision is None:
            return text.expand(4, -1)
        ids = input_ids.unsqueeze(0)  # (1, L)
        model = getattr(model, "module", model)  # a DDP wrapper holds the transformers model in .module
        inner = model.model if hasattr(model, "model") else model
        mrope, _ = inner.get_rope_index(ids, mm_token_type_ids=self._mm_token_type_ids(ids),
                                        image_grid_thw=vision.image_grid_thw.to(ids.device))  # (3, 1, L)
        return torch.cat([text.to(mrope.device), mrope[:, 0]], dim=0)

    def packed_forward_inputs(self, input_ids, position_ids, vision):
        kwargs: dict[str, Any] = {"input_ids": input_ids, "position_ids": position_ids}  # (4, N, T)
        if vision is not None:
            kwargs.update(pixel_values=vision.pixel_values, image_grid_thw=vision.image_grid_thw,
                          mm_token_type_ids=self._mm_token_type_ids(input_ids))
        return kwargs

    def generate_inputs(self, input_ids, attention_mask, vision):
        kwargs: dict[str, Any] = {"input_ids": input_ids, "attention_mask": attention_mask}
        if vision is not None:
            kwargs.update(pixel_values=vision.pixel_values, image_grid_thw=vision.image_grid_thw,
                          mm_token_type_ids=self._mm_token_type_ids(input_ids))
        return kwargs


def adapter_for(model_config: Any, tokenizer: Any, image_processor: Any | None) -> TextAdapter:
    """Pick the adapter for a transformers model config."""
    model_type = getattr(model_config, "model_type", "")
    if model_type in ("qwen2_vl", "qwen2_5_vl"):
        if image_processor is None:
            raise ValueError(f"{model_type} needs an image processor next to the model (preprocessor_config.json)")
        return Qwen2VLAdapter(tokenizer, image_processor, model_config)
    if hasattr(model_config, "vision_config"):
        raise ValueError(
            f"model family {model_type!r} has a vision tower but no vlrl adapter yet; "
            "add one in vlrl/models/adapters.py (image-token expansion and position ids)"
        )
    return TextAdapter(tokenizer)
