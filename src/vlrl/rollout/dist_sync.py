"""Distributed weight sync on SGLang's protocol: the trainer broadcasts its weights over a process group the
rollout servers join, instead of writing them to disk for the servers to read.

The protocol is SGLang's (``python/sglang/srt/managers/io_struct.py``; the trainers of slime and verl speak it):

    1. POST /init_weights_update_group  {master_address, master_port, rank_offset, world_size, group_name, backend}
       to every server, while the trainer joins the same group as rank 0 (it hosts the rendezvous store at
       master_address:master_port). Server i takes ranks ``rank_offset`` … ``rank_offset + tp_size − 1`` (SGLang:
       ``rank_offset + tp_rank``); ``world_size`` = 1 + every server rank. Every joiner blocks until all have joined.
       A group the trainer replaces is left by every server (``/destroy_weights_update_group {group_name}``).
    2. per update, per bucket of parameters:
         POST /update_weights_from_distributed  {names, dtypes, shapes, group_name, flush_cache, weight_version,
         load_format, ...} to every server (in the background), then broadcast the bucket from rank 0, then wait for
         every server's answer. The server receives the broadcasts into tensors of the listed shapes and dtypes
         and loads them. With ``load_format="flattened_bucket"`` (what vlrl's trainer sends) the bucket is one
         broadcast of the tensors' bytes concatenated in the listed order (SGLang's ``FlattenedTensorBucket``, which
         refuses a tensor whose offset is not a multiple of its element size: `buckets` orders each bucket by element
         size, largest first); without it, one broadcast per tensor.

Names are checkpoint names (what ``save_pretrained`` writes; SGLang's ``load_weights`` expects them), dtypes
strings without ``torch.``. The group is built the way SGLang's ``init_custom_process_group`` builds it — a TCP
store at ``master_address:master_port`` (hosted by rank 0), prefixed by ``group_name``, a process group of its
own beside any default group — so a trainer that already runs under torchrun can host it, and a real SGLang
server (NCCL on GPUs) can join it. vlrl's own server joins over gloo on CPU (`vlrl.rollout.server`).

The trainer's tensors are gathered bucket by bucket (`full_tensors`) onto the group's device (`group_device`: the GPU
for NCCL, which broadcasts only GPU memory; the CPU for gloo): an FSDP2 shard is all-gathered when its bucket is
sent, so no rank ever holds more than one bucket of full tensors beside its shards.

What one bucket costs (`pack`, `broadcast`, `Receiver.receive`): the trainer casts and copies the tensors into one
reused byte buffer, broadcasts it, and checksums those same bytes while the servers load them; a server receives
into its own reused buffer and copies each tensor straight into its spare weights (`vlrl.rollout.server`) — one
copy on each side, no allocation per bucket. Failure: a server that dies or refuses a bucket ends the trainer's
wait for that broadcast at once (its HTTP answer fails), a stuck one after ``timeout``; the trainer then closes the
group, which ends the broadcast on the survivors too (their connection to rank 0 drops), and loads that version
by disk (`vlrl.rollout.http_engine`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import threading
import zlib
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

EXIT_AT_BUCKET_ENV = "VLRL_TEST_EXIT_AT_BUCKET"
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
    from vlrl.compat import separate_process_group

    wait = timedelta(seconds=timeout)
    # the TCP store itself, not `rendezvous("tcp://…")`: under torchrun (TORCHELASTIC_USE_AGENT_STORE) that makes
    # every rank a client of a store nobody hosts, and a trainer rank 0 must host this one
    store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0, timeout=wait,
                          wait_for_workers=False)
    return separate_process_group(dist.PrefixStore(group_name, store), rank=rank, world_size=world_size,
                                  backend=backend, group_name=group_name, timeout=wait)


def close_group(group: dist.ProcessGroup | None) -> None:
    if group is not None:
        try:
            dist.destroy_process_group(group)
        except Exception:  # already gone (a peer died): nothing left to release
            pass


FLATTENED = "flattened_bucket"  # SGLang's load_format: a bucket's tensors go as one uint8 tensor, one broadcast


class ByteBuffer:
    """A flat byte buffer for a bucket's broadcast. On the CPU it is kept and reused from bucket to bucket and update
    to update (grown to the largest bucket): the bytes are packed into (trainer) or received into (server) memory
    already mapped, instead of a fresh allocation per bucket whose first touch costs a page fault per 4 KiB. On a
    GPU every bucket gets a fresh tensor (the caching allocator reuses the memory; a kept buffer would hold it)."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None

    def get(self, nbytes: int, device: torch.device | str = "cpu") -> torch.Tensor:
        device = torch.device(device)
        if device.type != "cpu":
            return torch.empty(nbytes, dtype=torch.uint8, device=device)
        if self.buffer is None or self.buffer.numel() < nbytes:
            self.buffer = None  # (the old one is freed before the new one is allocated)
            self.buffer = torch.empty(nbytes, dtype=torch.uint8)
        return self.buffer[:nbytes]


