"""The sample side of Syn-GRPO (`vlrl.synth.workflow`): the output template a prompt asks for
(`apply_syn_template`, `syn_eval_samples`), the foreground a synthesis must keep (`foreground_boxes`), and the
synthesised sample that replaces its parent (`synthetic_sample`).
"""

from __future__ import annotations

import copy
import dataclasses
import random
from collections.abc import Sequence
from typing import Any

from vlrl.config import SynthConfig
from vlrl.data.sample import Sample
from vlrl.data.tasks import TEMPLATES
from vlrl.rewards.base import reward_weights
from vlrl.rewards.boxes import to_pixels
from vlrl.rewards.syn import SYN_PROMPT, SYN_PROMPT_SHORT

# Descriptions of the SFT reference responses `apply_syn_template` writes (the policy learns the format).
DESCRIPTION_EXAMPLES = (
    "a striped blue wall", "green grass", "a dark city street at night", "a sandy desert", "ocean waves",
    "a red brick wall", "a checkered kitchen floor", "white clouds in the sky", "a busy cluttered desk",
    "a snowy field", "pink polka dots", "a wooden floor", "a foggy forest", "a sunset gradient",
    "yellow and purple noise", "a grey concrete wall",
)


# ----------------------------------------------------------------------------------------------- the template
def apply_syn_template(sample: Sample, *, template: str = "think", format_weight: float = 1.0) -> Sample:
    """``sample`` asking for the Syn-GRPO output template: the prompt's answer instruction (one of vlrl's
    `TEMPLATES`) is replaced by the template's, ``syn_format`` joins the reward with ``format_weight``, and an SFT
    reference response is rewritten into the template (with a description and diversity drawn per sample)."""
    if template not in ("think", "short"):
        raise ValueError(f"synth.template must be think or short here, got {template!r}")
    instruction = SYN_PROMPT if template == "think" else SYN_PROMPT_SHORT
    messages = copy.deepcopy(sample.messages)
    user = next((m for m in reversed(messages) if m.get("role") == "user"), None)
    if user is None:
        raise ValueError(f"sample {sample.id}: no user message to add the Syn-GRPO instruction to")
    if isinstance(user["content"], str):
        user["content"] = _with_instruction(user["content"], instruction)
    else:
        texts = [p for p in user["content"] if p.get("type") == "text"]
        if texts:
            texts[-1]["text"] = _with_instruction(texts[-1]["text"], instruction)
        else:
            user["content"].append({"type": "text", "text": instruction})
    reward = reward_weights(sample.reward)
    if format_weight > 0:
        reward["syn_format"] = format_weight
    metadata = {**sample.metadata, "require_think": template == "think"}
    response = _reference(sample, template) if sample.response is not None else None
    return dataclasses.replace(sample, messages=messages, reward=reward, metadata=metadata, response=response)


def _with_instruction(text: str, instruction: str) -> str:
    for suffix in sorted((s for s in TEMPLATES.values() if s), key=len, reverse=True):
        if text.rstrip().endswith(suffix):
            text = text.rstrip()[: -len(suffix)]
            break
    return f"{text.rstrip()} {instruction}".lstrip()


def _reference(sample: Sample, template: str) -> str:
    rng = random.Random(f"syn-reference/{sample.id}")
    answer = sample.response.strip()
    block = answer if answer.startswith("<answer>") else f"<answer>{answer}</answer>"
    think = "<think>Look at the objects in the image.</think>" if template == "think" else ""
    return (f"{think}<diversity>{rng.randint(0, 10) / 10:.1f}</diversity>"
            f"<description>{rng.choice(DESCRIPTION_EXAMPLES)}</description>{block}")


# ----------------------------------------------------------------------------------------------- foreground
def foreground_boxes(sample: Sample, image_size: tuple[int, int], *, preserve: str = "auto",
                     margin: int = 1) -> list[list[float]] | None:
    """The boxes (pixels) whose content must survive synthesis, or None if the sample has none.

    ``objects``: every ``metadata.objects[*].box`` (vlrl's shapes: keeps count, colour and locate labels valid);
    ``answer``: the answer's box (``[x1, y1, x2, y2]``, in ``metadata.coords``) or detection boxes
    (``[{"bbox_2d": ...}]``); ``auto``: objects if the sample lists any, else the answer. Boxes grow by
    ``margin`` pixels (clipped to the image, ``image_size`` = (W, H)).
    """
    W, H = image_size
    objects = [o["box"] for o in sample.metadata.get("objects", []) if isinstance(o, dict) and _is_box(o.get("box"))]
    boxes = objects if preserve == "objects" or (preserve == "auto" and objects) else _answer_boxes(sample, image_size)
    if not boxes:
        return None
    out = []
    for box in boxes:
        x1, y1, x2, y2 = (float(v) for v in box)
        box = [max(0.0, x1 - margin), max(0.0, y1 - margin), min(float(W), x2 + margin), min(float(H), y2 + margin)]
        if box[0] < box[2] and box[1] < box[3]:
            out.append(box)
    return out or None


def _is_box(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and len(value) == 4 and all(isinstance(v, (int, float)) for v in value)


def _answer_boxes(sample: Sample, image_size: tuple[int, int]) -> list[list[float]]:
    answer, coords = sample.answer, sample.metadata.get("coords", "pixel")
    if _is_box(answer):
        raw = [answer]
    elif isinstance(answer, list):
        raw = [d.get("bbox_2d", d.get("bbox")) for d in answer if isinstance(d, dict)]
        raw = [b for b in raw if _is_box(b)]
    else:
        return []
    try:
        return [to_pixels(b, coords, image_size) for b in raw]
    except ValueError:
        return []


def synthetic_sample(parent: Sample, image: Any, *, original: str, generation: int, description: str,
                     job_id: str | None) -> Sample:
    """The new sample: ``parent``'s question, answer, verifier and metadata, the synthesised image, a new id."""
    meta = {**parent.metadata, "synth": {"original": original, "parent": parent.id, "generation": generation,
                                         "description": description, "job": job_id}}
    return dataclasses.replace(parent, id=f"{original}~syn{generation}", images=[image], metadata=meta)


def syn_eval_samples(cfg: SynthConfig, samples: Sequence[Sample]) -> list[Sample]:
    """Held-out samples asking for the same template as training (unchanged unless ``synth.enabled``)."""
    if not cfg.enabled or cfg.template == "none":
        return list(samples)
    return [apply_syn_template(s, template=cfg.template, format_weight=cfg.format_weight) for s in samples]
