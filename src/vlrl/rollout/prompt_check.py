"""`PromptCheck`: ``rollout.servers.prompt_check`` — the prompt a rollout server sampled from against the one the trainer
scores.

A server that re-tokenizes or re-processes a prompt samples from another one than the trainer scores, and nothing else
shows it (the ratios are silently biased). SGLang re-runs the served model's processor on every image (its own
``--image-processor-backend``, ``auto`` by default — torchvision where installed, other pixels than the trainer's PIL
resize — and its own pixel bounds, ``--mm-process-config``) and replaces the image tokens; a multi-turn context that
goes through decode → encode can re-split into other ids of the same count. So the client asks for the exact ids
(SGLang's ``return_prompt_token_ids``: the answer's ``prompt_token_ids``) and compares them with the trainer's; a server
that returns none is compared by count (``meta_info.prompt_tokens``), and one that reports neither is warned about once.

Where a server reports its image settings (SGLang's ``/server_info`` carries its launch arguments), a mismatch names the
one that differs from the trainer's: the backend (``pil`` is the trainer's) and the pixel bounds (``model.min_pixels`` /
``model.max_pixels``, the trainer's image processor's ``size``).
"""

from __future__ import annotations

import logging
from typing import Any

from vlrl.models.policy import Policy
from vlrl.rollout.server_pool import RolloutRequestError, ServerPool, ServerState
from vlrl.rollout.types import Request

log = logging.getLogger("vlrl.rollout.http_engine")  # (the engine's: users filter one logger)

ADVICE = ("start SGLang with --image-processor-backend pil and --mm-process-config "
          "'{\"image\": {\"min_pixels\": …, \"max_pixels\": …}}' holding model.min_pixels / model.max_pixels (docs: "
          "\"Rollout servers\"), or set rollout.servers.prompt_check=warn / off")


class PromptMismatchError(RolloutRequestError):
    """A server sampled from another prompt than the one the trainer scores."""


def trainer_pixel_bounds(policy: Policy) -> tuple[int | None, int | None] | None:
    """(min_pixels, max_pixels) of the trainer's image processor (Qwen-style ``size``), or None (no such bounds)."""
    size = getattr(policy.image_processor, "size", None)
    if size is None:
        return None
    size = dict(size)
    if "shortest_edge" not in size or "longest_edge" not in size:
        return None
    return size.get("shortest_edge"), size.get("longest_edge")


def image_settings_differ(policy: Policy, server: ServerState) -> list[str]:
    """The image settings ``server`` reported that differ from the trainer's, each named with the flag that sets it."""
    if not policy.is_vision:
        return []
    out = []
    if server.image_processor_backend not in (None, "pil"):
        out.append(f"its --image-processor-backend is {server.image_processor_backend!r}, the trainer resizes with "
                   "PIL ('pil')")
    ours = trainer_pixel_bounds(policy)
    if server.pixel_bounds is not None and ours is not None:
        for k, name in enumerate(("min_pixels", "max_pixels")):
            if server.pixel_bounds[k] is not None and server.pixel_bounds[k] != ours[k]:
                out.append(f"its --mm-process-config image.{name} is {server.pixel_bounds[k]}, model.{name} is {ours[k]}")
    return out


class PromptCheck:
    """``rollout.servers.prompt_check`` on each answer (error, warn, off; `ClientSettings.prompt_check`)."""

    def __init__(self, policy: Policy, pool: ServerPool) -> None:
        self.policy, self.pool = policy, pool
        self.mode = pool.settings.prompt_check
        self.mismatches = 0  # answers from another prompt (prompt_check=warn)
        for server in pool.servers:  # at start: say so before the first rollout, not at the first mismatch
            differ = image_settings_differ(policy, server)
            if differ and self.mode != "off":
                log.warning("%s: %s — its prompts will differ from the trainer's (%s)", server.url, "; ".join(differ),
                            ADVICE)

    @property
    def wants_ids(self) -> bool:
        """Whether ``/generate`` asks for the exact prompt ids (SGLang's ``return_prompt_token_ids``)."""
        return self.mode != "off"

    def __call__(self, server: ServerState, request: Request, item: dict[str, Any]) -> None:
        """Compare one answer's prompt (``prompt_token_ids``, else ``meta_info.prompt_tokens``) with ``request``'s."""
        if self.mode == "off":
            return
        ours = [int(t) for t in request.prompt_ids]
        ids = item.get("prompt_token_ids")
        if isinstance(ids, list):
            if ids == ours:
                return
            first = next((k for k, (a, b) in enumerate(zip(ids, ours, strict=False)) if a != b), min(len(ids), len(ours)))
            what = (f"other prompt ids ({len(ids)} against the trainer's {len(ours)}, the first difference at "
                    f"position {first})")
        else:
            count = (item.get("meta_info") or {}).get("prompt_tokens")
            if not isinstance(count, int):
                self.pool.warn_once(server.url, "prompt_tokens", "%s returns neither prompt_token_ids nor "
                                    "meta_info.prompt_tokens: rollout.servers.prompt_check cannot compare its prompts "
                                    "with the trainer's", server.url)
                return
            if count == len(ours):
                return
            what = f"a prompt of {count} tokens; the trainer scores {len(ours)}"
        self._mismatch(server, request, what)

    def _mismatch(self, server: ServerState, request: Request, what: str) -> None:
        differ = image_settings_differ(self.policy, server)
        cause = ("; ".join(differ) if differ else
                 "with images, the server re-processed them with its own image processor and pixel bounds; without, "
                 "a context did not survive decode → encode")
        message = f"{server.url} sampled sample {request.sample.id!r} from {what}. {cause}: {ADVICE}"
        if self.mode == "error":
            raise PromptMismatchError(message)
        self.mismatches += 1
        if self.mismatches <= 5:
            log.warning("%s%s", message, " (further mismatches are counted, not logged)" if self.mismatches == 5 else "")