def element_size(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def unaligned_entry(dtypes: Sequence[torch.dtype], shapes: Sequence[Sequence[int]]) -> tuple[int, int] | None:
    """(index, byte offset) of the first tensor of a flattened bucket whose offset is not a multiple of its element
    size, or None: SGLang refuses such a bucket (``srt/weight_sync/tensor_bucket.py``), so the trainer never sends
    one (`buckets` orders each bucket by element size, largest first)."""
    offset = 0
    for k, (dtype, shape) in enumerate(zip(dtypes, shapes, strict=True)):
        size = element_size(dtype)
        if offset % size:
            return k, offset
        offset += math.prod(shape) * size
    return None


def group_device(backend: str) -> torch.device:
    """Where a group's tensors must live: CUDA (the current device) for NCCL, which broadcasts only GPU memory; the
    CPU for gloo. Each bucket is gathered and packed there."""
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _as(raw: torch.Tensor, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor | None:
    """``raw`` (uint8) seen as a tensor of ``dtype`` and ``shape`` without a copy; None when its offset in the
    buffer is not a multiple of the dtype's size (a bucket mixing dtypes can misalign what follows a small one)."""
    try:
        return raw.view(dtype).view(tuple(shape))
    except RuntimeError:
        return None


def receive(group: dist.ProcessGroup, shapes: Sequence[Sequence[int]], dtypes: Sequence[torch.dtype], *,
            flattened: bool = False, buffer: ByteBuffer | None = None, into: torch.Tensor | None = None,
            device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """The server's side of one bucket: one tensor per (shape, dtype) on ``device``, filled by rank 0's broadcast.
    ``flattened``: one broadcast of their bytes concatenated in order (SGLang's ``FlattenedTensorBucket``) into
    ``into`` (a flat uint8 tensor of the right size) or ``buffer``; the tensors returned are views of it (valid
    until its next use). Otherwise one broadcast per tensor into a fresh tensor (all posted at once, then waited
    for — SGLang's order)."""
    sizes = [math.prod(shape) * torch.empty(0, dtype=dtype).element_size() for shape, dtype in
             zip(shapes, dtypes, strict=True)]
    if flattened:
        flat = into if into is not None else (buffer or ByteBuffer()).get(sum(sizes), device)
        if flat.numel() != sum(sizes) or flat.dtype != torch.uint8:
            raise ValueError(f"a bucket of {sum(sizes)} bytes cannot be received into {flat.numel()} {flat.dtype}")
        dist.broadcast(flat, src=0, group=group)
        out, offset = [], 0
        for shape, dtype, size in zip(shapes, dtypes, sizes, strict=True):
            raw = flat[offset : offset + size]
            view = _as(raw, dtype, shape)
            out.append(view if view is not None else raw.clone().view(dtype).view(tuple(shape)))
            offset += size
        return out
    tensors = [torch.empty(tuple(shape), dtype=dtype, device=device) for shape, dtype in zip(shapes, dtypes, strict=True)]
    works = [dist.broadcast(t, src=0, group=group, async_op=True) for t in tensors]
    for work in works:
        work.wait()
    return tensors


def pack(tensors: Sequence[torch.Tensor], dtypes: Sequence[torch.dtype], buffer: ByteBuffer,
         device: torch.device | str | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The bytes of ``tensors`` cast to ``dtypes``, concatenated in order in ``buffer`` on ``device`` (the group's;
    default the tensors'), in one pass per tensor (the cast writes straight into the buffer). Returns (the flat
    bytes, each tensor's slice of them)."""
    sizes = [t.numel() * element_size(d) for t, d in zip(tensors, dtypes, strict=True)]
    if device is None:
        device = tensors[0].device if tensors else torch.device("cpu")
    flat = buffer.get(sum(sizes), device)
    slices, offset = [], 0
    for tensor, dtype, size in zip(tensors, dtypes, sizes, strict=True):
        raw = flat[offset : offset + size]
        view = _as(raw, dtype, tensor.shape)
        if view is not None:
            view.copy_(tensor)
        else:
            raw.copy_(tensor.to(dtype).contiguous().reshape(-1).view(torch.uint8))
        slices.append(raw)
        offset += size
    return flat, slices


class Abandoned(RuntimeError):
    """A broadcast the trainer stopped waiting for: a server refused or lost its bucket, or the timeout passed."""


def broadcast(group: dist.ProcessGroup, flat: torch.Tensor, *, settled: threading.Event, timeout: float) -> None:
    """Rank 0's broadcast of one bucket's bytes, waited for until it completes — or until ``settled`` is set by the
    caller (a server answered that bucket with an error, or its connection dropped: it will never receive it) or
    ``timeout`` seconds pass, which raise `Abandoned`. The caller then closes the group: the broadcast ends on every
    side (the survivors' receives fail as the connection drops), so no one waits for a peer that is gone.

    The collective is entered on a daemon thread of its own, not the caller's: NCCL creates a group's communicator
    inside its first collective and blocks there until every rank arrives, so even the call that only enqueues the
    broadcast can wait for a server that will never come — the caller's wait is bounded all the same."""
    entered: dict[str, Any] = {}

    def enter() -> None:
        try:
            work = dist.broadcast(flat, src=0, group=group, async_op=True)
            entered["work"] = work
            work.get_future().add_done_callback(lambda _: settled.set())
        except BaseException as err:  # noqa: BLE001 — handed to the waiting caller
            entered["error"] = err
            settled.set()

    threading.Thread(target=enter, name="vlrl-broadcast", daemon=True).start()
    if not settled.wait(timeout):
        raise Abandoned(f"the broadcast did not complete within {timeout:.0f} s (rollout.weight_sync.timeout)")
    if "error" in entered:
        raise entered["error"]
    work = entered.get("work")
    if work is None or not work.get_future().done():
        raise Abandoned("a server failed while the bucket was broadcast")
    work.wait()  # raises the broadcast's own error (a peer's connection dropped)


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
    dtype: torch.dtype | None = None  # the trainer's (a floating-point tensor is sent in the servers' dtype)

    def send_dtype(self, floating: torch.dtype) -> torch.dtype:
        """The dtype it travels in: ``floating`` (the servers') for a floating-point tensor, else its own."""
        return floating if self.dtype is None or self.dtype.is_floating_point else self.dtype


def plan_entries(state: Mapping[str, torch.Tensor], send_names: Mapping[str, str] | None) -> list[Entry]:
    """What a weight update sends, in state-dict order: every tensor of ``state`` (a model's state dict, or a LoRA
    policy's merged weights) once — a tied copy rides on its first name. ``send_names``: {state-dict name →
    checkpoint name} (`checkpoint_names` inverted); None sends state-dict names. Works on a plain model and on an
    FSDP2-sharded one (shapes are the full shapes)."""
    first: dict[tuple, str] = {}
    aliases: dict[str, list[str]] = {}
    order = []
    for name, tensor in state.items():
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a DTensor: its shard (storage)
        key = (local.data_ptr(), tuple(tensor.shape), local.storage_offset()) if local.numel() else ("empty", name)
        if key in first:
            aliases[first[key]].append(name)
            continue
        first[key] = name
        aliases[name] = []
        order.append(name)
    names = send_names or {}
    return [Entry(n, names.get(n, n), tuple(state[n].shape), state[n].numel(), tuple(aliases[n]), state[n].dtype)
            for n in order]


def buckets(entries: Sequence[Entry], *, send_dtype: torch.dtype, bucket_bytes: int) -> list[list[Entry]]:
    """Consecutive entries grouped into buckets of at most ``bucket_bytes`` as sent (floating-point tensors in
    ``send_dtype``; a larger tensor is a bucket alone), each bucket ordered by element size, largest first — so
    every tensor starts at a multiple of its own element size in the flattened bucket, as SGLang requires."""
    out: list[list[Entry]] = []
    size = 0
    for entry in entries:
        nbytes = entry.numel * element_size(entry.send_dtype(send_dtype))
        if not out or size + nbytes > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append(entry)
        size += nbytes
    return [sorted(bucket, key=lambda e: -element_size(e.send_dtype(send_dtype))) for bucket in out]


def full_tensors(state: Mapping[str, torch.Tensor], bucket: Sequence[Entry],
                 device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """The full tensors of one bucket on ``device`` (the group's: `group_device`): a DTensor shard is all-gathered
    (a collective: every trainer rank calls this with the same bucket), a plain tensor is detached as it is."""
    out = []
    for entry in bucket:
        tensor = state[entry.name].detach()
        if hasattr(tensor, "full_tensor"):
            tensor = tensor.full_tensor()
        out.append(tensor.to(device))
    return out


class StreamingChecksum:
    """`vlrl.rollout.weights.weight_checksum` of the full state dict, accumulated bucket by bucket (as the
    tensors are sent) for each server dtype at once: the same line per tensor, the same order (sorted by name), the
    same digest — so a server's answer can be compared with it. Each tensor's bytes go through CRC-32 once per
    server dtype; for the dtype it was sent in, those are the bytes that were broadcast (no second cast)."""

    def __init__(self, dtypes: Sequence[torch.dtype | None]) -> None:
        self.lines: dict[torch.dtype | None, dict[str, str]] = {d: {} for d in dtypes}

    def add(self, entry: Entry, tensor: torch.Tensor, *, sent: torch.Tensor | None = None,
            sent_dtype: torch.dtype | None = None) -> None:
        """``tensor`` as the trainer holds it; ``sent``: its bytes as broadcast (uint8), in ``sent_dtype``."""
        for dtype, lines in self.lines.items():
            target = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
            if sent is not None and target == sent_dtype:
                raw = sent
            else:
                raw = tensor.to(target).contiguous().reshape(-1).view(torch.uint8)
            crc = zlib.crc32(memoryview(raw.cpu().numpy()))
            for name in (entry.name, *entry.aliases):
                lines[name] = f"{name}|{target}|{tuple(tensor.shape)}|{crc:08x}\n"

    def digest(self, dtype: torch.dtype | None) -> str:
        digest = hashlib.sha256()
        lines = self.lines[dtype]
        for name in sorted(lines):
            digest.update(lines[name].encode())
        return digest.hexdigest()


# ----------------------------------------------------------------------------------------------- the server's side
class Receiver:
    """A server's side of the protocol (`vlrl serve`): the groups it joined, and the buffer each flattened bucket
    is received into (the server copies it into its spare weights before the next bucket arrives).

    ``timeout`` bounds joining a group and every broadcast on it: a broadcast whose trainer gave up is also ended
    sooner, when the trainer closes its side of the group (the connection drops). Test hook: with
    ``$VLRL_TEST_EXIT_AT_BUCKET=k`` the process exits (status 86) when the k-th bucket since it started is
    announced, before it joins that bucket's broadcast — a server dying in the middle of an update."""

    def __init__(self, *, timeout: float = 300.0, device: torch.device | str = "cpu") -> None:
        self.timeout = timeout
        self.device = torch.device(device)
        self.groups: dict[str, dist.ProcessGroup] = {}
        self.buffer = ByteBuffer()
        self._lock = threading.Lock()  # `groups` (a join runs beside a bucket's receive)
        self.buckets = 0  # buckets announced since the server started
        fault = os.environ.get(EXIT_AT_BUCKET_ENV)
        self.exit_at_bucket = int(fault) if fault else None

    def join(self, master_address: str, master_port: int, *, rank_offset: int, world_size: int, group_name: str,
             backend: str, timeout: float | None = None) -> None:
        """Join ``group_name`` as rank ``rank_offset`` (blocks until every rank joined, at most ``timeout`` seconds,
        default the receiver's); a group of the same name joined before is left (a trainer that restarted forms it
        again)."""
        group = open_group(master_address, master_port, rank=rank_offset, world_size=world_size,
                           group_name=group_name, backend=backend, timeout=timeout or self.timeout)
        with self._lock:
            old, self.groups[group_name] = self.groups.get(group_name), group
        close_group(old)

    def receive(self, group_name: str, names: Sequence[str], dtypes: Sequence[str],
                shapes: Sequence[Sequence[int]], *, load_format: str | None = None,
                place: Callable[[list[torch.dtype]], torch.Tensor | None] | None = None) -> list[torch.Tensor]:
        """Receive one bucket's broadcasts: its tensors, in ``names`` order. Flattened, they are views of the flat
        tensor ``place(dtypes)`` returns (the caller's storage), or of `buffer` (valid until the next bucket) when
        it returns None. A malformed request is refused before joining the broadcast."""
        with self._lock:
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
        if load_format == FLATTENED:
            misaligned = unaligned_entry(torch_dtypes, shapes)
            if misaligned is not None:  # SGLang refuses such a bucket (`FlattenedTensorBucket.empty`): so does vlrl
                k, offset = misaligned
                raise ValueError(f"fields 'dtypes', 'shapes': tensor {names[k]!r} ({dtypes[k]}) would start at byte "
                                 f"{offset} of the flattened bucket, not a multiple of its element size; order a "
                                 "bucket's tensors by element size, largest first")
        self.buckets += 1
        if self.buckets == self.exit_at_bucket:
            os._exit(86)
        flattened = load_format == FLATTENED
        into = place(torch_dtypes) if flattened and place is not None else None
        try:
            return receive(group, shapes, torch_dtypes, flattened=flattened, buffer=self.buffer, into=into,
                           device=self.device)
        except RuntimeError:  # a peer left or the trainer gave up on this group: it is unusable from now on
            self.leave(group_name)
            raise

    def group_names(self) -> list[str]:
        """The groups this server joined, by name (sorted)."""
        with self._lock:
            return sorted(self.groups)

    def leave(self, group_name: str) -> bool:
        """Leave ``group_name`` (SGLang's ``/destroy_weights_update_group``); False if this server had not joined it."""
        with self._lock:
            group = self.groups.pop(group_name, None)
        close_group(group)
        return group is not None

    def close(self) -> None:
        with self._lock:
            groups, self.groups = list(self.groups.values()), {}
        for group in groups:
            close_group(group)
