"""`VLLMTransfer`: ``rollout.weight_sync.method=distributed`` to vLLM servers — the trainer broadcasts its weights over
NCCL into vLLM's own weight-transfer engine (``vllm/distributed/weight_transfer/nccl_engine.py``; servers started with
``--weight-transfer-config '{"backend": "nccl"}'`` and ``VLLM_SERVER_DEV_MODE=1``). GPU only: NCCL moves GPU memory.
**This path has never run on a GPU**: its calls, their order and their bodies are checked against vLLM 0.32's own
route, engine-client and worker code on the CPU, with the broadcasts stubbed (tests/rollout/test_vllm_conformance.py).

The group (once, and again after a failure):

    trainer: uid = ncclGetUniqueId()                       (``torch.cuda.nccl.unique_id``: no vLLM on the trainer side)
    POST /init_weight_transfer_engine {init_info: {nccl_unique_id_b64, rank_offset, world_size, packed: false}}
         to every server at once (server i's workers take ranks rank_offset … rank_offset + workers − 1)
    trainer: ncclCommInitRank(world_size, uid, 0), then the one-element all-reduce every vLLM rank issues right after
             joining (``PyNcclCommunicator.from_unique_id_bytes``' warm-up handshake) — while the servers' calls wait

Each update:

    POST /start_weight_update                                (every server: the layer-wise reload begins)
    per bucket of ``rollout.weight_sync.bucket_mb``:
        POST /update_weights {update_info: {names, dtype_names, shapes}}   (every server, in the background)
        trainer: one broadcast per tensor from rank 0, in the listed order (``packed`` off)
        wait for every server's answer
    POST /finish_weight_update {weight_version: "V"}         (load what arrived, adopt V); GET /weight_info == "V"

A failure (a call refused, a broadcast that fails or times out) closes the group: vlrl asks every server to finish the
half-done session and release the group (``/shutdown_weight_transfer_engine``), then loads that version by disk
(`vlrl.rollout.vllm_client`); the next update forms a new group.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch

from vlrl.rollout import vllm_protocol as proto
from vlrl.rollout.server_pool import ServerPool, ServerState
from vlrl.rollout.weights import WeightSyncError

log = logging.getLogger(__name__)


class Collective(Protocol):
    """The trainer's NCCL calls (`TorchNCCL`; tests stand in a recording one on the CPU)."""

    def unique_id(self) -> bytes: ...

    def join(self, world_size: int, unique_id: bytes) -> Any: ...  # rank 0; then the warm-up all-reduce

    def broadcast(self, comm: Any, tensor: torch.Tensor) -> None: ...

    def close(self, comm: Any) -> None: ...


class TorchNCCL:
    """NCCL through torch's own bindings (``torch.cuda.nccl``), on the current CUDA device."""

    def unique_id(self) -> bytes:
        return torch.cuda.nccl.unique_id()

    def join(self, world_size: int, unique_id: bytes) -> Any:
        comm = torch.cuda.nccl.init_rank(world_size, unique_id, 0)
        torch.cuda.nccl.all_reduce([torch.zeros(1, device="cuda")], comms=[comm])  # vLLM's warm-up handshake
        torch.cuda.synchronize()
        return comm

    def broadcast(self, comm: Any, tensor: torch.Tensor) -> None:
        torch.cuda.nccl.broadcast([tensor], root=0, comms=[comm])

    def close(self, comm: Any) -> None:
        del comm  # torch's binding frees the communicator with the object


