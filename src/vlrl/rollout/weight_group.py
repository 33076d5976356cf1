"""`WeightGroup`: the distributed path of the HTTP engine's weight sync (``rollout.weight_sync.method=distributed``).

The weights travel over a process group (SGLang's ``/init_weights_update_group`` + ``/update_weights_from_distributed``;
`vlrl.rollout.dist_sync`): the first update has every live server join a group hosted by the trainer (rank 0); each
update then sends the parameters bucket by bucket (``bucket_mb``), each bucket announced to every server by HTTP and
broadcast from rank 0, the last bucket carrying the new ``weight_version``; checksums are compared as on disk. Nothing
touches the disk. Buckets are gathered and packed on the group's device (the GPU for NCCL), each ordered by element
size (SGLang refuses a tensor at a misaligned offset); server i holds ``tp_size`` ranks. vlrl's server receives the
buckets into its spare weights and swaps them in at once; a real SGLang server loads each bucket as it arrives —
paused meanwhile (`vlrl.rollout.publish`), so no request runs on a half-updated model. What happens when the group
breaks is `vlrl.rollout.publish`'s: the update falls back to disk and the next one forms a new group.

SGLang's weight-update session (0.5.23: ``srt/managers/scheduler_components/weight_updater.py``, which refuses
``update_weights_from_distributed`` outside it): every update's buckets are bracketed by ``/begin_weight_update`` and
``/end_weight_update`` (`open_session` / `close_session`; the end also after a failure), as SGLang's own clients do
(``srt/entrypoints/engine.py``, ``http_server_engine.py``); `vlrl serve` keeps the same session.

No collective can hang the trainer (NCCL creates a group's communicator at its first collective, and blocks there
until every rank arrives — a server that refused its bucket never does): a bucket is broadcast only once every server
accepted the update (its session opened; the bucket before answered success); the broadcast call itself runs off the
trainer's thread (`dist_sync.broadcast`), and every wait is bounded by ``rollout.weight_sync.timeout`` and by the
update's ``deadline``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import os
import socket
import threading
import time
from typing import Any

import torch

from vlrl.models.policy import DTYPES, Policy
from vlrl.rollout import dist_sync
from vlrl.rollout.http_settings import SyncSettings
from vlrl.rollout.server_pool import ServerPool, ServerState
from vlrl.rollout.weights import ChecksumCheck, WeightSyncError, checkpoint_names

log = logging.getLogger(__name__)

BucketPlan = tuple[torch.dtype, list[list[dist_sync.Entry]]]  # (the dtype the servers receive, the buckets)


SESSION_PATHS = ("/begin_weight_update", "/end_weight_update")  # SGLang's weight-update session (and vlrl serve's)


class SessionRefused(RuntimeError):
    """A server refused to open a weight-update session: its buckets would be refused, so none is broadcast."""


class Failures:
    """The server calls that failed during one wait of a weight update (``on_failure`` of `ServerPool.post_each`):
    their messages, and an event set at the first, which ends the wait at once."""

    def __init__(self, what: str = "") -> None:
        self.what, self.messages, self.settled = what, [], threading.Event()

    def __call__(self, server: ServerState, why: str) -> None:
        self.messages.append(f"{server.url}{self.what}: {why}")
        self.settled.set()


def sent_state(policy: Policy, state_dict: dict[str, torch.Tensor] | None = None, *,
               layout: bool = False) -> dict[str, torch.Tensor]:
    """The tensors an update sends: ``state_dict`` (the trainer's, handed in) or the model's own, or with model.lora
    base + adapters merged under the transformers names — on FSDP2 shards merged on the shards, a collective every
    rank calls; a peft state dict handed in is merged from the live module. ``layout``: the merged names and shapes
    only (`merged_tensors`' ``deltas=False``), for planning."""
    if getattr(policy, "lora", None) is None:
        return state_dict if state_dict is not None else policy.model.state_dict()
    from vlrl.models.lora import merged_tensors, merged_weights

    if state_dict is not None:
        return merged_weights(policy, state_dict)
    return dict(merged_tensors(policy, deltas=not layout))


class WeightGroup:
    """The trainer's weight-update group with ``pool``'s servers: formed (`form`) at the first distributed update and
    again whenever the live servers changed or it broke; each update planned (`bucket_plan`) and broadcast bucket by
    bucket (`broadcast`)."""

    def __init__(self, pool: ServerPool, policy: Policy, settings: SyncSettings, checksums: ChecksumCheck) -> None:
        self.pool, self.policy, self.settings, self.checksums = pool, policy, settings, checksums
        self.bucket_bytes = max(1, int(settings.bucket_mb * (1 << 20)))
        self.send_buffer = dist_sync.ByteBuffer()  # each bucket is packed here (reused: no allocation per bucket)
        self.group: Any = None  # the weight-update process group, once formed
        self.name = ""
        self.servers: list[str] = []  # the URLs of the servers in it
        self.backend = ""
        self.device = torch.device("cpu")  # where buckets are gathered and packed: the group's (`group_device`)
        self._ids = itertools.count()
        self._rendezvous: threading.Thread | None = None  # the trainer's side of the last group formation
        self._entries: list[dist_sync.Entry] | None = None

    def current(self, live: list[ServerState]) -> bool:
        """Whether the group is formed, with exactly the ``live`` servers."""
        return self.group is not None and self.servers == [s.url for s in live]

    def destroy(self, *, timeout: float | None = None) -> None:
        """Close this side of the weight-update group (a broadcast still waited for on the servers ends: their
        connection drops), then have the servers that joined it and are still live leave it too (SGLang's
        ``/destroy_weights_update_group``; an answer that it is gone already is fine). Each formation is a new
        group, so without this a server would keep one dead group per re-formation."""
        group, self.group = self.group, None
        dist_sync.close_group(group)
        del group
        name, urls = self.name, self.servers
        self.name, self.servers = "", []
        servers = [s for s in self.pool.live() if s.url in urls]
        if name and servers:
            answers = self.pool.call(self.pool.post_each(servers, "/destroy_weights_update_group",
                                                         [{"group_name": name}] * len(servers),
                                                         timeout=timeout or self.settings.timeout))
            for server, answer in zip(servers, answers, strict=True):
                if isinstance(answer, BaseException) or not answer.get("success", False):
                    log.info("%s did not leave weight-update group %s: %s", server.url, name,
                             answer if isinstance(answer, BaseException) else answer.get("message"))

    def open_session(self, live: list[ServerState], *, timeout: float) -> list[ServerState]:
        """SGLang's ``/begin_weight_update`` on every live server, before any bucket: the servers with an open session.
        A session left open (a trainer that died mid-update) is closed and opened again; a server without the route
        (404: an SGLang before sessions, which needs none) is warned about once and goes on without. Any other refusal
        closes the sessions opened and raises `SessionRefused`: no bucket is broadcast."""
        begin, end = SESSION_PATHS
        answers = self.pool.call(self.pool.post_each(live, begin, [{}] * len(live), timeout=timeout))
        stale = [s for s, a in zip(live, answers, strict=True)
                 if isinstance(a, dict) and "already open" in str(a.get("message", ""))]
        if stale:  # left open by an update that never ended: end it, begin again
            self.close_session(stale, timeout=timeout)
            again = self.pool.call(self.pool.post_each(stale, begin, [{}] * len(stale), timeout=timeout))
            answers = [again[stale.index(s)] if s in stale else a for s, a in zip(live, answers, strict=True)]
        opened, refused = [], []
        for server, answer in zip(live, answers, strict=True):
            if isinstance(answer, BaseException):
                refused.append(f"{server.url}{begin}: {type(answer).__name__}: {answer}")
            elif answer.get("status_code") == 404:
                self.pool.warn_once(server.url, begin, "%s has no %s (an SGLang before weight-update sessions): its "
                                    "buckets are sent without one", server.url, begin)
            elif not answer.get("success", False):
                refused.append(f"{server.url}{begin}: {answer.get('message', answer)}")
            else:
                opened.append(server)
        if refused:
            self.close_session(opened, timeout=timeout)
            raise SessionRefused("; ".join(refused))
        return opened

    def close_session(self, servers: list[ServerState], *, timeout: float) -> list[str]:
        """SGLang's ``/end_weight_update`` on ``servers`` (whatever the update's outcome); the failures, as messages."""
        if not servers:
            return []
        end = SESSION_PATHS[1]
        answers = self.pool.call(self.pool.post_each(servers, end, [{}] * len(servers), timeout=timeout))
        failed = [f"{s.url}{end}: {type(a).__name__}: {a}" if isinstance(a, BaseException) else
                  f"{s.url}{end}: {a.get('message', a)}" for s, a in zip(servers, answers, strict=True)
                  if isinstance(a, BaseException) or not a.get("success", False)]
        for message in failed:
            log.warning("%s", message)
        return failed

    def form(self, live: list[ServerState]) -> None:
        """Every live server joins a new group hosted here as rank 0 (their HTTP calls return once all joined), the
        group it replaces destroyed first. Server i holds ranks ``rank_offset .. rank_offset + tp_size − 1`` (SGLang:
        ``rank_offset + tp_rank``). The rendezvous runs in a thread: if a server's call fails first (it died, or
        refused), it can never complete, and this raises at once instead of waiting out ``sync_timeout`` (the thread
        ends with the rendezvous' own timeout, closing the group if it ever formed)."""
        settings = self.settings
        self.destroy()
        if self._rendezvous is not None and self._rendezvous.is_alive():
            # the last formation was abandoned: its rendezvous ends within sync_timeout, and with it the servers'
            # joins of that group (a server joins one group at a time: until then it answers 409)
            self._rendezvous.join(timeout=settings.timeout)
        port = settings.port or _free_port(settings.address)
        world_size = 1 + sum(s.ranks for s in live)
        name = f"vlrl_weights_{os.getpid()}_{id(self):x}_{next(self._ids)}"
        backend = settings.backend or ("nccl" if next(self.policy.model.parameters()).is_cuda else "gloo")
        self.device = dist_sync.group_device(backend)
        bodies = self.init_bodies(live, port, name, backend)
        failed = Failures(" could not join the weight-update group")
        answers = asyncio.run_coroutine_threadsafe(
            self.pool.post_each(live, "/init_weights_update_group", bodies, on_failure=failed,
                                timeout=settings.timeout + 30, busy_for=settings.timeout), self.pool.loop)
        joined = self._rendezvous_thread(port, world_size, name, backend, failed.settled)
        failed.settled.wait()  # (the rendezvous itself times out after sync_timeout)
        if not joined.done():
            joined.add_done_callback(lambda f: f.exception() is None and dist_sync.close_group(f.result()))
            answers.cancel()
            raise RuntimeError("; ".join(failed.messages))
        group = joined.result()
        try:
            answers.result(timeout=settings.timeout)
        except BaseException:
            dist_sync.close_group(group)
            raise
        if failed.messages:
            dist_sync.close_group(group)
            raise RuntimeError("; ".join(failed.messages))
        self.group, self.name, self.servers, self.backend = group, name, [s.url for s in live], backend
        log.info("weight-update group %s: trainer + %d server(s) over %s at %s:%d", name, len(live), backend,
                 settings.address, port)

    def _rendezvous_thread(self, port: int, world_size: int, name: str, backend: str,
                           settled: threading.Event) -> concurrent.futures.Future:
        """The trainer's side of a group formation, on a daemon thread: a future of the group; ``settled`` is set when
        it ends (formed or failed)."""
        joined: concurrent.futures.Future = concurrent.futures.Future()
        settings = self.settings

        def join() -> None:
            try:
                joined.set_result(dist_sync.open_group(settings.address, port, rank=0, world_size=world_size,
                                                       group_name=name, backend=backend, timeout=settings.timeout))
            except BaseException as err:  # noqa: BLE001 — handed to the waiting thread
                # without its traceback: the frames it holds keep the rendezvous store (and its port) open, and the
                # servers still waiting on that store wait until it closes
                joined.set_exception(err.with_traceback(None))
            settled.set()

        self._rendezvous = threading.Thread(target=join, name="vlrl-weight-group", daemon=True)
        self._rendezvous.start()
        return joined

    def init_bodies(self, live: list[ServerState], port: int, name: str, backend: str) -> list[dict[str, Any]]:
        """Each server's ``/init_weights_update_group`` body: the trainer is rank 0, server i takes the ranks from
        ``rank_offset`` on, one per tensor-parallel rank (its ``tp_size``); ``world_size`` counts them all."""
        offsets = list(itertools.accumulate([1] + [s.ranks for s in live[:-1]]))
        world_size = 1 + sum(s.ranks for s in live)
        return [{"master_address": self.settings.address, "master_port": port, "rank_offset": offset,
                 "world_size": world_size, "group_name": name, "backend": backend} for offset in offsets]

    def bucket_body(self, version: int, bucket: list[dist_sync.Entry], dtypes: list[torch.dtype], *, last: bool,
                    on_weight_update: str, flushed: bool = False) -> dict[str, Any]:
        """The ``/update_weights_from_distributed`` body announcing one flattened bucket (the last one carries the
        new ``weight_version`` and flushes the cache — unless it was ``flushed`` before the buckets, or requests are
        held in place)."""
        return {"names": [e.send_name for e in bucket], "dtypes": [dist_sync.dtype_name(d) for d in dtypes],
                "shapes": [list(e.shape) for e in bucket], "group_name": self.name,
                "flush_cache": last and not flushed and on_weight_update != "in_place",  # (SGLang: none with requests held)
                "abort_all_requests": on_weight_update == "abort", "load_format": dist_sync.FLATTENED,
                "weight_version": str(version) if last else None}

    def bucket_plan(self, live: list[ServerState]) -> BucketPlan:
        """(the dtype the servers receive, the update's buckets of entries) — what every trainer rank gathers."""
        model = self.policy.model
        if self._entries is None:
            layout = sent_state(self.policy, layout=True)
            names = checkpoint_names(model, layout)  # {checkpoint name → state-dict name}: what servers receive
            self._entries = dist_sync.plan_entries(layout, {v: k for k, v in names.items()} if names else None)
        dtypes = {s.dtype for s in live}
        trainer_dtype = next(model.parameters()).dtype
        send_dtype = DTYPES.get(next(iter(dtypes)) or "", trainer_dtype) if len(dtypes) == 1 else trainer_dtype
        return send_dtype, dist_sync.buckets(self._entries, send_dtype=send_dtype, bucket_bytes=self.bucket_bytes)

    def broadcast(self, version: int, state: dict[str, torch.Tensor], live: list[ServerState], plan: BucketPlan, *,
                  on_weight_update: str, flushed: bool = False, deadline: float | None = None) -> tuple[int, int]:
        """Send every bucket of ``plan``; check the last answers' checksums (of the servers that report one, when
        ``verify_checksum``). Returns (bytes of one copy sent, buckets). ``deadline`` (``time.monotonic()``) bounds
        every wait. Every bucket is gathered even after a failure (other trainer ranks gather it with this one); the
        first failure is raised once all were."""
        checked = {s.dtype for s in live if s.reports_checksum} if self.settings.verify_checksum else set()
        checksum = dist_sync.StreamingChecksum([DTYPES.get(d or "") for d in checked]) if checked else None
        send_dtype, planned = plan
        sent, failure = 0, None
        for k, bucket in enumerate(planned):
            last = k == len(planned) - 1
            gathered = dist_sync.full_tensors(state, bucket, self.device)  # FSDP2: gathered one bucket at a time
            if failure is not None:
                continue
            try:
                body = self.bucket_body(version, bucket, self._dtypes(gathered, send_dtype), last=last,
                                        on_weight_update=on_weight_update, flushed=flushed)
                sent += self._send_bucket(body, version, live, bucket, gathered, send_dtype, checksum, last=last,
                                          deadline=deadline)
            except BaseException as err:  # noqa: BLE001 — raised after the remaining buckets' gathers
                failure = err
        if failure is not None:
            raise failure
        return sent, len(planned)

    def _wait_for(self, deadline: float | None) -> float:
        """Seconds the next wait may take: ``rollout.weight_sync.timeout``, less where the update's deadline is nearer
        (`dist_sync.Abandoned` once it passed)."""
        if deadline is None:
            return self.settings.timeout
        left = deadline - time.monotonic()
        if left <= 0:
            raise dist_sync.Abandoned(f"the update took longer than its deadline of {self.settings.deadline:.0f} s "
                                      "(rollout.weight_sync.deadline)")
        return min(self.settings.timeout, left)

    @staticmethod
    def _dtypes(gathered: list[torch.Tensor], send_dtype: torch.dtype) -> list[torch.dtype]:
        return [send_dtype if t.is_floating_point() else t.dtype for t in gathered]

    def _send_bucket(self, body: dict[str, Any], version: int, live: list[ServerState], bucket: list[dist_sync.Entry],
                     gathered: list[torch.Tensor], send_dtype: torch.dtype,
                     checksum: dist_sync.StreamingChecksum | None, *, last: bool, deadline: float | None) -> int:
        """Announce one bucket (``body``) to every server, pack its tensors (cast to ``send_dtype``) into the send
        buffer and broadcast it, checksum the bytes sent while the servers load them, read the answers; returns the
        bytes sent. A server whose answer fails ends the wait for the broadcast at once (`dist_sync.broadcast`);
        every wait is bounded by ``rollout.weight_sync.timeout`` and the update's ``deadline``."""
        timeout = self._wait_for(deadline)
        dtypes = self._dtypes(gathered, send_dtype)
        failed = Failures()
        answers = asyncio.run_coroutine_threadsafe(
            self.pool.post_each(live, "/update_weights_from_distributed", [body] * len(live), on_failure=failed,
                                timeout=self.settings.update_timeout), self.pool.loop)
        try:
            flat, sent = dist_sync.pack(gathered, dtypes, self.send_buffer, self.device)
            dist_sync.broadcast(self.group, flat, settled=failed.settled, timeout=timeout)
        except dist_sync.Abandoned as err:
            answers.cancel()
            raise dist_sync.Abandoned(f"{err}: {'; '.join(failed.messages)}" if failed.messages else str(err)) from None
        except BaseException:
            answers.cancel()
            raise
        for entry, tensor, raw, dtype in zip(bucket, gathered, sent, dtypes, strict=True):
            if checksum is not None:  # per server dtype, as the disk path predicts
                checksum.add(entry, tensor, sent=raw, sent_dtype=dtype)
        try:
            timeout = self._wait_for(deadline)
            results = answers.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            answers.cancel()
            raise dist_sync.Abandoned(f"no answer within {timeout:.0f} s (rollout.weight_sync.timeout / "
                                      "deadline)") from None
        except BaseException:
            answers.cancel()
            raise
        for server, answer in zip(live, results, strict=True):
            if isinstance(answer, BaseException):
                raise RuntimeError(f"{server.url}: {type(answer).__name__}: {answer}")
            if not answer.get("success", False):
                raise WeightSyncError(f"{server.url} could not load version {version} from the trainer's broadcast: "
                                      f"{answer.get('message', answer)}")
            if last:
                expected = checksum.digest(DTYPES.get(server.dtype or "")) if checksum is not None and \
                    server.reports_checksum else None
                self.checksums(server.url, answer.get("weight_checksum"), version, expected)
        return flat.numel()


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
