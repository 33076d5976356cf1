"""`ScoringClient`: token sequences scored on servers that return SGLang's ``input_token_logprobs`` — `vlrl serve`
or SGLang — or vLLM's ``prompt_logprobs``, for a teacher on servers (``algo.distill.teacher_urls``,
`vlrl.train.distill_remote`).

Each sequence is one prefill-only ``/generate`` (``input_ids``, its images as PNG data URLs as `HTTPEngine` sends
them, ``return_logprob: true``, ``logprob_start_len``, ``sampling_params.max_new_tokens: 0``); on a vLLM server (found
from its ``/server_info``) one ``/inference/v1/generate`` with ``sampling_params.prompt_logprobs: 0`` and
``max_tokens: 1`` (vLLM samples at least one token; it is dropped), text only — vLLM returns every prompt token's
log-prob from the raw logits (``None`` for the first), of which those after ``start`` are kept. At most
``max_concurrent`` in flight, each to the live server with the fewest in flight (`ServerPool`: the API key from the
environment, ``/server_info`` read at start, a server with ``max_server_failures`` consecutive failures dropped). A
transport error, timeout or 5xx is retried on another server (``max_retries``); 503/429 (a full server) is waited
out until 4 × ``request_timeout``; another 4xx is a bad request and raises with the server's message. Every answer is
checked: one entry per token from ``logprob_start_len`` on, the ids the ones sent, every value but the first a
number.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from typing import Any

from vlrl.rollout import vllm_protocol as proto
from vlrl.rollout.http_settings import ClientSettings
from vlrl.rollout.server_pool import RolloutRequestError, ServerPool, ServerState, engine_of


@dataclasses.dataclass(frozen=True)
class ScoreRequest:
    """One sequence to score: its token ids (image tokens expanded, as the student encodes them), its images (PNG
    data URLs, in order) and where the scored tokens start (SGLang's ``logprob_start_len``: the tokens after it)."""

    input_ids: list[int]
    images: list[str]
    start: int


class ScoringClient:
    """The servers at ``urls`` (ready when the constructor returns; ``info``: each one's ``/server_info``)."""

    def __init__(self, urls: Sequence[str], settings: ClientSettings, *, max_concurrent: int = 64) -> None:
        self.pool = ServerPool(urls, settings)
        self.max_concurrent = max_concurrent
        self.info: dict[str, dict[str, Any]] = {s.url: self.pool.call(self._server_info(s)) for s in self.pool.servers}
        self.engines = {url: engine_of(info) for url, info in self.info.items()}  # vlrl | sglang | vllm

    async def _server_info(self, server: ServerState) -> dict[str, Any]:
        for path in ("/server_info?config_format=json", "/get_model_info"):  # (the query: vLLM's config as JSON)
            response = await self.pool.client.get(f"{server.url}{path}", headers=self.pool.headers)
            if response.status_code == 404 and path.startswith("/server_info"):
                continue
            response.raise_for_status()
            return response.json()
        raise AssertionError("unreachable")

    def close(self) -> None:
        self.pool.close()

    def score(self, requests: Sequence[ScoreRequest]) -> list[list[float]]:
        """For each request, log π(ids[j] | ids[:j]) of its tokens j > ``start``, in order (one list per request)."""
        return self.pool.call(self._score_all(list(requests)))

    async def _score_all(self, requests: list[ScoreRequest]) -> list[list[float]]:
        gate = asyncio.Semaphore(self.max_concurrent)

        async def one(request: ScoreRequest) -> list[float]:
            async with gate:
                return await self._score_one(request)

        return list(await asyncio.gather(*(one(r) for r in requests)))

    def _request(self, request: ScoreRequest, url: str) -> tuple[str, dict[str, Any]]:
        """(path, body) of ``request`` for the server at ``url`` (module docstring)."""
        if self.engines[url] == "vllm":
            if request.images:
                raise RolloutRequestError(f"teacher server {url} is vLLM: vlrl scores a teacher with images on vlrl "
                                          "serve or SGLang only (vLLM's prompt_logprobs are wired for text)")
            return proto.GENERATE_PATH, {"token_ids": request.input_ids, "sampling_params": {
                "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0, "detokenize": False}}
        body: dict[str, Any] = {"input_ids": request.input_ids, "return_logprob": True,
                                "logprob_start_len": request.start,
                                "sampling_params": {"max_new_tokens": 0, "temperature": 1.0}}
        if request.images:
            body["image_data"] = request.images
        return "/generate", body

    async def _score_one(self, request: ScoreRequest) -> list[float]:
        """One scoring request, retried on another server after a failure (`ServerPool.with_failover`)."""
        pool = self.pool

        async def send(server: ServerState):
            path, body = self._request(request, server.url)
            return await pool.client.post(f"{server.url}{path}", json=body, headers=pool.headers)

        def accept(response, server: ServerState) -> list[float]:
            parse = parse_prompt_logprobs if self.engines[server.url] == "vllm" else parse_scores
            return parse(response.json(), request, server.url)

        return await pool.with_failover(send, accept, what="teacher scoring request")


def parse_scores(answer: Any, request: ScoreRequest, url: str) -> list[float]:
    """The logprobs of ``request``'s scored tokens from a ``/generate`` answer, checked (`RolloutRequestError`
    naming the server otherwise)."""
    meta = answer.get("meta_info", {}) if isinstance(answer, dict) else {}
    entries = meta.get("input_token_logprobs")
    expected = request.input_ids[request.start:]
    if not isinstance(entries, list):
        raise RolloutRequestError(f"teacher server {url}: no meta_info.input_token_logprobs in its answer (does it "
                                  "score input tokens? SGLang and vlrl serve do)")
    if len(entries) != len(expected):
        raise RolloutRequestError(f"teacher server {url}: {len(entries)} input_token_logprobs for the {len(expected)} "
                                  f"tokens from logprob_start_len {request.start}")
    values = []
    for k, entry in enumerate(entries[1:], start=1):
        value, token = entry[0], entry[1]
        if token != expected[k]:
            raise RolloutRequestError(f"teacher server {url}: input token {request.start + k} scored as id {token}, "
                                      f"sent {expected[k]}")
        if not isinstance(value, (int, float)):
            raise RolloutRequestError(f"teacher server {url}: input token {request.start + k} has logprob {value!r}")
        values.append(float(value))
    return values


def parse_prompt_logprobs(answer: Any, request: ScoreRequest, url: str) -> list[float]:
    """The logprobs of ``request``'s scored tokens from a vLLM ``/inference/v1/generate`` answer's
    ``prompt_logprobs`` (one entry per prompt token, ``None`` first; each ``{"token id": {"logprob": …}}``, holding
    the prompt's own token), checked (`RolloutRequestError` naming the server otherwise)."""
    entries = answer.get("prompt_logprobs") if isinstance(answer, dict) else None
    ids = request.input_ids
    if not isinstance(entries, list) or len(entries) != len(ids):
        count = len(entries) if isinstance(entries, list) else "no"
        raise RolloutRequestError(f"teacher server {url}: {count} prompt_logprobs for the {len(ids)} tokens sent")
    values = []
    for j in range(request.start + 1, len(ids)):
        found = (entries[j] or {}).get(str(ids[j]))
        if not isinstance(found, dict) or not isinstance(found.get("logprob"), (int, float)):
            raise RolloutRequestError(f"teacher server {url}: prompt_logprobs[{j}] has no log-prob of token {ids[j]}")
        values.append(float(found["logprob"]))
    return values
