"""vlrl's reference rollout server (`vlrl serve`): any transformers policy behind SGLang's native HTTP API.

The server speaks the subset of SGLang's native API that RL training needs, so a real SGLang server can take
its place on GPUs (see the README, "Rollout servers and asynchronous RL"):

- ``POST /generate``: one prompt as ``input_ids`` or ``text``; ``image_data`` (base64, data URL or path; one
  or a list); ``sampling_params`` with SGLang's names (``n``, ``temperature``, ``top_p``, ``top_k``,
  ``max_new_tokens``, ``stop``, ``stop_token_ids``, ``logit_bias``); ``return_logprob``; types as strict as SGLang's
  schema, and a batch's ``image_data`` in its forms (`prompt_image_items`). The answer has SGLang's shape: ``text``, ``output_ids``
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
- ``POST /init_weights_update_group`` (``master_address``, ``master_port``, ``rank_offset``, ``world_size``,
  ``group_name``, ``backend``) and ``POST /update_weights_from_distributed`` (``names``, ``dtypes``, ``shapes``,
  ``group_name``, ``weight_version``, ...): SGLang's distributed weight sync (`vlrl.rollout.dist_sync`). The
  server joins the trainer's group over gloo (on CPU) in a thread off the event loop (not holding the update lock,
  so a join that never completes cannot hold up a disk load), receives each bucket's broadcast straight into its
  spare weights (their tensors become views of the bucket's storage; a bucket in another dtype is received into a
  buffer and cast in); the bucket carrying ``weight_version`` completes the update, which is swapped in like a
  disk load and answered with its ``weight_checksum``. A disk load or a new group drops an update left half-way.
  ``POST /destroy_weights_update_group`` leaves a group; joins run one at a time on a daemon thread of their own,
  bounded by ``join_timeout`` (`_WeightRoutes`).
- ``POST /pause_generation`` (``mode``: ``abort``, ``retract``, ``in_place``) and ``POST /continue_generation``
  (`ContinuousBatcher.pause`); with ``--admin-api-key`` these and the weight routes take that key only.
- ``GET /health``, ``GET /server_info`` (SGLang's parallel sizes and batch bound, then vlrl's facts),
  ``GET /get_model_info``, ``GET /get_weight_version``.

Batching: one worker thread decodes; requests that arrive while a batch decodes join the next batch
(`ContinuousBatcher`). A weight load never waits for a batch: the new weights are loaded beside the old ones
and swapped in at the next batch boundary, so a batch that was decoding finishes on the old weights and is
tagged with the old version. With ``abort_all_requests`` the queued requests and the decoding batch are
answered with ``finish_reason.type == "abort"`` instead (the client re-queues them).

Safety: binds to loopback and requires ``Authorization: Bearer <key>`` (except ``/health``) by default. Every
request is bounded before it is admitted (`ServeLimits`: ``max_new_tokens``, prompt + new tokens ≤ the model's
context, body bytes counted as received, image pixels and vision tokens read from headers; the batcher: samples
= prompts × n against the queue, tokens in flight; the pixels of all of a request's images; the body's read time
and the bytes of all requests held at once) — a 400 naming the field, 413 for the body, 408 / 503 while full.
JSON is parsed off the event loop (`vlrl.serving.BodyParser`), image decoding runs on an image thread and tokenizing
on one preprocessing thread, so ``/health`` answers under any load. A client that disconnects, or a request past its
deadline, stops at the next decode step. Unexpected errors answer 500 with an id (the traceback goes to the
log); server paths in ``image_data`` are read only under configured roots. SIGTERM drains within a bound.

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
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
from PIL import Image
from pydantic import BaseModel, ConfigDict, Field

from vlrl.data.sample import Sample, SampleError, image_size, load_image
from vlrl.models.policy import DTYPES, Policy
from vlrl.rollout import dist_sync
from vlrl.rollout.hf_engine import HFEngine
from vlrl.rollout.types import Request, SamplingParams, Status, Trajectory
from vlrl.rollout.weights import (
    FlatBuckets,
    WeightLoadError,
    WeightWriter,
    checkpoint_names,
    copy_weights,
    read_weights,
    weight_checksum,
)
from vlrl.serving import (
    API_KEY_ENV,
    BodyError,
    BodyParser,
    ServerThread,
    bind_socket,
    encode_json,
    is_loopback,
    on_close,
    protect,
    resolve_api_key,
    run_server,
)

__all__ = ["API_KEY_ENV", "ContinuousBatcher", "ServeLimits", "ServerThread", "ThreadedEngine", "bind_socket",
           "create_app", "is_loopback", "serve", "weight_checksum"]

log = logging.getLogger(__name__)



# ----------------------------------------------------------------------------------------------- batching
class QueueFullError(RuntimeError):
    """The server's bounded queue (or its budget of tokens in flight) is full; retry later."""


class TooLargeError(ValueError):
    """A job that could never be admitted: more samples than the queue holds, or more tokens than the budget."""


@dataclasses.dataclass
class _Job:
    requests: list[Request]
    sampling: SamplingParams
    future: concurrent.futures.Future
    tokens: int = 0  # counted against the budget of tokens in flight until the future is done
    deadline: float | None = None  # time.monotonic() past which the job is aborted at the next decode step
    aborted: bool = False  # by a weight update with abort, or at shutdown
    retracted: bool = False  # by /pause_generation with mode retract: stops, then decodes again from its prompt
    cancel_step: int | None = None  # the batcher's decode step at which the future was cancelled (client gone)
    stop_step: int | None = None  # the decode step at which its rows stopped decoding early

    @property
    def rows(self) -> int:
        return len(self.requests) * self.sampling.n

    def should_stop(self, now: float) -> bool:
        return (self.aborted or self.retracted or self.future.cancelled()
                or (self.deadline is not None and now > self.deadline))


@dataclasses.dataclass(frozen=True)
class EarlyStop:
    """A job whose rows stopped before the end of their batch: ``why`` (``cancelled`` — its client went away —,
    ``deadline`` or ``aborted``), the decode step at which that was asked (for a cancel) and the one at which
    its rows stopped (`ContinuousBatcher.decode_steps` counts steps)."""

    why: str  # cancelled | deadline | aborted | retracted
    asked_step: int | None
    stopped_step: int


