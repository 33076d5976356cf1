"""`ServerPool`: the rollout servers an `HTTPEngine` talks to — the event loop and HTTP client on a background thread,
each server's state and the facts it reports, failures and drops, and the weight calls posted to every server at once.

Server facts come from ``/server_info`` (``/get_model_info`` on older servers): the weights' dtype, how many sequences
a server decodes at once, the image pixels one request may carry, and its ranks in a weight-update group. A server with
``max_server_failures`` consecutive failures is dropped from the pool with a warning.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from vlrl.rollout.http_settings import ClientSettings
from vlrl.serving import ADMIN_API_KEY_ENV, API_KEY_ENV

T = TypeVar("T")

log = logging.getLogger(__name__)

_DTYPE_NAMES = {"float32": "float32", "float": "float32", "bfloat16": "bfloat16", "float16": "float16",
                "half": "float16"}  # SGLang's --dtype spellings → vlrl's (``auto``: unknown)


class NoServersLeft(RuntimeError):
    """Every rollout server failed and was dropped from the pool."""


class RolloutRequestError(RuntimeError):
    """A request failed on every server it was retried on, or a server answered with something unusable."""


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
    reports_checksum: bool = False  # it reports a weight_checksum (vlrl serve does, SGLang does not)
    image_processor_backend: str | None = None  # SGLang's --image-processor-backend, if it says
    pixel_bounds: tuple[int | None, int | None] | None = None  # SGLang's --mm-process-config image min/max_pixels
    engine: str | None = None  # what it is, from its /server_info: vlrl, sglang or vllm (`engine_of`)


class ServerPool:
    """The servers at ``urls``, ready (every one answered its facts) when the constructor returns. ``distributed``:
    weights will travel over a process group, so a server must hold one data-parallel replica in one stage."""

    def __init__(self, urls: Sequence[str], settings: ClientSettings, *, distributed: bool = False) -> None:
        import httpx

        if not urls:
            raise ValueError("HTTPEngine needs at least one server URL")
        self.settings, self.distributed = settings, distributed
        self.servers = [ServerState(url.rstrip("/")) for url in urls]
        self.dropped: list[str] = []  # "url: reason"
        self.gate = asyncio.Event()  # cleared while a weight update holds new requests back
        self.gate.set()
        self.closing = False
        self._warned: set[tuple[str, str]] = set()
        key = settings.api_key if settings.api_key is not None else os.environ.get(API_KEY_ENV)
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        admin = settings.admin_api_key if settings.admin_api_key is not None else os.environ.get(ADMIN_API_KEY_ENV)
        self.admin_headers = {"Authorization": f"Bearer {admin}"} if admin else self.headers  # weight and pause calls
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="vlrl-http-engine", daemon=True)
        self._thread.start()
        timeout = httpx.Timeout(settings.request_timeout, connect=settings.connect_timeout)
        # idle connections are dropped after 4 s, before a uvicorn server (vLLM, vlrl serve: 5 s keep-alive) closes
        # them: one it closed as it was reused failed a request with ReadError (a vLLM run's final evaluation)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256, keepalive_expiry=4.0)
        self.client = self.call(self._make_client(timeout, limits))
        self.call(self.wait_ready(settings.startup_timeout))

    @staticmethod
    async def _make_client(timeout, limits):
        import httpx

        return httpx.AsyncClient(timeout=timeout, limits=limits)

    @property
    def running(self) -> bool:
        return self.loop.is_running()

    def call(self, coro):
        """Run ``coro`` on the pool's loop and wait for it (from a thread that is not that loop)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def close(self) -> None:
        self.closing = True
        if self.loop.is_running():
            self.call(self.client.aclose())
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)

    def live(self) -> list[ServerState]:
        return [s for s in self.servers if s.alive]

    def no_servers_left(self) -> NoServersLeft:
        return NoServersLeft("every rollout server was dropped: " + "; ".join(self.dropped))

    # -------------------------------------------------------------------------------------------- facts
    async def wait_ready(self, timeout: float) -> None:
        """Wait until every server answers ``/server_info`` (SGLang ≥ 0.5: launch facts, parallel sizes) — or, where
        that route is missing, the older ``/get_model_info`` (servers may still be loading) — and read its facts.
        ``timeout`` bounds the whole wait, each probe included (a server that accepts the connection and never
        answers is given up on at the deadline, not after ``request_timeout``)."""
        deadline = time.monotonic() + timeout
        for server in self.servers:
            while True:
                try:
                    info = await self._server_info(server, max(0.1, deadline - time.monotonic()))
                    break
                except RolloutRequestError:
                    raise
                except Exception as err:
                    if time.monotonic() > deadline:
                        raise RolloutRequestError(f"rollout server {server.url} not ready after {timeout:.0f}s "
                                                  f"(the start-up timeout): {type(err).__name__}: {err}") from err
                    await asyncio.sleep(0.25)
            self.read_facts(server, info)

    async def _server_info(self, server: ServerState, timeout: float) -> dict[str, Any]:
        for path in ("/server_info", "/get_model_info"):
            response = await self.client.get(f"{server.url}{path}", headers=self.headers, timeout=timeout)
            if response.status_code == 401:
                raise RolloutRequestError(f"{server.url}: 401 unauthorised: set ${API_KEY_ENV} to the server's --api-key")
            if response.status_code == 404 and path == "/server_info":
                continue  # an older server: the deprecated route has what vlrl reads
            if response.status_code == 404 and (await self.client.get(f"{server.url}/version")).status_code == 200:
                raise RolloutRequestError(f"{server.url} has no /server_info nor /get_model_info but answers /version: "
                                          "a vLLM server without its RL routes — start it with VLLM_SERVER_DEV_MODE=1 "
                                          "(docs: \"Rollout servers\")")
            response.raise_for_status()
            return response.json()
        raise AssertionError("unreachable")

    def read_facts(self, server: ServerState, info: dict[str, Any]) -> None:
        """What vlrl reads from a server's info: its weights' dtype (SGLang's spellings: ``half``, ``float``; ``auto``
        is unknown), how many sequences it decodes at once (vlrl's ``max_batch_size``, SGLang's
        ``max_running_requests``), the pixels one request may carry (vlrl), and its ranks in a weight-update group
        (``tp_size``: SGLang's rank ``rank_offset + tp_rank``)."""
        server.engine = engine_of(info)
        if server.engine == "vllm":  # (its facts are in its configuration: `vlrl.rollout.vllm_client`)
            return
        server.dtype = _DTYPE_NAMES.get(str(info.get("dtype")))
        batch = info.get("max_batch_size") or info.get("max_running_requests")
        server.max_batch_size = int(batch) if isinstance(batch, int) and batch > 0 else None
        pixels = info.get("max_request_pixels")
        server.max_request_pixels = int(pixels) if isinstance(pixels, int) and pixels > 0 else None
        server.ranks = int(info.get("tp_size") or 1)
        server.reports_checksum = "weight_checksum" in info
        backend = info.get("image_processor_backend")
        server.image_processor_backend = "pil" if info.get("disable_fast_image_processor") else \
            (str(backend) if backend is not None else None)
        server.pixel_bounds = _pixel_bounds(info.get("mm_process_config"))
        replicas, stages = int(info.get("dp_size") or 1), int(info.get("pp_size") or 1)
        if self.distributed and (replicas > 1 or stages > 1):
            raise RolloutRequestError(
                f"{server.url}: dp_size {replicas}, pp_size {stages}: SGLang's distributed weight update takes one "
                "data-parallel replica, and ranks rank_offset + tp_rank (pipeline stages would share them); start one "
                "server per replica with pp_size 1, or use rollout.weight_sync.method=disk")

    # -------------------------------------------------------------------------------------------- failures
    def record_failure(self, server: ServerState, failure: str) -> None:
        server.failures += 1
        log.warning("rollout server %s failed (%d in a row): %s", server.url, server.failures, failure)
        if server.alive and server.failures >= self.settings.max_server_failures:
            self.drop(server, failure)

    def drop(self, server: ServerState, reason: str) -> None:
        server.alive = False
        self.dropped.append(f"{server.url}: {reason}")
        log.warning("dropping rollout server %s from the pool (%s); %d left", server.url, reason, len(self.live()))

    def warn_once(self, url: str, what: str, message: str, *args: Any) -> None:
        if (url, what) not in self._warned:
            self._warned.add((url, what))
            log.warning(message, *args)

    # -------------------------------------------------------------------------------------------- requests
    def pick(self, tried: set[str]) -> ServerState:
        """The live server with the fewest requests in flight, one not ``tried`` yet where there is one."""
        live = self.live()
        if not live:
            raise self.no_servers_left()
        fresh = [s for s in live if s.url not in tried] or live
        return min(fresh, key=lambda s: (s.in_flight, s.failures, s.served))

    async def with_failover(self, send: Callable[[ServerState], Awaitable[Any]],
                            accept: Callable[[Any, ServerState], T], *, rows: int = 1, first: str | None = None,
                            what: str = "request") -> T:
        """``accept(response, server)`` of ``send(server)``'s answer, on server ``first`` (else `pick`'s): ``rows``
        count in the server's in-flight while it runs. A full server (429/503) is waited out until 4 ×
        ``request_timeout``; a transport error, timeout or 5xx counts as a failure of that server and the request
        goes to another (up to ``max_retries`` times); another 4xx raises with the server's message. New requests
        wait while a weight update holds them back (``gate``)."""
        tried: set[str] = set()
        attempts, deadline = 0, None
        while True:
            await self.gate.wait()
            deadline = deadline or time.monotonic() + 4 * self.settings.request_timeout
            server = next((s for s in self.live() if s.url == first), None) if not tried else None
            server = server or self.pick(tried)
            server.in_flight += rows
            try:
                response = await send(server)
            except Exception as err:  # connection refused/reset, timeout: the server is down or stalled
                if self.closing:  # our own client was closed under the request: not the server's failure
                    raise RolloutRequestError("the HTTP engine was closed") from err
                failure = f"{type(err).__name__}: {err}"
            else:
                if response.status_code in (429, 503) and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)  # full: wait, not a failure
                    continue
                if response.status_code < 400:
                    server.failures, server.served = 0, server.served + rows
                    return accept(response, server)
                if response.status_code < 500:
                    raise RolloutRequestError(f"{server.url}: {what} refused: {response.status_code} "
                                              f"{response.text[:500]}")
                failure = f"HTTP {response.status_code}: {response.text[:200]}"
            finally:
                server.in_flight -= rows
            self.record_failure(server, failure)
            tried.add(server.url)
            attempts += 1
            if attempts > self.settings.max_retries:
                raise RolloutRequestError(f"{what} failed {attempts} times; last on {server.url}: {failure}")

    # -------------------------------------------------------------------------------------------- weight calls
    async def post_each(self, servers: list[ServerState], path: str, bodies: list[dict], *, timeout: float,
                        on_failure: Callable[[ServerState, str], None] | None = None,
                        busy_for: float = 0.0) -> list[Any]:
        """POST ``bodies[i]`` to ``servers[i]`` at once (a weight call: the admin key, ``timeout`` — never the
        generation's ``request_timeout``); each answer's JSON (with ``success: False`` and the status for an error
        answer), or the exception of a transport failure. ``on_failure(server, why)`` is called as soon as one fails
        (before the others answered). ``busy_for``: seconds a 409 (a group join already in progress on that server)
        is retried for."""
        async def post(server: ServerState, body: dict) -> dict:
            deadline = time.monotonic() + busy_for
            while True:
                try:
                    response = await self.client.post(f"{server.url}{path}", json=body, headers=self.admin_headers,
                                                      timeout=timeout)
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


def engine_of(info: dict[str, Any]) -> str:
    """What a server is, from its ``/server_info`` (or ``/get_model_info``): vLLM's carries ``vllm_config``, vlrl serve's
    ``version`` is ``vlrl``; anything else speaks SGLang's API."""
    if isinstance(info, dict) and "vllm_config" in info:
        return "vllm"
    return "vlrl" if isinstance(info, dict) and info.get("version") == "vlrl" else "sglang"


def _pixel_bounds(config: Any) -> tuple[int | None, int | None] | None:
    """(min_pixels, max_pixels) of SGLang's ``mm_process_config`` (``{"image": {"min_pixels": …, "max_pixels": …}}``;
    a JSON string as launched, or the parsed dict), or None where it sets neither."""
    import json

    if isinstance(config, str):
        try:
            config = json.loads(config)
        except ValueError:
            return None
    image = config.get("image") if isinstance(config, dict) else None
    if not isinstance(image, dict):
        return None
    bounds = tuple(image.get(k) if isinstance(image.get(k), int) else None for k in ("min_pixels", "max_pixels"))
    return bounds if any(b is not None for b in bounds) else None
