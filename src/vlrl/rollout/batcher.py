"""`ContinuousBatcher`: batch-level continuous batching over a `Policy` on one worker thread — the core of vlrl's
reference server (`vlrl.rollout.server`) and of the in-process asynchronous engine
(`vlrl.rollout.threaded_engine.ThreadedEngine`).

Requests that arrive while a batch decodes join the next batch. A weight load never waits for a batch: the new
weights are loaded beside the old ones and swapped in at the next batch boundary, so a batch that was decoding
finishes on the old weights and is tagged with the old version. With ``abort`` the queued requests and the decoding
batch are answered as ABORTED instead (the client re-queues them). A pause in mode ``partial`` (partial rollout,
`ContinuousBatcher.pause`) interrupts the decoding batch instead: every unfinished row keeps its tokens and goes on
after the pause from where it stopped, on the weights loaded meanwhile; each token carries the version that sampled it
(`Trajectory.token_versions`).
"""

from __future__ import annotations

import collections
import collections.abc
import concurrent.futures
import copy
import dataclasses
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from vlrl.models.policy import Policy
from vlrl.rollout.hf_engine import HFEngine
from vlrl.rollout.prompt_logprobs import score_prompts
from vlrl.rollout.types import Request, SamplingParams, Status, Trajectory
from vlrl.rollout.weights import WeightLoadError, copy_weights, weight_checksum

log = logging.getLogger(__name__)


