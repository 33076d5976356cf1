"""`vlrl serve`'s weight routes, SGLang's: load from disk, join / leave a weight-update group, open and close a
weight-update session, receive a bucket of a distributed update, flush the cache, pause and continue generation
(`WeightRoutes`).

The session is SGLang 0.5.23's (``srt/managers/scheduler_components/weight_updater.py``): ``/begin_weight_update``
opens it (400 if one is open), ``/end_weight_update`` closes it (400 if none is; an update left half-way is dropped),
and ``/update_weights_from_distributed`` is refused outside it with SGLang's message — so the client's own tests follow
the order a real SGLang enforces. ``/flush_cache`` answers as SGLang does (plain text, 200); vlrl serve keeps no cache
across requests, so there is nothing to refuse.

A disk load copies the directory's safetensors in place into the batcher's spare weights
(`ContinuousBatcher.load_in_place`; other formats: ``from_pretrained``). A distributed update receives each bucket
straight into the spare weights (`dist_sync.Receiver`; their tensors become views of the bucket's storage, a bucket in
another dtype is received into a buffer and cast in); the bucket carrying ``weight_version`` completes the update,
which is swapped in like a disk load and answered with its ``weight_checksum``. A disk load or a new group drops an
update left half-way.
"""

from __future__ import annotations

import asyncio
import collections.abc
import threading
import weakref
from typing import Any

import torch

from vlrl.models.policy import Policy
from vlrl.rollout import dist_sync
from vlrl.rollout.batcher import ContinuousBatcher
from vlrl.rollout.server.schema import (
    BadRequest,
    BeginSessionBody,
    ContinueBody,
    DestroyGroupBody,
    EndSessionBody,
    InitWeightsGroupBody,
    PauseBody,
    ServeLimits,
    UpdateDistributedBody,
    UpdateWeightsBody,
)
from vlrl.rollout.weights import FlatBuckets, WeightWriter, checkpoint_names, quiet_transformers, read_weights


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


class WeightRoutes:
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
        self.session: str | None = None  # the open weight-update session's selector (SGLang's), else None

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
                "/continue_generation": self.resume, "/begin_weight_update": self.begin_session,
                "/end_weight_update": self.end_session, "/flush_cache": self.flush_cache}

    def groups(self) -> list[str]:
        return self.receiver.group_names()

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
        if self.session is None:  # SGLang 0.5.23's refusal, word for word (its scheduler answers before receiving)
            return self.answer({"success": False, "message": "update_weights_from_distributed must run between "
                                "begin_weight_update() and end_weight_update()"}, 400)
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

    async def begin_session(self, request: Any):
        """SGLang's ``/begin_weight_update``: open the weight-update session (one at a time)."""
        body = await self.read(request, BeginSessionBody)
        if self.session is not None:
            return self.answer({"success": False, "message": "a weight-update session is already open; call "
                                "end_weight_update() first"}, 400)
        self.session = body.selector
        return self.answer({"success": True, "message": "Success"})

    async def end_session(self, request: Any):
        """SGLang's ``/end_weight_update``: close the session; a distributed update it left half-way is dropped (its
        trainer gave up on it: the weights served stay those of the last completed update)."""
        await self.read(request, EndSessionBody)
        if self.session is None:
            return self.answer({"success": False, "message": "no weight-update session is open; call "
                                "begin_weight_update() first"}, 400)
        async with self.lock:
            self.incoming.cancel()
            self.session = None
        return self.answer({"success": True, "message": "Success"})

    async def flush_cache(self, request: Any):
        """SGLang's ``/flush_cache`` (its plain-text answer): vlrl serve keeps no cache across requests."""
        from fastapi.responses import PlainTextResponse

        return PlainTextResponse("Cache flushed.\n")

    async def pause(self, request: Any):
        body = await self.read(request, PauseBody)
        self.batcher.pause(body.mode)
        return self.answer({"message": "Generation paused successfully.", "status": "ok"})

    async def resume(self, request: Any):
        await self.read(request, ContinueBody)
        self.batcher.resume()
        return self.answer({"message": "Generation continued successfully.", "status": "ok"})



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
                             "with /update_weights_from_disk (rollout.weight_sync.method=disk)")
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
