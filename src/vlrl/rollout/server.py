"""vlrl's reference rollout server (`vlrl serve`): any transformers policy behind SGLang's native HTTP API.

The server speaks the subset of SGLang's native API that RL training needs, so a real SGLang server can take
its place on GPUs (see the README, "Rollout servers and asynchronous RL"):

- ``POST /generate``: one prompt as ``input_ids`` or ``text``; ``image_data`` (base64, data URL or path; one
  or a list); ``sampling_params`` with SGLang's names (``n``, ``temperature``, ``top_p``, ``top_k``,
  ``max_new_tokens``, ``stop``); ``return_logprob``. The answer has SGLang's shape: ``text``, ``output_ids``
  and ``meta_info`` with ``finish_reason`` (``{"type": "stop" | "length" | "abort", ...}``),
  ``output_token_logprobs`` (``[[logprob, token_id, null], ...]``, log-softmax of logits / temperature,
  as SGLang returns by default), ``prompt_tokens``, ``completion_tokens`` and ``weight_version``; a list of
  ``n`` such objects when ``n > 1``. A batch (``text`` / ``input_ids`` a list of B prompts, ``image_data``
  and ``rid`` then one item per prompt) is decoded as one batch and answered as a list of B × n objects,
  prompt-major (SGLang's order).
- ``POST /update_weights_from_disk``: ``model_path`` (a transformers directory), ``weight_version``,
  ``abort_all_requests``; answers ``success``, ``message``, and (vlrl extensions) the new
  ``weight_version`` and a ``weight_checksum`` of the loaded weights that the trainer compares with its own.
  Safetensors weights are copied in place into a spare copy of the model (`vlrl.rollout.weights`); other
  formats are loaded with ``from_pretrained``.
- ``GET /health``, ``GET /get_model_info``, ``GET /get_weight_version``.

Batching: one worker thread decodes; requests that arrive while a batch decodes join the next batch
(`ContinuousBatcher`). A weight load never waits for a batch: the new weights are loaded beside the old ones
and swapped in at the next batch boundary, so a batch that was decoding finishes on the old weights and is
tagged with the old version. With ``abort_all_requests`` the queued requests and the decoding batch are
answered with ``finish_reason.type == "abort"`` instead (the client re-queues them).

Safety: binds to loopback and requires ``Authorization: Bearer <key>`` (except ``/health``) by default; the
queue is bounded (503 when full); malformed requests get a 400 naming the field.

`ThreadedEngine` is the same batcher used in-process, on a private copy of the trainer's policy — the
asynchronous recipe's engine when no server is configured.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import collections
import collections.abc
import concurrent.futures
import contextlib
import copy
import dataclasses
import io
import logging
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from PIL import Image
from pydantic import BaseModel, ConfigDict, Field

from vlrl.data.sample import Sample, SampleError, load_image
from vlrl.models.policy import DTYPES, Policy
from vlrl.rollout.hf_engine import HFEngine
from vlrl.rollout.types import Request, SamplingParams, Status, Trajectory
from vlrl.rollout.weights import checkpoint_names, copy_weights, read_weights, weight_checksum
from vlrl.serving import (
    API_KEY_ENV,
    ServerThread,
    bind_socket,
    install_bearer_auth,
    is_loopback,
    resolve_api_key,
)

__all__ = ["API_KEY_ENV", "ContinuousBatcher", "ServerThread", "ThreadedEngine", "bind_socket", "create_app",
           "is_loopback", "serve", "weight_checksum"]

log = logging.getLogger(__name__)



# ----------------------------------------------------------------------------------------------- batching
class QueueFullError(RuntimeError):
    """The server's bounded queue is full; retry later."""


@dataclasses.dataclass
class _Job:
    requests: list[Request]
    sampling: SamplingParams
    future: concurrent.futures.Future
    aborted: bool = False

    @property
    def rows(self) -> int:
        return len(self.requests) * self.sampling.n


def _sampling_key(sampling: SamplingParams) -> tuple:
    return (sampling.n, sampling.temperature, sampling.top_p, sampling.top_k, sampling.max_new_tokens, tuple(sampling.stop))


