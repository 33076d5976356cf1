"""The HTTP application of `vlrl serve` (`create_app`) and the command itself (`serve`).

`create_app` assembles route groups over one `ContinuousBatcher`: the info routes (``/health``, ``/get_model_info``,
``/server_info``, ``/get_weight_version``), ``/generate`` (`GenerateRoute`) and the weight routes
(`vlrl.rollout.server.weight_routes.WeightRoutes`). Every request is bounded before it is admitted (`ServeLimits`,
the batcher's queue and token budget; the body's bytes and read time, and the bytes of every request held at once);
JSON parsing runs off the event loop (`vlrl.serving.BodyParser`), image decoding on an image thread, tokenizing on
one preprocessing thread, weight loads and group joins on threads of their own, so ``/health`` and ``/generate``
answer while any request is being read, parsed, prepared or decoded, or any weight call waits.
"""

from __future__ import annotations

import asyncio
import collections.abc
import concurrent.futures
import ctypes
import heapq
import os
import threading
import time
from typing import Any

from pydantic import BaseModel

from vlrl.models.policy import DTYPES
from vlrl.rollout.batcher import ContinuousBatcher, QueueFullError, TooLargeError
from vlrl.rollout.server.prompts import (
    build_requests,
    decode_images,
    has_images,
    is_batched,
    logprob_starts,
    longest_token_chars,
    model_context,
    process_images,
    prompt_count,
    read_image_headers,
    sglang_output,
)
from vlrl.rollout.server.schema import (
    BadRequest,
    GenerateBody,
    PromptBounds,
    ServeLimits,
    ServerBusy,
    explain,
)
from vlrl.rollout.server.weight_routes import ShuttingDown, WeightRoutes
from vlrl.rollout.types import Trajectory
from vlrl.serving import (
    BodyError,
    BodyParser,
    Budget,
    bind_socket,
    encode_json,
    on_close,
    peer_identity,
    protect,
    resolve_api_key,
    run_server,
)

ADMIN_PATHS = ("/update_weights_from_disk", "/init_weights_update_group", "/update_weights_from_distributed",
               "/destroy_weights_update_group", "/pause_generation", "/continue_generation",
               "/begin_weight_update", "/end_weight_update", "/flush_cache")  # (the session: issue 46)
"""The routes an admin key guards when one is set (SGLang's ``ADMIN_OPTIONAL`` routes among those vlrl serves)."""


