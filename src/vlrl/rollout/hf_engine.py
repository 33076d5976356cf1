"""The in-process engine: sampling with transformers' `generate` on the trainer's own model.

Behaviour log-probs come from the logits `generate` already computed (``output_logits``), divided by the
temperature — the same quantity the trainer's teacher-forced pass computes — so no extra forward pass is
spent. The family's vision markup (every token of an expanded image, the config's vision token ids:
``<|image_pad|>``, ``<IMG_CONTEXT>``, ``<image_soft_token>``, ``<row_1_col_1>``, ...) and the tokenizer's other
special tokens, never EOS, are suppressed while sampling (`VisionAdapter.special_token_ids`): a random tiny model
would otherwise emit image placeholders that break re-scoring.

Multi-turn: to continue a conversation, pass a `Request` whose ``prompt_ids`` are the whole context so far
(prompt, earlier turns, observations) and whose ``vision`` holds all its images in order; the model family's
own code derives positions (M-RoPE for several images) from that context. `encode_observation` turns an
environment's message into the tokens to append (`vlrl.rollout.agent` does both).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from transformers import StoppingCriteria, StoppingCriteriaList

from vlrl.data.sample import Sample, load_image
from vlrl.models.adapters import EncodedPrompt, VisionInputs
from vlrl.models.policy import Policy
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

    def __init__(self, policy: Policy, *, max_batch_size: int = 256) -> None:
        self.policy = policy
        self.max_batch_size = max_batch_size
        self.weight_version = 0
        eos = set(policy.eos_token_ids)
        self._suppress = [t for t in policy.adapter.special_token_ids() if t not in eos]

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
        stop at that step (the caller discards them — `vlrl.rollout.server`'s batcher aborts a request whose
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
        device = next(policy.model.parameters()).device
        P = max(len(r.prompt_ids) for _, r in rows)
        input_ids = torch.full((len(rows), P), policy.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), P), dtype=torch.long)
        for k, (_, request) in enumerate(rows):
            n = len(request.prompt_ids)
            input_ids[k, P - n :] = torch.as_tensor(request.prompt_ids)
            attention_mask[k, P - n :] = 1
        vision = VisionInputs.concat([r.vision for _, r in rows])
        kwargs = policy.adapter.generate_inputs(
            input_ids.to(device), attention_mask.to(device), vision.to(device) if vision is not None else None
        )
        greedy = sampling.temperature <= 0
        _gather_root(policy.model)
        gen = policy.model.generate(
            **kwargs,
            do_sample=not greedy,
            temperature=None if greedy else sampling.temperature,
            top_p=None if greedy or sampling.top_p >= 1 else sampling.top_p,
            top_k=None if greedy or sampling.top_k <= 0 else sampling.top_k,
            max_new_tokens=sampling.max_new_tokens,
            eos_token_id=policy.eos_token_ids,
            pad_token_id=policy.pad_token_id,
            suppress_tokens=self._suppress or None,
            stop_strings=sampling.stop or None,
            tokenizer=policy.tokenizer if sampling.stop else None,
            output_logits=True,
            return_dict_in_generate=True,
            stopping_criteria=StoppingCriteriaList([_StepHook(rows, on_step)]) if on_step is not None else None,
        )
        new_tokens = gen.sequences[:, P:].cpu()  # (N, T)
        logits = torch.stack(gen.logits, dim=1).float().cpu()  # (N, T, V), raw (before temperature)
        temperature = 1.0 if greedy else sampling.temperature
        logp_all = F.log_softmax(logits / temperature, dim=-1).gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)
        eos = torch.tensor(policy.eos_token_ids)
        stop_texts = sampling.stop
        trajectories = []
        for k, (group_index, request) in enumerate(rows):
            tokens = new_tokens[k]
            is_eos = torch.isin(tokens, eos)
            if is_eos.any():
                length, status = int(is_eos.nonzero()[0]) + 1, Status.COMPLETED
            else:
                length, status = len(tokens), Status.TRUNCATED
            response = tokens[:length]
            text = policy.tokenizer.decode(response, skip_special_tokens=True)
            if status is Status.TRUNCATED and stop_texts and any(text.endswith(s) for s in stop_texts):
                status = Status.COMPLETED
            trajectories.append(
                Trajectory(
                    sample=request.sample,
                    prompt_ids=torch.as_tensor(request.prompt_ids, dtype=torch.long),
                    response_ids=response.clone(),
                    loss_mask=torch.ones(length, dtype=torch.long),
                    behaviour_logp=logp_all[k, :length].clone(),
                    vision=request.vision,
                    images=request.images,
                    weight_version=self.weight_version,
                    status=status,
                    response_text=text,
                    group_index=group_index,
                )
            )
        return trajectories



class _StepHook(StoppingCriteria):
    """`HFEngine.generate`'s ``on_step`` as a stopping criterion: asked once per decode step, per request."""

    def __init__(self, rows: list[tuple[int, Request]], on_step: Callable[[Sequence[Request]], Sequence[bool]]) -> None:
        distinct: dict[int, int] = {}
        for _, request in rows:
            distinct.setdefault(id(request), len(distinct))
        self.requests = list({id(r): r for _, r in rows}.values())
        self.row_request = torch.tensor([distinct[id(r)] for _, r in rows], dtype=torch.long)  # (N,)
        self.on_step = on_step

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        stop = torch.tensor(list(self.on_step(self.requests)), dtype=torch.bool)  # (distinct requests,)
        return stop[self.row_request].to(input_ids.device)  # (N,)