def settle(future: concurrent.futures.Future, result: Any = None, *, error: BaseException | None = None) -> None:
    """Set a future's outcome (a job's, a prompt's) unless its caller already cancelled it."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass


def aborted_trajectories(requests: Sequence[Request], n: int, version: int) -> list[Trajectory]:
    """``len(requests) * n`` empty ABORTED trajectories (never trained on; the caller re-queues the prompt)."""
    return [
        Trajectory(sample=r.sample, prompt_ids=torch.as_tensor(r.prompt_ids, dtype=torch.long),
                   response_ids=torch.zeros(0, dtype=torch.long), loss_mask=torch.zeros(0, dtype=torch.long),
                   behaviour_logp=torch.zeros(0), vision=r.vision, images=r.images, weight_version=version,
                   status=Status.ABORTED, group_index=i)
        for i, r in enumerate(requests) for _ in range(n)
    ]


class ContinuousBatcher:
    """Batch-level continuous batching over a `Policy` on one worker thread.

    `submit` queues a job (some requests sharing one `SamplingParams`) and returns a future of its
    trajectories. The worker takes every queued job that fits in ``max_batch_size`` rows, generates (one
    `HFEngine.generate` per distinct sampling setting), resolves the futures, and repeats. With
    ``batch_window > 0`` it first waits while requests keep arriving (at most that many seconds apart), so
    the requests of one burst decode together instead of the first one alone. `load` installs new
    weights beside the active ones; the worker swaps them in before its next batch. `load_in_place` does the
    same without building a model: it copies the tensors into the spare copy that no batch uses (the weights
    the last swap retired), so the server holds two copies of the weights and never waits for a batch.
    """

    def __init__(self, policy: Policy, *, max_batch_size: int = 256, max_queued_requests: int = 1024,
                 batch_window: float = 0.0, version: int = 0) -> None:
        self.max_batch_size = max_batch_size
        self.max_queued_requests = max_queued_requests
        self.batch_window = batch_window
        self._active = self._engine(policy, version)
        self._active_checksum = weight_checksum(policy.model)
        self._standby: tuple[HFEngine, str] | None = None
        self._spare: Policy | None = None  # weights no batch uses (retired by the last swap): `load_in_place` fills them
        self._load_lock = threading.Lock()
        self._pending: collections.deque[_Job] = collections.deque()
        self._running: list[_Job] = []
        self._cond = threading.Condition()
        self._closed = False
        self.batches = 0  # batches decoded so far (for tests and metrics)
        self.rows = 0  # sequences decoded so far
        self._thread = threading.Thread(target=self._loop, name="vlrl-batcher", daemon=True)
        self._thread.start()

    def _engine(self, policy: Policy, version: int) -> HFEngine:
        engine = HFEngine(policy, max_batch_size=self.max_batch_size)
        engine.weight_version = version
        return engine

    @property
    def policy(self) -> Policy:
        return self._active.policy

    @property
    def version(self) -> tuple[int, str]:
        """(weight version, checksum) that every batch started from now on uses."""
        with self._cond:
            if self._standby is not None:
                return self._standby[0].weight_version, self._standby[1]
            return self._active.weight_version, self._active_checksum

    def queued(self) -> int:
        with self._cond:
            return sum(len(job.requests) for job in self._pending)

    def submit(self, requests: Sequence[Request], sampling: SamplingParams) -> concurrent.futures.Future:
        job = _Job(list(requests), sampling, concurrent.futures.Future())
        with self._cond:
            if self._closed:
                raise RuntimeError("the batcher is closed")
            queued = sum(len(j.requests) for j in self._pending)
            if queued and queued + len(job.requests) > self.max_queued_requests:
                raise QueueFullError(f"{queued} requests queued (max_queued_requests = {self.max_queued_requests})")
            self._pending.append(job)
            self._cond.notify_all()
        return job.future

    def load(self, policy: Policy, *, version: int, abort: bool = False) -> str:
        """Install ``policy`` as the weights of ``version`` for every batch started from now on; return its
        checksum. With ``abort``, queued jobs and the decoding batch are answered as aborted."""
        checksum = weight_checksum(policy.model)
        engine = self._engine(policy, version)
        with self._cond:
            if self._standby is not None and self._spare is None:  # replaced before any batch used it
                self._spare = self._standby[0].policy
            self._standby = (engine, checksum)
            if abort:
                for job in self._running:
                    job.aborted = True
                dropped = list(self._pending)
                self._pending.clear()
            else:
                dropped = []
            old_version = self._active.weight_version
            self._cond.notify_all()
        for job in dropped:
            settle(job.future, aborted_trajectories(job.requests, job.sampling.n, old_version))
        return checksum

    def load_in_place(self, weights: Mapping[str, torch.Tensor], *, version: int, abort: bool = False) -> str:
        """`load` without building a model: copy ``weights`` (state-dict names; see `copy_weights`) into the
        spare copy — the weights the last swap retired, or the standby not yet swapped in (taken back first),
        or on the first call a new copy of the active model — then install it as ``version``. No batch reads
        the spare while it is written, so decoding goes on meanwhile. Returns the checksum of the result."""
        with self._load_lock:
            with self._cond:
                if self._standby is not None:  # not swapped in yet: no batch uses it
                    spare, self._standby = self._standby[0].policy, None
                else:
                    spare, self._spare = self._spare, None
            if spare is None:
                spare = private_copy(self.policy, tokenizer=self.policy.tokenizer)
            try:
                copy_weights(spare.model, weights)
            except BaseException:
                with self._cond:
                    self._spare = self._spare or spare
                raise
            return self.load(spare, version=version, abort=abort)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            dropped = list(self._pending)
            self._pending.clear()
            self._cond.notify_all()
        for job in dropped:
            settle(job.future, error=RuntimeError("the batcher was closed"))
        self._thread.join(timeout=60)

    def _take(self) -> tuple[HFEngine, list[_Job]] | None:
        with self._cond:
            while True:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return None
                self._gather()
                if self._pending:  # (an abort may have emptied the queue meanwhile)
                    break
            if self._standby is not None:  # batch boundary: swap in the new weights; the old ones become the spare
                self._spare = self._active.policy
                self._active, self._active_checksum = self._standby
                self._standby = None
            jobs = [self._pending.popleft()]
            rows = jobs[0].rows
            while self._pending and rows + self._pending[0].rows <= self.max_batch_size:
                rows += self._pending[0].rows
                jobs.append(self._pending.popleft())
            self._running = jobs
            self.rows += rows
            return self._active, jobs

    def _gather(self) -> None:
        """Dynamic batching: while less than a full batch is queued, wait for more requests as long as they
        keep arriving less than ``batch_window`` seconds apart (requests of one client burst join one batch)."""
        while self.batch_window > 0 and not self._closed:
            queued = len(self._pending)
            if not queued or sum(job.rows for job in self._pending) >= self.max_batch_size:
                return
            self._cond.wait(self.batch_window)
            if len(self._pending) <= queued:
                return

    def _loop(self) -> None:
        while (taken := self._take()) is not None:
            engine, jobs = taken
            by_setting: dict[tuple, list[_Job]] = {}
            for job in jobs:
                by_setting.setdefault(_sampling_key(job.sampling), []).append(job)
            for group in by_setting.values():
                self._run(engine, group)
            with self._cond:
                self._running = []
            self.batches += 1

    def _run(self, engine: HFEngine, jobs: list[_Job]) -> None:
        requests = [r for job in jobs for r in job.requests]
        try:
            out = engine.generate(requests, jobs[0].sampling)
        except Exception as err:  # a bad batch fails its own requests, never the server
            log.exception("generation failed")
            for job in jobs:
                settle(job.future, error=err)
            return
        n, start = jobs[0].sampling.n, 0
        for job in jobs:
            count = len(job.requests) * n
            if job.aborted:
                settle(job.future, aborted_trajectories(job.requests, n, engine.weight_version))
            else:
                trajectories = out[start : start + count]
                for t in trajectories:
                    t.group_index -= start // n  # index within the job
                settle(job.future, trajectories)
            start += count


def private_copy(policy: Policy, *, tokenizer: Any = None) -> Policy:
    """A copy of ``policy`` with its own weights (frozen, eval mode) and its own tokenizer (a copy, or the
    given one): tokenizers must not be shared between threads that encode and decode concurrently."""
    model = copy.deepcopy(policy.model).eval()
    for p in model.parameters():
        p.grad = None
        p.requires_grad_(False)
    tokenizer = tokenizer if tokenizer is not None else copy.deepcopy(policy.tokenizer)
    return Policy(model, tokenizer, policy.image_processor, policy.adapter, policy.source)


# ----------------------------------------------------------------------------------------------- in-process
class WeightSyncError(RuntimeError):
    """A rollout engine failed to load the trainer's weights, or loaded different ones (checksum mismatch)."""


