"""`HTTPEngine`: the `Engine` protocol over HTTP, against one or more SGLang-compatible rollout servers.

Prompts are encoded locally (tokenizer + image processor, exactly as `HFEngine` does) and sent as
``input_ids`` + ``image_data`` (PNG data URLs, in the batch form SGLang 0.5.23's schema accepts) to SGLang's native
``/generate``, sampled as the in-process engine samples (the model's EOS as ``stop_token_ids``, its vision markup
and other special tokens banned by ``logit_bias``); the answer's ``output_token_logprobs`` become the behaviour
log-probs and its weight version the trajectory's (`answer_version`: the oldest of SGLang's ``weight_versions``
spans; a server that reports none, or a label that is no integer, is tagged with the version current when the
request started — the oldest weights it can have used, so staleness is never under-estimated). Each answer's prompt
(SGLang's ``prompt_token_ids``, asked for with ``return_prompt_token_ids``; its ``meta_info.prompt_tokens`` where a
server returns no ids) is compared with the prompt the trainer scores (``prompt_check``, `vlrl.rollout.prompt_check`).

Reliability (`vlrl.rollout.server_pool`): each request goes to the live server with the fewest prompts in flight. A
transport error, timeout or 5xx answer counts as a failure of that server and the request is retried on another one
(up to ``max_retries`` times); a server with ``max_server_failures`` consecutive failures is dropped from the pool
with a warning. A 503/429 (queue full) is waited out, not counted. A 4xx is a bug in the request and raises.

Weights (`vlrl.rollout.publish`, `vlrl.rollout.weight_group`): by disk or over a process group, each update bracketed
by pausing the servers (their caches flushed first) and, over a group, by SGLang's weight-update session; `publish`
returns before the servers confirmed (`WeightPublisher`).

Batching: the prompts of one `generate` call (or of the `agenerate` calls made together) are sent as one
batched ``/generate`` per server (SGLang's list form of ``input_ids``), split evenly over the live servers.

The engine's pool owns an asyncio loop on a background thread: `generate` (the synchronous `Engine` method) and
`agenerate` (awaitable from any other event loop, `AsyncEngine`) both run there.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import functools
import logging
import threading
from collections.abc import Sequence
from typing import Any

import torch

from vlrl.data.sample import Sample
from vlrl.models.policy import Policy
from vlrl.rollout.batcher import sampling_key, settle
from vlrl.rollout.hf_engine import HFEngine
from vlrl.rollout.http_settings import ClientSettings, SyncSettings
from vlrl.rollout.image_url import encode_image
from vlrl.rollout.prompt_check import PromptCheck
from vlrl.rollout.publish import ServerWeights, SyncStats
from vlrl.rollout.server_pool import RolloutRequestError, ServerPool, ServerState
from vlrl.rollout.types import Request, SamplingParams, Status, Trajectory
from vlrl.rollout.versions import answer_version, token_versions

log = logging.getLogger(__name__)

_FINISH = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}
SUPPRESS_BIAS = -1.0e4  # the logit_bias of a token never to be sampled: exp(-1e4) underflows to 0 in float32


def _chunks(prompts: list, size: int, max_pixels: int | None) -> list[list]:
    """``prompts`` ((request, future) pairs) in order, in chunks of at most ``size`` prompts and — when the server
    bounds them — ``max_pixels`` image pixels (a prompt over the bound alone is a chunk alone)."""
    out: list[list] = [[]]
    pixels = 0
    for prompt in prompts:
        own = sum(image.width * image.height for image in prompt[0].images)
        if out[-1] and (len(out[-1]) >= size or (max_pixels is not None and pixels + own > max_pixels)):
            out.append([])
            pixels = 0
        out[-1].append(prompt)
        pixels += own
    return [chunk for chunk in out if chunk]


class HTTPEngine:
    """Generate on SGLang-compatible servers; encode and decode locally with the trainer's `Policy`. Implements
    `Engine`, `AgentEngine`, `AsyncEngine` and `WeightPublisher` (`vlrl.rollout.types`).

    ``sync``: how the servers get the trainer's weights (`SyncSettings`); ``client``: how the engine talks to them
    (`ClientSettings`). `vlrl.rollout.build_engine` builds both from the ``rollout`` config section."""

    def __init__(self, policy: Policy, servers: Sequence[str], sync: SyncSettings,
                 client: ClientSettings = ClientSettings(), *, owned: Any = None) -> None:
        self.policy = policy
        self._encoder = HFEngine(policy)
        self._tokenizer_lock = threading.Lock()
        self._images: collections.OrderedDict[int, tuple[Request, list[str]]] = collections.OrderedDict()
        self._gathering: dict[tuple, list[tuple[list[Request], asyncio.Future]]] = {}
        self._tasks: set[asyncio.Task] = set()
        self.pool = ServerPool(servers, client, distributed=sync.method == "distributed")
        self.owned = owned  # servers this engine started (`vlrl.rollout.engine_launch`), stopped by `close`
        self.engine = self._engine_kind(client.engine)
        self.vllm = None  # vLLM servers: their calls (`vlrl.rollout.vllm_client`), else SGLang's API below
        if self.engine == "vllm":
            from vlrl.rollout.vllm_client import VLLMServers
            from vlrl.rollout.vllm_weights import VLLMServerWeights

            self.vllm = VLLMServers(self.pool, checksum=client.checksum,
                                    keep_on_update=sync.on_weight_update in ("retract", "in_place", "partial"))
            self.pool.call(self.vllm.read_facts())
            self.weights: ServerWeights = VLLMServerWeights(self.pool, policy, sync, self.vllm)
        else:
            self.weights = ServerWeights(self.pool, policy, sync)
        self.prompt_check = PromptCheck(policy, self.pool)

    @property
    def prompt_mismatches(self) -> int:
        """Answers sampled from another prompt than the trainer's (counted under ``prompt_check=warn``)."""
        return self.prompt_check.mismatches

    def _engine_kind(self, configured: str) -> str:
        """The servers' engine: every server's, read from its info (`server_pool.engine_of`); a configured engine other
        than auto must match it (vlrl serve speaks SGLang's API: ``sglang`` accepts it)."""
        found = {s.engine or "sglang" for s in self.pool.servers}
        if len(found) > 1:
            raise RolloutRequestError(f"the rollout servers are of different engines ({sorted(found)}): one engine a run")
        kind = found.pop()
        if configured not in ("auto", kind) and not (configured == "sglang" and kind == "vlrl"):
            raise RolloutRequestError(f"rollout.servers.engine={configured}, but {self.pool.servers[0].url} is a {kind} "
                                      "server (from its /server_info); set rollout.servers.engine=auto or the server's")
        return kind

    # -------------------------------------------------------------------------------------------- the pool
    @property
    def servers(self) -> list[ServerState]:
        return self.pool.servers

    @property
    def dropped(self) -> list[str]:
        """``"url: reason"`` of every server dropped from the pool."""
        return self.pool.dropped

    def live_servers(self) -> list[ServerState]:
        return self.pool.live()

    def close(self) -> None:
        try:
            if self.pool.running:
                if self.vllm is not None:
                    self.pool.call(self.vllm.abort())  # (this engine's requests still in flight)
                self.weights.group.destroy(timeout=10.0)
            self.pool.close()
        finally:
            if self.owned is not None:
                self.owned.close()

    # -------------------------------------------------------------------------------------------- weights
    @property
    def weight_version(self) -> int:
        """The version every live server confirmed."""
        return self.weights.version

    @property
    def world_size(self) -> int:
        return self.weights.world_size

    @property
    def last_sync(self) -> SyncStats | None:
        return self.weights.last_sync

    def update_weights(self, *, version: int, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """`vlrl.rollout.publish.ServerWeights.update_weights`."""
        self.weights.update_weights(version=version, state_dict=state_dict)

    def publish(self, *, version: int, state_dict: dict[str, torch.Tensor] | None = None) -> concurrent.futures.Future:
        """`vlrl.rollout.publish.ServerWeights.publish`."""
        return self.weights.publish(version=version, state_dict=state_dict)

    def join_trainer_ranks(self, rank: int, world_size: int) -> None:
        """`vlrl.rollout.publish.ServerWeights.join_trainer_ranks`."""
        self.weights.join_trainer_ranks(rank, world_size)

    # -------------------------------------------------------------------------------------------- Engine
    def encode(self, sample: Sample) -> Request:
        with self._tokenizer_lock:
            return self._encoder.encode(sample)

    def encode_observation(self, messages: list[dict], *, last_token: int | None, tools: list[dict] | None = None):
        """Tokens (and vision inputs) of an environment's observation after a model turn (multi-turn rollouts)."""
        with self._tokenizer_lock:
            return self._encoder.encode_observation(messages, last_token=last_token, tools=tools)

    def decode(self, ids: Sequence[int]) -> str:
        with self._tokenizer_lock:
            return self._encoder.decode(ids)

    def generate(self, requests: Sequence[Request], sampling: SamplingParams) -> list[Trajectory]:
        return self.pool.call(self._generate(requests, sampling))

    async def agenerate(self, requests: Sequence[Request], sampling: SamplingParams) -> list[Trajectory]:
        """`generate`, awaitable from another event loop. The calls made in one iteration of that loop (e.g. one
        per prompt, started together) are sent together, as batched ``/generate`` requests, so a server decodes
        them as one batch however slowly they would otherwise trickle in; each call returns as soon as its own
        prompts are answered."""
        loop = asyncio.get_running_loop()
        key = (id(loop), sampling_key(sampling))
        if key not in self._gathering:
            self._gathering[key] = []
            loop.call_soon(self._flush, key, sampling)  # after every call already scheduled in this iteration
        futures = [concurrent.futures.Future() for _ in requests]
        self._gathering[key].extend(zip(requests, futures, strict=True))
        return await self._collect([asyncio.wrap_future(f) for f in futures], futures)

    def _flush(self, key: tuple, sampling: SamplingParams) -> None:
        self.pool.loop.call_soon_threadsafe(self._dispatch, self._gathering.pop(key), sampling)

    async def _generate(self, requests: Sequence[Request], sampling: SamplingParams) -> list[Trajectory]:
        futures = [concurrent.futures.Future() for _ in requests]
        self._dispatch(list(zip(requests, futures, strict=True)), sampling)
        return await self._collect([asyncio.wrap_future(f) for f in futures], futures)

    @staticmethod
    async def _collect(waiting: list[asyncio.Future], futures: list[concurrent.futures.Future]) -> list[Trajectory]:
        """The trajectories of one call's prompts, in order, ``group_index`` = the prompt's position."""
        try:
            groups = await asyncio.gather(*waiting)
        except BaseException:
            for future in futures:  # the caller gave up (or one prompt failed): give up the others too
                future.cancel()
            raise
        out = []
        for i, group in enumerate(groups):
            for t in group:
                t.group_index = i
            out.extend(group)
        return out

    def _dispatch(self, prompts: list[tuple[Request, concurrent.futures.Future]], sampling: SamplingParams) -> None:
        """On the engine's loop: give each prompt in turn to the live server with the fewest prompts in flight
        (counting those given out here) and send each server its prompts as batched requests, each at most what
        the server decodes at once (its ``max_batch_size``, when it reports one). Each prompt's future gets its
        n trajectories (or the request's error); a request whose prompts were all cancelled is cancelled."""
        prompts = [(r, f) for r, f in prompts if not f.cancelled()]  # (left pending, so that callers can cancel)
        live = self.pool.live()
        if not live:
            error = self.pool.no_servers_left()
            for _, future in prompts:
                settle(future, error=error)
            return
        load = {s.url: s.in_flight for s in live}
        assigned: dict[str, list[tuple[Request, concurrent.futures.Future]]] = {}
        for prompt in prompts:
            server = min(live, key=lambda s: (load[s.url], s.failures, s.served))
            load[server.url] += 1
            assigned.setdefault(server.url, []).append(prompt)
        servers = {s.url: s for s in live}
        chunks = []
        for url, given in assigned.items():  # a request per batch the server decodes, so the first answers come early
            size = max(1, (servers[url].max_batch_size or len(given) * sampling.n) // sampling.n)
            chunks += [(url, chunk) for chunk in _chunks(given, size, servers[url].max_request_pixels)]
        for url, chunk in chunks:
            task = self.pool.loop.create_task(self._answer(chunk, sampling, url))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            futures = [f for _, f in chunk]
            for future in futures:
                future.add_done_callback(functools.partial(self._cancel_if_abandoned, task, futures))

    def _cancel_if_abandoned(self, task: asyncio.Task, futures: list[concurrent.futures.Future], _: Any) -> None:
        if all(f.cancelled() for f in futures):
            self.pool.loop.call_soon_threadsafe(task.cancel)

    async def _answer(self, chunk: list[tuple[Request, concurrent.futures.Future]], sampling: SamplingParams,
                      url: str) -> None:
        futures = [f for _, f in chunk]
        try:
            trajectories = await self._generate_chunk([r for r, _ in chunk], sampling, first=url)
        except BaseException as err:
            for future in futures:
                settle(future, error=err if isinstance(err, Exception) else RolloutRequestError("cancelled"))
            if not isinstance(err, Exception):
                raise
            return
        for i, future in enumerate(futures):
            settle(future, trajectories[i * sampling.n : (i + 1) * sampling.n])

    def _payload(self, requests: Sequence[Request], sampling: SamplingParams) -> Any:
        """SGLang's batched ``/generate`` body: ``input_ids`` one list per prompt; ``image_data`` (when any prompt has
        images) one list per prompt, ``[]`` for a text-only one — SGLang reads the batch form from the first entry,
        and refuses ``[None, [image]]``. Sampling as the in-process engine samples: the model's EOS ids as
        ``stop_token_ids`` (not the server's generation config) and the family's vision markup and other special
        tokens never sampled (a ``logit_bias`` of `SUPPRESS_BIAS`). vLLM: one body per prompt (`VLLMServers.bodies`)."""
        if self.vllm is not None:
            problem = self.vllm.logprob_problem(sampling)
            if problem:  # (the run goes on: rollout/logprob_diff_max shows the gap)
                self.pool.warn_once("vllm", f"logprobs {sampling_key(sampling)}", "%s", problem)
            return self.vllm.bodies(requests, sampling, stop_token_ids=self.policy.eos_token_ids,
                                    suppress=self._encoder.suppress, images=self._encoded_images)
        body: dict[str, Any] = {"input_ids": [list(r.prompt_ids) for r in requests]}
        if any(r.images for r in requests):
            body["image_data"] = [self._encoded_images(r) if r.images else [] for r in requests]
        bias = {str(t): SUPPRESS_BIAS for t in self._encoder.suppress}
        bias.update({str(t): float(b) for t, b in sampling.logit_bias.items()})
        params: dict[str, Any] = {"n": sampling.n, "temperature": sampling.temperature, "top_p": sampling.top_p,
                                  "top_k": sampling.top_k if sampling.top_k > 0 else -1,
                                  "max_new_tokens": sampling.max_new_tokens, "stop": list(sampling.stop),
                                  "stop_token_ids": sorted(set(self.policy.eos_token_ids) | set(sampling.stop_token_ids))}
        if bias:
            params["logit_bias"] = bias
        body.update(sampling_params=params, return_logprob=True)
        if self.prompt_check.wants_ids:
            body["return_prompt_token_ids"] = True  # (SGLang: the ids it sampled from, after its own processing)
        return body

    def _encoded_images(self, request: Request) -> list[str]:
        """PNG data URLs of a request's images, cached (LRU) because prompts recur every epoch."""
        key = id(request)
        if key in self._images and self._images[key][0] is request:
            self._images.move_to_end(key)
            return self._images[key][1]
        encoded = [encode_image(image) for image in request.images]
        self._images[key] = (request, encoded)
        if len(self._images) > 4096:
            self._images.popitem(last=False)
        return encoded

    async def _generate_chunk(self, requests: Sequence[Request], sampling: SamplingParams, *,
                              first: str | None = None) -> list[Trajectory]:
        """One batched request to server ``first`` (retried whole on others: `ServerPool.with_failover`); its
        trajectories, prompt-major."""
        payload = self._payload(requests, sampling)
        version_at_start: dict[str, int] = {}

        async def send(server: ServerState):
            version_at_start[server.url] = self.weight_version
            if self.vllm is not None:
                return await self.vllm.post_generate(server, payload, self.pool.settings.request_timeout)
            return await self.pool.client.post(f"{server.url}/generate", json=payload, headers=self.pool.headers)

        return await self.pool.with_failover(
            send, lambda response, server: self._parse(response.json(), requests, sampling,
                                                       version_at_start[server.url], server),
            rows=len(requests), first=first, what="/generate")

    def _parse(self, body: Any, requests: Sequence[Request], sampling: SamplingParams, version_at_start: int,
               server: ServerState) -> list[Trajectory]:
        url = server.url
        if self.vllm is not None:  # (vLLM's prompt ids: the same exact check as SGLang's)
            return self.vllm.trajectories(
                body, requests, sampling, url=url, version_at_start=version_at_start, decode=self._decode_response,
                check_prompt=lambda _, request, ids: self.prompt_check(server, request, {"prompt_token_ids": ids}))
        items = body if isinstance(body, list) else [body]
        if len(items) != len(requests) * sampling.n:
            raise RolloutRequestError(f"{url}: asked for {len(requests)} prompt(s) × n = {sampling.n} samples, "
                                      f"got {len(items)}")
        out = []
        for k, item in enumerate(items):  # prompt-major: the n samples of prompt 0, then of prompt 1, ...
            request = requests[k // sampling.n]
            prompt_ids = torch.as_tensor(request.prompt_ids, dtype=torch.long)
            meta = item.get("meta_info", {})
            pairs = meta.get("output_token_logprobs")
            if pairs is None:
                raise RolloutRequestError(f"{url}: no meta_info.output_token_logprobs (does it support return_logprob?)")
            ids = [int(p[1]) for p in pairs]
            finish = (meta.get("finish_reason") or {}).get("type", "length")
            if finish not in _FINISH:
                raise RolloutRequestError(f"{url}: unknown finish_reason type {finish!r}")
            if finish != "abort":  # (an aborted answer is never trained on)
                self.prompt_check(server, request, item)
            with self._tokenizer_lock:
                text = self.policy.tokenizer.decode(ids, skip_special_tokens=True)
            out.append(Trajectory(
                sample=request.sample, prompt_ids=prompt_ids, response_ids=torch.tensor(ids, dtype=torch.long),
                loss_mask=torch.ones(len(ids), dtype=torch.long),
                behaviour_logp=torch.tensor([float(p[0]) for p in pairs], dtype=torch.float),
                vision=request.vision, images=request.images,
                weight_version=answer_version(meta, version_at_start),
                token_versions=token_versions(meta, len(ids), version_at_start),
                status=_FINISH[finish], response_text=text, group_index=k // sampling.n,
            ))
        return out

    def _decode_response(self, ids: list[int]) -> str:
        with self._tokenizer_lock:
            return self.policy.tokenizer.decode(ids, skip_special_tokens=True)
