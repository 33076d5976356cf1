"""`ServerWeights`: how an `HTTPEngine` gives its rollout servers the trainer's weights — by disk or over a process
group (`vlrl.rollout.weight_group`), each update bracketed by pausing the servers.

Weight updates are bracketed by SGLang's ``/pause_generation`` (mode by ``on_weight_update``) and
``/continue_generation``, on both paths, while the engine holds its own new requests (`ServerWeights.pause`); weight
and pause calls carry the admin key and have their own timeout (``weight_update_timeout``).

Disk: `ServerWeights.update_weights` saves the trainer's weights (``save_pretrained`` layout) under ``weights_dir``,
asks every live server to load them (``/update_weights_from_disk``), and bumps the version only after every server
confirmed. vlrl's servers answer with a checksum of what they loaded; a mismatch with the trainer's own checksum
raises `WeightSyncError` (the run stops). A server that reports no checksum (e.g. SGLang) is warned about once.
`ServerWeights.publish` is the same without waiting: it returns once the weights are saved, and a future that resolves
when every server confirmed (the asynchronous recipe trains its next step meanwhile). Put ``weights_dir`` on a RAM
disk (``/dev/shm``) when servers share the host.

Before the weights change, every live server's cache is flushed (SGLang's ``/flush_cache``, retried while it answers
that requests are still running or queued — an abort settling, a disk update in ``finish`` mode waiting for the
requests in flight) and the update's own calls then ask for no flush: SGLang fails a whole update whose flush it
refuses. Not with ``in_place`` (requests hold their cache; SGLang cannot flush).

Distributed (``weight_sync="distributed"``): each update is one SGLang weight-update session per server
(`WeightGroup.open_session`; a server that refuses it gets no bucket). If the update fails — a server refused it, died
mid-broadcast or could not join, nothing came back within ``rollout.weight_sync.timeout``, or the whole update passed
its ``deadline`` — the trainer closes the group (ending the survivors' broadcast too), closes the sessions and has the
servers destroy the group; that update goes by disk, loudly (a warning naming the failure), and then the run goes on —
the next update forms a new group with the servers left — or stops (``on_failure="stop"``).

Under torchrun every trainer rank holds an engine on the same servers (`ServerWeights.join_trainer_ranks`): an update
is then a collective call of every rank (`ServerWeights.update_over_ranks`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import gc
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from vlrl.models.policy import DTYPES, Policy
from vlrl.rollout import dist_sync
from vlrl.rollout.http_settings import SyncSettings, pause_mode
from vlrl.rollout.server_pool import NoServersLeft, RolloutRequestError, ServerPool
from vlrl.rollout.weight_group import BucketPlan, SessionRefused, WeightGroup, sent_state
from vlrl.rollout.weights import ChecksumCheck, WeightSyncError, quiet_transformers, weight_checksum

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SyncStats:
    """The last weight update: how, how long (seconds from the call to every server's confirmation), the bytes of
    one copy of the weights as sent (disk: the safetensors written), buckets sent, servers updated."""

    method: str
    seconds: float
    bytes: int
    buckets: int
    servers: int


class GroupBroken(RuntimeError):
    """The weight-update group failed mid-update (a server died, a timeout): this update must go by disk."""


class ServerWeights:
    """The weights ``pool``'s servers hold: their version, and the updates that change it (disk or distributed)."""

    def __init__(self, pool: ServerPool, policy: Policy, settings: SyncSettings) -> None:
        self.pool, self.policy, self.settings = pool, policy, settings
        self.method = settings.method  # disk | distributed (an update falling back to disk goes by disk meanwhile)
        self.on_weight_update = settings.on_weight_update
        self.weights_dir = Path(settings.weights_dir)
        self.version = 0  # the version every live server confirmed
        self.rank, self.world_size = 0, 1  # trainer ranks sharing these servers (`join_trainer_ranks`)
        self.last_sync: SyncStats | None = None
        self.checksums = ChecksumCheck()
        self.group = WeightGroup(pool, policy, settings, self.checksums)
        self._pause_depth = 0  # nested weight updates (a distributed one falling back to disk) pause once
        self._paused_servers = False
        self.flushed = False  # every live server's cache was flushed before this update's weights changed
        self.fallbacks: list[str] = []  # why each distributed update that went by disk could not go over the group
        self._saved: list[Path] = []
        self._publishing: concurrent.futures.Future | None = None

    @property
    def abort_on_update(self) -> bool:
        return self.on_weight_update == "abort"

    # -------------------------------------------------------------------------------------------- pause
    async def pause(self, method: str) -> None:
        """Before a weight update by ``method`` (``disk`` / ``distributed``): hold the engine's new requests back
        (the pool's ``gate``: they wait there, not in a server's queue against their timeout), then pause every live
        server (SGLang's ``/pause_generation``, mode by `pause_mode`) — so no request runs on half-updated weights
        (SGLang releases its writer lock between the buckets of a distributed update) and a paused SGLang loads at
        once. ``on_weight_update=finish``: a disk update pauses nothing (SGLang's load waits for the requests in
        flight, which end on the old weights, and holds new ones behind it; vlrl serve loads beside them); a
        distributed one first waits until the engine's requests in flight ended (each within its own timeout).
        Nested calls (a distributed update falling back to disk) pause once."""
        self._pause_depth += 1
        if self._pause_depth > 1:
            return
        self.pool.gate.clear()
        self.flushed = False
        if self.on_weight_update == "finish":
            if method == "disk":
                self.flushed = await self.flush_caches()
                return
            deadline = time.monotonic() + self.pool.settings.request_timeout
            while any(s.in_flight for s in self.pool.servers) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
        self._paused_servers = True
        engines = {s.engine for s in self.pool.servers}
        await self._weight_call("/pause_generation", {"mode": pause_mode(self.on_weight_update, engines)})
        if self.on_weight_update != "in_place":  # (requests held in place keep their cache: SGLang cannot flush)
            self.flushed = await self.flush_caches()

    async def flush_caches(self) -> bool:
        """SGLang's ``/flush_cache`` on every live server before the weights change, retried (backing off to 1 s) while
        a server answers 400 — requests still running or queued — for up to ``update_timeout``. True when every server
        flushed: the update's own calls then ask for no flush (SGLang fails a whole update, after loading it, when the
        flush it asks for is refused). A server without the route (404) or that never flushed: False (warned), and the
        update asks for the flush itself, as before."""
        pending, flushed, wait = self.pool.live(), True, 0.05
        deadline = time.monotonic() + self.settings.update_timeout
        while pending:
            answers = await self.pool.post_each(pending, "/flush_cache", [{}] * len(pending),
                                                timeout=self.settings.update_timeout)
            busy = []
            for server, answer in zip(pending, answers, strict=True):
                if isinstance(answer, BaseException):  # (gone: the update itself finds out)
                    log.warning("%s/flush_cache failed: %s: %s", server.url, type(answer).__name__, answer)
                    flushed = False
                elif answer.get("status_code") == 400:  # SGLang: requests still running or queued
                    busy.append(server)
                elif answer.get("status_code") == 404:
                    self.pool.warn_once(server.url, "/flush_cache", "%s has no /flush_cache: its cache is flushed by "
                                        "the update itself", server.url)
                    flushed = False
                elif answer.get("status_code") is not None:  # (401: the update's own call will say so)
                    log.warning("%s/flush_cache: %s", server.url, answer.get("message"))
                    flushed = False
            if busy and time.monotonic() + wait > deadline:
                log.warning("%s never flushed their cache within %.0f s (rollout.weight_sync.update_timeout): the "
                            "update asks for the flush itself", ", ".join(s.url for s in busy), self.settings.update_timeout)
                return False
            if busy:
                await asyncio.sleep(wait)
                wait = min(1.0, wait * 2)
            pending = busy
        return flushed

    async def resume(self) -> None:
        """After a weight update (whatever its outcome): ``/continue_generation`` on every live server (if they were
        paused), then let the engine's held requests go."""
        self._pause_depth -= 1
        if self._pause_depth:
            return
        try:
            if self._paused_servers:
                self._paused_servers = False
                await self._weight_call("/continue_generation", {})
        finally:
            self.pool.gate.set()

    async def _weight_call(self, path: str, body: dict) -> None:
        """POST ``body`` to every live server (admin key, ``weight_update_timeout``). A server without the route (404)
        is warned about once; other failures are logged — the update itself finds a server that is gone."""
        live = self.pool.live()
        answers = await self.pool.post_each(live, path, [body] * len(live), timeout=self.settings.update_timeout)
        for server, answer in zip(live, answers, strict=True):
            if isinstance(answer, BaseException):
                log.warning("%s%s failed: %s: %s", server.url, path, type(answer).__name__, answer)
            elif answer.get("status_code") == 404:
                self.pool.warn_once(server.url, path, "%s has no %s (not SGLang ≥ 0.4.9 nor vlrl serve): weight "
                                    "updates there are not paused", server.url, path)
            elif not answer.get("success", True):
                log.warning("%s%s: %s", server.url, path, answer.get("message", answer))

    # -------------------------------------------------------------------------------------------- updates
    def update_weights(self, *, version: int, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """Save the weights, have every live server load them, check checksums, then adopt ``version``.
        Under several trainer ranks (`join_trainer_ranks`) every rank calls it: see `update_over_ranks`."""
        if self.world_size > 1:
            self.update_over_ranks(version)
            return
        self.publish(version=version, state_dict=state_dict).result()

    def join_trainer_ranks(self, rank: int, world_size: int) -> None:
        """``rollout.servers.urls`` under torchrun: this engine is rank ``rank``'s of ``world_size`` trainer ranks (in
        the default torch.distributed group), each generating its share of the step on the same servers. A
        weight update is then a collective call of every rank: rank 0 alone talks to the servers, the others join
        the FSDP2 gathers of the parameters (bucket by bucket, or the full state dict for the disk path)."""
        self.rank, self.world_size = rank, world_size

    def update_over_ranks(self, version: int) -> None:
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
        state = sent_state(self.policy)  # (model.lora: merged on the shards — a collective, once per rank and update)
        if self.method == "distributed":
            plan = share(self.group.bucket_plan(self.pool.live()) if main else None)
            if main:
                try:
                    self.sync_distributed(version, state, plan=plan, fallback=False)
                    outcome = "done"
                except GroupBroken as err:
                    log.warning("distributed weight update %d failed (%s); loading it from disk instead — %s", version,
                                err, "then stopping (rollout.weight_sync.on_failure=stop)"
                                if self.settings.on_failure == "stop" else "the next update forms a new group")
                except Exception as err:  # noqa: BLE001 — every rank raises it below
                    outcome = f"{type(err).__name__}: {err}"
            else:
                for bucket in plan[1]:
                    dist_sync.full_tensors(state, bucket)  # rank 0's gathers need ours
            outcome = share(outcome)
        if outcome == "disk":
            full = self._full_state(state)
            if main:
                try:
                    if self.method == "disk":
                        self.publish(version=version, state_dict=full).result()
                    else:
                        self._disk_fallback(version, full)
                        self.stop_after_fallback(version, self.fallbacks[-1])
                    outcome = "done"
                except Exception as err:  # noqa: BLE001 — every rank raises it below
                    outcome = f"{type(err).__name__}: {err}"
            outcome = share(outcome)
        if outcome != "done":
            raise WeightSyncError(f"weight update {version} to the rollout servers failed on rank 0: {outcome}")
        self.version = version

    def _full_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """What rank 0 saves for a disk update under several ranks (a collective every rank joins): the merged LoRA
        weights (FSDP2: gathered onto rank 0), the full state dict of FSDP2 shards (on rank 0), or None (DDP: each
        rank's own model, whole)."""
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
        return full

    def _disk_fallback(self, version: int, state_dict: dict[str, torch.Tensor] | None) -> None:
        self.method = "disk"
        try:
            self.publish(version=version, state_dict=state_dict).result()
        finally:
            self.method = "distributed"

    # -------------------------------------------------------------------------------------------- disk
    def publish(self, *, version: int, state_dict: dict[str, torch.Tensor] | None = None) -> concurrent.futures.Future:
        """`update_weights` without waiting for the servers: save the weights and predict their checksums now (so
        the caller may change its parameters as soon as this returns), then have every live server load them in
        the background. The returned future resolves to ``version`` once every server confirmed a matching
        checksum — only then is the version bumped — or raises `WeightSyncError` / `NoServersLeft`.
        Publications are applied in order: a new one first waits for the previous one (and raises its error)."""
        previous, self._publishing = self._publishing, None
        if previous is not None:
            previous.result()
        if self.method == "distributed":  # the broadcast reads the live parameters: done before returning
            done: concurrent.futures.Future = concurrent.futures.Future()
            done.set_result(self.sync_distributed(version, state_dict))
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
        for server in self.pool.live():  # predicted checksum per server dtype, for the servers that report one
            if server.dtype not in checksums and server.reports_checksum and self.settings.verify_checksum:
                dtype = DTYPES.get(server.dtype or "")
                checksums[server.dtype] = weight_checksum(weights, dtype=dtype)
        self._publishing = asyncio.run_coroutine_threadsafe(self._publish(path, version, checksums, started),
                                                            self.pool.loop)
        return self._publishing

    async def _publish(self, path: Path, version: int, checksums: dict[str | None, str], started: float) -> int:
        await self.pause("disk")
        try:
            await self._load_everywhere(str(path.resolve()), version, checksums)
        finally:
            await self.resume()
        self.version = version
        size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        self.last_sync = SyncStats("disk", time.monotonic() - started, size, 0, len(self.pool.live()))
        self._saved.append(path)
        while len(self._saved) > self.settings.keep_checkpoints:
            shutil.rmtree(self._saved.pop(0), ignore_errors=True)
        return version

    def disk_body(self, path: str, version: int) -> dict[str, Any]:
        """The ``/update_weights_from_disk`` body (no flush asked for when the caches were flushed before it, or with
        requests held in place — SGLang cannot flush them)."""
        return {"model_path": path, "weight_version": str(version), "abort_all_requests": self.abort_on_update,
                "flush_cache": self.on_weight_update != "in_place" and not self.flushed}

    async def _load_everywhere(self, path: str, version: int, checksums: dict[str | None, str]) -> None:
        pool = self.pool
        live = pool.live()
        body = self.disk_body(path, version)
        results = await asyncio.gather(*(pool.client.post(f"{s.url}/update_weights_from_disk", json=body,
                                                          headers=pool.admin_headers,
                                                          timeout=self.settings.update_timeout) for s in live),
                                       return_exceptions=True)
        for server, result in zip(live, results, strict=True):
            if isinstance(result, BaseException):
                if pool.closing:
                    raise RolloutRequestError("the HTTP engine was closed during a weight update") from result
                pool.drop(server, f"weight update failed: {type(result).__name__}: {result}")
                continue
            answer = result.json() if result.headers.get("content-type", "").startswith("application/json") else {}
            if result.status_code >= 400 or not answer.get("success", False):
                raise WeightSyncError(f"{server.url} could not load {path}: {result.status_code} "
                                      f"{answer.get('message', result.text[:300])}")
            self.checksums(server.url, answer.get("weight_checksum"), version,
                           checksums.get(server.dtype) if server.reports_checksum else None)
        if not pool.live():
            raise pool.no_servers_left()

    # -------------------------------------------------------------------------------------------- distributed
    def sync_distributed(self, version: int, state_dict: dict[str, torch.Tensor] | None, *,
                         plan: BucketPlan | None = None, fallback: bool = True) -> int:
        """One update over the weight-update group (`vlrl.rollout.weight_group`); falls back to disk when the group
        breaks (``fallback=False``: raises `GroupBroken` instead, after every bucket was still gathered). ``plan``:
        the buckets (`WeightGroup.bucket_plan`) the other trainer ranks gather with this one. Returns ``version`` once
        every server confirmed a matching checksum. The servers are paused meanwhile (`pause`)."""
        self.pool.call(self.pause("distributed"))
        try:
            return self._sync_paused(version, state_dict, plan=plan, fallback=fallback)
        finally:
            self.pool.call(self.resume())

    def _sync_paused(self, version: int, state_dict: dict[str, torch.Tensor] | None, *, plan: BucketPlan | None,
                     fallback: bool) -> int:
        started = time.monotonic()
        deadline = started + self.settings.deadline
        state = sent_state(self.policy, state_dict)
        live = self.pool.live()
        plan = plan or self.group.bucket_plan(live)
        if not live:
            if not fallback:  # the other ranks still gather every bucket with us
                for bucket in plan[1]:
                    dist_sync.full_tensors(state, bucket)
            raise self.pool.no_servers_left()
        failure, session = None, []
        try:
            try:  # every server accepts the update (its session opened) before any collective is entered
                session = self.group.open_session(live, timeout=self.settings.timeout)
                if not self.group.current(live):
                    self.group.form(live)
            except BaseException:
                if not fallback:
                    for bucket in plan[1]:
                        dist_sync.full_tensors(state, bucket)
                raise
            sent, count = self.group.broadcast(version, state, live, plan, on_weight_update=self.on_weight_update,
                                               flushed=self.flushed, deadline=deadline)
            closed, session = self.group.close_session(session, timeout=self.settings.timeout), []
            if closed:
                raise SessionRefused("; ".join(closed))
        except (WeightSyncError, NoServersLeft):
            self.group.close_session(session, timeout=self.settings.timeout)
            raise
        except Exception as err:  # the update could not go over the group: it goes by disk
            if self.pool.closing:
                raise RolloutRequestError("the HTTP engine was closed during a weight update") from err
            failure = f"{type(err).__name__}: {err}"
        if failure is not None:  # (out of the except block: its traceback no longer holds the group's sockets open)
            # best effort, within what is left of the deadline (at least 5 s): a server still inside a receive answers
            # neither before that receive ends — on gloo when this side closes, on NCCL at the server's own timeout
            cleanup = max(5.0, min(self.settings.timeout, deadline - time.monotonic()))
            self.group.destroy(timeout=cleanup)  # first: the servers still waiting in its broadcast see it close …
            self.group.close_session(session, timeout=cleanup)  # … then their sessions can end
            gc.collect()
            self.fallbacks.append(failure)
            if not fallback:
                raise GroupBroken(failure)
            self._fall_back(version, state_dict, failure)
            return version
        self.version = version
        self.last_sync = SyncStats("distributed", time.monotonic() - started, sent, count, len(live))
        return version

    def _fall_back(self, version: int, state_dict: dict[str, torch.Tensor] | None, failure: str) -> None:
        """A distributed update that failed goes by disk, loudly; then the run goes on (the next update forms a new
        group) or, with ``on_failure="stop"``, stops with `WeightSyncError` — the servers holding the trainer's
        weights either way."""
        log.warning("distributed weight update %d failed (%s); loading it from disk instead — %s", version, failure,
                    "then stopping (rollout.weight_sync.on_failure=stop)" if self.settings.on_failure == "stop" else
                    "the next update forms a new group")
        self._disk_fallback(version, state_dict)
        self.stop_after_fallback(version, failure)

    def stop_after_fallback(self, version: int, failure: str) -> None:
        """``on_failure="stop"``: `WeightSyncError` naming why update ``version`` could not go over the group."""
        if self.settings.on_failure == "stop":
            raise WeightSyncError(f"distributed weight update {version} failed ({failure}); it was loaded from disk "
                                  "and rollout.weight_sync.on_failure=stop stops the run")
