"""The synthesis server (`vlrl synth serve`): foreground-preserving image synthesis as an asynchronous job API.

The Syn-GRPO data server (seed §3.3.1, "Decoupled design"): the trainer posts a job — the source image, the
boxes (or masks) to keep, the new description, a seed — and goes on training; it polls later and swaps the
result into its dataset. JSON over HTTP (FastAPI + uvicorn):

- ``POST /jobs`` → 202 ``{"id", "status": "queued", "queued"}``; 429 when the queue is full or the client holds
  its share of it (back-pressure, with ``Retry-After``); 400 naming the field for a bad image (format: PNG, JPEG, WEBP, BMP or GIF; size), box
  (bounds, order), mask, description or seed; 413 for a body over ``max_body_bytes`` (counted on the bytes
  received: a chunked body too); 500 with an error id for anything unexpected.
- ``GET /jobs/{id}`` → ``{"id", "status": queued | running | done | failed, "error": {"kind": timeout | error |
  worker_died, "message"} | null, "metadata", "created", "started", "finished", "seconds", "image"}`` with the
  result as a PNG data URL when done (``?image=false`` leaves it out); 404 for an unknown id, 410 when the
  result was evicted by the size cap. ``GET /jobs/{id}/image`` → the PNG itself.
- ``GET /jobs?ids=a,b,c`` → ``{"jobs": [{"id", "status", "error", "metadata"}, ...]}`` (``unknown`` for ids it
  does not know; metadata once done): one request polls every job a client has in flight.
- ``GET /health`` → back-end, queue and result-store counters (the only endpoint without the token).

Jobs wait in a bounded queue (``max_queued_jobs``) for one of ``workers`` workers. The queue is shared fairly
between clients: one client may hold at most ``max_queued_per_client`` queued jobs (default a quarter of the
queue), and the workers take jobs round-robin across the clients that have some, so a client's flood neither
fills the queue for the others (their jobs are still admitted) nor delays their jobs behind its own. A client
is its bearer token, its address and — on loopback — its process (``sha256(token)[:8]@host#pid``, the peer
process read from ``/proc``): with one shared key, clients on different hosts are told apart by their address and
local processes by their PID; the processes of one remote host share a share. With ``executor="process"``
(the default of the command) each worker is a process that builds the back-end once (pebble pool,
forkserver) and is killed and replaced when a job exceeds ``job_timeout``; with ``executor="thread"`` jobs run
in threads of this process (cheap to start: tests, notebooks) and a job over its timeout is marked failed
and its result discarded, but cannot be stopped. Results are PNG files in ``results_dir``; past
``max_results_bytes`` the oldest results are deleted (their jobs answer 410). Binds to loopback and requires
``Authorization: Bearer <key>`` by default (`vlrl.serving`).

This module holds the settings, the job queue and its workers (`SynthService`) and the command (`serve`); the
HTTP application is `vlrl.synth.app`, the job body and its checks `vlrl.synth.schema` (both re-exported here).
"""

from __future__ import annotations

import collections
import dataclasses
import io
import logging
import multiprocessing
import shutil
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from vlrl.serving import (
    bind_socket,
    resolve_api_key,
    run_server,
)
from vlrl.synth.app import create_app
from vlrl.synth.schema import QueueFull, SynthSettings

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------- the worker side
class _Runtime:
    """The back-end (and segmenter) one worker uses, built once per worker thread or process."""

    def __init__(self, backend: str, backend_options: dict, segmenter: str | None, segmenter_options: dict) -> None:
        from vlrl.synth.backends import get_generator
        from vlrl.synth.segment import get_segmenter

        self.generator = get_generator(backend, **backend_options)
        self.segmenter = get_segmenter(segmenter, **segmenter_options) if segmenter else None

    def run(self, image: np.ndarray, keep: np.ndarray, boxes: list[list[float]], description: str, seed: int,
            refine: bool) -> tuple[bytes, dict[str, Any]]:
        from vlrl.synth.backends import boxes_mask, synthesize

        t0 = time.perf_counter()
        meta: dict[str, Any] = {}
        if refine and self.segmenter is not None and boxes:
            refined, meta = self.segmenter.refine(image, boxes)
            keep = (keep & ~boxes_mask(keep.shape, boxes)) | refined  # masks sent as masks stay; boxes are refined
            meta["segmenter"] = self.segmenter.name
        out, generated = synthesize(self.generator, image, keep, description, seed=seed)
        buffer = io.BytesIO()
        Image.fromarray(out).save(buffer, format="PNG")
        return buffer.getvalue(), {**meta, **generated, "foreground_pixels": int(keep.sum()),
                                   "generate_seconds": time.perf_counter() - t0}