class ThreadedEngine:
    """The reference server's batcher in this process, on a private copy of the trainer's policy.

    Implements `Engine` and the asynchronous `agenerate`. The `agenerate` calls made in one iteration of an
    event loop (e.g. one per prompt, started together) are submitted as one job, so they decode as one batch
    exactly as `HFEngine.generate` would decode the same requests. `update_weights` copies the trainer's
    weights into the batcher's spare copy (`ContinuousBatcher.load_in_place`), checks its checksum and swaps
    it in at the next batch boundary.
    """

    def __init__(self, policy: Policy, *, max_batch_size: int = 256, abort_on_update: bool = False) -> None:
        self.policy = policy
        self.abort_on_update = abort_on_update
        self._encoder = HFEngine(policy)
        self._batcher = ContinuousBatcher(private_copy(policy), max_batch_size=max_batch_size,
                                          max_queued_requests=1 << 30)
        self._gathering: dict[tuple, list[tuple[list[Request], asyncio.Future]]] = {}
        self.weight_version = 0

    def encode(self, sample: Sample) -> Request:
        return self._encoder.encode(sample)

    def generate(self, requests: Sequence[Request], sampling: SamplingParams) -> list[Trajectory]:
        return self._batcher.submit(requests, sampling).result()

    async def agenerate(self, requests: Sequence[Request], sampling: SamplingParams) -> list[Trajectory]:
        loop = asyncio.get_running_loop()
        key = (id(loop), _sampling_key(sampling))
        if key not in self._gathering:
            self._gathering[key] = []
            loop.call_soon(self._flush, key, sampling)  # after every call already scheduled in this iteration
        future = loop.create_future()
        self._gathering[key].append((list(requests), future))
        return await future

    def _flush(self, key: tuple, sampling: SamplingParams) -> None:
        calls = self._gathering.pop(key)
        job = asyncio.wrap_future(self._batcher.submit([r for requests, _ in calls for r in requests], sampling))

        def distribute(done: asyncio.Future) -> None:
            start = 0
            for requests, future in calls:
                count = len(requests) * sampling.n
                if not future.done():
                    if done.cancelled() or done.exception() is not None:
                        future.set_exception(done.exception() or asyncio.CancelledError())
                    else:
                        trajectories = done.result()[start : start + count]
                        for t in trajectories:
                            t.group_index -= start // sampling.n
                        future.set_result(trajectories)
                start += count

        job.add_done_callback(distribute)

    def update_weights(self, *, version: int, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        weights = state_dict if state_dict is not None else self.policy.model.state_dict()
        expected = weight_checksum(weights)
        loaded = self._batcher.load_in_place(weights, version=version, abort=self.abort_on_update)
        if loaded != expected:
            raise WeightSyncError(f"in-process rollout copy: checksum {loaded[:12]} != trainer's {expected[:12]}")
        self.weight_version = version

    def close(self) -> None:
        self._batcher.close()


# ----------------------------------------------------------------------------------------------- HTTP API
_SAMPLING_NAMES = ("n", "temperature", "top_p", "top_k", "max_new_tokens", "stop")


class SamplingBody(BaseModel):
    """SGLang's ``sampling_params`` (the subset vlrl's server implements; others are rejected by name)."""

    model_config = ConfigDict(extra="forbid")
    n: int = Field(1, ge=1, le=1024)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)
    max_new_tokens: int = Field(128, ge=1)
    stop: str | list[str] | None = None

    def to_params(self) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=max(self.top_k, 0),
                              max_new_tokens=self.max_new_tokens, stop=stop)


