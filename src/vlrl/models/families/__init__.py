"""Model families: one module per family, found by the model config's ``model_type``.

vlrl's family layer is driven by each family's own transformers processor and model (`vlrl.models.adapters`), so a
family module holds only what transformers does not say:

- its tiny presets (`PresetSpec`: a real config class at toy size, the family's PIL image processor, the processor's
  settings) and their tokenizer `Markup` (special tokens, named tokens, a chat template in the family's style);
- where its model keeps its parts: the vision tower's attribute and the parameter-name prefixes of its projector,
  vision tower and language model (the module groups of ``train.trainable`` / ``optim.module_lr``);
- how many features its vision tower outputs for the processor's outputs, read from the *model* config
  (`tower_features`: ``vlrl check`` holds the processor's image tokens to it);
- the real checkpoints' image-processor pixel bounds (a bare ``config.json`` gets a stand-in processor,
  `vlrl.models.config_only`);
- its quirks (Gemma 3's zero-initialised image projection, drawn at random in its preset).

Each module of this package defines ``FAMILY = Family(...)``. The package finds them itself (every module in this
folder) and registers each under its model types in `FAMILIES` (`vlrl.registry`; a model type claimed twice is
an error). Adding a family is one new module here: its presets join `vlrl.models.presets.PRESETS`, and the family
tests run every vision preset of it (`vlrl.models.presets.FAMILY_PRESETS`).
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import cache
from typing import TYPE_CHECKING, Any

from vlrl.models.markup import Markup
from vlrl.registry import Registry, RegistryError

if TYPE_CHECKING:
    import torch

    from vlrl.models.vision_inputs import VisionInputs

# The vision tower's output count from the model config: fn(config, vision, *, processor_merge_size) →
# (features, how it was counted), or None when the config lacks what the family's arithmetic reads.
TowerFeatures = Callable[..., "tuple[int, str] | None"]


@dataclass(frozen=True)
class PresetSpec:
    """One tiny preset.

    Attributes:
        family: the transformers ``model_type`` of the model it builds.
        markup: the tokenizer markup (`vlrl.models.markup.Markup`).
        build: ``build(ids) -> (config, image_processor, processor_settings)``; ``ids`` maps token strings to ids
            (``"__vocab__"``: the tokenizer's size). A text model's image processor is None.
        vocab_size: BPE vocabulary size before the added tokens.
        post_init: changes the built model's random weights (under ``torch.no_grad``), e.g. an initialisation the
            family's own code leaves at zero.
    """

    family: str
    markup: Markup
    build: Callable[[dict[str, int]], tuple[Any, Any, dict[str, Any]]]
    vocab_size: int = 1024
    post_init: Callable[[torch.nn.Module], None] | None = None


@dataclass(frozen=True, eq=False)  # eq=False: a family is itself (hashable, compared by identity)
class Family:
    """What vlrl knows about one model family beyond what transformers derives from its config and processor.

    Attributes:
        model_types: the transformers ``model_type`` values it covers (its keys in `FAMILIES`).
        order: where its presets are listed (`vlrl.models.presets.PRESETS`, error messages): families in the order
            they were added, text-only families after the vision ones.
        presets: its tiny presets by name (``tiny-…``), the first of each model type its stand-in.
        vision_tower: the attribute of the base model (``model.model``) that holds its vision encoder.
        module_prefixes: parameter-name prefixes of its parts by module group (``projector``, ``vision``, ``llm``);
            a group takes the prefixes some parameter of the model starts with.
        tower_features: its vision tower's feature count (`TowerFeatures`), for ``vlrl check``.
        pixel_bounds: (min_pixels, max_pixels) of the real checkpoints' image processor, for a stand-in one.
    """

    model_types: tuple[str, ...]
    order: int
    presets: dict[str, PresetSpec] = field(default_factory=dict, repr=False)
    vision_tower: str | None = None
    module_prefixes: dict[str, tuple[str, ...]] = field(default_factory=dict, repr=False)
    tower_features: TowerFeatures | None = field(default=None, repr=False)
    pixel_bounds: tuple[int, int] | None = None


FAMILIES = Registry("model family", signature="Family (vlrl.models.families), under each of its model types")


def load_families(package: str, path: Iterable[str], registry: Registry) -> tuple[Family, ...]:
    """Import every module of ``package`` (its folder(s) ``path``), register each one's ``FAMILY`` in ``registry``
    under its model types, and return them in `Family.order`. A module without a `Family`, or two modules claiming
    one model type or one preset name, is an error naming both."""
    found: list[tuple[Family, str]] = []
    for info in pkgutil.iter_modules(list(path)):
        module = importlib.import_module(f"{package}.{info.name}")
        family = getattr(module, "FAMILY", None)
        if not isinstance(family, Family):
            raise RegistryError(f"{module.__name__}: a family module defines FAMILY = Family(...)")
        found.append((family, module.__name__))
    found.sort(key=lambda pair: pair[0].order)
    owners: dict[str, str] = {}
    for family, module in found:
        for key in (*family.model_types, *family.presets):
            if key in owners:
                raise RegistryError(f"{key!r} is claimed by two family modules: {owners[key]} and {module}")
            owners[key] = module
    for family, _ in found:
        for model_type in family.model_types:
            registry.register(model_type)(family)
    return tuple(family for family, _ in found)


@cache
def all_families() -> tuple[Family, ...]:
    """Every family module's `Family` (this package's modules), in `Family.order`; registered in `FAMILIES` at the
    first call."""
    return load_families(__name__, __path__, FAMILIES)


def family_of(model_type: str | None) -> Family | None:
    """The family registered for ``model_type``; None for a model type no family module claims."""
    all_families()
    return FAMILIES.get(model_type) if model_type in FAMILIES else None


def vision_tower_names(model_type: str | None) -> tuple[str, ...]:
    """Where a model of ``model_type`` keeps its vision encoder: its family's attribute, or — for a model type no
    family claims — every family's, in order."""
    family = family_of(model_type)
    if family is not None and family.vision_tower is not None:
        return (family.vision_tower,)
    return tuple(dict.fromkeys(f.vision_tower for f in all_families() if f.vision_tower is not None))