PAUSE_MODES = ("abort", "retract", "in_place", "partial")
REJOIN_SECONDS = 0.1  # partial rollout: how long continued answers wait for new prompts to decode with (`_gather`)
"""What `ContinuousBatcher.pause` does with the decoding batch (SGLang's three, and vlrl's partial rollout)."""


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
    interrupted: bool = False  # by a pause with mode partial: stops, its rows keep their tokens and go on after it
    kept: list[Trajectory] | None = None  # partial: every row's response so far (None until first interrupted)
    continuing: list[int] = dataclasses.field(default_factory=list)  # partial: the rows of ``kept`` still to decode
    continuations: list[Request] = dataclasses.field(default_factory=list)  # ... each as prompt + its kept tokens
    cancel_step: int | None = None  # the batcher's decode step at which the future was cancelled (client gone)
    stop_step: int | None = None  # the decode step at which its rows stopped decoding early
    logprob_start: list[int] | None = None  # per request: score its prompt after this token (SGLang logprob_start_len)
    prompt_logp: list[torch.Tensor] | None = None  # ... those scores (`score_prompts`), on the weights of its answer

    @property
    def rows(self) -> int:
        """Sequences its next decode holds: prompts × n, or the rows an interruption left unfinished."""
        return len(self.continuations) if self.kept is not None else len(self.requests) * self.sampling.n

    def decode_rows(self) -> list[Request]:
        """One request per sequence its next decode holds: each prompt n times (prefilled once: a group's rows are
        one object), or each unfinished row's continuation."""
        if self.kept is not None:
            return self.continuations
        return [r for r in self.requests for _ in range(self.sampling.n)]

    def should_stop(self, now: float) -> bool:
        return (self.aborted or self.retracted or self.interrupted or self.future.cancelled()
                or (self.deadline is not None and now > self.deadline))

    def past_deadline(self) -> bool:
        return self.deadline is not None and time.monotonic() > self.deadline

    def keep(self, rows: list[Trajectory], tokenizer: Any) -> bool:
        """Partial rollout: this decode's ``rows`` joined to what the job kept; True when some row is unfinished
        (stopped by the interruption before its end), which is then to decode again from its prompt and the tokens
        it kept, with the budget it has left."""
        kept = self.joined(rows, tokenizer)
        budget = self.sampling.max_new_tokens
        unfinished = [i for i, t in enumerate(kept) if t.status is Status.TRUNCATED and len(t.response_ids) < budget]
        self.kept, self.continuing, self.interrupted, self.stop_step = kept, unfinished, False, None
        self.continuations = [continuation(self.requests[i // self.sampling.n], kept[i], budget) for i in unfinished]
        return bool(unfinished)

    def joined(self, rows: list[Trajectory], tokenizer: Any) -> list[Trajectory]:
        """Every row of the job: this decode's ``rows`` (all of them, or the continued ones joined to their kept
        tokens), each with its index in the job's group (``group_index``: its prompt among the job's)."""
        if self.kept is None:
            out = list(rows)
        else:
            out = list(self.kept)
            for row, after in zip(self.continuing, rows, strict=True):
                out[row] = join(out[row], after, tokenizer)
        for i, t in enumerate(out):
            t.group_index = i // self.sampling.n
        return out


@dataclasses.dataclass(frozen=True)
class EarlyStop:
    """A job whose rows stopped before the end of their batch: ``why`` (``cancelled`` — its client went away —,
    ``deadline`` or ``aborted``), the decode step at which that was asked (for a cancel) and the one at which
    its rows stopped (`ContinuousBatcher.decode_steps` counts steps)."""

    why: str  # cancelled | deadline | aborted | retracted | interrupted
    asked_step: int | None
    stopped_step: int


def sampling_key(sampling: SamplingParams) -> tuple:
    """What decides whether two jobs may decode in one batch: every field of their `SamplingParams`."""
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


def continuation(request: Request, kept: Trajectory, max_new_tokens: int) -> Request:
    """What a row interrupted by a weight update decodes next: its prompt followed by the tokens it kept (prefilled on
    the new weights — no token is sampled again), with the budget it has left."""
    return Request(sample=request.sample, prompt_ids=[*request.prompt_ids, *kept.response_ids.tolist()],
                   vision=request.vision, images=request.images,
                   max_new_tokens=max_new_tokens - len(kept.response_ids))


def join(before: Trajectory, after: Trajectory, tokenizer: Any) -> Trajectory:
    """A row's kept tokens (``before``) followed by what its continuation sampled (``after``): every response tensor
    concatenated, each token with the version that sampled it, tagged with the oldest; the continuation's status."""
    ids = torch.cat([before.response_ids, after.response_ids])
    return Trajectory(
        sample=before.sample, prompt_ids=before.prompt_ids, response_ids=ids,
        loss_mask=torch.cat([before.loss_mask, after.loss_mask]),
        behaviour_logp=torch.cat([before.behaviour_logp, after.behaviour_logp]),
        vision=before.vision, images=before.images, weight_version=min(before.weight_version, after.weight_version),
        status=after.status, response_text=tokenizer.decode(ids, skip_special_tokens=True),
        group_index=before.group_index, token_versions=torch.cat([before.versions, after.versions]))


def prefilled(requests: Sequence[Request], version: int) -> list[Trajectory]:
    """The answers of a prefill-only job (``max_new_tokens`` 0, SGLang's scoring request): nothing sampled, finished
    by length (SGLang's ``FINISH_LENGTH(length=0)``)."""
    return [Trajectory(sample=r.sample, prompt_ids=torch.as_tensor(r.prompt_ids, dtype=torch.long),
                       response_ids=torch.zeros(0, dtype=torch.long), loss_mask=torch.zeros(0, dtype=torch.long),
                       behaviour_logp=torch.zeros(0), vision=r.vision, images=r.images, weight_version=version,
                       status=Status.TRUNCATED)
            for r in requests]


def with_prompt_logp(job: _Job, trajectories: list[Trajectory]) -> list[Trajectory]:
    """``trajectories`` (prompt-major, n per request) with their prompt's scores, if the job asked for them."""
    if job.prompt_logp is not None:
        for i, t in enumerate(trajectories):
            t.prompt_logp = job.prompt_logp[i // job.sampling.n]
    return trajectories


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
    keeps the last of them (for metrics and tests). A batch that fails is decoded again job by job, so a job that
    cannot be decoded fails alone (its future gets the error) and the others of its batch still get their answers.
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
        self.retried_batches = 0  # batches that failed and were decoded again job by job
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
               deadline: float | None = None, logprob_start: Sequence[int] | None = None) -> concurrent.futures.Future:
        """Queue a job; its future gives ``len(requests) × n`` trajectories. ``tokens``: what it holds against
        ``max_tokens_in_flight``; ``deadline``: a ``time.monotonic()`` past which it is aborted. Cancel the
        future to abort the job (it stops at the next decode step). ``logprob_start`` (one per request): its
        prompt's tokens after that one are scored on the weights that answer it (`Trajectory.prompt_logp`).
        ``sampling.max_new_tokens == 0``: prefill only (SGLang's scoring request): nothing is sampled."""
        job = _Job(list(requests), sampling, concurrent.futures.Future(), tokens=tokens, deadline=deadline,
                   logprob_start=list(logprob_start) if logprob_start is not None else None)
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
        weights only between batches), tagged with their version; ``partial`` (vlrl's; partial rollout) — it stops at
        its next decode step, every unfinished row keeps its tokens, and its jobs go back to the head of the queue to
        go on after `resume` from where they stopped, on the weights loaded meanwhile (each token tagged with the
        version that sampled it: `Trajectory.token_versions`). Queued jobs wait (their deadline still runs)."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r}: {', '.join(PAUSE_MODES)}")
        dropped: list[_Job] = []
        with self._cond:
            self.paused = mode
            if mode == "abort":
                dropped = self._abort_locked()
            elif mode == "retract":
                for job in self._running:
                    job.retracted = True
            elif mode == "partial":
                for job in self._running:
                    job.interrupted = True
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
                if self._pending and not self.paused:  # (an abort may have emptied the queue, a pause come, meanwhile)
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
        keep arriving less than ``batch_window`` seconds apart (requests of one client burst join one batch). Partial
        rollout: when only answers continued after an update are queued, wait up to ``REJOIN_SECONDS`` for the
        prompts the client sends on the new version, so the long answers decode in one batch with them instead of
        alone ahead of them."""
        deadline = time.monotonic() + REJOIN_SECONDS
        while (self._pending and all(job.kept is not None for job in self._pending) and not self._closed
               and (left := deadline - time.monotonic()) > 0):
            self._cond.wait(left)
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

    @staticmethod
    def _score(engine: HFEngine, jobs: list[_Job]) -> None:
        """Score the prompts of the ``jobs`` that asked (`score_prompts`; all of them in one call), once per job."""
        wanting = [job for job in jobs if job.logprob_start is not None and job.prompt_logp is None]
        if not wanting:
            return
        scores = iter(score_prompts(engine.policy, [r for job in wanting for r in job.requests],
                                    [s for job in wanting for s in job.logprob_start]))
        for job in wanting:
            job.prompt_logp = [next(scores) for _ in job.requests]

    def _run(self, engine: HFEngine, jobs: list[_Job]) -> None:
        jobs = [job for job in jobs if not job.future.cancelled()]  # (cancelled while the batch was formed)
        if not jobs:
            return
        rows = {id(job): job.decode_rows() for job in jobs}  # each job's sequences, one request per row (n = 1)
        owners = {id(r): job for job in jobs for r in rows[id(job)]}
        try:
            out = (engine.generate([r for job in jobs for r in rows[id(job)]], dataclasses.replace(jobs[0].sampling, n=1),
                                   on_step=self._on_step(owners))
                   if jobs[0].sampling.max_new_tokens > 0 else prefilled([r for job in jobs for r in rows[id(job)]],
                                                                         engine.weight_version))
            self._score(engine, jobs)
        except Exception as err:  # a bad batch fails its own requests, never the server
            if len(jobs) > 1:  # one bad job must not fail the others: each is decoded again on its own
                log.warning("a batch of %d jobs failed (%s: %s); retrying them one by one", len(jobs),
                            type(err).__name__, str(err)[:200])
                self.retried_batches += 1
                for job in jobs:
                    self._run(engine, [job])
                return
            log.exception("generation failed")
            settle(jobs[0].future, error=err)
            return
        requeue, start, tokenizer = [], 0, engine.policy.tokenizer
        for job in jobs:
            mine = out[start : start + len(rows[id(job)])]
            start += len(rows[id(job)])
            live = not job.aborted and not job.future.cancelled()
            if job.retracted and live:  # decoded again from its prompt after the pause
                self.early_stops.append(EarlyStop("retracted", None, job.stop_step or self.decode_steps))
                job.retracted, job.stop_step, job.prompt_logp = False, None, None  # (scored again on its new weights)
                requeue.append(job)
            elif job.interrupted and live and not job.past_deadline():  # partial: its rows go on from their tokens
                if job.stop_step is not None:
                    self.early_stops.append(EarlyStop("interrupted", None, job.stop_step))
                if job.keep(mine, tokenizer):
                    requeue.append(job)
                else:  # every row had ended before the interruption reached it
                    settle(job.future, with_prompt_logp(job, job.kept))
            elif job.stop_step is not None or job.aborted:
                if job.stop_step is not None:
                    why = "cancelled" if job.future.cancelled() else "aborted" if job.aborted else "deadline"
                    self.early_stops.append(EarlyStop(why, job.cancel_step, job.stop_step))
                settle(job.future, aborted_trajectories(job.requests, job.sampling.n, engine.weight_version))
            else:
                settle(job.future, with_prompt_logp(job, job.joined(mine, tokenizer)))
        if requeue:
            with self._cond:
                closed = self._closed
                if not closed:
                    self._pending.extendleft(reversed(requeue))
                    self._cond.notify_all()
            for job in requeue if closed else ():
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
