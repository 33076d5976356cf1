"""Tiny offline presets: real transformers architectures built from their config classes, no download.

Each preset is a real family at toy size with random weights, a BPE tokenizer trained locally on the task
vocabulary carrying the family's vision markup and a chat template in its style (`vlrl.models.markup.Markup`),
the family's own PIL image processor (no torchvision) and its own transformers processor class. `save_pretrained`
output loads back through plain transformers (`AutoModelForImageTextToText` / `AutoModelForCausalLM`), and a saved
directory loads back into vlrl through exactly the code a real checkpoint of the family goes through.

The presets are declared by their family modules (`vlrl.models.families`: each module's table lists its presets
and their sizes); `PRESETS` lists them all, family by family.
"""

from __future__ import annotations

from functools import lru_cache

from vlrl.models.families import PresetSpec, all_families
from vlrl.models.markup import Markup

PRESETS: dict[str, PresetSpec] = {name: spec for family in all_families() for name, spec in family.presets.items()}


def _family_presets() -> list[str]:
    """The first preset of every vision-language model type (its smallest), in `PRESETS` order."""
    first: dict[str, str] = {}
    for family in all_families():
        if family.vision_tower is None:
            continue
        for name, spec in family.presets.items():
            first.setdefault(spec.family, name)
    return list(first.values())


# One preset per vision-language family (its smallest): what the family tests run (tests/models/test_families.py).
FAMILY_PRESETS = _family_presets()


def tokenizer_corpus() -> list[str]:
    """Text the preset tokenizers are trained on: every task suite's prompts and responses, all templates."""
    from vlrl.data.tasks import TEMPLATES, embodied, generate
    from vlrl.data.tasks.shapes import TASKS as SHAPE_TASKS

    corpus = ["system", "user", "assistant", "You are a helpful assistant."]
    for template in TEMPLATES:
        for suite, tasks in (("shapes", SHAPE_TASKS), ("arith", None)):
            kwargs = {"image_size": 32} if suite == "shapes" else {}  # only the text matters here: small images
            for sample in generate(suite, 400, split="tokenizer", tasks=tasks, template=template, **kwargs):
                corpus.append(sample.prompt_text().replace("<image>", ""))
                corpus.append(sample.response or "")
    corpus += [f"[{a}, {b}, {a + 20}, {b + 20}]" for a in range(0, 112, 3) for b in range(0, 112, 7)]
    corpus += embodied.text_corpus(300)  # JSON action plans
    return corpus


@lru_cache(maxsize=8)
def _trained_tokenizer(markup: Markup, vocab_size: int):
    from vlrl.models.tokenizer import train_tokenizer

    return train_tokenizer(tokenizer_corpus(), vocab_size=vocab_size, markup=markup)


def preset_tokenizer(name: str):
    """A fresh copy of preset ``name``'s tokenizer (trained once per process and markup, then copied)."""
    import copy

    spec = PRESETS[name]
    return copy.deepcopy(_trained_tokenizer(spec.markup, spec.vocab_size))