def sampling_key(sampling: SamplingParams) -> tuple:
    return (sampling.n, sampling.temperature, sampling.top_p, sampling.top_k, sampling.max_new_tokens, tuple(sampling.stop),
            tuple(sampling.stop_token_ids), tuple(sorted(sampling.logit_bias.items())))


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

    Admission: the queue holds at most ``max_queued_requests`` samples (prompts × n) and, with
    ``max_tokens_in_flight``, the jobs queued or decoding hold at most that many tokens (Σ samples × (prompt
    + max_new_tokens)); beyond either `submit` raises `QueueFullError` (retry later), and a job that could never
    fit raises `TooLargeError`. Pause (SGLang's ``/pause_generation``, `pause` / `resume`): no batch starts while
    paused; the decoding batch is aborted, retracted (re-queued, decoded again from its prompts after the pause) or
    held at its next decode step (``in_place``). Early stop: a job whose future is cancelled (its client went away),
    whose ``deadline`` passed, or that is aborted stops decoding at the next decode step — the engine asks the
    batcher once per step (`HFEngine.generate`'s ``on_step``) — and its rows leave the batch; ``early_stops``
    keeps the last of them (for metrics and tests).
    """

    def __init__(self, policy: Policy, *, max_batch_size: int = 256, max_queued_requests: int = 1024,
                 batch_window: float = 0.0, version: int = 0, max_tokens_in_flight: int | None = None) -> None:
        self.max_batch_size = max_batch_size
        self.max_queued_requests = max_queued_requests
        self.max_tokens_in_flight = max_tokens_in_flight
        self.batch_window = batch_window
        self._active = self._engine(policy, version)
        self._active_checksum = weight_checksum(policy.model)
        self._standby: tuple[HFEngine, str] | None = None
        self._spare: Policy | None = None  # weights no batch uses (retired by the last swap): `load_in_place` fills them
        self._taken_standby: tuple[HFEngine, str] | None = None  # the standby `take_spare` took back (restorable)
        self.paused: str | None = None  # the /pause_generation mode while paused, else None
        self._load_lock = threading.Lock()
        self._pending: collections.deque[_Job] = collections.deque()
        self._running: list[_Job] = []
        self._cond = threading.Condition()
        self._closed = False
        self.tokens_in_flight = 0  # tokens of the jobs queued or decoding
        self.batches = 0  # batches decoded so far (for tests and metrics)
        self.rows = 0  # sequences decoded so far
        self.decode_steps = 0  # decode steps taken so far (every batch, every step)
        self.cancelled = 0  # jobs whose future was cancelled (their client went away), queued or decoding
        self.early_stops: collections.deque[EarlyStop] = collections.deque(maxlen=256)
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
        """Samples (prompts × n) waiting in the queue."""
        with self._cond:
            return sum(job.rows for job in self._pending)

    def submit(self, requests: Sequence[Request], sampling: SamplingParams, *, tokens: int = 0,
               deadline: float | None = None) -> concurrent.futures.Future:
        """Queue a job; its future gives ``len(requests) × n`` trajectories. ``tokens``: what it holds against
        ``max_tokens_in_flight``; ``deadline``: a ``time.monotonic()`` past which it is aborted. Cancel the
        future to abort the job (it stops at the next decode step)."""
        job = _Job(list(requests), sampling, concurrent.futures.Future(), tokens=tokens, deadline=deadline)
        budget = self.max_tokens_in_flight
        if job.rows > self.max_queued_requests:
            raise TooLargeError(f"{len(job.requests)} prompt(s) × n = {sampling.n} is {job.rows} samples; the queue "
                                f"holds at most {self.max_queued_requests} (max_queued_requests)")
        if budget is not None and tokens > budget:
            raise TooLargeError(f"{job.rows} samples × (prompt + max_new_tokens) = {tokens} tokens; at most {budget} "
                                "tokens may be in flight (max_tokens_in_flight)")
        with self._cond:
            if self._closed:
                raise RuntimeError("the batcher is closed")
            queued = sum(j.rows for j in self._pending)
            if queued + job.rows > self.max_queued_requests:
                raise QueueFullError(f"{queued} samples queued (max_queued_requests = {self.max_queued_requests})")
            if budget is not None and self.tokens_in_flight + tokens > budget:
                raise QueueFullError(f"{self.tokens_in_flight} tokens in flight (max_tokens_in_flight = {budget})")
            self.tokens_in_flight += tokens
            self._pending.append(job)
            self._cond.notify_all()
        job.future.add_done_callback(lambda future: self._done(job))
        return job.future

    def _done(self, job: _Job) -> None:
        with self._cond:
            self.tokens_in_flight -= job.tokens
            job.tokens = 0
            if job.future.cancelled():
                self.cancelled += 1
                job.cancel_step = self.decode_steps
                if job in self._pending:  # never decoded: leave the queue now
                    self._pending.remove(job)

    def load(self, policy: Policy, *, version: int, abort: bool = False) -> str:
        """Install ``policy`` as the weights of ``version`` for every batch started from now on; return its
        checksum. With ``abort``, queued jobs and the decoding batch are answered as aborted."""
        checksum = weight_checksum(policy.model)
        engine = self._engine(policy, version)
        with self._cond:
            if self._standby is not None and self._spare is None:  # replaced before any batch used it
                self._spare = self._standby[0].policy
            self._standby = (engine, checksum)
            self._taken_standby = None
            old_version = self._active.weight_version
            dropped = self._abort_locked() if abort else []
            self._cond.notify_all()
        for job in dropped:
            settle(job.future, aborted_trajectories(job.requests, job.sampling.n, old_version))
        return checksum

    def abort_all(self) -> None:
        """Answer every queued job and the decoding batch as aborted now (shutdown after the drain bound)."""
        with self._cond:
            dropped = self._abort_locked()
            version = self._active.weight_version
            self._cond.notify_all()
        for job in dropped:
            settle(job.future, aborted_trajectories(job.requests, job.sampling.n, version))

    def pause(self, mode: str) -> None:
        """SGLang's ``/pause_generation``: no batch starts until `resume`. The decoding batch, by ``mode``: ``abort`` —
        it and every queued job are answered as aborted (the client re-queues them); ``retract`` — it stops at its next
        decode step and its jobs go back to the head of the queue, to be decoded again from their prompts after
        `resume` (on the weights loaded meanwhile, so each answer still comes from one version); ``in_place`` — it
        waits at its next decode step and, after `resume`, finishes on the weights it started with (vlrl swaps
        weights only between batches), tagged with their version. Queued jobs wait (their deadline still runs)."""
        if mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"pause mode {mode!r}: abort, retract or in_place")
        dropped: list[_Job] = []
        with self._cond:
            self.paused = mode
            if mode == "abort":
                dropped = self._abort_locked()
            elif mode == "retract":
                for job in self._running:
                    job.retracted = True
            version = self._active.weight_version
            self._cond.notify_all()
        for job in dropped:
            settle(job.future, aborted_trajectories(job.requests, job.sampling.n, version))

    def resume(self) -> None:
        """SGLang's ``/continue_generation``: batches start again."""
        with self._cond:
            self.paused = None
            self._cond.notify_all()

    def _hold_in_place(self, jobs: Sequence[_Job]) -> None:
        """While paused ``in_place``, the decoding batch waits here (its decode step) — until `resume`, shutdown,
        or one of its jobs must stop (abort, retract, cancel, deadline)."""
        with self._cond:
            while (self.paused == "in_place" and not self._closed
                   and not any(job.should_stop(time.monotonic()) for job in jobs)):
                self._cond.wait(0.25)

    def _abort_locked(self) -> list[_Job]:
        for job in self._running:
            job.aborted = True  # stops at the next decode step; answered as aborted by `_run`
        dropped = list(self._pending)
        self._pending.clear()
        return dropped

    def load_in_place(self, weights: Mapping[str, torch.Tensor], *, version: int, abort: bool = False) -> str:
        """`load` without building a model: copy ``weights`` (state-dict names; see `copy_weights`) into the
        spare copy (`take_spare`), then install it as ``version``. No batch reads the spare while it is written,
        so decoding goes on meanwhile. Returns the checksum of the result. Weights that do not fit the model are
        refused before anything is copied: the version served (and acknowledged) before stays."""
        with self._load_lock:
            spare = self.take_spare()
            try:
                copy_weights(spare.model, weights)
            except WeightLoadError:  # checked before any copy: the spare is as it was
                self.give_back(spare, intact=True)
                raise
            except BaseException:
                self.give_back(spare)
                raise
            return self.load(spare, version=version, abort=abort)

    def take_spare(self) -> Policy:
        """Weights no batch uses, to be overwritten and then installed with `load` (or handed back with
        `give_back`): the weights the last swap retired, or the standby not yet swapped in (taken back), or on the
        first call a new copy of the active model."""
        with self._cond:
            if self._standby is not None:  # not swapped in yet: no batch uses it
                self._taken_standby = self._standby
                spare, self._standby = self._standby[0].policy, None
            else:
                spare, self._spare = self._spare, None
        return spare if spare is not None else private_copy(self.policy, tokenizer=self.policy.tokenizer)

    def give_back(self, spare: Policy, *, intact: bool = False) -> None:
        """A spare taken by `take_spare` and not installed (its load failed): kept for the next load. ``intact``:
        nothing was written into it — if it was the standby `take_spare` took back (a loaded version no batch has
        used yet), it is the standby again, so a failed load never reverts the version last loaded."""
        with self._cond:
            taken, self._taken_standby = self._taken_standby, None
            if intact and taken is not None and taken[0].policy is spare and self._standby is None:
                self._standby = taken
            else:
                self._spare = self._spare or spare

    def close(self) -> None:
        """Stop: queued jobs fail, the decoding batch stops at its next decode step (answered as aborted)."""
        with self._cond:
            self._closed = True
            dropped = list(self._pending)
            self._pending.clear()
            for job in self._running:
                job.aborted = True
            self._cond.notify_all()
        for job in dropped:
            settle(job.future, error=RuntimeError("the batcher was closed"))
        self._thread.join(timeout=60)

    def _take(self) -> tuple[HFEngine, list[_Job]] | None:
        with self._cond:
            while True:
                while (not self._pending or self.paused) and not self._closed:
                    self._cond.wait(0.25 if self.paused else None)
                    if self.paused:
                        self._drop_expired()  # (a paused server still answers a request past its deadline)
                if self._closed:
                    return None
                self._gather()
                self._drop_expired()
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

    def _drop_expired(self) -> None:
        """Queued jobs past their deadline are answered as aborted without decoding."""
        now = time.monotonic()
        expired = [job for job in self._pending if job.deadline is not None and now > job.deadline]
        for job in expired:
            self._pending.remove(job)
            self.early_stops.append(EarlyStop("deadline", None, self.decode_steps))
            settle(job.future, aborted_trajectories(job.requests, job.sampling.n, self._active.weight_version))

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
                by_setting.setdefault(sampling_key(job.sampling), []).append(job)
            for group in by_setting.values():
                self._run(engine, group)
            with self._cond:
                self._running = []
            self.batches += 1

    def _on_step(self, owners: dict[int, _Job]) -> collections.abc.Callable[[Sequence[Request]], list[bool]]:
        """The engine's per-decode-step hook: count the step; stop the rows of every job that should stop."""

        jobs = list({id(job): job for job in owners.values()}.values())

        def on_step(requests: Sequence[Request]) -> list[bool]:
            self.decode_steps += 1
            if self.paused == "in_place":
                self._hold_in_place(jobs)
            now = time.monotonic()
            flags = []
            for request in requests:
                job = owners[id(request)]
                stop = job.should_stop(now)
                if stop and job.stop_step is None:
                    job.stop_step = self.decode_steps
                flags.append(stop)
            return flags

        return on_step

    def _run(self, engine: HFEngine, jobs: list[_Job]) -> None:
        jobs = [job for job in jobs if not job.future.cancelled()]  # (cancelled while the batch was formed)
        if not jobs:
            return
        requests = [r for job in jobs for r in job.requests]
        owners = {id(r): job for job in jobs for r in job.requests}
        try:
            out = engine.generate(requests, jobs[0].sampling, on_step=self._on_step(owners))
        except Exception as err:  # a bad batch fails its own requests, never the server
            log.exception("generation failed")
            for job in jobs:
                settle(job.future, error=err)
            return
        n, start = jobs[0].sampling.n, 0
        retracted = [job for job in jobs if job.retracted and not job.aborted and not job.future.cancelled()]
        for job in jobs:
            count = len(job.requests) * n
            if job in retracted:  # decoded again from its prompt after the pause
                self.early_stops.append(EarlyStop("retracted", None, job.stop_step or self.decode_steps))
                job.retracted, job.stop_step = False, None
                start += count
                continue
            if job.stop_step is not None:
                why = "cancelled" if job.future.cancelled() else "aborted" if job.aborted else "deadline"
                self.early_stops.append(EarlyStop(why, job.cancel_step, job.stop_step))
            if job.stop_step is not None or job.aborted:
                settle(job.future, aborted_trajectories(job.requests, n, engine.weight_version))
            else:
                trajectories = out[start : start + count]
                for t in trajectories:
                    t.group_index -= start // n  # index within the job
                settle(job.future, trajectories)
            start += count
        if retracted:
            with self._cond:
                closed = self._closed
                if not closed:
                    self._pending.extendleft(reversed(retracted))
                    self._cond.notify_all()
            for job in retracted if closed else ():
                settle(job.future, error=RuntimeError("the batcher was closed"))


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

    def __init__(self, policy: Policy, *, max_batch_size: int = 256, abort_on_update: bool = False,
                 on_weight_update: str = "finish") -> None:
        self.policy = policy
        self.on_weight_update = "abort" if abort_on_update else on_weight_update
        self.abort_on_update = self.on_weight_update == "abort"
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
        key = (id(loop), sampling_key(sampling))
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
        pause = self.on_weight_update in ("retract", "in_place")  # (`ContinuousBatcher.pause` says what each does)
        if pause:
            self._batcher.pause(self.on_weight_update)
        try:
            loaded = self._batcher.load_in_place(weights, version=version, abort=self.abort_on_update)
        finally:
            if pause:
                self._batcher.resume()
        if loaded != expected:
            raise WeightSyncError(f"in-process rollout copy: checksum {loaded[:12]} != trainer's {expected[:12]}")
        self.weight_version = version

    def close(self) -> None:
        self._batcher.close()


# ----------------------------------------------------------------------------------------------- HTTP API
_SAMPLING_NAMES = ("n", "temperature", "top_p", "top_k", "max_new_tokens", "stop", "stop_token_ids", "logit_bias")
SGLANG_TOP_K_OFF = 1 << 30  # SGLang's default top_k: the whole vocabulary
MAX_TEMPERATURE = 100.0  # beyond this every token is equally likely anyway; 1e308 overflowed to NaN probabilities


@dataclasses.dataclass(frozen=True)
class ServeLimits:
    """What one request may ask of `vlrl serve`; a request beyond them is refused before it is admitted (400
    naming the field; 413 for the body). The batcher's own bounds (``max_queued_requests`` samples,
    ``max_tokens_in_flight``) answer 400 for a request that could never fit and 503 while they are full."""

    max_new_tokens: int = 4096
    """``sampling_params.max_new_tokens`` at most this (``--max-new-tokens``); prompt + max_new_tokens must also
    fit the model's context (``max_position_embeddings``)."""
    max_body_bytes: int = 32 << 20
    """Request body size (``--max-body-mb``), counted on the bytes received (chunked bodies too): 413 beyond."""
    max_image_pixels: int = 16 << 20
    """Pixels of one image, read from its header before any decoding (``--max-image-pixels``)."""
    max_request_pixels: int = 128 << 20
    """Pixels of all the images of one request together (every prompt of a batch), read from their headers before
    any is decoded (``--max-request-pixels``); a decoded RGB pixel takes 3 bytes, so the default bounds one request's
    decoded images near 400 MB."""
    request_timeout: float = 600.0
    """Seconds from admission after which a request still queued or decoding is aborted at the next decode step
    (``--request-timeout``); its answer has ``finish_reason.type == "abort"``."""
    image_roots: tuple[str, ...] = ()
    """Directories whose files ``image_data`` may name by path (``--image-root``, repeatable). Empty (the
    default): server paths are refused, and no answer says whether a path exists."""
    drain_seconds: float = 30.0
    """On SIGTERM: stop accepting, give requests in flight this long, then abort the rest (``--drain-seconds``)."""
    max_inflight_body_bytes: int = 256 << 20
    """Request bytes held by the server at once, over every request being received or handled
    (``--max-inflight-body-mb``): a request whose body would pass it is answered 503 (a declared
    ``Content-Length`` is reserved before any byte is read)."""
    body_timeout: float = 60.0
    """Seconds a client may take to send one request's body (``--body-timeout``); past it: 408, the bytes freed."""
    join_timeout: float = 120.0
    """Seconds a ``/init_weights_update_group`` may wait for the group's other ranks (``--join-timeout``). Joins run
    one at a time on a thread of their own (a second while one waits: 409), never on the request path's threads."""


class SamplingBody(BaseModel):
    """SGLang's ``sampling_params`` (the subset vlrl's server implements; others are rejected by name).
    ``logit_bias`` keys are token ids written as strings (SGLang's form); ``top_k`` -1 or SGLang's own default
    (2^30) mean off."""

    model_config = ConfigDict(extra="forbid", strict=True)
    n: int = Field(1, ge=1, le=1024)
    temperature: float = Field(1.0, ge=0, le=MAX_TEMPERATURE, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    top_k: int = Field(-1, ge=-1)
    max_new_tokens: int = Field(128, ge=1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(None, max_length=4096)
    logit_bias: dict[str, float] | None = Field(None, max_length=1 << 20)

    def to_params(self, vocab: int | None = None) -> SamplingParams:
        """As a `SamplingParams`; token ids are checked against ``vocab`` (`BadRequest` naming the field)."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        bias: dict[int, float] = {}
        for key, value in (self.logit_bias or {}).items():
            if not key.strip().isdigit() or (vocab is not None and int(key) >= vocab):
                raise BadRequest(f"field 'sampling_params.logit_bias': key {key[:40]!r} is not a token id"
                                 + (f" in [0, {vocab})" if vocab is not None else ""))
            if value != value or abs(value) == float("inf"):
                raise BadRequest(f"field 'sampling_params.logit_bias': the bias of token {key} is not finite")
            bias[int(key)] = float(value)
        stop_ids = list(self.stop_token_ids or [])
        if any(t < 0 or (vocab is not None and t >= vocab) for t in stop_ids):
            raise BadRequest(f"field 'sampling_params.stop_token_ids': token ids must lie in [0, {vocab})")
        top_k = self.top_k if 0 < self.top_k < SGLANG_TOP_K_OFF else 0
        return SamplingParams(n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=top_k,
                              max_new_tokens=self.max_new_tokens, stop=stop, stop_token_ids=stop_ids, logit_bias=bias)


ImageItem = str | bytes  # a data URL, base64, or a server path; bytes: already decoded by the body parser


class GenerateBody(BaseModel):
    """SGLang's ``GenerateReqInput``: one prompt, or a batch (``text`` / ``input_ids`` a list of prompts, then
    ``image_data`` and ``rid`` one item per prompt) sharing one ``sampling_params``."""

    model_config = ConfigDict(extra="forbid", strict=True)  # (SGLang's schema coerces nothing either: "1" is no id)
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    image_data: ImageItem | list[ImageItem | list[ImageItem | None] | None] | None = None
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


class InitWeightsGroupBody(BaseModel):
    """SGLang's ``InitWeightsUpdateGroupReqInput``: join the trainer's weight-update group."""

    model_config = ConfigDict(extra="forbid")
    master_address: str
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2)
    group_name: str = dist_sync.GROUP_NAME
    backend: str = "nccl"


class UpdateDistributedBody(BaseModel):
    """SGLang's ``UpdateWeightsFromDistributedReqInput``: one bucket of tensors broadcast from the trainer."""

    model_config = ConfigDict(extra="forbid")
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = dist_sync.GROUP_NAME
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None
    torch_empty_cache: bool = False


class PauseBody(BaseModel):
    """SGLang's ``PauseGenerationReqInput`` (`ContinuousBatcher.pause` says what each mode does here)."""

    model_config = ConfigDict(extra="forbid")
    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueBody(BaseModel):
    """SGLang's ``ContinueGenerationReqInput`` (``torch_empty_cache`` is accepted; vlrl serve has no cache to empty)."""

    model_config = ConfigDict(extra="forbid")
    torch_empty_cache: bool = True


class DestroyGroupBody(BaseModel):
    """SGLang's ``DestroyWeightsUpdateGroupReqInput``: leave a weight-update group."""

    model_config = ConfigDict(extra="forbid")
    group_name: str = dist_sync.GROUP_NAME


class BadRequest(ValueError):
    """A malformed request; the message names the field."""


@dataclasses.dataclass(frozen=True)
class PromptBounds:
    """What a prompt is checked against while it is built: the model's context (``None``: unknown), the longest
    text that could fit it (context × the most characters one token covers, so the check never refuses a text
    that fits), the request's ``max_new_tokens``, and the server's `ServeLimits`."""

    context: int | None
    max_text_chars: int | None
    max_new_tokens: int
    limits: ServeLimits


def model_context(policy: Policy) -> int | None:
    """The model's context length (its text config's ``max_position_embeddings``), if it states one."""
    config = policy.model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    value = getattr(text, "max_position_embeddings", None)
    return int(value) if value else None


def longest_token_chars(tokenizer: Any) -> int:
    """The most characters one token of ``tokenizer`` can stand for (vocabulary and added tokens; a byte-level
    token's mapped characters count one per byte, which is at least the characters it decodes to)."""
    longest = max((len(piece.encode("utf-8", "replace")) for piece in tokenizer.get_vocab()), default=1)
    added = [str(t) for t in getattr(tokenizer, "all_special_tokens", [])]
    return max([longest, *(len(t) for t in added)])


def _check_unicode(value: str, field: str) -> None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise BadRequest(f"field '{field}': not valid Unicode (a lone surrogate at character {err.start})") from None


def _server_path(item: str, roots: Sequence[str]) -> str | None:
    """``item`` as a file path when it resolves inside one of ``roots``, else None — decided on the path alone,
    so the answer for a path outside the roots never depends on whether it exists."""
    if not roots or not item.startswith("/") or len(item) > 4096 or "\0" in item:
        return None
    real = os.path.realpath(item)
    for root in roots:
        base = os.path.realpath(root)
        if real.startswith(base.rstrip(os.sep) + os.sep):
            return real
    return None


def _image_source(item: ImageItem, k: int, limits: ServeLimits) -> tuple[str | bytes, bool]:
    """(what `load_image` reads, whether it is a server file) of an ``image_data`` item, or `BadRequest`."""
    where = f"field 'image_data[{k}]'"
    if isinstance(item, bytes):
        return item, False
    if item.startswith(("http://", "https://")):
        raise BadRequest(f"{where}: URLs are not fetched; send a data URL or base64")
    path = _server_path(item, limits.image_roots)
    if path is not None:
        if not os.path.isfile(path):
            raise BadRequest(f"{where}: no such file under the server's image roots")
        return path, True
    payload = item.split(",", 1)[1] if item.startswith("data:") and "," in item else item
    try:
        return base64.b64decode(payload, validate=True), False
    except (binascii.Error, ValueError):
        hint = "" if limits.image_roots else "; the server takes no file paths (vlrl serve --image-root)"
        raise BadRequest(f"{where}: neither a data URL nor valid base64{hint}") from None


def prompt_image_items(body: GenerateBody) -> list[list[ImageItem]]:
    """The ``image_data`` items of each prompt of ``body``, in SGLang's shapes: one prompt takes an item or a list of
    items; a batch takes one entry per prompt — either all items (one image each, ``None`` for none) or, when its
    first entry is a list, all lists (``[]`` or ``None`` for none). SGLang's schema decides the form by the first
    entry, so a batch like ``[None, [url]]`` is refused here as it is there."""
    data = body.image_data
    if not is_batched(body):
        if isinstance(data, list) and not all(isinstance(item, (str, bytes)) for item in data):
            raise BadRequest("field 'image_data': one prompt takes a string or a list of strings")
        return [[data] if isinstance(data, (str, bytes)) else list(data or [])]
    B = prompt_count(body)
    if data is None:
        return [[] for _ in range(B)]
    if not isinstance(data, list) or len(data) != B:
        raise BadRequest(f"field 'image_data': a batch of {B} prompts takes a list of {B} items")
    if isinstance(data[0], list):
        for i, entry in enumerate(data):
            if entry is not None and not isinstance(entry, list):
                raise BadRequest(f"field 'image_data[{i}]': the batch's first entry is a list, so every entry must be "
                                 "a list of that prompt's images ([] or null for none), as SGLang reads it")
        return [[item for item in entry or [] if item is not None] for entry in data]
    for i, entry in enumerate(data):
        if isinstance(entry, list):
            raise BadRequest(f"field 'image_data[{i}]': a list, but the batch's first entry is not one: SGLang reads "
                             "this batch as one image per prompt (make every entry a list, [] for a text-only prompt)")
    return [[] if entry is None else [entry] for entry in data]


def load_request_images(body: GenerateBody, bounds: PromptBounds, adapter: Any) -> list[list[Image.Image]]:
    """Every prompt's decoded images. Before any pixel is decoded, each image's format and size are read from its
    header and checked — each against ``max_image_pixels``, all of them together against ``max_request_pixels``,
    each prompt's vision tokens (from the sizes) against the context. Runs on the server's image thread, off the
    thread that tokenizes (a request of large images never holds up the others' text)."""
    limits, batched = bounds.limits, is_batched(body)
    per_prompt = prompt_image_items(body)
    sources, total = [], 0
    for i, items in enumerate(per_prompt):
        prefix = f"prompt {i} of the batch: " if batched else ""
        found, vision_tokens = [], 0
        for k, item in enumerate(items):
            where = f"{prefix}field 'image_data[{k}]'"
            try:
                source, server_file = _image_source(item, k, limits)
                width, height = image_size(source)
            except BadRequest as err:
                raise BadRequest(f"{prefix}{err}") from None
            except SampleError as err:
                raise BadRequest(f"{where}: {_image_problem(err, server_file)}") from None
            if width * height > limits.max_image_pixels:
                raise BadRequest(f"{where}: {width}x{height} has more than the server's limit of "
                                 f"{limits.max_image_pixels} pixels (--max-image-pixels)")
            total += width * height
            if total > limits.max_request_pixels:
                count = sum(len(x) for x in per_prompt)
                raise BadRequest(f"field 'image_data': the request's {count} image(s) hold more than the server's limit "
                                 f"of {limits.max_request_pixels} pixels in all (--max-request-pixels); send fewer or "
                                 "smaller images per request")
            try:
                vision_tokens += adapter.image_token_count(width, height)
            except ValueError as err:  # a text-only model
                raise BadRequest(f"{where}: {err}") from None
            found.append((source, server_file))
        if bounds.context is not None and vision_tokens + bounds.max_new_tokens > bounds.context:
            raise BadRequest(f"{prefix}field 'image_data': {len(items)} image(s) take {vision_tokens} vision tokens; "
                             f"with sampling_params.max_new_tokens = {bounds.max_new_tokens} that exceeds the model "
                             f"context of {bounds.context} tokens")
        sources.append(found)
    out = []
    for i, found in enumerate(sources):
        prefix = f"prompt {i} of the batch: " if batched else ""
        images = []
        for k, (source, server_file) in enumerate(found):
            try:
                images.append(load_image(source, max_pixels=limits.max_image_pixels))
            except SampleError as err:
                raise BadRequest(f"{prefix}field 'image_data[{k}]': {_image_problem(err, server_file)}") from None
        out.append(images)
    return out


def _image_problem(err: SampleError, server_file: bool) -> str:
    """What is wrong with an image, without echoing a server file's bytes (Pillow's messages can quote them)."""
    message = str(err)
    if "is not accepted" in message:
        return message.split(": ", 1)[-1] if not server_file else "format " + message.split("format ", 1)[-1]
    if server_file:
        return "the file is not a decodable PNG, JPEG, WEBP, BMP or GIF image"
    return "not a decodable PNG, JPEG, WEBP, BMP or GIF image" + (f" ({message.split(': ', 1)[-1][:200]})" if ": " in message else "")


def is_batched(body: GenerateBody) -> bool:
    """Whether ``body`` holds a batch of prompts (SGLang: ``text`` or ``input_ids`` is a list of prompts)."""
    return isinstance(body.text, list) or bool(body.input_ids and isinstance(body.input_ids[0], list))


def prompt_count(body: GenerateBody) -> int:
    if not is_batched(body):
        return 1
    return len(body.text) if body.text is not None else len(body.input_ids)


def build_requests(policy: Policy, body: GenerateBody, rids: collections.abc.Iterator[str],
                   bounds: PromptBounds | None = None, images: list[list[Image.Image]] | None = None) -> list[Request]:
    """Turn a `GenerateBody` into its `Request` (one prompt) or requests (a batch), in order; a prompt
    without ``rid`` is named by ``rids``. With ``bounds``, every prompt is checked against the context (text
    length before tokenizing, prompt + max_new_tokens after). ``images``: each prompt's, decoded by
    `load_request_images` (decoded here when not given)."""
    bounds = bounds or PromptBounds(None, None, 0, ServeLimits())
    if (body.text is None) == (body.input_ids is None):
        raise BadRequest("give exactly one of 'text' or 'input_ids'")
    if body.stream:
        raise BadRequest("field 'stream': streaming is not supported")
    stops = [body.sampling_params.stop] if isinstance(body.sampling_params.stop, str) else body.sampling_params.stop or []
    for k, stop in enumerate(stops):
        _check_unicode(stop, f"sampling_params.stop[{k}]")
    if is_batched(body) and any(isinstance(p, int) for p in body.input_ids or []):
        raise BadRequest("field 'input_ids': a batch is a list of token-id lists")
    if images is None:
        images = load_request_images(body, bounds, policy.adapter)
    if not is_batched(body):
        if isinstance(body.rid, list):
            raise BadRequest("field 'rid': one prompt takes one string")
        return [build_request(policy, body.text, body.input_ids, images[0], body.rid or next(rids), bounds)]
    prompts = body.text if body.text is not None else body.input_ids
    B = len(prompts)
    rid = body.rid if body.rid is not None else [next(rids) for _ in range(B)]
    if not isinstance(rid, list) or len(rid) != B:
        raise BadRequest(f"field 'rid': a batch of {B} prompts takes a list of {B} items")
    out = []
    for i, prompt in enumerate(prompts):
        try:
            text, ids = (prompt, None) if body.text is not None else (None, prompt)
            out.append(build_request(policy, text, ids, images[i], rid[i], bounds))
        except BadRequest as err:
            raise BadRequest(f"prompt {i} of the batch: {err}") from None
    return out


def build_request(policy: Policy, text: str | None, input_ids: list[int] | None, images: list[Image.Image], rid: str,
                  bounds: PromptBounds | None = None) -> Request:
    """One prompt as a `Request` (tokenize ``text``, process its decoded ``images``, expand image tokens)."""
    bounds = bounds or PromptBounds(None, None, 0, ServeLimits())
    _check_unicode(rid, "rid")
    if text is not None:
        if bounds.max_text_chars is not None and len(text) > bounds.max_text_chars:
            raise BadRequest(f"field 'text': {len(text)} characters cannot fit the model context of {bounds.context} "
                             "tokens")
        _check_unicode(text, "text")
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
    if bounds.context is not None and len(ids) + bounds.max_new_tokens > bounds.context:
        raise BadRequest(f"field 'sampling_params.max_new_tokens': {len(ids)} prompt tokens + max_new_tokens "
                         f"{bounds.max_new_tokens} exceed the model context of {bounds.context} tokens")
    sample = Sample(id=rid, task="serve", messages=[{"role": "user", "content": ""}])
    return Request(sample=sample, prompt_ids=ids, vision=vision, images=images)


def _expand_ids(policy: Policy, ids: list[int], vision) -> list[int]:
    """Token ids with image tokens already expanded pass through; one placeholder per image is expanded (by the
    family's adapter: each image's markup as its processor expands it)."""
    return policy.adapter.expand_ids(ids, vision)


def sglang_output(policy: Policy, t: Trajectory, sampling: SamplingParams, *, return_logprob: bool,
                  abort_message: str = "aborted by a weight update") -> dict[str, Any]:
    """One trajectory in the shape of SGLang's ``/generate`` answer."""
    ids = t.response_ids.tolist()
    text = policy.tokenizer.decode(ids, skip_special_tokens=True)
    if t.status is Status.ABORTED:
        finish: dict[str, Any] = {"type": "abort", "message": abort_message}
    elif t.status is Status.TRUNCATED:
        finish = {"type": "length", "length": len(ids)}
    elif ids and (ids[-1] in policy.eos_token_ids or ids[-1] in sampling.stop_token_ids):
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


async def _until_disconnected(receive: collections.abc.Callable) -> None:
    """Return when the client closes its connection (the body was read: the next message is the disconnect)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _answer_or_abandon(receive: collections.abc.Callable, future: concurrent.futures.Future) -> list[Trajectory] | None:
    """The job's trajectories, or None if the client went away first — then the job's future is cancelled,
    which stops its rows at the batcher's next decode step."""
    answer = asyncio.wrap_future(future)
    gone = asyncio.ensure_future(_until_disconnected(receive))
    try:
        done, _ = await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
        if answer in done:
            return answer.result()
        future.cancel()
        return None
    finally:
        gone.cancel()
        if not future.done():  # this handler was cancelled (shutdown backstop): stop decoding for nobody
            future.cancel()


ADMIN_PATHS = ("/update_weights_from_disk", "/init_weights_update_group", "/update_weights_from_distributed",
               "/destroy_weights_update_group", "/pause_generation", "/continue_generation")
"""The routes an admin key guards when one is set (SGLang's ``ADMIN_OPTIONAL`` routes among those vlrl serves)."""


def create_app(batcher: ContinuousBatcher, *, api_key: str | None, model_path: str = "",
               limits: ServeLimits = ServeLimits(), admin_api_key: str | None = None) -> Any:
    """The FastAPI application serving ``batcher``. ``api_key=None`` disables authentication; ``admin_api_key``
    (SGLang's ``--admin-api-key``): the key `ADMIN_PATHS` require instead of ``api_key``.

    Every request is bounded before it is admitted (`ServeLimits`, the batcher's queue and token budget; the body's
    bytes and read time, and the bytes of every request held at once); JSON parsing runs off the event loop
    (`BodyParser`), image decoding on an image thread, tokenizing on one preprocessing thread, weight loads and
    group joins on threads of their own, so ``/health`` and ``/generate`` answer while any request is being read,
    parsed, prepared or decoded, or any weight call waits. A client that disconnects cancels its job (its rows stop
    at the next decode step); ``app.state.on_drain`` is what SIGTERM calls (no new requests; the rest aborted after
    ``limits.drain_seconds``)."""
    from fastapi import FastAPI
    from fastapi import Request as HTTPRequest
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from pydantic import ValidationError

    class SafeJSON(JSONResponse):
        def render(self, content: Any) -> bytes:
            return encode_json(content)

    app = FastAPI(title="vlrl rollout server", default_response_class=SafeJSON)
    counter = iter(range(1 << 62))
    context = model_context(batcher.policy)
    max_text_chars = context * longest_token_chars(batcher.policy.tokenizer) if context else None
    budget = batcher.max_tokens_in_flight
    vocab = batcher.policy.model.get_input_embeddings().num_embeddings
    parser = BodyParser(max_values=(budget if budget is not None else 1 << 22) + 65_536,
                        max_string_chars=max_text_chars or 1 << 24)
    prep = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="vlrl-prep")  # one tokenizer user
    images = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="vlrl-images")
    state = {"draining": False}

    def close() -> None:
        parser.close()
        prep.shutdown(wait=False, cancel_futures=True)
        images.shutdown(wait=False, cancel_futures=True)

    on_close(app, close)
    protect(app, api_key=api_key, max_body_bytes=limits.max_body_bytes, setting="vlrl serve --max-body-mb",
            admin_api_key=admin_api_key, admin_paths=ADMIN_PATHS, max_inflight_bytes=limits.max_inflight_body_bytes,
            body_timeout=limits.body_timeout)

    def on_drain() -> None:
        state["draining"] = True
        weights.on_drain()
        timer = threading.Timer(limits.drain_seconds, batcher.abort_all)
        timer.daemon = True
        timer.start()

    app.state.on_drain = on_drain

    async def in_pool(pool: concurrent.futures.Executor, fn: collections.abc.Callable, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    async def read(request: HTTPRequest, model: type[BaseModel], base64_fields: tuple[str, ...] = ()) -> Any:
        content_type = request.headers.get("content-type", "")
        if "json" not in content_type:
            raise BadRequest("the body must be a JSON object sent with Content-Type: application/json")
        try:
            payload = await parser.parse(await request.body(), base64_fields=base64_fields)
        except BodyError as err:
            raise BadRequest(str(err)) from None
        if not isinstance(payload, dict):
            raise BadRequest("the body must be a JSON object sent with Content-Type: application/json")
        try:
            return await asyncio.to_thread(model.model_validate, payload)
        except ValidationError as err:
            raise BadRequest(_explain(err)) from None

    weights = _WeightRoutes(batcher, limits, read, SafeJSON)
    app.state.weights = weights
    on_close(app, weights.close)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: HTTPRequest, err: RequestValidationError):
        return SafeJSON({"error": _explain(err)}, 400)

    @app.exception_handler(BadRequest)
    async def _bad(request: HTTPRequest, err: BadRequest):
        return SafeJSON({"error": str(err)}, 400)

    @app.exception_handler(ShuttingDown)
    async def _stopping(request: HTTPRequest, err: ShuttingDown):
        return SafeJSON({"success": False, "message": "the server is shutting down"}, 503)

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
                "vocab_size": vocab, "context_length": context,
                "max_batch_size": batcher.max_batch_size, "max_queued_requests": batcher.max_queued_requests,
                "max_tokens_in_flight": budget, "max_new_tokens": limits.max_new_tokens,
                "max_body_bytes": limits.max_body_bytes, "max_image_pixels": limits.max_image_pixels,
                "max_request_pixels": limits.max_request_pixels,
                "queued_requests": batcher.queued(), "tokens_in_flight": batcher.tokens_in_flight,
                "batches": batcher.batches, "rows": batcher.rows, "decode_steps": batcher.decode_steps,
                "early_stops": len(batcher.early_stops), "cancelled": batcher.cancelled, "paused": batcher.paused,
                "weight_groups": weights.groups(), "server": "vlrl"}

    @app.get("/server_info")
    async def server_info():
        """SGLang's ``/server_info`` fields (what a launch fixed: parallel sizes, dtype, batch bound), then vlrl's."""
        info = await model_info()
        sglang = {"served_model_name": info["model_path"], "version": "vlrl", "internal_states": [],
                  "tp_size": 1, "dp_size": 1, "pp_size": 1, "max_running_requests": batcher.max_batch_size}
        if context is not None:
            sglang["max_context_length"] = context
        return {**info, **sglang}

    @app.get("/get_weight_version")
    async def get_weight_version():
        return {"weight_version": str(batcher.version[0])}

    async def generate(request: HTTPRequest):  # (a plain Starlette route: the raw body is read, not injected)
        if state["draining"]:
            return SafeJSON({"error": "server busy: shutting down"}, 503, headers={"Retry-After": "1"})
        body = await read(request, GenerateBody, base64_fields=("image_data",))
        sampling = body.sampling_params.to_params(vocab)
        new_tokens, prompts = sampling.max_new_tokens, prompt_count(body)
        if new_tokens > limits.max_new_tokens:
            raise BadRequest(f"field 'sampling_params.max_new_tokens': {new_tokens} exceeds the server's limit of "
                             f"{limits.max_new_tokens} (vlrl serve --max-new-tokens)")
        if context is not None and new_tokens >= context:
            raise BadRequest(f"field 'sampling_params.max_new_tokens': {new_tokens} leaves no room for a prompt in the "
                             f"model context of {context} tokens")
        if prompts * sampling.n > batcher.max_queued_requests:
            raise BadRequest(f"field 'sampling_params.n': {prompts} prompt(s) × n = {sampling.n} is "
                             f"{prompts * sampling.n} samples; the server queues at most {batcher.max_queued_requests} "
                             "(vlrl serve --max-queued-requests)")
        bounds = PromptBounds(context, max_text_chars, new_tokens, limits)
        rids = (f"req-{i}" for i in counter)
        decoded = await in_pool(images, load_request_images, body, bounds, batcher.policy.adapter)
        requests = await in_pool(prep, build_requests, batcher.policy, body, rids, bounds, decoded)
        tokens = sum(sampling.n * (len(r.prompt_ids) + new_tokens) for r in requests)
        deadline = time.monotonic() + limits.request_timeout
        try:  # one job: a batch's prompts decode together
            future = batcher.submit(requests, sampling, tokens=tokens, deadline=deadline)
        except TooLargeError as err:
            raise BadRequest(f"field 'sampling_params': {err}") from None
        except QueueFullError as err:
            return SafeJSON({"error": f"server busy: {err}"}, 503, headers={"Retry-After": "1"})
        trajectories = await _answer_or_abandon(request.receive, future)
        if trajectories is None:  # the client is gone (counted in batcher.cancelled): nobody reads an answer
            return SafeJSON({"error": "client disconnected"}, 499)
        why = ("the server shut down" if state["draining"] else "the request's deadline passed"
               if time.monotonic() >= deadline - 1e-3 else "aborted by a weight update")

        def answers() -> list[dict[str, Any]]:
            policy = batcher.policy
            return [sglang_output(policy, t, sampling, return_logprob=body.return_logprob, abort_message=why)
                    for t in trajectories]

        out = await in_pool(prep, answers)
        return SafeJSON(out if is_batched(body) or sampling.n > 1 else out[0])  # a batch: prompt-major, n per prompt

    app.router.add_route("/generate", generate, methods=["POST"])
    for path, route in weights.routes().items():
        app.router.add_route(path, route, methods=["POST"])
    return app


