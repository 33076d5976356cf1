"""`VLLMServerWeights`: `ServerWeights` for vLLM servers — the same saves, versions, publications and fall-backs, with
vLLM's own calls where SGLang's were:

    pause before an update      ``/pause?mode=`` wait (``on_weight_update=finish``) / abort / keep (``retract``,
                                ``in_place``) — on both paths; vLLM has no ``retract`` (`vllm_protocol.PAUSE_MODES`)
    resume after it             ``/resume``
    disk update                 `VLLMServers.load_everywhere`: ``reload_weights`` from the saved directory, the prefix
                                cache reset, the version set and read back, the checksums compared; a failed load
                                restores the last good version on that server and raises `WeightSyncError`
    distributed update          `vlrl.rollout.vllm_transfer` (NCCL, GPU only); a failure closes the group and loads
                                that version by disk

Several trainer ranks (torchrun) share the servers by disk only: the NCCL transfer sends from one process.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from vlrl.models.policy import DTYPES
from vlrl.rollout.publish import ServerWeights, SyncStats
from vlrl.rollout.vllm_client import VLLMServers, checkpoint_state
from vlrl.rollout.vllm_transfer import VLLMTransfer, send_order
from vlrl.rollout.weights import WeightSyncError

log = logging.getLogger(__name__)


class VLLMServerWeights(ServerWeights):
    """The weights of a pool of vLLM servers (module docstring). ``vllm``: the pool's `VLLMServers`."""

    def __init__(self, pool, policy, settings, vllm: VLLMServers) -> None:
        super().__init__(pool, policy, settings)
        self.vllm = vllm
        self.transfer: VLLMTransfer | None = None
        self._good: tuple[Path, int] | None = None  # the last version every server loaded, and where it is saved

    def join_trainer_ranks(self, rank: int, world_size: int) -> None:
        if world_size > 1 and self.method == "distributed":
            raise ValueError("rollout.weight_sync.method=distributed to vLLM servers sends from one trainer process; "
                             "with several trainer ranks use rollout.weight_sync.method=disk")
        super().join_trainer_ranks(rank, world_size)

    # -------------------------------------------------------------------------------------------- pause
    async def pause(self, method: str) -> None:
        """Hold the engine's new requests, then pause every live server (`VLLMServers.pause_call`) — for a disk update
        too: vLLM's reload does not wait for the requests in flight (``finish`` → ``wait`` lets them end first)."""
        self._pause_depth += 1
        if self._pause_depth > 1:
            return
        self.pool.gate.clear()
        self._paused_servers = True
        await self._weight_call(*self.vllm.pause_call(self.on_weight_update))

    async def resume(self) -> None:
        self._pause_depth -= 1
        if self._pause_depth:
            return
        try:
            if self._paused_servers:
                self._paused_servers = False
                await self._weight_call(*VLLMServers.RESUME_CALL)
        finally:
            self.pool.gate.set()

    # -------------------------------------------------------------------------------------------- disk
    async def _load_everywhere(self, path: str, version: int, checksums: dict[str | None, str]) -> None:
        """Every live server reloads ``path`` as ``version`` (`VLLMServers.load_everywhere`)."""
        await self.vllm.load_everywhere(Path(path), version, state=lambda: checkpoint_state(path), previous=self._good,
                                        timeout=self.settings.update_timeout)
        self._good = (Path(path), version)

    # -------------------------------------------------------------------------------------------- distributed
    def sync_distributed(self, version: int, state_dict: dict[str, torch.Tensor] | None, *, plan: Any = None,
                         fallback: bool = True) -> int:
        """One update over NCCL (`VLLMTransfer`), the servers paused meanwhile; on failure the group is closed and the
        version loaded by disk."""
        from vlrl.rollout.weight_group import sent_state
        from vlrl.rollout.weights import checkpoint_names

        started = time.monotonic()
        live = self.pool.live()
        if not live:
            raise self.pool.no_servers_left()
        state = sent_state(self.policy, state_dict)
        names = checkpoint_names(self.policy.model, state)
        tensors = send_order({n: t.to("cuda") if torch.cuda.is_available() else t for n, t in state.items()}, names)
        dtype = DTYPES.get(live[0].dtype or "", torch.bfloat16)
        if self.transfer is None:
            self.transfer = VLLMTransfer(self.pool, timeout=self.settings.timeout,
                                         update_timeout=self.settings.update_timeout, bucket_mb=self.settings.bucket_mb)
        self.pool.call(self.pause("distributed"))
        failure = None
        try:
            sent = self.transfer.update(live, tensors, version, dtype)
            for server in live:
                self.pool.call(self.vllm.set_version(server, version, self.settings.update_timeout))
        except Exception as err:  # noqa: BLE001 - any failure: close the group, load the version by disk
            failure = f"{type(err).__name__}: {err}"
            self.transfer.close(live)
        finally:
            self.pool.call(self.resume())
        if failure is not None:
            if not fallback:
                raise WeightSyncError(f"distributed weight update {version} to vLLM failed: {failure}")
            log.warning("distributed weight update %d to vLLM failed (%s); loading it from disk instead, the next "
                        "update forms a new group", version, failure)
            self._disk_fallback(version, state_dict)
            return version
        self.version = version
        self.last_sync = SyncStats("distributed", time.monotonic() - started, sent, 1, len(live))
        return version
