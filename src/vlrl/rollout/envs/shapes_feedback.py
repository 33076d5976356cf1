"""``shapes_feedback``: answer, hear "incorrect, try again" (optionally with a zoomed crop), answer again.

The geo3k-style multi-turn of the slime seed on vlrl's own shapes tasks (any sample with a verifier works):
each model turn is checked by the sample's verifier; a correct answer ends the episode, a wrong one gets the
feedback text — and, with ``zoom=True``, a crop of the region that matters enlarged as a new image — until
``rollout.agent.max_turns``. The reward stage scores the final answer; each step's verifier score is reported as
``info["reward"]``.
"""

from __future__ import annotations

from typing import Any

from PIL import Image

from vlrl.data.sample import Sample, load_image
from vlrl.rewards import compose
from vlrl.rollout.env import BaseEnv, Observation, StepResult
from vlrl.rollout.envs import register_env

KINDS = ("circle", "square", "triangle")


@register_env("shapes_feedback")
class ShapesFeedbackEnv(BaseEnv):
    """Feedback after a wrong answer, optionally with a zoomed crop of the relevant region."""

    def __init__(self, *, feedback: str = "Incorrect, try again.", zoom: bool = False, zoom_size: int = 112,
                 margin: int = 6) -> None:
        """
        Args:
            feedback: text shown after a wrong answer.
            zoom: also show a crop of the relevant region (the named shape, or all shapes) as a new image.
            zoom_size: side in pixels the crop is resized to.
            margin: pixels added around the region before cropping.
        """
        self.feedback, self.zoom, self.zoom_size, self.margin = feedback, zoom, zoom_size, margin

    def reset(self, sample: Sample) -> Any:
        self.sample = sample
        return None

    def step(self, response_text: str) -> StepResult:
        sample = self.sample
        out = compose(response_text, sample.answer, sample.reward, sample.metadata)
        correct = (out.accuracy if out.accuracy is not None else out.overall) >= 1.0
        info = {"reward": out.overall, "correct": correct}
        if correct:
            return None, True, info
        images = [self.crop()] if self.zoom and sample.images else []
        return Observation(text=self.feedback, images=images), False, info

    def crop(self) -> Image.Image:
        """The region of the first image that the question is about, enlarged to ``zoom_size``."""
        image = load_image(self.sample.images[0])
        box = relevant_box(self.sample, image.size)
        x1, y1, x2, y2 = box
        m = self.margin
        region = (max(0, x1 - m), max(0, y1 - m), min(image.width, x2 + m), min(image.height, y2 + m))
        return image.crop(region).resize((self.zoom_size, self.zoom_size), Image.Resampling.BICUBIC)


def relevant_box(sample: Sample, size: tuple[int, int]) -> list[int]:
    """The box of the shape the question names (if it names exactly one kind present once), else the box
    around all shapes, else the whole image."""
    objects = sample.metadata.get("objects") or []
    question = sample.prompt_text().lower()
    named = [k for k in KINDS if k in question]
    if len(named) == 1:
        matches = [o for o in objects if o.get("kind") == named[0]]
        if len(matches) == 1:
            return list(matches[0]["box"])
    if objects:
        boxes = [o["box"] for o in objects]
        return [min(b[0] for b in boxes), min(b[1] for b in boxes), max(b[2] for b in boxes), max(b[3] for b in boxes)]
    return [0, 0, size[0], size[1]]
