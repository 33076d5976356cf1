"""Distributed weight sync on SGLang's protocol: the trainer broadcasts its weights over a process group the
rollout servers join, instead of writing them to disk for the servers to read.

The protocol is SGLang's (``python/sglang/srt/managers/io_struct.py``; the trainers of slime and verl speak it):

    1. POST /init_weights_update_group  {master_address, master_port, rank_offset, world_size, group_name, backend}
       to every server, while the trainer joins the same group as rank 0 (it hosts the rendezvous store at
       master_address:master_port). Server i takes rank ``rank_offset`` (1 + i for one-rank servers);
       ``world_size`` = 1 + every server rank. Every joiner blocks until all have joined.
    2. per update, per bucket of parameters:
         POST /update_weights_from_distributed  {names, dtypes, shapes, group_name, flush_cache, weight_version,
         load_format, ...} to every server (in the background), then broadcast the bucket from rank 0, then wait for
         every server's answer. The server allocates ``torch.empty(shape, dtype)`` per name, receives the broadcasts
         and loads the tensors. With ``load_format="flattened_bucket"`` (what vlrl's trainer sends) the bucket is one
         broadcast of the tensors' bytes concatenated in the listed order (SGLang's ``FlattenedTensorBucket``);
         without it, one broadcast per tensor.

Names are checkpoint names (what ``save_pretrained`` writes; SGLang's ``load_weights`` expects them), dtypes
strings without ``torch.``. The group is built the way SGLang's ``init_custom_process_group`` builds it — a TCP
store at ``master_address:master_port`` (hosted by rank 0), prefixed by ``group_name``, a process group of its
own beside any default group — so a trainer that already runs under torchrun can host it, and a real SGLang
server (NCCL on GPUs) can join it. vlrl's own server joins over gloo on CPU (`vlrl.rollout.server`).

The trainer's tensors are gathered bucket by bucket (`full_tensors`): an FSDP2 shard is all-gathered when its
bucket is sent, so no rank ever holds more than one bucket of full tensors beside its shards.
"""

from __future__ import annotations

import dataclasses
import hashlib
import zlib
from collections.abc import Iterator, Mapping, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

GROUP_NAME = "weight_update_group"  # SGLang's default
DTYPE_NAMES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64,
               "int64": torch.int64, "int32": torch.int32, "uint8": torch.uint8, "bool": torch.bool}


def dtype_name(dtype: torch.dtype) -> str:
    """SGLang's spelling of a dtype: ``torch.bfloat16`` → ``bfloat16``."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str, *, field: str = "dtypes") -> torch.dtype:
    try:
        return DTYPE_NAMES[name.removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"field '{field}': unknown dtype {name!r} (choose from {sorted(DTYPE_NAMES)})") from None


def open_group(master_address: str, master_port: int, *, rank: int, world_size: int, group_name: str = GROUP_NAME,
               backend: str = "gloo", timeout: float = 300.0) -> dist.ProcessGroup:
    """Join (rank 0: host) the weight-update group, as SGLang's ``init_custom_process_group`` does: a TCP
    rendezvous, a store prefixed by ``group_name``, a group of its own beside any default process group.
    Blocks until all ``world_size`` ranks joined (or ``timeout`` seconds passed)."""
    from torch.distributed import distributed_c10d as c10d

    wait = timedelta(seconds=timeout)
    # the TCP store itself, not `rendezvous("tcp://…")`: under torchrun (TORCHELASTIC_USE_AGENT_STORE) that makes
    # every rank a client of a store nobody hosts, and a trainer rank 0 must host this one
    store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0, timeout=wait,
                          wait_for_workers=False)
    group, _ = c10d._new_process_group_helper(world_size, rank, [], backend, dist.PrefixStore(group_name, store),
                                              group_name=group_name, timeout=wait)
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}  # so dist.broadcast(..., group=) works
    return group


def close_group(group: dist.ProcessGroup | None) -> None:
    if group is not None:
        try:
            dist.destroy_process_group(group)
        except Exception:  # already gone (a peer died): nothing left to release
            pass


FLATTENED = "flattened_bucket"  # SGLang's load_format: a bucket's tensors go as one uint8 tensor, one broadcast


def receive(group: dist.ProcessGroup, shapes: Sequence[Sequence[int]], dtypes: Sequence[torch.dtype], *,
            flattened: bool = False) -> list[torch.Tensor]:
    """The server's side of one bucket: a fresh tensor per (shape, dtype), each filled by rank 0's broadcast (all
    posted at once, then waited for — SGLang's order); ``flattened``: one broadcast of their bytes, concatenated
    in order (SGLang's ``FlattenedTensorBucket``), cut back into the tensors."""
    tensors = [torch.empty(tuple(shape), dtype=dtype) for shape, dtype in zip(shapes, dtypes, strict=True)]
    if flattened:
        flat = torch.empty(sum(t.numel() * t.element_size() for t in tensors), dtype=torch.uint8)
        dist.broadcast(flat, src=0, group=group)
        offset = 0
        for t in tensors:
            size = t.numel() * t.element_size()
            t.reshape(-1).view(torch.uint8).copy_(flat[offset : offset + size])
            offset += size
        return tensors
    works = [dist.broadcast(t, src=0, group=group, async_op=True) for t in tensors]
    for work in works:
        work.wait()
    return tensors


def send(group: dist.ProcessGroup, tensors: Sequence[torch.Tensor], *, flattened: bool = False) -> None:
    """The trainer's side of one bucket: broadcast each tensor from rank 0, in order (``flattened``: their bytes
    concatenated, one broadcast)."""
    if flattened:
        dist.broadcast(torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in tensors]), src=0, group=group)
        return
    works = [dist.broadcast(t.contiguous(), src=0, group=group, async_op=True) for t in tensors]
    for work in works:
        work.wait()


