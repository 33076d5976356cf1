"""A small byte-level BPE tokenizer trained locally, with a model family's special tokens and chat template.

The tiny presets need a tokenizer without a download. Byte-level BPE (as in Qwen2) encodes any text; it is
trained on the task vocabulary so that task words are single tokens and sequences stay short. Each family's
tokenizer carries that family's vision markup (the tokens its processor expands and its model looks for) and
a chat template in that family's style (its `vlrl.models.markup.Markup`, declared in its family module), so the
code the tiny presets exercise is the code a real checkpoint of the family runs.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from vlrl.models.markup import Markup

# Plain (non-special) added tokens: the answer/think tags of the RL prompt templates stay one token each.
TAG_TOKENS = ["<think>", "</think>", "<answer>", "</answer>"]
# Plain added tokens for the JSON scaffolding of the embodied plans (`vlrl.data.tasks.embodied`): the byte-level
# pre-tokenizer splits at every quote and underscore, so without them a plan step costs ~14 tokens instead of ~8.
PLAN_TOKENS = ['{"visual_state_description": "', '", "reasoning_and_reflection": "', '", "language_plan": "',
               '", "executable_plan": [', '{"action_id": ', ', "action_name": "', '"}']


def train_tokenizer(corpus: Iterable[str], vocab_size: int = 1024, *, markup: Markup | None = None) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on ``corpus`` and wrap it as a transformers fast tokenizer with a family's ``markup``
    (its `vlrl.models.markup.Markup`; None: Qwen's, `vlrl.models.families.qwen2_vl`)."""
    if markup is None:
        from vlrl.models.families.qwen2_vl import MARKUP

        markup = MARKUP
    spec = markup
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(spec.special),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus, trainer)
    named_specials = {spec.eos, spec.pad, spec.bos}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=spec.eos,
        pad_token=spec.pad,
        bos_token=spec.bos,
        padding_side="left",
        chat_template=spec.template,
        model_max_length=4096,
        # the family's named tokens (``tokenizer.image_token`` …), as transformers' multimodal tokenizers declare them
        extra_special_tokens=dict(spec.named) if not spec.legacy_layout and spec.named else None,
    )
    if spec.legacy_layout:  # the original presets' layout (kept: changing it would change their token ids)
        tokenizer.add_special_tokens({"additional_special_tokens": list(spec.special[1:])})
    else:
        extra: dict | list = [t for t in spec.special if t not in named_specials and t not in spec.named.values()]
        tokenizer.add_special_tokens({"extra_special_tokens": extra})
    tokenizer.add_tokens(TAG_TOKENS)
    tokenizer.add_tokens(PLAN_TOKENS)
    return tokenizer