class GenerateBody(BaseModel):
    """SGLang's ``GenerateReqInput``: one prompt, or a batch (``text`` / ``input_ids`` a list of prompts, then
    ``image_data`` and ``rid`` one item per prompt) sharing one ``sampling_params``."""

    model_config = ConfigDict(extra="forbid")
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    image_data: str | list[str | list[str] | None] | None = None
    sampling_params: SamplingBody = Field(default_factory=SamplingBody)
    return_logprob: bool = False
    rid: str | list[str] | None = None
    stream: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False


class UpdateWeightsBody(BaseModel):
    """SGLang's ``UpdateWeightFromDiskReqInput`` (fields vlrl does not need are accepted and ignored)."""

    model_config = ConfigDict(extra="forbid")
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True
    is_async: bool = False
    torch_empty_cache: bool = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = 0


class BadRequest(ValueError):
    """A malformed request; the message names the field."""


def _decode_image(item: str, k: int) -> Image.Image:
    """An ``image_data`` item: a data URL, a path on the server, or plain base64 (SGLang's three forms)."""
    where = f"field 'image_data[{k}]'"
    if item.startswith(("http://", "https://")):
        raise BadRequest(f"{where}: URLs are not fetched; send base64 or a path on the server")
    try:
        if item.startswith("data:") or (len(item) < 4096 and os.path.isfile(item)):
            return load_image(item)
        try:
            data = base64.b64decode(item, validate=True)
        except (binascii.Error, ValueError):
            raise BadRequest(f"{where}: neither a file on the server nor valid base64") from None
        return load_image(data)
    except SampleError as err:
        raise BadRequest(f"{where}: {err}") from None