class VLLMTransfer:
    """The NCCL group between this trainer and ``pool``'s vLLM servers, and the updates over it (module docstring)."""

    def __init__(self, pool: ServerPool, *, timeout: float, update_timeout: float, bucket_mb: float,
                 collective: Collective | None = None) -> None:
        self.pool, self.timeout, self.update_timeout = pool, timeout, update_timeout
        self.bucket_bytes = max(1, int(bucket_mb * 2**20))
        self.collective = collective or TorchNCCL()
        self.comm: Any = None
        self.members: tuple[str, ...] = ()

    async def _post_all(self, servers: Sequence[ServerState], path: str, body: dict[str, Any] | None,
                        timeout: float) -> None:
        """POST ``body`` to every server at once; `WeightSyncError` naming the first that failed."""
        answers = await self.pool.post_each(list(servers), path, [body or {}] * len(servers), timeout=timeout)
        for server, answer in zip(servers, answers, strict=True):
            if isinstance(answer, BaseException):
                raise WeightSyncError(f"{server.url}{path}: {type(answer).__name__}: {answer}")
            if isinstance(answer, dict) and answer.get("success") is False:
                raise WeightSyncError(f"{server.url}{path}: {answer.get('message', answer)}")

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.pool.loop)

    # -------------------------------------------------------------------------------------------- the group
    def form(self, servers: Sequence[ServerState]) -> None:
        """Join every server's workers and this trainer (rank 0) in one NCCL group."""
        world = 1 + sum(s.ranks for s in servers)
        unique_id = self.collective.unique_id()
        offsets = list(itertools.accumulate([1, *(s.ranks for s in servers)]))[: len(servers)]  # each one's first rank
        bodies = [proto.nccl_init_body(unique_id, rank_offset=o, world_size=world) for o in offsets]
        joined = self._run(self.pool.post_each(list(servers), "/init_weight_transfer_engine", bodies,
                                               timeout=self.timeout))
        try:
            self.comm = self.collective.join(world, unique_id)  # (the servers' calls return once everyone joined)
        finally:
            answers = joined.result(timeout=self.timeout + 5)
        for server, answer in zip(servers, answers, strict=True):
            if isinstance(answer, BaseException) or (isinstance(answer, dict) and answer.get("success") is False):
                raise WeightSyncError(f"{server.url}/init_weight_transfer_engine: {answer}")
        self.members = tuple(s.url for s in servers)

    def current(self, servers: Sequence[ServerState]) -> bool:
        return self.comm is not None and self.members == tuple(s.url for s in servers)

    def close(self, servers: Sequence[ServerState]) -> None:
        """After a failure: end the servers' half-done session, release their group and ours."""
        for path in ("/finish_weight_update", "/shutdown_weight_transfer_engine"):
            try:
                self._run(self.pool.post_each(list(servers), path, [{}] * len(servers), timeout=30.0)).result(60)
            except Exception as err:  # noqa: BLE001 - best effort: the disk load that follows checks the server
                log.debug("%s after a failed transfer: %s", path, err)
        if self.comm is not None:
            self.collective.close(self.comm)
        self.comm, self.members = None, ()

    # -------------------------------------------------------------------------------------------- an update
    def buckets(self, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype) -> list[list[str]]:
        """Names in order, grouped into buckets of at most ``bucket_mb`` as sent (a larger tensor is a bucket alone)."""
        out: list[list[str]] = [[]]
        size = 0
        for name, tensor in tensors.items():
            nbytes = tensor.numel() * (torch.empty(0, dtype=dtype).element_size() if tensor.is_floating_point()
                                       else tensor.element_size())
            if out[-1] and size + nbytes > self.bucket_bytes:
                out.append([])
                size = 0
            out[-1].append(name)
            size += nbytes
        return [b for b in out if b]

    def update(self, servers: Sequence[ServerState], tensors: Mapping[str, torch.Tensor], version: int,
               dtype: torch.dtype) -> int:
        """Broadcast ``tensors`` (checkpoint names → full tensors on the CUDA device, in send order) to ``servers`` as
        ``version`` (module docstring); returns the bytes sent. Raises on any failure (the caller closes the group
        and loads the version by disk)."""
        if not self.current(servers):
            self.form(servers)
        self._run(self._post_all(servers, "/start_weight_update", None, self.update_timeout)).result()
        sent = 0
        for names in self.buckets(tensors, dtype):
            payload = [tensors[n].to(dtype) if tensors[n].is_floating_point() else tensors[n] for n in names]
            body = proto.nccl_update_body(names, [t.dtype for t in payload], [tuple(t.shape) for t in payload])
            answered = self._run(self._post_all(servers, "/update_weights", body, self.update_timeout))
            for tensor in payload:
                self.collective.broadcast(self.comm, tensor.contiguous())
                sent += tensor.numel() * tensor.element_size()
            answered.result(timeout=self.timeout)
        self._run(self._post_all(servers, "/finish_weight_update", proto.finish_body(version),
                                 self.update_timeout)).result()
        return sent


def send_order(state: Mapping[str, torch.Tensor], names: Mapping[str, str] | None) -> dict[str, torch.Tensor]:
    """The tensors of a state dict under their checkpoint names (``names``: {checkpoint name → state-dict name},
    `vlrl.rollout.weights.checkpoint_names`), each once (a tied copy is sent under its first name), in order."""
    seen: set[tuple[int, tuple[int, ...]]] = set()
    out: dict[str, torch.Tensor] = {}
    for send_name, name in (names or {n: n for n in state}).items():
        tensor = state[name]
        key = (tensor.data_ptr(), tuple(tensor.shape))
        if key in seen and math.prod(tensor.shape):
            continue
        seen.add(key)
        out[send_name] = tensor
    return out