_PROCESS_RUNTIME: _Runtime | None = None
_PROCESS_ERROR: str | None = None


def _init_process(backend: str, backend_options: dict, segmenter: str | None, segmenter_options: dict) -> None:
    """Pool worker start: build the back-end once; remember a failure (every job then reports it)."""
    import signal

    global _PROCESS_RUNTIME, _PROCESS_ERROR
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        _PROCESS_RUNTIME = _Runtime(backend, backend_options, segmenter, segmenter_options)
    except Exception as err:  # noqa: BLE001  (reported by every job of this worker)
        _PROCESS_ERROR = f"back-end {backend!r} failed to start: {type(err).__name__}: {err}"


def _process_job(*args: Any) -> tuple[bytes, dict[str, Any]]:
    if _PROCESS_RUNTIME is None:
        raise RuntimeError(_PROCESS_ERROR or "the worker has no back-end")
    return _PROCESS_RUNTIME.run(*args)


def _process_ready() -> str | None:
    return _PROCESS_ERROR


# ----------------------------------------------------------------------------------------------- jobs
@dataclasses.dataclass
class Job:
    id: str
    description: str
    seed: int
    status: str = "queued"  # queued → running → done | failed;  evicted (result deleted by the size cap)
    created: float = dataclasses.field(default_factory=time.time)
    started: float | None = None
    finished: float | None = None
    error: dict[str, str] | None = None
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    result_path: Path | None = None
    result_bytes: int = 0
    inputs: tuple | None = None  # (image, keep, boxes, refine) until the job runs

    def public(self) -> dict[str, Any]:
        seconds = self.finished - self.started if self.finished and self.started else None
        return {"id": self.id, "status": self.status, "error": self.error, "metadata": self.metadata,
                "description": self.description, "seed": self.seed, "created": self.created,
                "started": self.started, "finished": self.finished, "seconds": seconds}


