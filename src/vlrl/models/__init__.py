"""Models: loading policies (presets, local dirs, hub ids), family adapters, teacher-forced log-probs."""

from vlrl.models.logprobs import TokenBatch, collate, response_logprobs
from vlrl.models.policy import Policy, build_preset, load_policy
from vlrl.models.presets import PRESETS
from vlrl.models.vision_inputs import EncodedPrompt, VisionInputs

__all__ = [
    "PRESETS", "EncodedPrompt", "Policy", "TokenBatch", "VisionInputs", "build_preset", "collate", "load_policy",
    "response_logprobs",
]