def create_app(batcher: ContinuousBatcher, *, api_key: str | None, model_path: str = "",
               limits: ServeLimits = ServeLimits(), admin_api_key: str | None = None) -> Any:
    """The FastAPI application serving ``batcher``. ``api_key=None`` disables authentication; ``admin_api_key``
    (SGLang's ``--admin-api-key``): the key `ADMIN_PATHS` require instead of ``api_key``.

    A client that disconnects cancels its job (its rows stop at the next decode step); ``app.state.on_drain`` is what
    SIGTERM calls (no new requests; the rest aborted after ``limits.drain_seconds``)."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    class SafeJSON(JSONResponse):
        def render(self, content: Any) -> bytes:
            return encode_json(content)

    app = FastAPI(title="vlrl rollout server", default_response_class=SafeJSON)
    route = GenerateRoute(batcher, limits, SafeJSON)
    on_close(app, route.close)
    protect(app, api_key=api_key, max_body_bytes=limits.max_body_bytes, setting="vlrl serve --max-body-mb",
            admin_api_key=admin_api_key, admin_paths=ADMIN_PATHS, max_inflight_bytes=limits.max_inflight_body_bytes,
            body_timeout=limits.body_timeout, first_byte_timeout=limits.first_byte_timeout)
    app.state.on_drain = route.on_drain
    app.state.weights = route.weights
    on_close(app, route.weights.close)
    _error_handlers(app, SafeJSON)
    _info_routes(app, route, model_path)
    app.router.add_route("/generate", route.generate, methods=["POST"])  # (a plain Starlette route: the raw body)
    for path, weight_route in route.weights.routes().items():
        app.router.add_route(path, weight_route, methods=["POST"])
    return app


def _error_handlers(app: Any, answer: type) -> None:
    """400 naming the field for a malformed request, 503 for a weight call the shutdown answered."""
    from fastapi import Request as HTTPRequest
    from fastapi.exceptions import RequestValidationError

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: HTTPRequest, err: RequestValidationError):
        return answer({"error": explain(err)}, 400)

    @app.exception_handler(BadRequest)
    async def _bad(request: HTTPRequest, err: BadRequest):
        return answer({"error": str(err)}, 400)

    @app.exception_handler(ServerBusy)
    async def _busy(request: HTTPRequest, err: ServerBusy):
        return answer({"error": f"server busy: {err}"}, 503, headers={"Retry-After": "1"})

    @app.exception_handler(ShuttingDown)
    async def _stopping(request: HTTPRequest, err: ShuttingDown):
        return answer({"success": False, "message": "the server is shutting down"}, 503)


def _info_routes(app: Any, route: GenerateRoute, model_path: str) -> None:
    """``/health``, ``/get_model_info`` (vlrl's facts and counters), ``/server_info`` (SGLang's launch facts, then
    vlrl's) and ``/get_weight_version``."""
    batcher, limits = route.batcher, route.limits

    @app.get("/health")
    async def health():
        return {}

    @app.get("/get_model_info")
    async def model_info():
        policy = batcher.policy
        version, checksum = batcher.version
        return {"model_path": model_path or policy.source, "tokenizer_path": model_path or policy.source,
                "is_generation": True, "weight_version": str(version), "weight_checksum": checksum,
                "dtype": str(next(policy.model.parameters()).dtype).removeprefix("torch."),
                "vocab_size": route.vocab, "context_length": route.context,
                "max_batch_size": batcher.max_batch_size, "max_queued_requests": batcher.max_queued_requests,
                "max_tokens_in_flight": batcher.max_tokens_in_flight, "max_new_tokens": limits.max_new_tokens,
                "max_body_bytes": limits.max_body_bytes, "max_image_pixels": limits.max_image_pixels,
                "max_request_pixels": limits.max_request_pixels, "max_queued_pixels": limits.max_queued_pixels,
                "queued_pixels": route.pixels.held,
                "queued_requests": batcher.queued(), "tokens_in_flight": batcher.tokens_in_flight,
                "batches": batcher.batches, "rows": batcher.rows, "decode_steps": batcher.decode_steps,
                "early_stops": len(batcher.early_stops), "cancelled": batcher.cancelled, "paused": batcher.paused,
                "weight_groups": route.weights.groups(), "server": "vlrl"}

    @app.get("/server_info")
    async def server_info():
        """SGLang's ``/server_info`` fields (what a launch fixed: parallel sizes, dtype, batch bound), then vlrl's."""
        info = await model_info()
        sglang = {"served_model_name": info["model_path"], "version": "vlrl", "internal_states": [],
                  "tp_size": 1, "dp_size": 1, "pp_size": 1, "max_running_requests": batcher.max_batch_size}
        if route.context is not None:
            sglang["max_context_length"] = route.context
        return {**info, **sglang}

    @app.get("/get_weight_version")
    async def get_weight_version():
        return {"weight_version": str(batcher.version[0])}


class GenerateRoute:
    """``POST /generate`` over ``batcher``, and what the other routes share with it: the model's context and
    vocabulary, the body parser, the image and preprocessing threads, the weight routes, the drain."""

    def __init__(self, batcher: ContinuousBatcher, limits: ServeLimits, answer: type) -> None:
        self.batcher, self.limits, self.answer = batcher, limits, answer
        self.counter = iter(range(1 << 62))
        self.context = model_context(batcher.policy)
        self.max_text_chars = self.context * longest_token_chars(batcher.policy.tokenizer) if self.context else None
        budget = batcher.max_tokens_in_flight
        self.vocab = batcher.policy.model.get_input_embeddings().num_embeddings
        self.parser = BodyParser(max_values=(budget if budget is not None else 1 << 22) + 65_536,
                                 max_string_chars=self.max_text_chars or 1 << 24)
        self.prep = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="vlrl-prep")  # one tokenizer user
        self.images = SmallestFirst("vlrl-images")  # decodes and processes images, the smallest request first
        share = limits.max_queued_pixels_per_client or max(limits.max_queued_pixels // 2,
                                                            min(limits.max_queued_pixels, limits.max_request_pixels))
        self.pixels = Budget(limits.max_queued_pixels, share)  # pixels of the requests admitted, not yet answered
        self.draining = False
        self.weights = WeightRoutes(batcher, limits, self.read, answer)

    def close(self) -> None:
        self.parser.close()
        self.prep.shutdown(wait=False, cancel_futures=True)
        self.images.close()

    def on_drain(self) -> None:
        self.draining = True
        self.weights.on_drain()
        timer = threading.Timer(self.limits.drain_seconds, self.batcher.abort_all)
        timer.daemon = True
        timer.start()

    @staticmethod
    async def in_pool(pool: concurrent.futures.Executor, fn: collections.abc.Callable, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    async def read(self, request: Any, model: type[BaseModel], base64_fields: tuple[str, ...] = ()) -> Any:
        """The body of ``request`` as ``model`` (`BadRequest` naming the field), parsed and validated off the loop."""
        from pydantic import ValidationError

        content_type = request.headers.get("content-type", "")
        if "json" not in content_type:
            raise BadRequest("the body must be a JSON object sent with Content-Type: application/json")
        try:
            payload = await self.parser.parse(await request.body(), base64_fields=base64_fields)
        except BodyError as err:
            raise BadRequest(str(err)) from None
        if not isinstance(payload, dict):
            raise BadRequest("the body must be a JSON object sent with Content-Type: application/json")
        try:
            return await asyncio.to_thread(model.model_validate, payload)
        except ValidationError as err:
            raise BadRequest(explain(err)) from None

    def _check(self, prompts: int, new_tokens: int, n: int) -> None:
        """What a request may ask: ``max_new_tokens`` within the server's limit and the context, samples within the
        queue (`BadRequest` naming the field)."""
        limits, context, batcher = self.limits, self.context, self.batcher
        if new_tokens > limits.max_new_tokens:
            raise BadRequest(f"field 'sampling_params.max_new_tokens': {new_tokens} exceeds the server's limit of "
                             f"{limits.max_new_tokens} (vlrl serve --max-new-tokens)")
        if context is not None and new_tokens >= context:
            raise BadRequest(f"field 'sampling_params.max_new_tokens': {new_tokens} leaves no room for a prompt in the "
                             f"model context of {context} tokens")
        if prompts * n > batcher.max_queued_requests:
            raise BadRequest(f"field 'sampling_params.n': {prompts} prompt(s) × n = {n} is {prompts * n} samples; the "
                             f"server queues at most {batcher.max_queued_requests} (vlrl serve --max-queued-requests)")

    async def _admit(self, body: GenerateBody, sampling: Any, bounds: PromptBounds, hold: PixelHold,
                     scope: dict) -> tuple[concurrent.futures.Future, float, list[int] | None]:
        """Prepare ``body``'s requests and queue them as one job: (its future, its deadline, where each prompt's
        scored tokens start — `logprob_starts`; the scored tokens are the prompt's, already counted). The images' headers are
        read, their pixels reserved against the server's budget of queued pixels (``hold``), then they are decoded
        and processed on the image thread, the request with the fewest pixels first; a text-only request never goes
        there (it does not wait behind an image). 400 / 503 by raising."""
        batcher = self.batcher
        rids = (f"req-{i}" for i in self.counter)
        visions = None
        if has_images(body):
            adapter = batcher.policy.adapter
            sources, pixels = await self.in_pool(self.prep, read_image_headers, body, bounds, adapter)  # headers only
            hold.client = await self.in_pool(self.prep, peer_identity, scope)  # (reads /proc once per connection)
            hold.take(pixels)
            visions = await asyncio.wrap_future(self.images.submit(pixels, _decode_and_process, hold, body, sources,
                                                                   bounds, adapter))
        requests = await self.in_pool(self.prep, build_requests, batcher.policy, body, rids, bounds, visions)
        starts = logprob_starts(body, requests)
        wanted = starts is not None and any(s < len(r.prompt_ids) - 1 for s, r in zip(starts, requests, strict=True))
        scored = starts if wanted else None  # (a start at the prompt's last token or past it scores nothing)
        tokens = sum(sampling.n * (len(r.prompt_ids) + sampling.max_new_tokens) for r in requests)
        deadline = time.monotonic() + self.limits.request_timeout
        try:  # one job: a batch's prompts decode together
            future = batcher.submit(requests, sampling, tokens=tokens, deadline=deadline, logprob_start=scored)
            return future, deadline, starts
        except TooLargeError as err:
            raise BadRequest(f"field 'sampling_params': {err}") from None
        except QueueFullError as err:
            raise ServerBusy(str(err)) from None

    async def generate(self, request: Any):
        if self.draining:
            return self.answer({"error": "server busy: shutting down"}, 503, headers={"Retry-After": "1"})
        batcher, answer = self.batcher, self.answer
        body = await self.read(request, GenerateBody, base64_fields=("image_data",))
        sampling = body.sampling_params.to_params(self.vocab)
        new_tokens = sampling.max_new_tokens
        self._check(prompt_count(body), new_tokens, sampling.n)
        bounds = PromptBounds(self.context, self.max_text_chars, new_tokens, self.limits)
        hold = PixelHold(self.pixels)  # what this request holds of the budget of queued pixels
        gone = asyncio.ensure_future(_until_disconnected(request.receive))
        try:
            admitted = await _admit_or_abandon(self._admit(body, sampling, bounds, hold, request.scope), gone, hold)
            if admitted is None:  # the client left while its request was prepared: nothing more is done for it
                return answer({"error": "client disconnected"}, 499)
            future, deadline, starts = admitted
            future.add_done_callback(hold.release)
            trajectories = await _answer_or_abandon(gone, future)
        finally:
            hold.release()  # (once: an admitted job's is released when its future is done)
            gone.cancel()
        if trajectories is None:  # the client is gone (counted in batcher.cancelled): nobody reads an answer
            return answer({"error": "client disconnected"}, 499)
        why = ("the server shut down" if self.draining else "the request's deadline passed"
               if time.monotonic() >= deadline - 1e-3 else "aborted by a weight update")

        def answers() -> list[dict[str, Any]]:
            policy = batcher.policy
            return [sglang_output(policy, t, sampling, return_logprob=body.return_logprob, abort_message=why,
                                  return_prompt_ids=body.return_prompt_token_ids, return_text=body.return_text_in_logprobs,
                                  logprob_start=starts[k // sampling.n] if starts is not None else None)
                    for k, t in enumerate(trajectories)]

        out = await self.in_pool(self.prep, answers)
        return answer(out if is_batched(body) or sampling.n > 1 else out[0])  # a batch: prompt-major, n per prompt


class PixelHold:
    """The pixels one request holds of the server's budget of queued pixels (its ``client``'s share of it too):
    taken on the image thread's behalf before its images are decoded, released once — when its job is answered or
    cancelled, or its admission failed (a take after that is refused, so an abandoned request leaves nothing held)."""

    def __init__(self, budget: Budget, client: str | None = None) -> None:
        self.budget, self.client, self.amount, self.done = budget, client, 0, False
        self._lock = threading.Lock()

    def take(self, pixels: int) -> None:
        with self._lock:
            if self.done:
                raise ServerBusy("the request was abandoned before its images were read")
            if not self.budget.reserve(pixels, self.client):
                mine = self.budget.held_by(self.client) if self.client is not None else 0
                if self.client is not None and self.budget.share is not None and mine + pixels > self.budget.share:
                    raise ServerBusy(f"this client's queued requests hold {mine} pixels of images; with this "
                                     f"request's {pixels} that would pass its share of {self.budget.share} "
                                     "(vlrl serve --max-queued-pixels-per-client)")
                raise ServerBusy(f"the images of the requests queued hold {self.budget.held} pixels; with this "
                                 f"request's {pixels} that would pass the server's limit of {self.budget.limit} "
                                 "(vlrl serve --max-queued-pixels)")
            self.amount += pixels

    def release(self, *_: Any) -> None:
        with self._lock:
            if self.done:
                return
            self.done = True
            self.budget.release(self.amount, self.client)
            freed, self.amount = self.amount, 0
        if freed and self.budget.held == 0:
            _trim_heap()


def _trim_heap() -> None:
    """Give the heap's free pages back to the system (glibc's ``malloc_trim``) once no queued request holds an
    image: the decoding threads' arenas keep what a burst of large images freed otherwise (282 MB measured after 8
    requests of 4096²)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


async def _until_disconnected(receive: collections.abc.Callable) -> None:
    """Return when the client closes its connection (the body was read: the next message is the disconnect)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _admit_or_abandon(admit: collections.abc.Coroutine, gone: asyncio.Future,
                            hold: PixelHold) -> tuple[concurrent.futures.Future, float, list[int] | None] | None:
    """The admission's (job future, deadline, scoring starts), or None if the client went away first — then its pixels are
    released at once (so the image thread skips its decoding) and a job admitted meanwhile is cancelled."""
    admitting = asyncio.ensure_future(admit)
    await asyncio.wait({admitting, gone}, return_when=asyncio.FIRST_COMPLETED)
    if admitting.done() or not gone.done():
        return admitting.result()
    hold.release()
    try:
        future, *_ = await admitting
    except Exception:  # noqa: BLE001  (refused, or skipped as abandoned: nobody reads the answer)
        return None
    future.cancel()
    return None


async def _answer_or_abandon(gone: asyncio.Future, future: concurrent.futures.Future) -> list[Trajectory] | None:
    """The job's trajectories, or None if the client went away first (``gone`` is done) — then the job's future is
    cancelled, which stops its rows at the batcher's next decode step."""
    answer = asyncio.wrap_future(future)
    try:
        done, _ = await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
        if answer in done:
            return answer.result()
        future.cancel()
        return None
    finally:
        if not future.done():  # this handler was cancelled (shutdown backstop): stop decoding for nobody
            future.cancel()


def _decode_and_process(hold: PixelHold, body: GenerateBody, sources: list, bounds: PromptBounds,
                        adapter: Any) -> list[Any]:
    """On the image thread: a request's images decoded and processed — unless its client has gone (then nothing)."""
    if hold.done:
        raise ServerBusy("the client went away before its images were decoded")
    return process_images(body, decode_images(body, sources, bounds), adapter)


class SmallestFirst:
    """One worker thread running the work submitted to it, the smallest ``size`` first (ties in order): a request
    of a few small images is not queued behind requests of 16-megapixel ones."""

    def __init__(self, name: str) -> None:
        self._heap: list[tuple[int, int, Any]] = []
        self._order = iter(range(1 << 62))
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, size: int, fn: collections.abc.Callable, *args: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("the image worker is closed")
            heapq.heappush(self._heap, (size, next(self._order), (future, fn, args)))
            self._cond.notify()
        return future

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._heap and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                _, _, (future, fn, args) = heapq.heappop(self._heap)
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as err:  # noqa: BLE001  (handed to the awaiting request)
                    future.set_exception(err)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            pending, self._heap = self._heap, []
            self._cond.notify_all()
        for _, _, (future, _, _) in pending:
            future.cancel()


# ----------------------------------------------------------------------------------------------- running
def serve(model: str, *, host: str = "127.0.0.1", port: int = 30000, api_key: str | None = None,
          no_auth: bool = False, dtype: str = "float32", device: str = "cpu", max_batch_size: int = 256,
          max_queued_requests: int = 1024, batch_window_ms: float = 10.0, init_seed: int = 0,
          max_tokens_in_flight: int = 1 << 20, limits: ServeLimits = ServeLimits(),
          admin_api_key: str | None = None, options: Any = None) -> None:
    """`vlrl serve`: load the policy and serve it until SIGTERM/SIGINT, then drain (``limits.drain_seconds``).
    ``options``: the model's `vlrl.models.policy.LoadOptions` (attention implementation, revision, remote code)."""
    from vlrl.models import load_policy

    if dtype not in DTYPES:
        raise ValueError(f"--dtype: choose from {sorted(DTYPES)}")
    for root in limits.image_roots:
        if not os.path.isdir(root):
            raise ValueError(f"--image-root {root}: not a directory")
    api_key = resolve_api_key(api_key, no_auth=no_auth, host=host, command="vlrl serve")
    policy = load_policy(model, dtype=dtype, device=device, seed=init_seed, options=options)
    policy.model.eval()
    batcher = ContinuousBatcher(policy, max_batch_size=max_batch_size, max_queued_requests=max_queued_requests,
                                batch_window=batch_window_ms / 1000, max_tokens_in_flight=max_tokens_in_flight)
    app = create_app(batcher, api_key=api_key, model_path=model, limits=limits, admin_api_key=admin_api_key or None)
    sock = bind_socket(host, port)
    print(f"vlrl serve: listening on http://{host}:{sock.getsockname()[1]} ({policy.source}, "
          f"{policy.num_parameters() / 1e6:.2f}M parameters, auth {'on' if api_key else 'off'}"
          f"{', admin key on' if admin_api_key else ''})", flush=True)
    signalled: list[float] = []  # when the shutdown signal arrived (the drain bound counts from here)

    def on_drain() -> None:
        signalled.append(time.monotonic())
        app.state.on_drain()

    try:
        run_server(app, sock, drain_seconds=limits.drain_seconds, on_drain=on_drain)
    finally:
        batcher.close()
        after = f" {time.monotonic() - signalled[0]:.2f} s after the shutdown signal" if signalled else ""
        print(f"vlrl serve: stopped{after}", flush=True)