class SynthService:
    """The job queue, the workers and the result store behind the HTTP API (usable without HTTP too)."""

    def __init__(self, settings: SynthSettings) -> None:
        if settings.workers < 1 or settings.max_queued_jobs < 1 or settings.job_timeout <= 0:
            raise ValueError("workers and max_queued_jobs must be ≥ 1 and job_timeout > 0")
        if settings.max_queued_per_client is not None and settings.max_queued_per_client < 1:
            raise ValueError("max_queued_per_client must be ≥ 1")
        self.settings = settings
        self.per_client = settings.max_queued_per_client or max(1, settings.max_queued_jobs // 4)
        self._own_dir = settings.results_dir is None
        self.results_dir = Path(settings.results_dir or tempfile.mkdtemp(prefix="vlrl-synth-"))
        self.results_dir.mkdir(parents=True, exist_ok=True)
        self._jobs: dict[str, Job] = {}
        self._queues: collections.OrderedDict[str, collections.deque[Job]] = collections.OrderedDict()  # per client
        self._queued = 0
        self._finished: collections.deque[str] = collections.deque()  # finished job ids, oldest first
        self._cond = threading.Condition()
        self._closed = False
        self.counts: collections.Counter[str] = collections.Counter()
        self.results_bytes = 0
        self._pool = None
        self._local = threading.local()
        self._spare: list[_Runtime] = []
        if settings.executor == "process":
            self._start_pool()
        elif settings.executor == "thread":  # built now so that a bad back-end fails here; more on demand
            self._spare.append(_Runtime(settings.backend, settings.backend_options, settings.segmenter,
                                        settings.segmenter_options))
        else:
            raise ValueError(f"executor must be 'process' or 'thread', got {settings.executor!r}")
        self._threads = [threading.Thread(target=self._work, name=f"vlrl-synth-{k}", daemon=True)
                         for k in range(settings.workers)]
        for thread in self._threads:
            thread.start()

    # --- the API
    def submit(self, image: np.ndarray, keep: np.ndarray, boxes: list[list[float]], description: str, seed: int,
               refine: bool = True, *, client: str = "local") -> Job:
        """Queue ``client``'s job (inputs already validated); raises `QueueFull` beyond ``max_queued_jobs`` in all
        or beyond the client's share (``max_queued_per_client``)."""
        job = Job(uuid.uuid4().hex, description, seed, inputs=(image, keep, boxes, refine))
        with self._cond:
            if self._closed:
                raise RuntimeError("the synthesis service is closed")
            if self._queued >= self.settings.max_queued_jobs:
                self.counts["rejected_busy"] += 1
                raise QueueFull(f"{self._queued} jobs queued (max_queued_jobs = {self.settings.max_queued_jobs})")
            mine = self._queues.get(client)
            if mine is not None and len(mine) >= self.per_client:
                self.counts["rejected_client_share"] += 1
                raise QueueFull(f"this client has {len(mine)} jobs queued (its share: max_queued_per_client = "
                                f"{self.per_client})")
            self._jobs[job.id] = job
            self._queues.setdefault(client, collections.deque()).append(job)
            self._queued += 1
            self.counts["submitted"] += 1
            self._cond.notify()
        return job

    def _next_job(self) -> Job:
        """The next job, round-robin across clients (under the lock; the queue is not empty)."""
        client, queue = next(iter(self._queues.items()))
        job = queue.popleft()
        del self._queues[client]
        if queue:
            self._queues[client] = queue  # to the back of the round
        self._queued -= 1
        return job

    def get(self, job_id: str) -> Job | None:
        with self._cond:
            return self._jobs.get(job_id)

    def result(self, job: Job) -> bytes | None:
        with self._cond:
            path = job.result_path if job.status == "done" else None
        try:
            return path.read_bytes() if path is not None else None
        except FileNotFoundError:  # evicted between the status check and the read
            return None

    def health(self) -> dict[str, Any]:
        with self._cond:
            running = sum(1 for j in self._jobs.values() if j.status == "running")
            return {"status": "ok", "backend": self.settings.backend, "segmenter": self.settings.segmenter,
                    "executor": self.settings.executor, "workers": self.settings.workers, "queued": self._queued,
                    "clients_queued": len(self._queues), "running": running,
                    "max_queued_jobs": self.settings.max_queued_jobs, "max_queued_per_client": self.per_client,
                    "job_timeout": self.settings.job_timeout, "results_bytes": self.results_bytes,
                    "max_results_bytes": self.settings.max_results_bytes, **dict(self.counts)}

    def close(self) -> None:
        with self._cond:
            self._closed = True
            for queue in self._queues.values():
                for job in queue:
                    self._fail(job, "error", "the server shut down before the job ran")
            self._queues.clear()
            self._queued = 0
            self._cond.notify_all()
        for thread in self._threads:
            thread.join(timeout=5)
        if self._pool is not None:
            self._pool.stop()
            self._pool.join(timeout=10)
        if self._own_dir:
            shutil.rmtree(self.results_dir, ignore_errors=True)

    # --- workers
    def _start_pool(self) -> None:
        from pebble import ProcessPool

        s = self.settings
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["numpy", "PIL.Image", "vlrl.synth.backends"])
        self._pool = ProcessPool(max_workers=s.workers, context=context, initializer=_init_process,
                                 initargs=(s.backend, s.backend_options, s.segmenter, s.segmenter_options))
        error = self._pool.schedule(_process_ready).result()  # fail now, not at the first job
        if error:
            self._pool.stop()
            raise RuntimeError(error)

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._queued and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                job = self._next_job()
                job.status, job.started = "running", time.time()
                image, keep, boxes, refine = job.inputs
                job.inputs = None
            args = (image, keep, boxes, job.description, job.seed, refine)
            try:
                png, meta = self._run(args)
            except TimeoutError:
                self._finish_failed(job, "timeout", f"no result within job_timeout = {self.settings.job_timeout:g} s")
            except Exception as err:  # noqa: BLE001  (a bad job fails itself, never the server)
                kind = "worker_died" if type(err).__name__ == "ProcessExpired" else "error"
                log.warning("synthesis job %s failed: %s: %s", job.id, type(err).__name__, err)
                self._finish_failed(job, kind, f"{type(err).__name__}: {err}")
            else:
                self._store(job, png, meta)

    def _run(self, args: tuple) -> tuple[bytes, dict[str, Any]]:
        from concurrent.futures import TimeoutError as FutureTimeout

        if self._pool is not None:
            try:
                return self._pool.schedule(_process_job, args=args, timeout=self.settings.job_timeout).result()
            except FutureTimeout:
                raise TimeoutError from None
        runtime = getattr(self._local, "runtime", None)
        if runtime is None:  # one back-end per worker thread (pipelines are not thread-safe)
            with self._cond:
                runtime = self._spare.pop() if self._spare else None
            if runtime is None:
                s = self.settings
                runtime = _Runtime(s.backend, s.backend_options, s.segmenter, s.segmenter_options)
            self._local.runtime = runtime
        t0 = time.perf_counter()
        out = runtime.run(*args)
        if time.perf_counter() - t0 > self.settings.job_timeout:
            raise TimeoutError
        return out

    def _store(self, job: Job, png: bytes, meta: dict[str, Any]) -> None:
        path = self.results_dir / f"{job.id}.png"
        path.write_bytes(png)
        with self._cond:
            job.status, job.finished, job.metadata = "done", time.time(), meta
            job.result_path, job.result_bytes = path, len(png)
            self.results_bytes += len(png)
            self.counts["completed"] += 1
            self._finished.append(job.id)
            self._evict()

    def _finish_failed(self, job: Job, kind: str, message: str) -> None:
        with self._cond:
            self._fail(job, kind, message)
            self._finished.append(job.id)
            self._evict()

    def _fail(self, job: Job, kind: str, message: str) -> None:
        job.status, job.finished, job.error = "failed", time.time(), {"kind": kind, "message": message}
        job.inputs = None
        self.counts["failed"] += 1
        self.counts[f"failed_{kind}"] += 1

    def _evict(self) -> None:
        """Delete the oldest results past the size cap, and forget the oldest jobs past ``max_jobs``."""
        for job_id in list(self._finished):
            if self.results_bytes <= self.settings.max_results_bytes:
                break
            job = self._jobs.get(job_id)
            if job is not None and job.status == "done" and job.result_path is not None:
                job.result_path.unlink(missing_ok=True)
                self.results_bytes -= job.result_bytes
                job.status, job.result_path = "evicted", None
                self.counts["evicted"] += 1
        while len(self._finished) > self.settings.max_jobs:
            job = self._jobs.pop(self._finished.popleft(), None)
            if job is not None and job.result_path is not None:
                job.result_path.unlink(missing_ok=True)
                self.results_bytes -= job.result_bytes


def serve(settings: SynthSettings, *, host: str = "127.0.0.1", port: int = 30100, api_key: str | None = None,
          no_auth: bool = False) -> None:
    """`vlrl synth serve`: start the workers and serve until interrupted."""
    api_key = resolve_api_key(api_key, no_auth=no_auth, host=host, command="vlrl synth serve")
    service = SynthService(settings)
    sock = bind_socket(host, port)
    print(f"vlrl synth serve: listening on http://{host}:{sock.getsockname()[1]} (back-end {settings.backend}, "
          f"{settings.workers} {settings.executor} worker(s), results in {service.results_dir}, "
          f"auth {'on' if api_key else 'off'})", flush=True)
    try:  # SIGTERM: no new connections, requests in flight get drain_seconds, then the workers stop
        run_server(create_app(service, api_key=api_key), sock, drain_seconds=settings.drain_seconds)
    finally:
        service.close()