# ----------------------------------------------------------------------------------------------- the trainer's tensors
@dataclasses.dataclass(frozen=True)
class Entry:
    """One tensor the trainer sends: its state-dict name, the name the servers receive it under (the checkpoint
    name), its shape, and the other state-dict names tied to it (they are not sent, but are checksummed)."""

    name: str
    send_name: str
    shape: tuple[int, ...]
    numel: int
    aliases: tuple[str, ...] = ()


def plan_entries(model: torch.nn.Module, send_names: Mapping[str, str] | None) -> list[Entry]:
    """What a weight update sends, in state-dict order: every state-dict tensor once (a tied copy rides on its
    first name). ``send_names``: {state-dict name → checkpoint name} (`checkpoint_names` inverted); None sends
    state-dict names. Works on a plain model and on an FSDP2-sharded one (shapes are the full shapes)."""
    state = model.state_dict()
    first: dict[tuple, str] = {}
    aliases: dict[str, list[str]] = {}
    order = []
    for name, tensor in state.items():
        local = getattr(tensor, "_local_tensor", tensor)
        key = (local.data_ptr(), tuple(tensor.shape), local.storage_offset()) if local.numel() else ("empty", name)
        if key in first:
            aliases[first[key]].append(name)
            continue
        first[key] = name
        aliases[name] = []
        order.append(name)
    names = send_names or {}
    return [Entry(n, names.get(n, n), tuple(state[n].shape), state[n].numel(), tuple(aliases[n])) for n in order]


def buckets(entries: Sequence[Entry], *, element_size: int, bucket_bytes: int) -> list[list[Entry]]:
    """Consecutive entries grouped into buckets of at most ``bucket_bytes`` (a larger tensor is a bucket alone)."""
    out: list[list[Entry]] = []
    size = 0
    for entry in entries:
        nbytes = entry.numel * element_size
        if not out or size + nbytes > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append(entry)
        size += nbytes
    return out


def full_tensors(state: Mapping[str, torch.Tensor], bucket: Sequence[Entry]) -> list[torch.Tensor]:
    """The full tensors of one bucket: a DTensor shard is all-gathered (a collective: every trainer rank calls
    this with the same bucket), a plain tensor is detached as it is."""
    out = []
    for entry in bucket:
        tensor = state[entry.name].detach()
        if hasattr(tensor, "full_tensor"):
            tensor = tensor.full_tensor()
        out.append(tensor.cpu())
    return out