def module_prefixes(model_type: str | None) -> dict[str, tuple[str, ...]]:
    """Parameter-name prefixes by module group: its family's, or — for a model type no family claims — every
    family's, in order."""
    family = family_of(model_type)
    if family is not None:
        return dict(family.module_prefixes)
    union: dict[str, tuple[str, ...]] = {}
    for f in all_families():
        for group, prefixes in f.module_prefixes.items():
            union[group] = tuple(dict.fromkeys((*union.get(group, ()), *prefixes)))
    return union


def tower_features(config: Any, vision: VisionInputs, *, processor_merge_size: int | None = None,
                   ) -> tuple[int, str] | None:
    """Features the vision tower of ``config``'s model outputs for these processor outputs, by the family's own
    arithmetic read from the *model* config (so a processor that disagrees with the model is caught), and how
    it was counted; None when no family's arithmetic applies. The family of ``config.model_type`` counts first,
    then every other family's arithmetic in order (a model type no family claims may share one's layout)."""
    if getattr(config, "vision_config", None) is None or vision.pixel_values is None:
        return None
    own = family_of(getattr(config, "model_type", None))
    for family in ([own] if own is not None else []) + [f for f in all_families() if f is not own]:
        if family.tower_features is None:
            continue
        counted = family.tower_features(config, vision, processor_merge_size=processor_merge_size)
        if counted is not None:
            return counted
    return None


def patches_per_side(vision_config: Any) -> int | None:
    """Patches along one side of a fixed-size tower input (``image_size / patch_size``); None when unset."""
    size, patch = getattr(vision_config, "image_size", None), getattr(vision_config, "patch_size", None)
    size = size[0] if isinstance(size, (list, tuple)) else size
    patch = patch[0] if isinstance(patch, (list, tuple)) else patch
    return size // patch if size and patch else None


# ----------------------------------------------------------------------------------------------- preset sizes
# Text sizes of the presets. head_dim = hidden / heads; M-RoPE sections must sum to head_dim / 2.
TEXT_1M = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
TEXT_20M = dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=6, num_key_value_heads=2)
# The later families' presets are smaller still (they exist to exercise every path, fast): 2 layers of width 64.
TEXT_S = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)

IMAGE_SIDE = 112  # the shapes images; 112x112 with 14px patches and 2x2 merge = 16 vision tokens


def rope(**extra: Any) -> dict:
    """Default RoPE parameters (θ = 10,000) plus ``extra`` (M-RoPE sections, partial rotary factor, ...)."""
    return {"rope_type": "default", "rope_theta": 10000.0, **extra}


def text_config(ids: dict[str, int], sizes: dict, eos: str, pad: str, **extra: Any) -> dict:
    """A preset's text config: ``sizes``, the tokenizer's vocabulary, its ``eos`` / ``pad`` tokens' ids, no bos."""
    return dict(sizes, vocab_size=ids["__vocab__"], max_position_embeddings=2048, rms_norm_eps=1e-6,
                bos_token_id=None, eos_token_id=ids[eos], pad_token_id=ids[pad], **extra)
