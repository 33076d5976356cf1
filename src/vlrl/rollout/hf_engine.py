"""The in-process engine: sampling on the trainer's own model (`vlrl.rollout.decode`'s loop, not `generate`).

Each distinct prompt of a batch — a GRPO group's n samples share one — is prefilled once, vision tower
included, and its KV cache expanded to its rows (`vlrl.rollout.decode`). Behaviour log-probs come from the
logits the decode steps already computed, divided by the temperature — the same quantity the trainer's
teacher-forced pass computes — so no extra forward pass is spent. The family's vision markup (every token of an
expanded image, the config's vision token ids: ``<|image_pad|>``, ``<IMG_CONTEXT>``, ``<image_soft_token>``,
``<row_1_col_1>``, ...) and the tokenizer's other special tokens, never EOS, are suppressed while sampling
(`VisionAdapter.special_token_ids`): a random tiny model would otherwise emit image placeholders that break
re-scoring.

Multi-turn: to continue a conversation, pass a `Request` whose ``prompt_ids`` are the whole context so far
(prompt, earlier turns, observations) and whose ``vision`` holds all its images in order; the model family's
own code derives positions (M-RoPE for several images) from that context. `encode_observation` turns an
environment's message into the tokens to append (`vlrl.rollout.agent` does both).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from vlrl.data.sample import Sample, load_image
from vlrl.models.adapters import EncodedPrompt
from vlrl.models.policy import Policy
from vlrl.rollout import decode
from vlrl.rollout.types import Request, SamplingParams, Status, Trajectory


def _gather_root(model: torch.nn.Module) -> None:
    """FSDP2: gather the root unit's parameters before ``generate``. transformers 5 encodes a prompt's images
    before the decoder's first forward (``get_image_features`` outside the root's forward), and parts of that
    encoder may live in the root unit (Gemma 3's / InternVL's / SmolVLM's projector, LLaVA-OneVision's
    ``image_newline``); the vision tower itself is a unit of its own (`vlrl.train.distributed.fsdp_units`)."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        model.unshard()


class HFEngine:
    """Generate with a `Policy` living in this process (colocated with the trainer, weights shared)."""

    def __init__(self, policy: Policy, *, max_batch_size: int = 256, compile: bool = False) -> None:
        self.policy = policy
        self.max_batch_size = max_batch_size
        self.compiled = decode.CompiledStep() if compile else None  # rollout.engine.compile: a static cache, one compiled step
        self.weight_version = 0
        eos = set(policy.eos_token_ids)
        self.suppress = [t for t in policy.adapter.special_token_ids() if t not in eos]  # never sampled: markup, specials
        self.last_stats = decode.DecodeStats()  # what the last batch did (prompts prefilled, steps, seconds)
        self.total_stats = decode.DecodeStats()  # summed over every batch since construction

    def encode(self, sample: Sample) -> Request:
        """Render, tokenize and process the images of ``sample`` into a `Request`."""
        images = [load_image(src) for src in sample.images]
        encoded = self.policy.adapter.encode_prompt(sample.messages, images)
        return Request(sample=sample, prompt_ids=encoded.input_ids, vision=encoded.vision, images=images)

    def decode(self, ids: Sequence[int]) -> str:
        return self.policy.tokenizer.decode(list(ids), skip_special_tokens=True)

    def encode_observation(
        self, messages: list[dict], *, last_token: int | None, tools: list[dict] | None = None
    ) -> EncodedPrompt:
        """Tokens (and vision inputs) of observation ``messages`` appended after a model turn whose last
        token was ``last_token``; a turn that did not end with EOS is closed by the template's end marker."""
        close_turn = last_token is None or last_token not in self.policy.eos_token_ids
        return self.policy.adapter.encode_observation(messages, close_turn=close_turn, tools=tools)

    def update_weights(self, *, version: int, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        if state_dict is not None:
            self.policy.model.load_state_dict(state_dict)
        self.weight_version = version

    @torch.no_grad()
    def generate(self, requests: Sequence[Request], sampling: SamplingParams, *,
                 on_step: Callable[[Sequence[Request]], Sequence[bool]] | None = None) -> list[Trajectory]:
        """``n`` samples of every request, request-major. ``on_step`` (optional): called once per decode step
        with the distinct requests being decoded, returns one flag per request; the rows of a flagged request
        stop at that step (the caller discards them — `vlrl.rollout.batcher` aborts a request whose
        client went away or whose deadline passed)."""
        rows = [(i, request) for i, request in enumerate(requests) for _ in range(sampling.n)]
        out: list[Trajectory] = []
        model = self.policy.model
        was_training = model.training
        model.eval()
        try:
            for start in range(0, len(rows), self.max_batch_size):
                out.extend(self._generate_rows(rows[start : start + self.max_batch_size], sampling, on_step))
        finally:
            model.train(was_training)
        return out

    def _generate_rows(self, rows: list[tuple[int, Request]], sampling: SamplingParams,
                       on_step: Callable[[Sequence[Request]], Sequence[bool]] | None = None) -> list[Trajectory]:
        policy = self.policy
        self.last_stats = decode.DecodeStats()
        _gather_root(policy.model)  # FSDP2: the root unit (projectors, LLaVA-OV's image_newline) gathered first
        decoded = decode.sample(
            policy.model, policy.adapter, [request for _, request in rows], sampling,
            pad_token_id=policy.pad_token_id, eos_token_ids=policy.eos_token_ids, suppress=self.suppress,
            on_step=_row_flags(rows, on_step) if on_step is not None else None, stats=self.last_stats,
            compiled=self.compiled,
        )
        self.total_stats.add(self.last_stats)
        trajectories = []
        for k, (group_index, request) in enumerate(rows):
            response = torch.tensor(decoded.tokens[k], dtype=torch.long)
            status = Status.COMPLETED if decoded.eos[k] or decoded.stop_string[k] else Status.TRUNCATED
            trajectories.append(
                Trajectory(
                    sample=request.sample,
                    prompt_ids=torch.as_tensor(request.prompt_ids, dtype=torch.long),
                    response_ids=response,
                    loss_mask=torch.ones(len(response), dtype=torch.long),
                    behaviour_logp=decoded.logp[k],
                    vision=request.vision,
                    images=request.images,
                    weight_version=self.weight_version,
                    status=status,
                    response_text=policy.tokenizer.decode(response, skip_special_tokens=True),
                    group_index=group_index,
                )
            )
        return trajectories


def _row_flags(rows: list[tuple[int, Request]], on_step: Callable[[Sequence[Request]], Sequence[bool]]
               ) -> Callable[[], torch.Tensor]:
    """`HFEngine.generate`'s ``on_step`` (one flag per distinct request) as one flag per row."""
    distinct: dict[int, int] = {}
    for _, request in rows:
        distinct.setdefault(id(request), len(distinct))
    requests = list({id(r): r for _, r in rows}.values())
    row_request = torch.tensor([distinct[id(r)] for _, r in rows], dtype=torch.long)  # (N,)

    def flags() -> torch.Tensor:
        return torch.tensor(list(on_step(requests)), dtype=torch.bool)[row_request]  # (N,)

    return flags