def is_batched(body: GenerateBody) -> bool:
    """Whether ``body`` holds a batch of prompts (SGLang: ``text`` or ``input_ids`` is a list of prompts)."""
    return isinstance(body.text, list) or bool(body.input_ids and isinstance(body.input_ids[0], list))


def build_requests(policy: Policy, body: GenerateBody, rids: collections.abc.Iterator[str]) -> list[Request]:
    """Turn a `GenerateBody` into its `Request` (one prompt) or requests (a batch), in order; a prompt
    without ``rid`` is named by ``rids``."""
    if (body.text is None) == (body.input_ids is None):
        raise BadRequest("give exactly one of 'text' or 'input_ids'")
    if body.stream:
        raise BadRequest("field 'stream': streaming is not supported")
    if not is_batched(body):
        if isinstance(body.image_data, list) and not all(isinstance(item, str) for item in body.image_data):
            raise BadRequest("field 'image_data': one prompt takes a string or a list of strings")
        if isinstance(body.rid, list):
            raise BadRequest("field 'rid': one prompt takes one string")
        return [build_request(policy, body.text, body.input_ids, body.image_data, body.rid or next(rids))]
    prompts = body.text if body.text is not None else body.input_ids
    if any(isinstance(p, int) for p in prompts):
        raise BadRequest("field 'input_ids': a batch is a list of token-id lists")
    B = len(prompts)
    images = body.image_data if body.image_data is not None else [None] * B
    rid = body.rid if body.rid is not None else [next(rids) for _ in range(B)]
    for field, value in (("image_data", images), ("rid", rid)):
        if not isinstance(value, list) or len(value) != B:
            raise BadRequest(f"field '{field}': a batch of {B} prompts takes a list of {B} items")
    out = []
    for i, prompt in enumerate(prompts):
        try:
            text, ids = (prompt, None) if body.text is not None else (None, prompt)
            out.append(build_request(policy, text, ids, images[i], rid[i]))
        except BadRequest as err:
            raise BadRequest(f"prompt {i} of the batch: {err}") from None
    return out


def build_request(policy: Policy, text: str | None, input_ids: list[int] | None, image_data: str | list[str] | None,
                  rid: str) -> Request:
    """One prompt as a `Request` (tokenize ``text``, process images, expand image tokens)."""
    items = [image_data] if isinstance(image_data, str) else list(image_data or [])
    images = [_decode_image(item, k) for k, item in enumerate(items)]
    adapter = policy.adapter
    try:
        vision = adapter.encode_images(images)
        if text is not None:
            ids = adapter.encode_text(adapter.expand_image_tokens(text, vision) if images else text)
        else:
            ids = _expand_ids(policy, list(input_ids), vision)
    except ValueError as err:
        raise BadRequest(f"field 'image_data': {err}") from None
    if not ids:
        raise BadRequest("the prompt is empty")
    vocab = policy.model.get_input_embeddings().num_embeddings
    if min(ids) < 0 or max(ids) >= vocab:
        raise BadRequest(f"field 'input_ids': token ids must lie in [0, {vocab})")
    sample = Sample(id=rid, task="serve", messages=[{"role": "user", "content": ""}])
    return Request(sample=sample, prompt_ids=ids, vision=vision, images=images)


