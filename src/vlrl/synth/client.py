"""Clients of the synthesis server: `SynthClient` (one call per endpoint) and `AsyncSynthesizer` (the trainer's
non-blocking front: submit and drain never wait on the network).

`AsyncSynthesizer` keeps a bounded local queue of requests; one background thread posts them (at most
``max_in_flight`` jobs on the server at once), polls every job it has in flight with one ``GET /jobs?ids=…``
per round, fetches finished images (``GET /jobs/{id}/image``, plain PNG), and files an outcome per request — the image, or the reason it failed:
``busy`` (429), ``rejected`` (4xx), ``unavailable`` (connection error, 5xx), ``timeout`` (the server's job
timeout), ``error`` / ``worker_died`` (the back-end), ``deadline`` (not done ``deadline`` seconds after it
was submitted), ``lost`` (the server forgot the job, e.g. it restarted), ``dropped`` (the local queue was full).
Nothing is retried: the trainer keeps training on the original sample, and every failure is counted.
"""

from __future__ import annotations

import base64
import collections
import dataclasses
import io
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from PIL import Image

from vlrl.serving import API_KEY_ENV

log = logging.getLogger(__name__)


class SynthError(RuntimeError):
    """A request the server did not accept or answer; ``kind`` says why (see the module docstring)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind, self.message = kind, message


@dataclasses.dataclass
class JobResult:
    id: str
    status: str  # queued | running | done | failed
    image: Image.Image | None = None
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    error: dict[str, str] | None = None
    seconds: float | None = None


def png_data_url(image: Image.Image | np.ndarray) -> str:
    image = Image.fromarray(image) if isinstance(image, np.ndarray) else image
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _decode(data_url: str) -> Image.Image:
    image = Image.open(io.BytesIO(base64.b64decode(data_url.split(",", 1)[1])))
    image.load()
    return image.convert("RGB")


class SynthClient:
    """Blocking calls to one synthesis server (`vlrl.synth.server`); errors raise `SynthError`."""

    def __init__(self, url: str, *, api_key: str | None = None, timeout: float = 10.0) -> None:
        import httpx

        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=httpx.Timeout(timeout, connect=2.0))

    def submit(self, image: Image.Image | np.ndarray, *, description: str, boxes: Sequence[Sequence[float]] = (),
               masks: Sequence[Image.Image | np.ndarray] = (), seed: int = 0, refine: bool = True) -> str:
        """Post a job; returns its id."""
        body = {"image": png_data_url(image), "boxes": [list(map(float, b)) for b in boxes],
                "masks": [png_data_url(m) for m in masks], "description": description, "seed": int(seed),
                "refine": refine}
        return self._call("POST", "/jobs", json=body)["id"]

    def poll(self, job_id: str, *, image: bool = True) -> JobResult:
        data = self._call("GET", f"/jobs/{job_id}", params={"image": str(image).lower()})
        picture = _decode(data["image"]) if data.get("image") else None
        return JobResult(data["id"], data["status"], picture, data.get("metadata") or {}, data.get("error"),
                         data.get("seconds"))

    def image(self, job_id: str) -> Image.Image:
        """The result of a finished job, fetched as PNG bytes (no JSON, no base64)."""
        import httpx

        try:
            response = self._http.get(f"/jobs/{job_id}/image")
        except httpx.HTTPError as err:
            raise SynthError("unavailable", f"{self.url}/jobs/{job_id}/image: {type(err).__name__}: {err}") from None
        if response.status_code != 200:
            raise SynthError("lost" if response.status_code in (404, 409, 410) else "unavailable",
                             f"{response.status_code}: {response.text[:200]}")
        image = Image.open(io.BytesIO(response.content))
        image.load()
        return image.convert("RGB")

    def statuses(self, job_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
        """Status, error and (when done) metadata of many jobs in one request."""
        if not job_ids:
            return {}
        data = self._call("GET", "/jobs", params={"ids": ",".join(job_ids)})
        return {job["id"]: job for job in data["jobs"]}

    def wait(self, job_id: str, *, timeout: float = 60.0, interval: float = 0.05) -> JobResult:
        """Poll until the job is done or failed; raises `SynthError("deadline")` after ``timeout`` seconds."""
        end = time.monotonic() + timeout
        while True:
            status = self.statuses([job_id]).get(job_id, {"status": "unknown"})["status"]
            if status in ("done", "failed"):
                return self.poll(job_id)
            if status in ("unknown", "evicted"):
                raise SynthError("lost", f"job {job_id} is {status} on the server")
            if time.monotonic() > end:
                raise SynthError("deadline", f"job {job_id} not finished within {timeout:g} s")
            time.sleep(interval)

    def health(self) -> dict[str, Any]:
        return self._call("GET", "/health")

    def close(self) -> None:
        self._http.close()

    def _call(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        import httpx

        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as err:
            raise SynthError("unavailable", f"{self.url}{path}: {type(err).__name__}: {err}") from None
        if response.status_code < 300:
            return response.json()
        try:
            message = response.json().get("error", response.text)
        except ValueError:
            message = response.text
        code = response.status_code
        if code == 429:
            raise SynthError("busy", message)
        if code == 401:
            raise SynthError("rejected", f"401 unauthorised: set ${API_KEY_ENV} to the server's key ({message})")
        if code in (404, 410):
            raise SynthError("lost", message)
        if 400 <= code < 500:
            raise SynthError("rejected", f"{code}: {message}")
        raise SynthError("unavailable", f"{code}: {message}")


# ----------------------------------------------------------------------------------------------- non-blocking
@dataclasses.dataclass
class SynthRequest:
    """What to synthesise, plus ``payload``: anything the caller wants back with the outcome."""

    image: Image.Image
    boxes: list[list[float]]
    description: str
    seed: int = 0
    payload: Any = None


@dataclasses.dataclass
class SynthOutcome:
    request: SynthRequest
    image: Image.Image | None  # None when it failed
    error: str | None  # failure kind (module docstring), None on success
    message: str = ""
    latency: float = 0.0  # seconds from `submit` to the outcome
    job_id: str | None = None
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclasses.dataclass
class SynthSnapshot:
    """An `AsyncSynthesizer` at one instant (`AsyncSynthesizer.snapshot`): what a checkpoint holds of it."""

    requests: list[SynthRequest]  # not answered yet: on the server, being posted, queued
    outcomes: list[SynthOutcome]  # answered, not drained yet
    counts: dict[str, int]


class AsyncSynthesizer:
    """A non-blocking front of a `SynthClient` (module docstring). ``submit`` and ``drain`` take a lock for a
    few microseconds and never touch the network; all HTTP runs on one background thread."""

    def __init__(self, client: SynthClient, *, max_in_flight: int = 8, max_pending: int = 64, deadline: float = 120.0,
                 poll_interval: float = 0.5) -> None:
        self.client = client
        self.max_in_flight, self.max_pending = max_in_flight, max_pending
        self.deadline, self.poll_interval = deadline, poll_interval
        self.counts: collections.Counter[str] = collections.Counter()
        self.cpu_seconds = 0.0  # CPU time of the background thread (what synthesis costs the trainer's process)
        self._pending: collections.deque[tuple[SynthRequest, float]] = collections.deque()
        self._in_flight: dict[str, tuple[SynthRequest, float]] = {}
        self._sending: list[SynthRequest] = []  # taken from the queue, being posted
        self._outcomes: list[SynthOutcome] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="vlrl-synth-client", daemon=True)
        self._thread.start()

    def submit(self, request: SynthRequest) -> bool:
        """Queue a request; False (counted as ``dropped``) when ``max_pending`` requests already wait."""
        with self._lock:
            self.counts["requested"] += 1
            if len(self._pending) >= self.max_pending:
                self.counts["failed"] += 1
                self.counts["failed_dropped"] += 1
                self._outcomes.append(SynthOutcome(request, None, "dropped", "the local queue is full"))
                return False
            self._pending.append((request, time.monotonic()))
            self._idle.clear()
        self._wake.set()
        return True

    def drain(self) -> list[SynthOutcome]:
        """Every outcome filed since the last call (successes and failures)."""
        with self._lock:
            out, self._outcomes = self._outcomes, []
            return out

    def outstanding(self) -> int:
        """Requests not yet answered: waiting, being posted, or on the server."""
        with self._lock:
            return len(self._pending) + len(self._sending) + len(self._in_flight)

    def wait_idle(self, timeout: float) -> bool:
        """Block until nothing is pending or in flight (synchronous mode); False on timeout."""
        self._wake.set()
        return self._idle.wait(timeout)

    def snapshot(self) -> SynthSnapshot:
        """What a checkpoint keeps of the client, taken at once under its lock: every request not yet answered
        (queued, being posted or on the server — `restore` queues them again), the outcomes not yet drained, and
        the counters without the in-flight posts (they are posted, and counted, again after a restore)."""
        with self._lock:
            requests = [r for r, _ in self._in_flight.values()] + list(self._sending) + [r for r, _ in self._pending]
            counts = collections.Counter(self.counts)
            counts["submitted"] -= len(self._in_flight)
            return SynthSnapshot(requests, list(self._outcomes), dict(counts))

    def restore(self, snapshot: SynthSnapshot) -> None:
        """Continue from a `snapshot` (a fresh client, nothing submitted yet): its counters, its undrained
        outcomes, and its unanswered requests queued again in their order (the server's results depend only on
        the request and its seed, so a request posted again gives the same image)."""
        now = time.monotonic()
        with self._lock:
            if self._pending or self._sending or self._in_flight or self._outcomes:
                raise RuntimeError("AsyncSynthesizer.restore: the client has already been used")
            self.counts = collections.Counter(snapshot.counts)
            self._outcomes = list(snapshot.outcomes)
            self._pending.extend((request, now) for request in snapshot.requests)
            if snapshot.requests:
                self._idle.clear()
        self._wake.set()

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=30)
        self.client.close()

    # --- the background thread
    def _loop(self) -> None:
        while not self._stop:
            cpu = time.thread_time()
            try:
                self._send()
                self._poll()
            except Exception as err:  # noqa: BLE001  (never let the thread die; the trainer must go on)
                log.exception("synthesis client: %s", err)
            self.cpu_seconds += time.thread_time() - cpu
            with self._lock:
                if not self._pending and not self._in_flight and not self._sending:
                    self._idle.set()
                busy = bool(self._in_flight)
            self._wake.wait(self.poll_interval if busy else 1.0)
            self._wake.clear()

    def _send(self) -> None:
        while True:
            with self._lock:
                if not self._pending or len(self._in_flight) >= self.max_in_flight:
                    return
                request, since = self._pending.popleft()
                self._sending.append(request)
            try:
                job_id = self.client.submit(request.image, description=request.description, boxes=request.boxes,
                                            seed=request.seed)
            except SynthError as err:
                self._file(SynthOutcome(request, None, err.kind, err.message, time.monotonic() - since), sent=request)
                continue
            with self._lock:
                self._sending = [r for r in self._sending if r is not request]
                self._in_flight[job_id] = (request, since)
                self.counts["submitted"] += 1

    def _poll(self) -> None:
        with self._lock:
            ids = list(self._in_flight)
        if not ids:
            return
        try:
            statuses = self.client.statuses(ids)
        except SynthError as err:
            self.counts["poll_errors"] += 1
            statuses = {}
            log.debug("synthesis poll failed: %s", err)
        now = time.monotonic()
        for job_id in ids:
            request, since = self._in_flight[job_id]
            status = statuses.get(job_id, {}).get("status")
            if status == "done":
                self._finish_done(job_id, request, since, statuses[job_id].get("metadata") or {})
            elif status == "failed":
                error = statuses[job_id].get("error") or {}
                self._finish(job_id, SynthOutcome(request, None, error.get("kind", "error"), error.get("message", ""),
                                                  now - since, job_id))
            elif status in ("unknown", "evicted"):
                self._finish(job_id, SynthOutcome(request, None, "lost", f"the server answers {status!r}", now - since, job_id))
            elif now - since > self.deadline:
                self._finish(job_id, SynthOutcome(request, None, "deadline", f"not done within {self.deadline:g} s",
                                                  now - since, job_id))

    def _finish_done(self, job_id: str, request: SynthRequest, since: float, metadata: dict[str, Any]) -> None:
        try:
            image = self.client.image(job_id)
        except SynthError as err:
            self._finish(job_id, SynthOutcome(request, None, err.kind, err.message, time.monotonic() - since, job_id))
            return
        self._finish(job_id, SynthOutcome(request, image, None, "", time.monotonic() - since, job_id, metadata))

    def _finish(self, job_id: str, outcome: SynthOutcome) -> None:
        with self._lock:
            self._in_flight.pop(job_id, None)
        self._file(outcome)

    def _file(self, outcome: SynthOutcome, *, sent: SynthRequest | None = None) -> None:
        with self._lock:
            if sent is not None:
                self._sending = [r for r in self._sending if r is not sent]
            if outcome.ok:
                self.counts["completed"] += 1
            else:
                self.counts["failed"] += 1
                self.counts[f"failed_{outcome.error}"] += 1
            self._outcomes.append(outcome)