async def in_daemon_thread(fn: collections.abc.Callable, *args: Any, name: str, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` on a daemon thread of its own, awaited. Not asyncio's default pool (a blocking call
    there starves every other use of it, and an interpreter exits only once that pool's threads end): a call that
    blocks for long holds only its own thread, and never delays the process's exit."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle_future(result: Any, error: BaseException | None) -> None:
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(result)

    def target() -> None:
        try:
            result, error = fn(*args, **kwargs), None
        except BaseException as err:  # noqa: BLE001 — handed to the awaiting coroutine
            result, error = None, err
        try:
            loop.call_soon_threadsafe(settle_future, result, error)
        except RuntimeError:  # the loop closed meanwhile (shutdown): nobody waits for the answer
            pass

    threading.Thread(target=target, name=name, daemon=True).start()
    return await future


class ShuttingDown(RuntimeError):
    """A weight call the server's shutdown answered before its thread finished (503)."""


class _WeightRoutes:
    """`vlrl serve`'s weight routes, SGLang's: load from disk, join / leave a weight-update group, receive a bucket,
    pause and continue generation. Loads and bucket receives run one at a time (the update lock) on daemon threads;
    a join runs on its own daemon thread, one at a time (a second while one waits: 409) and for at most
    ``limits.join_timeout`` — so joins aimed at a port nobody serves hold one thread, not the request path's pool,
    and never the server's exit. At shutdown (`on_drain`) every weight call still waiting is answered 503 at once.
    """

    def __init__(self, batcher: ContinuousBatcher, limits: ServeLimits, read: Any, answer: Any) -> None:
        self.batcher, self.limits, self.read, self.answer = batcher, limits, read, answer
        self.names: dict[str, Any] = {}  # checkpoint → state-dict names of the served model, found at the first update
        self.lock = asyncio.Lock()  # one weight change at a time
        self.joining = threading.Lock()  # held by the join in progress (its thread releases it)
        self.device = next(batcher.policy.model.parameters()).device
        self.receiver = dist_sync.Receiver(timeout=limits.request_timeout, device=self.device)
        self.incoming = _IncomingUpdate(batcher, self.names)
        self.waiting: set[tuple[asyncio.AbstractEventLoop, asyncio.Task]] = set()
        self.stopping = False

    def on_drain(self) -> None:
        """Shutdown: answer every weight call still waiting for its thread (its thread, a daemon, ends by itself)."""
        self.stopping = True
        for loop, task in list(self.waiting):
            try:
                loop.call_soon_threadsafe(task.cancel)
            except RuntimeError:  # its loop already closed
                pass

    async def _off_loop(self, fn: collections.abc.Callable, *args: Any, name: str, **kwargs: Any) -> Any:
        """``fn`` on a daemon thread (`in_daemon_thread`), awaited — `ShuttingDown` if the server drains first."""
        task = asyncio.ensure_future(in_daemon_thread(fn, *args, name=name, **kwargs))
        entry = (asyncio.get_running_loop(), task)
        self.waiting.add(entry)
        try:
            if self.stopping:
                task.cancel()
            return await task
        except asyncio.CancelledError:
            if self.stopping:
                raise ShuttingDown from None
            raise
        finally:
            self.waiting.discard(entry)

    def routes(self) -> dict[str, Any]:
        return {"/update_weights_from_disk": self.update_from_disk, "/init_weights_update_group": self.init_group,
                "/update_weights_from_distributed": self.update_distributed,
                "/destroy_weights_update_group": self.destroy_group, "/pause_generation": self.pause,
                "/continue_generation": self.resume}

    def groups(self) -> list[str]:
        with self.receiver._lock:
            return sorted(self.receiver.groups)

    def close(self) -> None:
        self.receiver.close()

    async def update_from_disk(self, request: Any):
        body = await self.read(request, UpdateWeightsBody)
        batcher = self.batcher
        try:
            version = int(body.weight_version) if body.weight_version is not None else batcher.version[0] + 1
        except ValueError:
            raise BadRequest(f"field 'weight_version': vlrl versions are integers, got {body.weight_version!r}") from None
        async with self.lock:
            self.incoming.cancel()  # a distributed update left half-way (its trainer fell back to disk): superseded
            try:
                checksum = await self._off_loop(_update_from_disk, batcher, body.model_path, version=version,
                                                abort=body.abort_all_requests, names=self.names, name="vlrl-load")
            except (OSError, ValueError) as err:  # (the version loaded before stays: `ContinuousBatcher.give_back`)
                return self.answer({"success": False, "message": f"cannot load {body.model_path}: {err}"}, 400)
        return self.answer({"success": True, "message": f"loaded {body.model_path} as version {version}",
                            "num_paused_requests": 0, "weight_version": str(version), "weight_checksum": checksum})

    async def init_group(self, request: Any):
        body = await self.read(request, InitWeightsGroupBody)
        if body.backend not in ("gloo", "nccl"):
            raise BadRequest(f"field 'backend': {body.backend!r}; vlrl serve joins over gloo (CPU) or nccl (CUDA)")
        if body.backend == "nccl" and self.device.type != "cuda":
            raise BadRequest(f"field 'backend': nccl needs a CUDA server; this one runs on {self.device.type}: use gloo")
        if body.rank_offset >= body.world_size:
            raise BadRequest(f"field 'rank_offset': {body.rank_offset} is not a rank of a group of {body.world_size}")
        if not self.joining.acquire(blocking=False):
            return self.answer({"success": False, "message": "a weight-update group join is already in progress (one "
                                "at a time; it ends within --join-timeout)"}, 409)
        try:
            async with self.lock:
                self.incoming.cancel()  # the trainer forms a new group: an update half-way on the old one never ends
        except BaseException:
            self.joining.release()
            raise
        where = f"{body.group_name} at {body.master_address}:{body.master_port}"
        try:  # blocks until every rank joined: not under the update lock, so a join that never completes (a member
            # died first) cannot hold up a disk update; the thread lets the next join in when it ends
            await self._off_loop(self._join, body, name="vlrl-join")
        except ShuttingDown:
            raise
        except Exception as err:
            return self.answer({"success": False, "message": f"cannot join {where}: {type(err).__name__}: {err}"}, 400)
        return self.answer({"success": True, "message": f"joined {body.group_name} as rank {body.rank_offset} of "
                            f"{body.world_size}"})

    def _join(self, body: InitWeightsGroupBody) -> None:
        try:
            self.receiver.join(body.master_address, body.master_port, rank_offset=body.rank_offset,
                               world_size=body.world_size, group_name=body.group_name, backend=body.backend,
                               timeout=self.limits.join_timeout)
        finally:
            self.joining.release()

    def _receive_bucket(self, body: UpdateDistributedBody, version: int | None) -> str | None:
        """One bucket, received into the spare weights (`_IncomingUpdate`); the last bucket (``version`` set)
        installs them. Returns the checksum then, else None."""
        self.incoming.receive(self.receiver, body)
        return self.incoming.finish(version) if version is not None else None

    async def update_distributed(self, request: Any):
        body = await self.read(request, UpdateDistributedBody)
        try:
            version = int(body.weight_version) if body.weight_version is not None else None
        except ValueError:
            raise BadRequest(f"field 'weight_version': vlrl versions are integers, got {body.weight_version!r}") from None
        async with self.lock:
            try:
                checksum = await self._off_loop(self._receive_bucket, body, version, name="vlrl-receive")
            except ShuttingDown:
                raise
            except (OSError, ValueError, RuntimeError) as err:
                self.incoming.cancel()  # a failed update leaves nothing half-written behind
                return self.answer({"success": False, "message": f"distributed update failed: {err}"}, 400)
        if checksum is None:  # a bucket of the update in progress
            return self.answer({"success": True, "message": f"received {len(body.names)} tensor(s)"})
        return self.answer({"success": True, "message": f"loaded version {version} from {body.group_name}",
                            "num_paused_requests": 0, "weight_version": str(version), "weight_checksum": checksum})

    async def destroy_group(self, request: Any):
        body = await self.read(request, DestroyGroupBody)
        async with self.lock:
            self.incoming.cancel()
            left = self.receiver.leave(body.group_name)
        if not left:
            return self.answer({"success": False, "message": "The group to be destroyed does not exist."}, 400)
        return self.answer({"success": True, "message": f"left {body.group_name}"})

    async def pause(self, request: Any):
        body = await self.read(request, PauseBody)
        self.batcher.pause(body.mode)
        return self.answer({"message": "Generation paused successfully.", "status": "ok"})

    async def resume(self, request: Any):
        await self.read(request, ContinueBody)
        self.batcher.resume()
        return self.answer({"message": "Generation continued successfully.", "status": "ok"})


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


class _IncomingUpdate:
    """The distributed update a server is receiving, into its spare weights (`ContinuousBatcher.take_spare`, taken at
    the first bucket): a flattened bucket whose layout the spare can hold in place (`FlatBuckets`: same names,
    shapes and dtypes as its tensors) is received straight into the spare's own storage, any other into the
    receiver's buffer and copied in (cast). The last bucket checks every tensor came and installs them as its version — no
    batch sees half an update, nothing is staged. Used under the server's update lock."""

    def __init__(self, batcher: ContinuousBatcher, names: dict[str, Any]) -> None:
        self.batcher, self.names = batcher, names
        self.spare: Policy | None = None
        self.writer: WeightWriter | None = None
        self.started = False  # a bucket's receive began: the spare's bytes may have changed
        self.abort = False
        self.in_place: weakref.WeakKeyDictionary[torch.nn.Module, FlatBuckets] = weakref.WeakKeyDictionary()

    def receive(self, receiver: dist_sync.Receiver, body: UpdateDistributedBody) -> None:
        """Receive one bucket (checkpoint names, or state-dict names) into the spare weights."""
        if "names" not in self.names:
            self.names["names"] = checkpoint_names(self.batcher.policy.model)
        renames = self.names["names"]
        if renames is None:
            raise ValueError("this model's checkpoint layout is more than a renaming of its tensors; load its weights "
                             "with /update_weights_from_disk (rollout.weight_sync=disk)")
        if self.spare is None:
            self.spare = self.batcher.take_spare()
            self.writer = WeightWriter(self.spare.model)
        names = [renames.get(k, k) for k in body.names]
        flats = self.in_place.setdefault(self.spare.model, FlatBuckets(self.spare.model))
        placed: list = []

        def place(dtypes: list[torch.dtype]) -> torch.Tensor | None:  # (called once the request was checked)
            self.started = True
            placed.append(flats.storage(names, dtypes, body.shapes) if len(names) == len(dtypes) else None)
            placed.append(dtypes)
            return placed[0][0] if placed[0] is not None else None

        received = receiver.receive(body.group_name, body.names, body.dtypes, body.shapes,
                                    load_format=body.load_format, place=place)
        if placed and placed[0] is not None:  # already in the spare's storage
            flat, fresh = placed[0]
            if fresh:
                flats.adopt(names, placed[1], body.shapes, flat)
            self.writer.written_in_place(names)
        else:
            self.started = True
            self.writer.write(dict(zip(names, received, strict=True)))
        self.abort = self.abort or body.abort_all_requests

    def finish(self, version: int) -> str:
        """Install the update as ``version`` (every tensor must have come); returns its checksum."""
        spare, writer, abort = self.spare, self.writer, self.abort
        if spare is None or writer is None:
            raise ValueError("no tensors received for this update")
        try:
            writer.finish()
        except BaseException:
            self.cancel()
            raise
        self.spare, self.writer, self.abort, self.started = None, None, False, False
        return self.batcher.load(spare, version=version, abort=abort)

    def cancel(self) -> None:
        """Drop the update in progress (if any); its spare weights go back to the batcher (as the version they held,
        if no bucket's receive had begun)."""
        if self.spare is not None:
            self.batcher.give_back(self.spare, intact=not self.started)
        self.spare, self.writer, self.abort, self.started = None, None, False, False


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


def encode_image(image: Image.Image) -> str:
    """A PNG data URL, the form the HTTP engine sends images in."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