def _expand_ids(policy: Policy, ids: list[int], vision) -> list[int]:
    """Token ids with image tokens already expanded pass through; one placeholder per image is expanded (by the
    family's adapter: each image's markup as its processor expands it)."""
    return policy.adapter.expand_ids(ids, vision)


def sglang_output(policy: Policy, t: Trajectory, sampling: SamplingParams, *, return_logprob: bool) -> dict[str, Any]:
    """One trajectory in the shape of SGLang's ``/generate`` answer."""
    ids = t.response_ids.tolist()
    text = policy.tokenizer.decode(ids, skip_special_tokens=True)
    if t.status is Status.ABORTED:
        finish: dict[str, Any] = {"type": "abort", "message": "aborted by a weight update"}
    elif t.status is Status.TRUNCATED:
        finish = {"type": "length", "length": len(ids)}
    elif ids and ids[-1] in policy.eos_token_ids:
        finish = {"type": "stop", "matched": ids[-1]}
    else:
        matched = next((s for s in sampling.stop if s in text), "")
        finish = {"type": "stop", "matched": matched}
        if matched:
            text = text[: text.rfind(matched)]  # SGLang trims the stop string from the text
    meta: dict[str, Any] = {"id": t.sample.id, "finish_reason": finish, "prompt_tokens": len(t.prompt_ids),
                            "completion_tokens": len(ids), "cached_tokens": 0, "weight_version": str(t.weight_version)}
    if return_logprob:
        meta["output_token_logprobs"] = [[float(lp), int(i), None] for lp, i in zip(t.behaviour_logp.tolist(), ids, strict=True)]
    return {"text": text, "output_ids": ids, "meta_info": meta}


def create_app(batcher: ContinuousBatcher, *, api_key: str | None, model_path: str = "") -> Any:
    """The FastAPI application serving ``batcher``. ``api_key=None`` disables authentication."""
    from fastapi import FastAPI
    from fastapi import Request as HTTPRequest
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse

    app = FastAPI(title="vlrl rollout server")
    counter = iter(range(1 << 62))
    update_lock = asyncio.Lock()
    names: dict[str, Any] = {}  # checkpoint → state-dict names of the served model, found at the first update

    install_bearer_auth(app, api_key)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: HTTPRequest, err: RequestValidationError):
        return JSONResponse({"error": _explain(err)}, 400)

    @app.exception_handler(BadRequest)
    async def _bad(request: HTTPRequest, err: BadRequest):
        return JSONResponse({"error": str(err)}, 400)

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
                "vocab_size": policy.model.get_input_embeddings().num_embeddings,
                "max_batch_size": batcher.max_batch_size, "max_queued_requests": batcher.max_queued_requests,
                "queued_requests": batcher.queued(), "batches": batcher.batches, "rows": batcher.rows, "server": "vlrl"}

    @app.get("/get_weight_version")
    async def get_weight_version():
        return {"weight_version": str(batcher.version[0])}

    @app.post("/generate")
    async def generate(body: GenerateBody):
        requests = build_requests(batcher.policy, body, (f"req-{i}" for i in counter))
        sampling = body.sampling_params.to_params()
        try:
            future = batcher.submit(requests, sampling)  # one job: a batch's prompts decode together
        except QueueFullError as err:
            return JSONResponse({"error": f"server busy: {err}"}, 503, headers={"Retry-After": "1"})
        trajectories = await asyncio.wrap_future(future)
        policy = batcher.policy
        out = [sglang_output(policy, t, sampling, return_logprob=body.return_logprob) for t in trajectories]
        return out if is_batched(body) or sampling.n > 1 else out[0]  # a batch: prompt-major, n per prompt

    @app.post("/update_weights_from_disk")
    async def update_weights(body: UpdateWeightsBody):
        try:
            version = int(body.weight_version) if body.weight_version is not None else batcher.version[0] + 1
        except ValueError:
            raise BadRequest(f"field 'weight_version': vlrl versions are integers, got {body.weight_version!r}") from None
        async with update_lock:
            try:
                checksum = await asyncio.to_thread(_update_from_disk, batcher, body.model_path, version=version,
                                                   abort=body.abort_all_requests, names=names)
            except (OSError, ValueError) as err:
                return JSONResponse({"success": False, "message": f"cannot load {body.model_path}: {err}"}, 400)
        return {"success": True, "message": f"loaded {body.model_path} as version {version}",
                "num_paused_requests": 0, "weight_version": str(version), "weight_checksum": checksum}

    return app


