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
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import os
import socket
import threading
from typing import Any

import torch

from vlrl.models.policy import DTYPES, Policy
from vlrl.rollout import dist_sync
from vlrl.rollout.http_settings import SyncSettings
from vlrl.rollout.server_pool import ServerPool, ServerState
from vlrl.rollout.weights import ChecksumCheck, WeightSyncError, checkpoint_names

log = logging.getLogger(__name__)

BucketPlan = tuple[torch.dtype, list[list[dist_sync.Entry]]]  # (the dtype the servers receive, the buckets)


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
                    on_weight_update: str) -> dict[str, Any]:
        """The ``/update_weights_from_distributed`` body announcing one flattened bucket (the last one carries the
        new ``weight_version`` and flushes the cache — unless requests are held in place)."""
        return {"names": [e.send_name for e in bucket], "dtypes": [dist_sync.dtype_name(d) for d in dtypes],
                "shapes": [list(e.shape) for e in bucket], "group_name": self.name,
                "flush_cache": last and on_weight_update != "in_place",  # (SGLang: no flush with requests held)
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
                  on_weight_update: str) -> tuple[int, int]:
        """Send every bucket of ``plan``; check the last answers' checksums. Returns (bytes of one copy sent,
        buckets). Every bucket is gathered even after a failure (other trainer ranks gather it with this one);
        the first failure is raised once all were."""
        dtypes = {s.dtype for s in live}
        checksum = dist_sync.StreamingChecksum([DTYPES.get(d or "") for d in dtypes])
        send_dtype, planned = plan
        sent, failure = 0, None
        for k, bucket in enumerate(planned):
            last = k == len(planned) - 1
            gathered = dist_sync.full_tensors(state, bucket, self.device)  # FSDP2: gathered one bucket at a time
            if failure is not None:
                continue
            try:
                body = self.bucket_body(version, bucket, self._dtypes(gathered, send_dtype), last=last,
                                        on_weight_update=on_weight_update)
                sent += self._send_bucket(body, version, live, bucket, gathered, send_dtype, checksum, last=last)
            except BaseException as err:  # noqa: BLE001 — raised after the remaining buckets' gathers
                failure = err
        if failure is not None:
            raise failure
        return sent, len(planned)

    @staticmethod
    def _dtypes(gathered: list[torch.Tensor], send_dtype: torch.dtype) -> list[torch.dtype]:
        return [send_dtype if t.is_floating_point() else t.dtype for t in gathered]

    def _send_bucket(self, body: dict[str, Any], version: int, live: list[ServerState], bucket: list[dist_sync.Entry],
                     gathered: list[torch.Tensor], send_dtype: torch.dtype, checksum: dist_sync.StreamingChecksum,
                     *, last: bool) -> int:
        """Announce one bucket (``body``) to every server, pack its tensors (cast to ``send_dtype``) into the send
        buffer and broadcast it, checksum the bytes sent while the servers load them, read the answers; returns the
        bytes sent. A server whose answer fails ends the wait for the broadcast at once (`dist_sync.broadcast`);
        every wait is bounded by ``sync_timeout``."""
        timeout = self.settings.timeout
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
            checksum.add(entry, tensor, sent=raw, sent_dtype=dtype)  # per server dtype, as the disk path predicts
        try:
            results = answers.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            answers.cancel()
            raise dist_sync.Abandoned(f"no answer within {timeout:.0f} s (rollout.weight_sync.timeout)") from None
        for server, answer in zip(live, results, strict=True):
            if isinstance(answer, BaseException):
                raise RuntimeError(f"{server.url}: {type(answer).__name__}: {answer}")
            if not answer.get("success", False):
                raise WeightSyncError(f"{server.url} could not load version {version} from the trainer's broadcast: "
                                      f"{answer.get('message', answer)}")
            if last:
                self.checksums(server.url, answer.get("weight_checksum"), version,
                               checksum.digest(DTYPES.get(server.dtype or "")))
        return flat.numel()


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