class StreamingChecksum:
    """`vlrl.rollout.weights.weight_checksum` of the full state dict, accumulated bucket by bucket (as the
    tensors are gathered) for each server dtype at once: the same line per tensor, the same order (sorted by
    name), the same digest — so a server's answer can be compared with it."""

    def __init__(self, dtypes: Sequence[torch.dtype | None]) -> None:
        self.lines: dict[torch.dtype | None, dict[str, str]] = {d: {} for d in dtypes}

    def add(self, entry: Entry, tensor: torch.Tensor) -> None:
        for dtype, lines in self.lines.items():
            t = tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor
            flat = t.contiguous().reshape(-1)
            crc = zlib.crc32(memoryview(flat.view(torch.uint8).numpy()))
            for name in (entry.name, *entry.aliases):
                lines[name] = f"{name}|{flat.dtype}|{tuple(tensor.shape)}|{crc:08x}\n"

    def digest(self, dtype: torch.dtype | None) -> str:
        digest = hashlib.sha256()
        lines = self.lines[dtype]
        for name in sorted(lines):
            digest.update(lines[name].encode())
        return digest.hexdigest()


def iter_updates(model: torch.nn.Module, entries: Sequence[Entry], *, bucket_bytes: int,
                 send_dtype: torch.dtype) -> Iterator[tuple[list[Entry], list[torch.Tensor]]]:
    """(bucket, its full tensors), bucket after bucket — buckets of at most ``bucket_bytes`` once cast to
    ``send_dtype``; one bucket of full tensors exists at a time. Every trainer rank iterates (FSDP2 gathers are
    collectives)."""
    state = model.state_dict()
    element_size = torch.empty(0, dtype=send_dtype).element_size()
    for bucket in buckets(entries, element_size=element_size, bucket_bytes=bucket_bytes):
        tensors = full_tensors(state, bucket)
        yield bucket, tensors


# ----------------------------------------------------------------------------------------------- the server's side
class Receiver:
    """A server's side of the protocol (`vlrl serve`): the groups it joined, and the buckets of the update in
    progress, staged until the bucket carrying ``weight_version`` completes it (then the server loads them all at
    once, so no batch ever sees half an update). Thread-safe use is the caller's (the server's update lock)."""

    def __init__(self, *, timeout: float = 300.0) -> None:
        self.timeout = timeout
        self.groups: dict[str, dist.ProcessGroup] = {}
        self.staged: dict[str, torch.Tensor] = {}
        self.abort = False

    def join(self, master_address: str, master_port: int, *, rank_offset: int, world_size: int, group_name: str,
             backend: str) -> None:
        """Join ``group_name`` as rank ``rank_offset`` (blocks until every rank joined); a group of the same name
        joined before is left first (a trainer that restarted forms it again)."""
        close_group(self.groups.pop(group_name, None))
        self.staged.clear()
        self.groups[group_name] = open_group(master_address, master_port, rank=rank_offset, world_size=world_size,
                                             group_name=group_name, backend=backend, timeout=self.timeout)

    def receive(self, group_name: str, names: Sequence[str], dtypes: Sequence[str],
                shapes: Sequence[Sequence[int]], *, abort: bool, load_format: str | None = None) -> None:
        """Receive one bucket's broadcasts and stage them under ``names``."""
        group = self.groups.get(group_name)
        if group is None:
            raise ValueError(f"field 'group_name': {group_name!r} is not a group this server joined "
                             f"(joined: {sorted(self.groups) or 'none'}); call /init_weights_update_group first")
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError(f"fields 'names', 'dtypes', 'shapes': {len(names)}, {len(dtypes)} and {len(shapes)} "
                             "items; one each per tensor")
        if load_format not in (None, FLATTENED):
            raise ValueError(f"field 'load_format': {load_format!r}; vlrl serve receives tensors one by one (null) or "
                             f"as a {FLATTENED!r}")
        torch_dtypes = [parse_dtype(d) for d in dtypes]
        try:
            received = receive(group, shapes, torch_dtypes, flattened=load_format == FLATTENED)
        except RuntimeError:  # a peer left (the trainer gave up on this group): it is unusable from now on
            close_group(self.groups.pop(group_name, None))
            raise
        for name, tensor in zip(names, received, strict=True):
            self.staged[name] = tensor
        self.abort = self.abort or abort

    def take(self) -> tuple[dict[str, torch.Tensor], bool]:
        """The staged tensors of the update (and whether any bucket asked to abort requests); staging is reset."""
        staged, abort = self.staged, self.abort
        self.staged, self.abort = {}, False
        return staged, abort

    def close(self) -> None:
        for group in self.groups.values():
            close_group(group)
        self.groups.clear()