def _explain(err) -> str:
    """One readable line per validation error, naming the field."""
    lines = []
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"] if p != "body") or "(body)"
        if e["type"] == "extra_forbidden":
            hint = f" (sampling parameters: {', '.join(_SAMPLING_NAMES)})" if field.startswith("sampling_params") else ""
            lines.append(f"field '{field}': not supported by vlrl's server{hint}")
        elif field == "(body)":
            lines.append("the body must be a JSON object sent with Content-Type: application/json")
        elif e["type"] == "json_invalid":
            lines.append(f"invalid JSON: {e['msg']}")
        else:
            lines.append(f"field '{field}': {e['msg']}")
    return "; ".join(lines)


@contextlib.contextmanager
def quiet_transformers():
    """No progress bars while weights are saved or loaded every step."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def _update_from_disk(batcher: ContinuousBatcher, path: str, *, version: int, abort: bool, names: dict[str, Any]) -> str:
    """Load the transformers directory ``path`` as ``version``: its safetensors copied in place into the
    batcher's spare weights (`ContinuousBatcher.load_in_place`), or — for other formats, or a model whose
    checkpoint layout is more than a renaming — a new model built by ``from_pretrained``. Returns the checksum."""
    if "names" not in names:
        names["names"] = checkpoint_names(batcher.policy.model)
    weights = read_weights(path, names["names"]) if names["names"] is not None else None
    if weights is not None:
        return batcher.load_in_place(weights, version=version, abort=abort)
    return batcher.load(_load_weights(batcher.policy, path), version=version, abort=abort)


def _load_weights(current: Policy, path: str) -> Policy:
    """A new policy object: ``current``'s tokenizer and processors, the weights of the directory ``path``."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    model_cls = AutoModelForImageTextToText if current.is_vision else AutoModelForCausalLM
    dtype = next(current.model.parameters()).dtype
    device = next(current.model.parameters()).device
    with quiet_transformers():
        model = model_cls.from_pretrained(path, dtype=dtype).to(device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return Policy(model, current.tokenizer, current.image_processor, current.adapter, path)


# ----------------------------------------------------------------------------------------------- running
def serve(model: str, *, host: str = "127.0.0.1", port: int = 30000, api_key: str | None = None,
          no_auth: bool = False, dtype: str = "float32", device: str = "cpu", max_batch_size: int = 256,
          max_queued_requests: int = 1024, batch_window_ms: float = 10.0, init_seed: int = 0) -> None:
    """`vlrl serve`: load the policy and serve it until interrupted."""
    import uvicorn

    from vlrl.models import load_policy

    if dtype not in DTYPES:
        raise ValueError(f"--dtype: choose from {sorted(DTYPES)}")
    api_key = resolve_api_key(api_key, no_auth=no_auth, host=host, command="vlrl serve")
    policy = load_policy(model, dtype=dtype, device=device, seed=init_seed)
    policy.model.eval()
    batcher = ContinuousBatcher(policy, max_batch_size=max_batch_size, max_queued_requests=max_queued_requests,
                                batch_window=batch_window_ms / 1000)
    app = create_app(batcher, api_key=api_key, model_path=model)
    sock = bind_socket(host, port)
    print(f"vlrl serve: listening on http://{host}:{sock.getsockname()[1]} ({policy.source}, "
          f"{policy.num_parameters() / 1e6:.2f}M parameters, auth {'on' if api_key else 'off'})", flush=True)
    try:
        uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off")).run(sockets=[sock])
    finally:
        batcher.close()


def encode_image(image: Image.Image) -> str:
    """A PNG data URL, the form the HTTP engine sends images in."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
