"""`HTTPEngine`: the `Engine` protocol over HTTP, against one or more SGLang-compatible rollout servers.

Prompts are encoded locally (tokenizer + image processor, exactly as `HFEngine` does) and sent as
``input_ids`` + ``image_data`` (PNG data URLs, in the batch form SGLang 0.5.23's schema accepts) to SGLang's native
``/generate``, sampled as the in-process engine samples (the model's EOS as ``stop_token_ids``, its vision markup
and other special tokens banned by ``logit_bias``); the answer's ``output_token_logprobs`` become the behaviour
log-probs and its weight version the trajectory's (`answer_version`: the oldest of SGLang's ``weight_versions``
spans; a server that reports none, or a label that is no integer, is tagged with the version current when the
request started — the oldest weights it can have used, so staleness is never under-estimated). Each answer's
``meta_info.prompt_tokens`` is compared with the prompt the trainer scores (``prompt_check``). Server facts come from
``/server_info`` (``/get_model_info`` on older servers).

Reliability: each request goes to the live server with the fewest prompts in flight. A transport error,
timeout or 5xx answer counts as a failure of that server and the request is retried on another one (up to
``max_retries`` times); a server with ``max_server_failures`` consecutive failures is dropped from the pool
with a warning. A 503/429 (queue full) is waited out, not counted. A 4xx is a bug in the request and raises.

Weight updates are bracketed by SGLang's ``/pause_generation`` (mode by ``on_weight_update``) and
``/continue_generation``, on both sync paths, while this client holds its own new requests (`_pause`); weight and
pause calls carry the admin key and have their own timeout (``weight_update_timeout``).
`update_weights` saves the trainer's weights (``save_pretrained`` layout) under
``weights_dir``, asks every live server to load them (``/update_weights_from_disk``), and bumps
``weight_version`` only after every server confirmed. vlrl's servers answer with a checksum of what they
loaded; a mismatch with the trainer's own checksum raises `WeightSyncError` (the run stops). A server that
reports no checksum (e.g. SGLang) is warned about once. `publish` is the same without waiting: it returns
once the weights are saved, and a future that resolves when every server confirmed (the asynchronous recipe
trains its next step meanwhile). Put ``weights_dir`` on a RAM disk (``/dev/shm``) when servers share the host.

With ``weight_sync="distributed"`` the weights travel over a process group instead (SGLang's
``/init_weights_update_group`` + ``/update_weights_from_distributed``; `vlrl.rollout.dist_sync`): the first update
has every live server join a group hosted by the trainer (rank 0); each update then sends the parameters bucket
by bucket (``bucket_mb``), each bucket announced to every server by HTTP and broadcast from rank 0, the last
bucket carrying the new ``weight_version``; checksums are compared as on disk. Nothing touches the disk. If the
group breaks — a server died mid-broadcast or could not join, or nothing came back within ``sync_timeout``
(``rollout.weight_sync_timeout``) — the trainer closes the group (ending the survivors' broadcast too) and has the
servers destroy it, that update falls back to disk and the next one forms a new group with the servers left. Buckets
are gathered and packed on the group's device (the GPU for NCCL), each ordered by element size (SGLang refuses a
tensor at a misaligned offset); server i holds ``tp_size`` ranks. vlrl's server receives the buckets into its spare
weights and swaps them in at once; a real SGLang server loads each bucket as it arrives — paused meanwhile, so no
request runs on a half-updated model.

Batching: the prompts of one `generate` call (or of the `agenerate` calls made together) are sent as one
batched ``/generate`` per server (SGLang's list form of ``input_ids``), split evenly over the live servers.

The engine owns an asyncio loop on a background thread: `generate` (the synchronous `Engine` method) and
`agenerate` (awaitable from any other event loop) both run there.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import functools
import gc
import itertools
import logging
import os
import shutil
import socket
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from vlrl.data.sample import Sample
from vlrl.models.policy import DTYPES, Policy
from vlrl.rollout import dist_sync
from vlrl.rollout.hf_engine import HFEngine
from vlrl.rollout.server import (
    API_KEY_ENV,
    WeightSyncError,
    encode_image,
    quiet_transformers,
    sampling_key,
    settle,
    weight_checksum,
)
from vlrl.rollout.types import Engine, Request, SamplingParams, Status, Trajectory
from vlrl.rollout.weights import checkpoint_names
from vlrl.serving import ADMIN_API_KEY_ENV

log = logging.getLogger(__name__)

_FINISH = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}
_DTYPE_NAMES = {"float32": "float32", "float": "float32", "bfloat16": "bfloat16", "float16": "float16",
                "half": "float16"}  # SGLang's --dtype spellings → vlrl's (``auto``: unknown)
SUPPRESS_BIAS = -1.0e4  # the logit_bias of a token never to be sampled: exp(-1e4) underflows to 0 in float32
PAUSE_MODES = {"finish": "retract", "abort": "abort", "retract": "retract", "in_place": "in_place"}
"""`rollout.on_weight_update` → the ``/pause_generation`` mode sent before each update (``finish``: none before a disk
update; before a distributed one, once this client's requests in flight ended — nothing of its own is retracted)."""


def answer_version(meta: dict[str, Any], version_at_start: int) -> int:
    """The weight version an answer is tagged with: the oldest of SGLang's ``weight_versions`` spans (a request
    that lived through an update — paused ``retract`` / ``in_place`` — holds tokens of both), else its
    ``weight_version``. A version that is no integer (SGLang's ``--weight-version`` default ``default``, or any
    label a server was started with) or none at all counts as the version current when the request started —
    the oldest the server can have used, so staleness is never under-estimated."""
    spans = meta.get("weight_versions") or []
    reported = [span.get("version") if isinstance(span, dict) else span[0] if isinstance(span, list) and span else None
                for span in spans] or [meta.get("weight_version")]
    versions = []
    for value in reported:
        try:
            versions.append(int(value))
        except (TypeError, ValueError):
            versions.append(version_at_start)
    return min(versions)


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


@runtime_checkable
class AsyncEngine(Engine, Protocol):
    """An `Engine` that can also be awaited (what the asynchronous recipe needs)."""

    async def agenerate(self, requests: Sequence[Request], sampling: SamplingParams) -> list[Trajectory]:
        """Same contract as `Engine.generate`; trajectories carry the version that produced them and
        ``Status.ABORTED`` when a weight update aborted them."""
        ...

    def close(self) -> None:
        ...


class NoServersLeft(RuntimeError):
    """Every rollout server failed and was dropped from the pool."""


class _GroupBroken(RuntimeError):
    """The weight-update group failed mid-update (a server died, a timeout): this update must go by disk."""


class RolloutRequestError(RuntimeError):
    """A request failed on every server it was retried on, or a server answered with something unusable."""


class PromptMismatchError(RolloutRequestError):
    """A server sampled from another prompt than the one the trainer scores (``meta_info.prompt_tokens``)."""


@dataclasses.dataclass
class ServerState:
    url: str
    in_flight: int = 0
    failures: int = 0  # consecutive
    alive: bool = True
    dtype: str | None = None
    served: int = 0  # prompts answered
    max_batch_size: int | None = None  # sequences it decodes at once, if it says (vlrl's server does)
    ranks: int = 1  # ranks it holds in a weight-update group (SGLang: its tp_size)
    max_request_pixels: int | None = None  # image pixels one request may carry, if it says (vlrl's server does)


@dataclasses.dataclass(frozen=True)
class SyncStats:
    """The last weight update: how, how long (seconds from the call to every server's confirmation), the bytes of
    one copy of the weights as sent (disk: the safetensors written), buckets sent, servers updated."""

    method: str
    seconds: float
    bytes: int
    buckets: int
    servers: int


class _Failures:
    """The server calls that failed during one wait of a weight update (``on_failure`` of `_post_each`): their
    messages, and an event set at the first, which ends the wait at once."""

    def __init__(self, what: str = "") -> None:
        self.what, self.messages, self.settled = what, [], threading.Event()

    def __call__(self, server: ServerState, why: str) -> None:
        self.messages.append(f"{server.url}{self.what}: {why}")
        self.settled.set()


class HTTPEngine:
    """Generate on SGLang-compatible servers; encode and decode locally with the trainer's `Policy`."""

    def __init__(self, policy: Policy, servers: Sequence[str], *, weights_dir: str | Path, api_key: str | None = None,
                 request_timeout: float = 300.0, connect_timeout: float = 10.0, max_retries: int = 3,
                 max_server_failures: int = 2, abort_on_update: bool = False, startup_timeout: float = 60.0,
                 keep_checkpoints: int = 2, weight_sync: str = "disk", sync_address: str = "127.0.0.1",
                 sync_port: int = 0, bucket_mb: float = 256.0, sync_timeout: float = 120.0,
                 on_weight_update: str = "finish", weight_update_timeout: float = 600.0, prompt_check: str = "error",
                 admin_api_key: str | None = None, sync_backend: str | None = None) -> None:
        import httpx

        if not servers:
            raise ValueError("HTTPEngine needs at least one server URL")
        if weight_sync not in ("disk", "distributed"):
            raise ValueError(f"rollout.weight_sync: 'disk' or 'distributed', got {weight_sync!r}")
        on_weight_update = "abort" if abort_on_update else on_weight_update
        if on_weight_update not in PAUSE_MODES:
            raise ValueError(f"rollout.on_weight_update: one of {sorted(PAUSE_MODES)}, got {on_weight_update!r}")
        if prompt_check not in ("error", "warn", "off"):
            raise ValueError(f"rollout.prompt_check: error, warn or off, got {prompt_check!r}")
        self.on_weight_update, self.prompt_check = on_weight_update, prompt_check
        self.weight_update_timeout = weight_update_timeout
        self.sync_backend = sync_backend  # the weight-update group's backend; None: NCCL for a CUDA policy, else gloo
        self.prompt_mismatches = 0  # answers whose prompt_tokens differed from the trainer's prompt (prompt_check=warn)
        self._pause_depth = 0  # nested weight updates (a distributed one falling back to disk) pause once
        self._paused_servers = False
        self._open = asyncio.Event()  # cleared while a weight update holds new requests back
        self._open.set()
        self._warned: set[tuple[str, str]] = set()
        self.weight_sync = weight_sync
        self.sync_address, self.sync_port = sync_address, sync_port
        self.bucket_bytes = max(1, int(bucket_mb * (1 << 20)))
        self.sync_timeout = sync_timeout
        self._send_buffer = dist_sync.ByteBuffer()  # each bucket is packed here (reused: no allocation per bucket)
        self.last_sync: SyncStats | None = None
        self._group: Any = None  # the weight-update process group (distributed sync), once formed
        self._group_name = ""
        self._group_servers: list[str] = []
        self._group_ids = itertools.count()
        self._group_backend = ""
        self._rendezvous: threading.Thread | None = None  # the trainer's side of the last group formation
        self._group_device = torch.device("cpu")  # where buckets are gathered and packed: the group's (`group_device`)
        self._entries: list[dist_sync.Entry] | None = None
        self.rank, self.world_size = 0, 1  # trainer ranks sharing these servers (`join_trainer_ranks`)
        self.policy = policy
        self.weight_version = 0
        self.weights_dir = Path(weights_dir)
        self.request_timeout = request_timeout
        self.max_retries = max_retries
        self.max_server_failures = max_server_failures
        self.abort_on_update = on_weight_update == "abort"
        self.keep_checkpoints = keep_checkpoints
        self.servers = [ServerState(url.rstrip("/")) for url in servers]
        self.dropped: list[str] = []  # "url: reason"
        self._encoder = HFEngine(policy)
        self._tokenizer_lock = threading.Lock()
        self._images: collections.OrderedDict[int, tuple[Request, list[str]]] = collections.OrderedDict()
        self._warned_no_checksum: set[str] = set()
        self._saved: list[Path] = []
        self._gathering: dict[tuple, list[tuple[list[Request], asyncio.Future]]] = {}
        self._publishing: concurrent.futures.Future | None = None
        self._closing = False
        self._tasks: set[asyncio.Task] = set()
        key = api_key if api_key is not None else os.environ.get(API_KEY_ENV)
        self._headers = {"Authorization": f"Bearer {key}"} if key else {}
        admin = admin_api_key if admin_api_key is not None else os.environ.get(ADMIN_API_KEY_ENV)
        self._admin_headers = {"Authorization": f"Bearer {admin}"} if admin else self._headers  # weight and pause calls
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vlrl-http-engine", daemon=True)
        self._thread.start()
        timeout = httpx.Timeout(request_timeout, connect=connect_timeout)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        self._client = self._call(self._make_client(timeout, limits))
        self._call(self._wait_ready(startup_timeout))

    # -------------------------------------------------------------------------------------------- plumbing
    @staticmethod
    async def _make_client(timeout, limits):
        import httpx

        return httpx.AsyncClient(timeout=timeout, limits=limits)

    def _call(self, coro):
        """Run ``coro`` on the engine's loop and wait for it (from a thread that is not that loop)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def close(self) -> None:
        if self._loop.is_running():
            self._destroy_group(timeout=10.0)
        self._closing = True
        if self._loop.is_running():
            self._call(self._client.aclose())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)

    def live_servers(self) -> list[ServerState]:
        return [s for s in self.servers if s.alive]

    async def _wait_ready(self, timeout: float) -> None:
        """Wait until every server answers ``/server_info`` (SGLang ≥ 0.5: launch facts, parallel sizes) — or, where
        that route is missing, the older ``/get_model_info`` (servers may still be loading) — and read its facts."""
        deadline = time.monotonic() + timeout
        for server in self.servers:
            while True:
                try:
                    info = await self._server_info(server)
                    break
                except RolloutRequestError:
                    raise
                except Exception as err:
                    if time.monotonic() > deadline:
                        raise RolloutRequestError(f"rollout server {server.url} not ready after {timeout:.0f}s: {err}") from err
                    await asyncio.sleep(0.25)
            self._read_facts(server, info)

    async def _server_info(self, server: ServerState) -> dict[str, Any]:
        for path in ("/server_info", "/get_model_info"):
            response = await self._client.get(f"{server.url}{path}", headers=self._headers)
            if response.status_code == 401:
                raise RolloutRequestError(f"{server.url}: 401 unauthorised: set ${API_KEY_ENV} to the server's --api-key")
            if response.status_code == 404 and path == "/server_info":
                continue  # an older server: the deprecated route has what vlrl reads
            response.raise_for_status()
            return response.json()
        raise AssertionError("unreachable")

    def _read_facts(self, server: ServerState, info: dict[str, Any]) -> None:
        """What vlrl reads from a server's info: its weights' dtype (SGLang's spellings: ``half``, ``float``; ``auto``
        is unknown), how many sequences it decodes at once (vlrl's ``max_batch_size``, SGLang's
        ``max_running_requests``), the pixels one request may carry (vlrl), and its ranks in a weight-update group
        (``tp_size``: SGLang's rank ``rank_offset + tp_rank``)."""
        server.dtype = _DTYPE_NAMES.get(str(info.get("dtype")))
        batch = info.get("max_batch_size") or info.get("max_running_requests")
        server.max_batch_size = int(batch) if isinstance(batch, int) and batch > 0 else None
        pixels = info.get("max_request_pixels")
        server.max_request_pixels = int(pixels) if isinstance(pixels, int) and pixels > 0 else None
        server.ranks = int(info.get("tp_size") or 1)
        replicas, stages = int(info.get("dp_size") or 1), int(info.get("pp_size") or 1)
        if self.weight_sync == "distributed" and (replicas > 1 or stages > 1):
            raise RolloutRequestError(
                f"{server.url}: dp_size {replicas}, pp_size {stages}: SGLang's distributed weight update takes one "
                "data-parallel replica, and ranks rank_offset + tp_rank (pipeline stages would share them); start one "
                "server per replica with pp_size 1, or use rollout.weight_sync=disk")

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
        return self._call(self._generate(requests, sampling))

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
        self._loop.call_soon_threadsafe(self._dispatch, self._gathering.pop(key), sampling)

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
        live = self.live_servers()
        if not live:
            error = NoServersLeft("every rollout server was dropped: " + "; ".join(self.dropped))
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
            task = self._loop.create_task(self._answer(chunk, sampling, url))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            futures = [f for _, f in chunk]
            for future in futures:
                future.add_done_callback(functools.partial(self._cancel_if_abandoned, task, futures))

    def _cancel_if_abandoned(self, task: asyncio.Task, futures: list[concurrent.futures.Future], _: Any) -> None:
        if all(f.cancelled() for f in futures):
            self._loop.call_soon_threadsafe(task.cancel)

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

    def _payload(self, requests: Sequence[Request], sampling: SamplingParams) -> dict[str, Any]:
        """SGLang's batched ``/generate`` body: ``input_ids`` one list per prompt; ``image_data`` (when any prompt has
        images) one list per prompt, ``[]`` for a text-only one — SGLang reads the batch form from the first entry,
        and refuses ``[None, [image]]``. Sampling as the in-process engine samples: the model's EOS ids as
        ``stop_token_ids`` (not the server's generation config) and the family's vision markup and other special
        tokens never sampled (a ``logit_bias`` of `SUPPRESS_BIAS`)."""
        body: dict[str, Any] = {"input_ids": [list(r.prompt_ids) for r in requests]}
        if any(r.images for r in requests):
            body["image_data"] = [self._encoded_images(r) if r.images else [] for r in requests]
        bias = {str(t): SUPPRESS_BIAS for t in self._encoder._suppress}
        bias.update({str(t): float(b) for t, b in sampling.logit_bias.items()})
        params: dict[str, Any] = {"n": sampling.n, "temperature": sampling.temperature, "top_p": sampling.top_p,
                                  "top_k": sampling.top_k if sampling.top_k > 0 else -1,
                                  "max_new_tokens": sampling.max_new_tokens, "stop": list(sampling.stop),
                                  "stop_token_ids": sorted(set(self.policy.eos_token_ids) | set(sampling.stop_token_ids))}
        if bias:
            params["logit_bias"] = bias
        body.update(sampling_params=params, return_logprob=True)
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

    def _pick(self, tried: set[str]) -> ServerState:
        live = self.live_servers()
        if not live:
            raise NoServersLeft("every rollout server was dropped: " + "; ".join(self.dropped))
        fresh = [s for s in live if s.url not in tried] or live
        return min(fresh, key=lambda s: (s.in_flight, s.failures, s.served))

    async def _generate_chunk(self, requests: Sequence[Request], sampling: SamplingParams, *,
                              first: str | None = None) -> list[Trajectory]:
        """One batched request to server ``first`` (retried whole on others); its trajectories, prompt-major."""
        payload = self._payload(requests, sampling)
        tried: set[str] = set()
        attempts, deadline = 0, None
        while True:
            await self._open.wait()  # (a weight update in progress holds new requests back: `_pause`)
            deadline = deadline or time.monotonic() + 4 * self.request_timeout
            server = next((s for s in self.live_servers() if s.url == first), None) if not tried else None
            server = server or self._pick(tried)
            version_at_start = self.weight_version
            server.in_flight += len(requests)
            try:
                response = await self._client.post(f"{server.url}/generate", json=payload, headers=self._headers)
            except Exception as err:  # connection refused/reset, timeout: the server is down or stalled
                if self._closing:  # our own client was closed under the request: not the server's failure
                    raise RolloutRequestError("the HTTP engine was closed") from err
                failure = f"{type(err).__name__}: {err}"
            else:
                if response.status_code in (429, 503) and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)  # queue full: wait, not a failure
                    continue
                if response.status_code < 400:
                    server.failures, server.served = 0, server.served + len(requests)
                    return self._parse(response.json(), requests, sampling, version_at_start, server.url)
                if response.status_code < 500:
                    raise RolloutRequestError(f"{server.url}/generate rejected the request: "
                                              f"{response.status_code} {response.text[:500]}")
                failure = f"HTTP {response.status_code}: {response.text[:200]}"
            finally:
                server.in_flight -= len(requests)
            self._record_failure(server, failure)
            tried.add(server.url)
            attempts += 1
            if attempts > self.max_retries:
                raise RolloutRequestError(f"request failed {attempts} times; last on {server.url}: {failure}")

    def _record_failure(self, server: ServerState, failure: str) -> None:
        server.failures += 1
        log.warning("rollout server %s failed (%d in a row): %s", server.url, server.failures, failure)
        if server.alive and server.failures >= self.max_server_failures:
            self._drop(server, failure)

    def _drop(self, server: ServerState, reason: str) -> None:
        server.alive = False
        self.dropped.append(f"{server.url}: {reason}")
        log.warning("dropping rollout server %s from the pool (%s); %d left", server.url, reason, len(self.live_servers()))

    def _parse(self, body: Any, requests: Sequence[Request], sampling: SamplingParams, version_at_start: int,
               url: str) -> list[Trajectory]:
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
                self._check_prompt(url, request, meta.get("prompt_tokens"))
            with self._tokenizer_lock:
                text = self.policy.tokenizer.decode(ids, skip_special_tokens=True)
            out.append(Trajectory(
                sample=request.sample, prompt_ids=prompt_ids, response_ids=torch.tensor(ids, dtype=torch.long),
                loss_mask=torch.ones(len(ids), dtype=torch.long),
                behaviour_logp=torch.tensor([float(p[0]) for p in pairs], dtype=torch.float),
                vision=request.vision, images=request.images,
                weight_version=answer_version(meta, version_at_start),
                status=_FINISH[finish], response_text=text, group_index=k // sampling.n,
            ))
        return out

    def _check_prompt(self, url: str, request: Request, reported: Any) -> None:
        """``rollout.prompt_check``: the server's ``meta_info.prompt_tokens`` against the prompt the trainer scores.
        SGLang re-runs the served model's processor on a prompt's images with its own pixel bounds and replaces the
        ids; a mismatch means the response was sampled from another prompt (biased ratios, no other sign)."""
        if self.prompt_check == "off":
            return
        if not isinstance(reported, int):
            self._warn_once(url, "prompt_tokens", "%s reports no meta_info.prompt_tokens: rollout.prompt_check cannot "
                            "compare its prompts with the trainer's", url)
            return
        if reported == len(request.prompt_ids):
            return
        message = (f"{url} sampled sample {request.sample.id!r} from a prompt of {reported} tokens; the trainer scores "
                   f"{len(request.prompt_ids)}. With images, the server re-processed them with its own pixel bounds: "
                   "start SGLang with --mm-process-config holding model.min_pixels / model.max_pixels (README "
                   "\"Rollout servers\"), or set rollout.prompt_check=warn / off")
        if self.prompt_check == "error":
            raise PromptMismatchError(message)
        self.prompt_mismatches += 1
        if self.prompt_mismatches <= 5:
            log.warning("%s%s", message, " (further mismatches are counted, not logged)" if self.prompt_mismatches == 5
                        else "")

    def _warn_once(self, url: str, what: str, message: str, *args: Any) -> None:
        if (url, what) not in self._warned:
            self._warned.add((url, what))
            log.warning(message, *args)

    # -------------------------------------------------------------------------------------------- pause
    async def _pause(self, method: str) -> None:
        """Before a weight update by ``method`` (``disk`` / ``distributed``): hold this client's new requests back
        (`_open`: they wait here, not in a server's queue against their timeout), then pause every live server
        (SGLang's ``/pause_generation``, mode by `PAUSE_MODES`) — so no request runs on half-updated weights (SGLang
        releases its writer lock between the buckets of a distributed update) and a paused SGLang loads at once.
        ``on_weight_update=finish``: a disk update pauses nothing (SGLang's load waits for the requests in flight,
        which end on the old weights, and holds new ones behind it; vlrl serve loads beside them); a distributed one
        first waits until this client's requests in flight ended (each within its own timeout). Nested calls (a
        distributed update falling back to disk) pause once."""
        self._pause_depth += 1
        if self._pause_depth > 1:
            return
        self._open.clear()
        if self.on_weight_update == "finish":
            if method == "disk":
                return
            deadline = time.monotonic() + self.request_timeout
            while any(s.in_flight for s in self.servers) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
        self._paused_servers = True
        await self._weight_call("/pause_generation", {"mode": PAUSE_MODES[self.on_weight_update]})

    async def _resume(self) -> None:
        """After a weight update (whatever its outcome): ``/continue_generation`` on every live server (if they were
        paused), then let this client's held requests go."""
        self._pause_depth -= 1
        if self._pause_depth:
            return
        try:
            if self._paused_servers:
                self._paused_servers = False
                await self._weight_call("/continue_generation", {})
        finally:
            self._open.set()

    async def _weight_call(self, path: str, body: dict) -> None:
        """POST ``body`` to every live server (admin key, `weight_update_timeout`). A server without the route (404)
        is warned about once; other failures are logged — the update itself finds a server that is gone."""
        live = self.live_servers()
        answers = await self._post_each(live, path, [body] * len(live))
        for server, answer in zip(live, answers, strict=True):
            if isinstance(answer, BaseException):
                log.warning("%s%s failed: %s: %s", server.url, path, type(answer).__name__, answer)
            elif answer.get("status_code") == 404:
                self._warn_once(server.url, path, "%s has no %s (not SGLang ≥ 0.4.9 nor vlrl serve): weight updates "
                                "there are not paused", server.url, path)
            elif not answer.get("success", True):
                log.warning("%s%s: %s", server.url, path, answer.get("message", answer))

    # -------------------------------------------------------------------------------------------- weights
    def update_weights(self, *, version: int, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """Save the weights, have every live server load them, check checksums, then adopt ``version``.
        Under several trainer ranks (`join_trainer_ranks`) every rank calls it: see `_update_over_ranks`."""
        if self.world_size > 1:
            self._update_over_ranks(version)
            return
        self.publish(version=version, state_dict=state_dict).result()

    def join_trainer_ranks(self, rank: int, world_size: int) -> None:
        """``rollout.servers`` under torchrun: this engine is rank ``rank``'s of ``world_size`` trainer ranks (in
        the default torch.distributed group), each generating its share of the step on the same servers. A
        weight update is then a collective call of every rank: rank 0 alone talks to the servers, the others join
        the FSDP2 gathers of the parameters (bucket by bucket, or the full state dict for the disk path)."""
        self.rank, self.world_size = rank, world_size

    def _update_over_ranks(self, version: int) -> None:
        """One weight update with several trainer ranks. Distributed sync: rank 0 plans the buckets and shares the
        plan; every rank gathers each bucket's full tensors (FSDP2 all-gathers: one bucket of full tensors at a
        time) and rank 0 broadcasts them to the servers. If the group breaks, or with ``weight_sync=disk``, every
        rank joins the gather of the full state dict onto rank 0, which saves it and has the servers load it.
        Rank 0 then shares the outcome, so every rank adopts ``version`` — or raises rank 0's error — only after
        the servers confirmed: no rank generates from the old weights after the call returns."""
        import torch.distributed as dist

        def share(obj):  # rank 0's ``obj`` on every rank
            box = [obj]
            dist.broadcast_object_list(box, src=0)
            return box[0]

        main, outcome = self.rank == 0, "disk"
        state = self._sent_state()  # (model.lora: merged on the shards — a collective, once per rank and update)
        if self.weight_sync == "distributed":
            plan = share(self._bucket_plan(self.live_servers()) if main else None)
            if main:
                try:
                    self._sync_distributed(version, state, plan=plan, fallback=False)
                    outcome = "done"
                except _GroupBroken as err:
                    log.warning("distributed weight update %d failed (%s); loading it from disk instead, the next "
                                "update forms a new group", version, err)
                except Exception as err:  # noqa: BLE001 — every rank raises it below
                    outcome = f"{type(err).__name__}: {err}"
            else:
                for bucket in plan[1]:
                    dist_sync.full_tensors(state, bucket)  # rank 0's gathers need ours
            outcome = share(outcome)
        if outcome == "disk":
            lora = getattr(self.policy, "lora", None) is not None
            sharded = any(hasattr(t, "full_tensor") for t in state.values())
            full = state if lora else None  # LoRA: the merged weights above (DDP: each rank's own, whole)
            if sharded and lora:  # FSDP2: the merged shards gathered onto rank 0 only
                from vlrl.models.lora import gather_on_rank0

                full = gather_on_rank0(state.items())
            elif sharded:
                from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

                full = get_model_state_dict(self.policy.model, options=StateDictOptions(full_state_dict=True,
                                                                                        cpu_offload=True))
            if main:
                try:
                    self.publish(version=version, state_dict=full).result() if self.weight_sync == "disk" else \
                        self._disk_fallback(version, full)
                    outcome = "done"
                except Exception as err:  # noqa: BLE001 — every rank raises it below
                    outcome = f"{type(err).__name__}: {err}"
            outcome = share(outcome)
        if outcome != "done":
            raise WeightSyncError(f"weight update {version} to the rollout servers failed on rank 0: {outcome}")
        self.weight_version = version

    def _disk_fallback(self, version: int, state_dict: dict[str, torch.Tensor] | None) -> None:
        self.weight_sync = "disk"
        try:
            self.publish(version=version, state_dict=state_dict).result()
        finally:
            self.weight_sync = "distributed"

    def publish(self, *, version: int, state_dict: dict[str, torch.Tensor] | None = None) -> concurrent.futures.Future:
        """`update_weights` without waiting for the servers: save the weights and predict their checksums now (so
        the caller may change its parameters as soon as this returns), then have every live server load them in
        the background. The returned future resolves to ``version`` once every server confirmed a matching
        checksum — only then is ``weight_version`` bumped — or raises `WeightSyncError` / `NoServersLeft`.
        Publications are applied in order: a new one first waits for the previous one (and raises its error)."""
        previous, self._publishing = self._publishing, None
        if previous is not None:
            previous.result()
        if self.weight_sync == "distributed":  # the broadcast reads the live parameters: done before returning
            done: concurrent.futures.Future = concurrent.futures.Future()
            done.set_result(self._sync_distributed(version, state_dict))
            return done
        started = time.monotonic()
        path = self.weights_dir / f"v{version:06d}"
        model = self.policy.model
        if getattr(self.policy, "lora", None) is not None:  # LoRA: servers load base + adapters merged, plain names
            from vlrl.models.lora import merged_weights

            state_dict = merged_weights(self.policy, state_dict)
        with quiet_transformers():  # a copy: save_pretrained may pop the entries of the dict it is handed (transformers
            # 5.x writes each shard by popping its tensors when no conversion made a new dict), and the checksum below
            # needs them — without it an FSDP2 run predicted the checksum of nothing (e3b0c442…) at its first update
            model.save_pretrained(path, state_dict=None if state_dict is None else dict(state_dict))
        weights = state_dict if state_dict is not None else model
        checksums: dict[str | None, str] = {}
        for server in self.live_servers():  # predicted checksum per server dtype
            if server.dtype not in checksums:
                dtype = DTYPES.get(server.dtype or "")
                checksums[server.dtype] = weight_checksum(weights, dtype=dtype)
        self._publishing = asyncio.run_coroutine_threadsafe(self._publish(path, version, checksums, started), self._loop)
        return self._publishing

    async def _publish(self, path: Path, version: int, checksums: dict[str | None, str], started: float) -> int:
        await self._pause("disk")
        try:
            await self._load_everywhere(str(path.resolve()), version, checksums)
        finally:
            await self._resume()
        self.weight_version = version
        size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        self.last_sync = SyncStats("disk", time.monotonic() - started, size, 0, len(self.live_servers()))
        self._saved.append(path)
        while len(self._saved) > self.keep_checkpoints:
            shutil.rmtree(self._saved.pop(0), ignore_errors=True)
        return version

    async def _load_everywhere(self, path: str, version: int, checksums: dict[str | None, str]) -> None:
        live = self.live_servers()
        body = self._disk_body(path, version)
        results = await asyncio.gather(*(self._client.post(f"{s.url}/update_weights_from_disk", json=body,
                                                           headers=self._admin_headers,
                                                           timeout=self.weight_update_timeout) for s in live),
                                       return_exceptions=True)
        for server, result in zip(live, results, strict=True):
            if isinstance(result, BaseException):
                if self._closing:
                    raise RolloutRequestError("the HTTP engine was closed during a weight update") from result
                self._drop(server, f"weight update failed: {type(result).__name__}: {result}")
                continue
            answer = result.json() if result.headers.get("content-type", "").startswith("application/json") else {}
            if result.status_code >= 400 or not answer.get("success", False):
                raise WeightSyncError(f"{server.url} could not load {path}: {result.status_code} "
                                      f"{answer.get('message', result.text[:300])}")
            loaded = answer.get("weight_checksum")
            if loaded is None:
                if server.url not in self._warned_no_checksum:
                    self._warned_no_checksum.add(server.url)
                    log.warning("%s reports no weight checksum (not a vlrl server): its weights are not verified", server.url)
            elif loaded != checksums[server.dtype]:
                raise WeightSyncError(f"{server.url} loaded weights with checksum {loaded[:12]} for version {version}, "
                                      f"the trainer's are {checksums[server.dtype][:12]}: stopping")
        if not self.live_servers():
            raise NoServersLeft("every rollout server was dropped: " + "; ".join(self.dropped))

    # -------------------------------------------------------------------------------------------- distributed sync
    def _sync_distributed(self, version: int, state_dict: dict[str, torch.Tensor] | None, *,
                          plan: tuple[torch.dtype, list[list[dist_sync.Entry]]] | None = None,
                          fallback: bool = True) -> int:
        """One update over the weight-update group (see the module docstring); falls back to disk when the group
        breaks (``fallback=False``: raises `_GroupBroken` instead, after every bucket was still gathered). ``plan``:
        the buckets (`_bucket_plan`) the other trainer ranks gather with this one. Returns ``version`` once every
        server confirmed a matching checksum. The servers are paused meanwhile (`_pause`)."""
        self._call(self._pause("distributed"))
        try:
            return self._sync_paused(version, state_dict, plan=plan, fallback=fallback)
        finally:
            self._call(self._resume())

    def _sync_paused(self, version: int, state_dict: dict[str, torch.Tensor] | None, *,
                     plan: tuple[torch.dtype, list[list[dist_sync.Entry]]] | None, fallback: bool) -> int:
        started = time.monotonic()
        state = self._sent_state(state_dict)
        live = self.live_servers()
        plan = plan or self._bucket_plan(live)
        if not live:
            if not fallback:  # the other ranks still gather every bucket with us
                for bucket in plan[1]:
                    dist_sync.full_tensors(state, bucket)
            raise NoServersLeft("every rollout server was dropped: " + "; ".join(self.dropped))
        failure = None
        try:
            if self._group is None or self._group_servers != [s.url for s in live]:
                try:
                    self._form_group(live)
                except BaseException:
                    if not fallback:
                        for bucket in plan[1]:
                            dist_sync.full_tensors(state, bucket)
                    raise
            sent, count = self._broadcast(version, state, live, plan)
        except (WeightSyncError, NoServersLeft):
            raise
        except Exception as err:  # the group broke (a server died, a timeout): this update goes by disk
            if self._closing:
                raise RolloutRequestError("the HTTP engine was closed during a weight update") from err
            failure = f"{type(err).__name__}: {err}"
        if failure is not None:  # (out of the except block: its traceback no longer holds the group's sockets open)
            self._destroy_group()  # the servers still waiting in its broadcast see the connection close
            gc.collect()
            if not fallback:
                raise _GroupBroken(failure)
            log.warning("distributed weight update %d failed (%s); loading it from disk instead, the next update "
                        "forms a new group", version, failure)
            self._disk_fallback(version, state_dict)
            return version
        self.weight_version = version
        self.last_sync = SyncStats("distributed", time.monotonic() - started, sent, count, len(live))
        return version

    def _destroy_group(self, *, timeout: float | None = None) -> None:
        """Close this side of the weight-update group (a broadcast still waited for on the servers ends: their
        connection drops), then have the servers that joined it and are still live leave it too (SGLang's
        ``/destroy_weights_update_group``; an answer that it is gone already is fine). Each formation is a new
        group, so without this a server would keep one dead group per re-formation."""
        group, self._group = self._group, None
        dist_sync.close_group(group)
        del group
        name, urls = self._group_name, self._group_servers
        self._group_name, self._group_servers = "", []
        servers = [s for s in self.live_servers() if s.url in urls]
        if name and servers:
            answers = self._call(self._post_each(servers, "/destroy_weights_update_group",
                                                 [{"group_name": name}] * len(servers),
                                                 timeout=timeout or self.sync_timeout))
            for server, answer in zip(servers, answers, strict=True):
                if isinstance(answer, BaseException) or not answer.get("success", False):
                    log.info("%s did not leave weight-update group %s: %s", server.url, name,
                             answer if isinstance(answer, BaseException) else answer.get("message"))

    def _form_group(self, live: list[ServerState]) -> None:
        """Every live server joins a new group hosted here as rank 0 (their HTTP calls return once all joined), the
        group it replaces destroyed first. Server i holds ranks ``rank_offset .. rank_offset + tp_size − 1`` (SGLang:
        ``rank_offset + tp_rank``). The rendezvous runs in a thread: if a server's call fails first (it died, or
        refused), it can never complete, and this raises at once instead of waiting out ``sync_timeout`` (the thread
        ends with the rendezvous' own timeout, closing the group if it ever formed)."""
        self._destroy_group()
        if self._rendezvous is not None and self._rendezvous.is_alive():
            # the last formation was abandoned: its rendezvous ends within sync_timeout, and with it the servers'
            # joins of that group (a server joins one group at a time: until then it answers 409)
            self._rendezvous.join(timeout=self.sync_timeout)
        port = self.sync_port or _free_port(self.sync_address)
        world_size = 1 + sum(s.ranks for s in live)
        name = f"vlrl_weights_{os.getpid()}_{id(self):x}_{next(self._group_ids)}"
        backend = self.sync_backend or ("nccl" if next(self.policy.model.parameters()).is_cuda else "gloo")
        self._group_device = dist_sync.group_device(backend)
        bodies = self._init_bodies(live, port, name, backend)
        failed = _Failures(" could not join the weight-update group")
        settled, failures = failed.settled, failed.messages

        answers = asyncio.run_coroutine_threadsafe(self._post_each(live, "/init_weights_update_group", bodies,
                                                                   on_failure=failed, timeout=self.sync_timeout + 30,
                                                                   busy_for=self.sync_timeout), self._loop)
        joined: concurrent.futures.Future = concurrent.futures.Future()

        def join() -> None:
            try:
                joined.set_result(dist_sync.open_group(self.sync_address, port, rank=0, world_size=world_size,
                                                       group_name=name, backend=backend, timeout=self.sync_timeout))
            except BaseException as err:  # noqa: BLE001 — handed to the waiting thread
                # without its traceback: the frames it holds keep the rendezvous store (and its port) open, and the
                # servers still waiting on that store wait until it closes
                joined.set_exception(err.with_traceback(None))
            settled.set()

        self._rendezvous = threading.Thread(target=join, name="vlrl-weight-group", daemon=True)
        self._rendezvous.start()
        settled.wait()  # (the rendezvous itself times out after sync_timeout)
        if not joined.done():
            joined.add_done_callback(lambda f: f.exception() is None and dist_sync.close_group(f.result()))
            answers.cancel()
            raise RuntimeError("; ".join(failures))
        group = joined.result()
        try:
            answers.result(timeout=self.sync_timeout)
        except BaseException:
            dist_sync.close_group(group)
            raise
        if failures:
            dist_sync.close_group(group)
            raise RuntimeError("; ".join(failures))
        self._group, self._group_name, self._group_servers = group, name, [s.url for s in live]
        self._group_backend = backend
        log.info("weight-update group %s: trainer + %d server(s) over %s at %s:%d", name, len(live), backend,
                 self.sync_address, port)

    def _init_bodies(self, live: list[ServerState], port: int, name: str, backend: str) -> list[dict[str, Any]]:
        """Each server's ``/init_weights_update_group`` body: the trainer is rank 0, server i takes the ranks from
        ``rank_offset`` on, one per tensor-parallel rank (its ``tp_size``); ``world_size`` counts them all."""
        offsets = list(itertools.accumulate([1] + [s.ranks for s in live[:-1]]))
        world_size = 1 + sum(s.ranks for s in live)
        return [{"master_address": self.sync_address, "master_port": port, "rank_offset": offset,
                 "world_size": world_size, "group_name": name, "backend": backend} for offset in offsets]

    def _bucket_body(self, version: int, bucket: list[dist_sync.Entry], dtypes: list[torch.dtype], *,
                     last: bool) -> dict[str, Any]:
        """The ``/update_weights_from_distributed`` body announcing one flattened bucket (the last one carries the
        new ``weight_version`` and flushes the cache — unless requests are held in place)."""
        return {"names": [e.send_name for e in bucket], "dtypes": [dist_sync.dtype_name(d) for d in dtypes],
                "shapes": [list(e.shape) for e in bucket], "group_name": self._group_name,
                "flush_cache": last and self.on_weight_update != "in_place",  # (SGLang: no flush with requests held)
                "abort_all_requests": self.abort_on_update, "load_format": dist_sync.FLATTENED,
                "weight_version": str(version) if last else None}

    def _disk_body(self, path: str, version: int) -> dict[str, Any]:
        """The ``/update_weights_from_disk`` body."""
        return {"model_path": path, "weight_version": str(version), "abort_all_requests": self.abort_on_update,
                "flush_cache": self.on_weight_update != "in_place"}  # (SGLang cannot flush with requests held in place)

    def _sent_state(self, state_dict: dict[str, torch.Tensor] | None = None, *,
                    layout: bool = False) -> dict[str, torch.Tensor]:
        """The tensors a distributed update sends: ``state_dict`` (the trainer's, handed in) or the model's own,
        or with model.lora base + adapters merged under the transformers names — on FSDP2 shards merged on the
        shards, a collective every rank calls; a peft state dict handed in is merged from the live module.
        ``layout``: the merged names and shapes only (`merged_tensors`' ``deltas=False``), for planning."""
        if getattr(self.policy, "lora", None) is None:
            return state_dict if state_dict is not None else self.policy.model.state_dict()
        from vlrl.models.lora import merged_tensors, merged_weights

        if state_dict is not None:
            return merged_weights(self.policy, state_dict)
        return dict(merged_tensors(self.policy, deltas=not layout))

    def _bucket_plan(self, live: list[ServerState]) -> tuple[torch.dtype, list[list[dist_sync.Entry]]]:
        """(the dtype the servers receive, the update's buckets of entries) — what every trainer rank gathers."""
        model = self.policy.model
        if self._entries is None:
            layout = self._sent_state(layout=True)
            names = checkpoint_names(model, layout)  # {checkpoint name → state-dict name}: what servers receive
            self._entries = dist_sync.plan_entries(layout, {v: k for k, v in names.items()} if names else None)
        dtypes = {s.dtype for s in live}
        trainer_dtype = next(model.parameters()).dtype
        send_dtype = DTYPES.get(next(iter(dtypes)) or "", trainer_dtype) if len(dtypes) == 1 else trainer_dtype
        return send_dtype, dist_sync.buckets(self._entries, send_dtype=send_dtype, bucket_bytes=self.bucket_bytes)

    def _broadcast(self, version: int, state: dict[str, torch.Tensor], live: list[ServerState],
                   plan: tuple[torch.dtype, list[list[dist_sync.Entry]]]) -> tuple[int, int]:
        """Send every bucket of ``plan``; check the last answers' checksums. Returns (bytes of one copy sent,
        buckets). Every bucket is gathered even after a failure (other trainer ranks gather it with this one);
        the first failure is raised once all were."""
        dtypes = {s.dtype for s in live}
        checksum = dist_sync.StreamingChecksum([DTYPES.get(d or "") for d in dtypes])
        send_dtype, planned = plan
        sent, failure = 0, None
        for k, bucket in enumerate(planned):
            last = k == len(planned) - 1
            gathered = dist_sync.full_tensors(state, bucket, self._group_device)  # FSDP2: gathered one bucket at a time
            if failure is not None:
                continue
            try:
                sent += self._send_bucket(version, live, bucket, gathered, send_dtype, checksum, last=last)
            except BaseException as err:  # noqa: BLE001 — raised after the remaining buckets' gathers
                failure = err
        if failure is not None:
            raise failure
        return sent, len(planned)

    def _send_bucket(self, version: int, live: list[ServerState], bucket: list[dist_sync.Entry],
                     gathered: list[torch.Tensor], send_dtype: torch.dtype, checksum: dist_sync.StreamingChecksum,
                     *, last: bool) -> int:
        """Announce one bucket to every server, pack its tensors (cast to ``send_dtype``) into the send buffer and
        broadcast it, checksum the bytes sent while the servers load them, read the answers; returns the bytes
        sent. A server whose answer fails ends the wait for the broadcast at once (`dist_sync.broadcast`); every
        wait is bounded by ``sync_timeout``."""
        dtypes = [send_dtype if t.is_floating_point() else t.dtype for t in gathered]
        body = self._bucket_body(version, bucket, dtypes, last=last)
        failed = _Failures()
        settled, failures = failed.settled, failed.messages

        answers = asyncio.run_coroutine_threadsafe(self._post_each(live, "/update_weights_from_distributed",
                                                                   [body] * len(live), on_failure=failed), self._loop)
        try:
            flat, sent = dist_sync.pack(gathered, dtypes, self._send_buffer, self._group_device)
            dist_sync.broadcast(self._group, flat, settled=settled, timeout=self.sync_timeout)
        except dist_sync.Abandoned as err:
            answers.cancel()
            raise dist_sync.Abandoned(f"{err}: {'; '.join(failures)}" if failures else str(err)) from None
        except BaseException:
            answers.cancel()
            raise
        for entry, tensor, raw, dtype in zip(bucket, gathered, sent, dtypes, strict=True):
            checksum.add(entry, tensor, sent=raw, sent_dtype=dtype)  # per server dtype, as the disk path predicts
        try:
            results = answers.result(timeout=self.sync_timeout)
        except concurrent.futures.TimeoutError:
            answers.cancel()
            raise dist_sync.Abandoned(f"no answer within {self.sync_timeout:.0f} s (rollout.weight_sync_timeout)") from None
        for server, answer in zip(live, results, strict=True):
            if isinstance(answer, BaseException):
                raise RuntimeError(f"{server.url}: {type(answer).__name__}: {answer}")
            if not answer.get("success", False):
                raise WeightSyncError(f"{server.url} could not load version {version} from the trainer's broadcast: "
                                      f"{answer.get('message', answer)}")
            if last:
                self._check_checksum(server, answer.get("weight_checksum"), version,
                                     checksum.digest(DTYPES.get(server.dtype or "")))
        return flat.numel()

    def _check_checksum(self, server: ServerState, loaded: str | None, version: int, expected: str) -> None:
        if loaded is None:
            if server.url not in self._warned_no_checksum:
                self._warned_no_checksum.add(server.url)
                log.warning("%s reports no weight checksum (not a vlrl server): its weights are not verified", server.url)
        elif loaded != expected:
            raise WeightSyncError(f"{server.url} loaded weights with checksum {loaded[:12]} for version {version}, "
                                  f"the trainer's are {expected[:12]}: stopping")

    async def _post_each(self, servers: list[ServerState], path: str, bodies: list[dict], *,
                         on_failure: Any = None, timeout: float | None = None,
                         busy_for: float = 0.0) -> list[Any]:
        """POST ``bodies[i]`` to ``servers[i]`` at once (a weight call: the admin key, ``timeout`` or
        `weight_update_timeout` — never the generation's `request_timeout`); each answer's JSON (with ``success:
        False`` and the status for an error answer), or the exception of a transport failure. ``on_failure(server,
        why)`` is called as soon as one fails (before the others answered). ``busy_for``: seconds a 409 (a group join
        already in progress on that server) is retried for."""
        async def post(server: ServerState, body: dict) -> dict:
            deadline = time.monotonic() + busy_for
            while True:
                try:
                    response = await self._client.post(f"{server.url}{path}", json=body, headers=self._admin_headers,
                                                       timeout=timeout or self.weight_update_timeout)
                except Exception as err:
                    if on_failure is not None:
                        on_failure(server, f"{type(err).__name__}: {err}")
                    raise
                if response.status_code != 409 or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.2)
            answer = response.json() if response.headers.get("content-type", "").startswith("application/json") else {}
            if response.status_code >= 400:
                answer = {"success": False, "status_code": response.status_code,
                          "message": f"HTTP {response.status_code}: "
                                     f"{answer.get('message') or answer.get('error') or response.text[:300]}"}
            if on_failure is not None and not answer.get("success", False):
                on_failure(server, answer.get("message", answer))
            return answer

        return list(await asyncio.gather(*(post(s, b) for s, b in zip(servers, bodies, strict=True)),
                                         return_exceptions=True))


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
