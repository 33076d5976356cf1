"""``tool_zoom``: the model may call ``zoom(x1, y1, x2, y2)`` to see a region enlarged before answering.

A turn holding a call ``zoom(x1, y1, x2, y2)`` (pixel coordinates of the sample's first image) gets the
cropped region back as a new image; a malformed or out-of-range call gets an error message (the model's
mistake, not an environment failure); a turn without a call is the final answer and ends the episode.
``max_calls`` bounds the calls; ``instructions`` (shown before the first turn, as part of the prompt) tell
the model about the tool.
"""

from __future__ import annotations

import re
from typing import Any

from PIL import Image

from vlrl.data.sample import Sample, load_image
from vlrl.rollout.env import BaseEnv, Observation, StepResult
from vlrl.rollout.envs import register_env

ZOOM_CALL = re.compile(r"zoom\(\s*(-?\d+)\s*,\s*(-?\d+)\s*,\s*(-?\d+)\s*,\s*(-?\d+)\s*\)")
INSTRUCTIONS = ("You may call zoom(x1, y1, x2, y2) with pixel coordinates to see that region enlarged; "
                "otherwise give your final answer.")


@register_env("tool_zoom")
class ToolZoomEnv(BaseEnv):
    """A zoom tool over the sample's first image."""

    def __init__(self, *, zoom_size: int = 112, max_calls: int = 3, instructions: str = INSTRUCTIONS,
                 role: str = "user") -> None:
        """
        Args:
            zoom_size: side in pixels the crop is resized to.
            max_calls: zoom calls allowed per episode; later calls get a message asking for the answer.
            instructions: shown before the first turn (empty: none; the data's prompt explains the tool).
            role: chat role of the tool's replies ("user", or "tool" for templates that render it).
        """
        self.zoom_size, self.max_calls, self.instructions, self.role = zoom_size, max_calls, instructions, role

    def reset(self, sample: Sample) -> Any:
        if not sample.images:
            raise ValueError(f"tool_zoom: sample {sample.id!r} has no image to zoom into")
        self.sample, self.calls = sample, 0
        self.image = load_image(sample.images[0])
        return Observation(text=self.instructions) if self.instructions else None

    def step(self, response_text: str) -> StepResult:
        match = ZOOM_CALL.search(response_text)
        if match is None:
            return None, True, {"zoom_calls": self.calls}
        if self.calls >= self.max_calls:
            return Observation(text="No more zoom calls; give your final answer.", role=self.role), False, {}
        x1, y1, x2, y2 = (int(v) for v in match.groups())
        W, H = self.image.size
        if not (0 <= x1 < x2 <= W and 0 <= y1 < y2 <= H):
            text = f"zoom error: need 0 <= x1 < x2 <= {W} and 0 <= y1 < y2 <= {H}, got ({x1}, {y1}, {x2}, {y2})."
            return Observation(text=text, role=self.role), False, {"zoom_error": True}
        self.calls += 1
        crop = self.image.crop((x1, y1, x2, y2)).resize((self.zoom_size, self.zoom_size), Image.Resampling.BICUBIC)
        observation = Observation(text=f"zoom({x1}, {y1}, {x2}, {y2}):", images=[crop], role=self.role)
        return observation, False, {"zoom_call": 1}  # counted per episode as agent/env/zoom_call
