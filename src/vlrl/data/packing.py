"""Offline packing: many variable-length samples → few fixed-capacity sequences, planned once, reused in training.

LLaVA-OneVision-1.5 ("Offline Packing"): compute every sample's token length for the whole shard, index the
shard by length, treat long samples as seeds and fill each seed's remaining capacity with the best-fitting
shorter samples, switching between diversity-first filling and greedy completion when a bucket stalls; write
the arrangement once and reuse it in training with no packing cost. Quality is measured as

    padding compression = padding of the baseline / padding after packing
    fill ratio          = Σ len / (bins · capacity)
    lower bound         = ⌈Σ len / capacity⌉ bins (no packing can use fewer)

How the packer works (`pack_lengths`):

1. **Hash buckets.** Lengths are integers in [1, capacity], so the exact-length bucket of a sample is its
   length: one stable counting sort (numpy's radix sort on 16-bit keys) over a seeded shuffle groups the
   shard by length, in a seeded random order inside each bucket. Coarse buckets of ``bucket_width`` tokens
   group neighbouring lengths for the diversity phase.
2. **Bin patterns over the histogram.** The packer works on the length histogram, not on the items: a bin is
   a *pattern* (which lengths, how many of each), and a pattern is emitted as many times as the histogram
   allows at once. The seed of a pattern is the longest remaining length. Its remaining capacity is filled
   first **diversity-first** — from a coarse bucket chosen at random (seeded) among those holding a length
   that fits — while more than ``greedy_below · capacity`` tokens remain; when a random bucket has nothing
   that fits (it stalls) or the gap is small, **greedy completion** takes the longest remaining length that
   fits, until nothing fits.
3. **Items.** Each pattern instance takes the next sample ids of its lengths' buckets; the plan is the
   concatenation of those ids, bin by bin, with bin offsets.

The work is O(n) numpy for the sort and the id gathering plus a Python loop over patterns (a few thousand to a
few hundred thousand for a 10 M-sample shard), so 10 M lengths pack in seconds on one core
(`benchmarks/packing.py`). Samples longer than the capacity are never cut silently: ``on_overlong="drop"``
leaves them out and lists them, ``"truncate"`` gives each its own bin of ``capacity`` tokens and lists them
(training cuts the response tail to fit), ``"raise"`` stops.

The plan file (`PackingPlan.save`) is a compact ``.npz`` (bin offsets, sample indices, lengths, truncated and
dropped indices) with a JSON sidecar (``<plan>.json``: capacity, statistics, the data file, a fingerprint of
its sample ids, the model/processor the lengths were computed with).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

OnOverlong = Literal["drop", "truncate", "raise"]
PLAN_FORMAT = "vlrl.packing_plan.v1"


class PackingError(ValueError):
    """A packing request or plan file that cannot be used; the message names the file or sample."""


@dataclass
class PackingPlan:
    """Bins of sample indices, and the lengths they were planned from.

    Attributes:
        capacity: tokens per packed sequence.
        bin_offsets: (n_bins + 1,) bin b holds ``sample_index[bin_offsets[b]:bin_offsets[b + 1]]``.
        sample_index: indices into the shard's samples (read order), bin after bin.
        lengths: (n_samples,) token length of every sample of the shard, before truncation.
        truncated: indices of samples longer than ``capacity`` planned as one bin each, to be cut to fit.
        dropped: indices of samples longer than ``capacity`` left out of the plan.
        meta: the JSON sidecar: statistics, data file, id fingerprint, model, settings.
    """

    capacity: int
    bin_offsets: np.ndarray
    sample_index: np.ndarray
    lengths: np.ndarray
    truncated: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    dropped: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def num_bins(self) -> int:
        return len(self.bin_offsets) - 1

    def bin(self, b: int) -> np.ndarray:
        return self.sample_index[self.bin_offsets[b] : self.bin_offsets[b + 1]]

    def bins(self) -> list[np.ndarray]:
        return np.split(self.sample_index, self.bin_offsets[1:-1])

    def packed_lengths(self) -> np.ndarray:
        """(n_bins,) tokens in each bin (truncated samples count ``capacity``)."""
        effective = np.minimum(self.lengths, self.capacity).astype(np.int64)
        per_item = effective[self.sample_index]
        return np.add.reduceat(per_item, self.bin_offsets[:-1]) if len(per_item) else np.zeros(0, np.int64)

    def save(self, path: str | Path) -> Path:
        """Write ``path`` (.npz) and its sidecar ``path.with_suffix('.json')``; returns the .npz path."""
        path = Path(path)
        if path.suffix != ".npz":
            raise PackingError(f"{path}: a packing plan file must end in .npz")
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez_compressed(
            path, bin_offsets=self.bin_offsets.astype(np.int64), sample_index=self.sample_index.astype(np.int64),
            lengths=self.lengths.astype(np.int32), truncated=self.truncated.astype(np.int64),
            dropped=self.dropped.astype(np.int64),
        )
        sidecar = {"format": PLAN_FORMAT, "capacity": self.capacity, **self.meta}
        path.with_suffix(".json").write_text(json.dumps(sidecar, indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> PackingPlan:
        path = Path(path)
        sidecar_path = path.with_suffix(".json")
        if not path.is_file():
            raise PackingError(f"{path}: packing plan not found (write one with `vlrl data pack`)")
        if not sidecar_path.is_file():
            raise PackingError(f"{sidecar_path}: the plan's JSON sidecar is missing")
        try:
            sidecar = json.loads(sidecar_path.read_text())
        except json.JSONDecodeError as err:
            raise PackingError(f"{sidecar_path}: not valid JSON ({err.msg} at line {err.lineno})") from err
        if sidecar.get("format") != PLAN_FORMAT:
            raise PackingError(f"{sidecar_path}: field 'format' is {sidecar.get('format')!r}, expected {PLAN_FORMAT!r}")
        with np.load(path) as arrays:
            missing = {"bin_offsets", "sample_index", "lengths", "truncated", "dropped"} - set(arrays.files)
            if missing:
                raise PackingError(f"{path}: missing array(s) {sorted(missing)}")
            plan = cls(
                capacity=int(sidecar["capacity"]), bin_offsets=arrays["bin_offsets"],
                sample_index=arrays["sample_index"], lengths=arrays["lengths"].astype(np.int64),
                truncated=arrays["truncated"], dropped=arrays["dropped"],
                meta={k: v for k, v in sidecar.items() if k not in ("format", "capacity")},
            )
        plan.validate(str(path))
        return plan

    def check_samples(self, ids: Sequence[str]) -> None:
        """Raise unless ``ids`` (the training file's sample ids, in read order) are the ones the plan was made for."""
        source = self.meta.get("data", "?")
        if len(ids) != len(self.lengths):
            raise PackingError(f"data.packing_plan: the plan covers {len(self.lengths)} samples of {source} but the "
                               f"training data holds {len(ids)}; re-run `vlrl data pack` on the training file")
        expected = self.meta.get("ids_sha256")
        if expected is not None and ids_fingerprint(ids) != expected:
            raise PackingError(f"data.packing_plan: the training data's sample ids (or their order) differ from those "
                               f"of {source} the plan was made for; re-run `vlrl data pack` on the training file")

    def validate(self, where: str = "packing plan") -> None:
        """Every sample is planned at most once, indices are in range, and no bin exceeds the capacity."""
        n = len(self.lengths)
        if len(self.bin_offsets) == 0 or self.bin_offsets[0] != 0 or self.bin_offsets[-1] != len(self.sample_index):
            raise PackingError(f"{where}: bin_offsets must start at 0 and end at len(sample_index)")
        if len(self.sample_index) and (self.sample_index.min() < 0 or self.sample_index.max() >= n):
            raise PackingError(f"{where}: a sample index is out of range for {n} samples")
        if len(np.unique(self.sample_index)) != len(self.sample_index):
            raise PackingError(f"{where}: a sample appears in more than one bin")
        over = np.flatnonzero(self.packed_lengths() > self.capacity)
        if len(over):
            raise PackingError(f"{where}: bin {int(over[0])} holds more than {self.capacity} tokens")


# ----------------------------------------------------------------------------------------------- the packer
def pack_lengths(
    lengths: Sequence[int] | np.ndarray,
    capacity: int,
    *,
    seed: int = 0,
    on_overlong: OnOverlong = "drop",
    diversity: bool = True,
    greedy_below: float = 0.25,
    bucket_width: int = 64,
    prompt_lengths: Sequence[int] | np.ndarray | None = None,
) -> PackingPlan:
    """Plan bins of at most ``capacity`` tokens for samples of the given token lengths.

    Args:
        lengths: token length of each sample (text + vision tokens, response and EOS included), ≥ 1.
        capacity: tokens per packed sequence.
        seed: the plan is a deterministic function of (lengths, capacity, options, seed).
        on_overlong: samples longer than ``capacity``: ``drop`` (listed in ``plan.dropped``), ``truncate``
            (one bin each, listed in ``plan.truncated``), or ``raise``.
        diversity: fill from random coarse buckets first (True), or only greedily (False).
        greedy_below: switch to greedy completion once fewer than ``greedy_below · capacity`` tokens remain.
        bucket_width: width in tokens of the coarse buckets of the diversity phase.
        prompt_lengths: prompt tokens of each sample; with ``truncate``, an overlong sample whose prompt alone
            leaves no room for a target token within ``capacity`` is dropped instead (truncation cuts targets only).
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.ndim != 1:
        raise PackingError(f"lengths must be a 1-D array, got shape {lengths.shape}")
    if capacity < 1 or capacity > np.iinfo(np.int32).max:
        raise PackingError(f"capacity must be a positive int32, got {capacity}")
    if len(lengths) and lengths.min() < 1:
        raise PackingError(f"sample {int(np.argmin(lengths))}: length {int(lengths.min())} < 1")
    overlong = np.flatnonzero(lengths > capacity)
    if len(overlong) and on_overlong == "raise":
        raise PackingError(f"{len(overlong)} sample(s) longer than the capacity {capacity} (first: sample "
                           f"{int(overlong[0])}, {int(lengths[overlong[0]])} tokens); set on_overlong to drop or truncate")
    keep = lengths <= capacity
    rng = np.random.default_rng(seed)
    ids = np.flatnonzero(keep)
    ids = ids[rng.permutation(len(ids))]
    key = lengths[ids]
    order = ids[np.argsort(key.astype(np.uint16) if capacity < 2**16 else key, kind="stable")]  # grouped by length
    counts = np.bincount(key, minlength=capacity + 1)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    blocks, widths = _plan_patterns(counts, starts, order, capacity, rng=rng, diversity=diversity,
                                    greedy_below=greedy_below, bucket_width=bucket_width)
    truncated = overlong if on_overlong == "truncate" else np.zeros(0, np.int64)
    dropped = overlong if on_overlong == "drop" else np.zeros(0, np.int64)
    if len(truncated) and prompt_lengths is not None:
        uncuttable = np.asarray(prompt_lengths, dtype=np.int64)[truncated] >= capacity
        truncated, dropped = truncated[~uncuttable], truncated[uncuttable]
    if len(truncated):
        blocks.append(truncated.reshape(-1, 1))
        widths.append(np.ones(len(truncated), np.int64))
    sample_index = np.concatenate([b.reshape(-1) for b in blocks]) if blocks else np.zeros(0, np.int64)
    sizes = np.concatenate(widths) if widths else np.zeros(0, np.int64)
    bin_offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    plan = PackingPlan(capacity=capacity, bin_offsets=bin_offsets, sample_index=sample_index.astype(np.int64),
                       lengths=lengths, truncated=truncated.astype(np.int64), dropped=dropped.astype(np.int64))
    plan.meta.update(settings={"seed": seed, "on_overlong": on_overlong, "diversity": diversity,
                               "greedy_below": greedy_below, "bucket_width": bucket_width},
                     stats=packing_stats(plan))
    return plan


def _plan_patterns(counts, starts, order, capacity, *, rng, diversity, greedy_below, bucket_width):
    """The pattern loop over the length histogram; returns blocks of (copies, width) sample ids and the
    width of every bin, in bin order."""
    counts = counts.copy()
    cursor = starts.copy()  # next unused position in ``order`` for each length
    available = [int(x) for x in np.flatnonzero(counts)]  # sorted lengths with samples left
    buckets: dict[int, list[int]] = {}  # coarse bucket → its available lengths (sorted)
    for length in available:
        buckets.setdefault(length // bucket_width, []).append(length)
    bucket_ids = sorted(buckets)
    greedy_gap = greedy_below * capacity
    blocks: list[np.ndarray] = []
    widths: list[np.ndarray] = []
    while available:
        seed_length = available[-1]
        need = {seed_length: 1}
        room = capacity - seed_length

        if diversity:
            while room > greedy_gap:
                top = bisect.bisect_right(bucket_ids, room // bucket_width)
                if top == 0:
                    break
                bucket = bucket_ids[int(rng.integers(top))]
                lengths = buckets[bucket]
                k = bisect.bisect_right(lengths, room) - 1
                while k >= 0 and counts[lengths[k]] <= need.get(lengths[k], 0):  # none left
                    k -= 1
                if k < 0:
                    break  # the bucket stalls: switch to greedy completion
                need[lengths[k]] = need.get(lengths[k], 0) + 1
                room -= lengths[k]
        k = bisect.bisect_right(available, room) - 1
        while k >= 0:  # greedy completion: the longest remaining length that fits, again and again
            length = available[k]
            if counts[length] > need.get(length, 0) and length <= room:
                take = min(room // length, int(counts[length]) - need.get(length, 0))
                need[length] = need.get(length, 0) + take
                room -= take * length
            k = min(k - 1, bisect.bisect_right(available, room) - 1)
        copies = min(int(counts[length]) // n for length, n in need.items())
        columns = []
        for length, n in need.items():
            start = cursor[length]
            columns.append(order[start : start + copies * n].reshape(copies, n))
            cursor[length] += copies * n
            counts[length] -= copies * n
            if counts[length] == 0:
                available.pop(bisect.bisect_left(available, length))
                siblings = buckets[length // bucket_width]
                siblings.pop(bisect.bisect_left(siblings, length))
                if not siblings:
                    del buckets[length // bucket_width]
                    bucket_ids.pop(bisect.bisect_left(bucket_ids, length // bucket_width))
        blocks.append(np.concatenate(columns, axis=1))
        widths.append(np.full(copies, sum(need.values()), np.int64))
    return blocks, widths


# ----------------------------------------------------------------------------------------------- statistics
def packing_stats(plan: PackingPlan) -> dict[str, Any]:
    """Bins, lower bound, fill ratio and padding compression of ``plan`` against pad-to-capacity batching
    (one sample per sequence of ``capacity`` tokens, the naive fixed-length baseline)."""
    packed = plan.packed_lengths()
    tokens = int(packed.sum())
    n_bins = plan.num_bins
    n_samples = int(len(plan.sample_index))
    lower_bound = math.ceil(tokens / plan.capacity) if tokens else 0
    packed_padding = n_bins * plan.capacity - tokens
    naive_padding = n_samples * plan.capacity - tokens
    return {
        "samples": int(len(plan.lengths)),
        "packed_samples": n_samples,
        "truncated": int(len(plan.truncated)),
        "dropped": int(len(plan.dropped)),
        "tokens": tokens,
        "bins": n_bins,
        "lower_bound": lower_bound,
        "bins_over_lower_bound": (n_bins / lower_bound - 1) if lower_bound else 0.0,
        "fill_ratio": tokens / (n_bins * plan.capacity) if n_bins else 0.0,
        "samples_per_bin": n_samples / n_bins if n_bins else 0.0,
        "padding_packed": int(packed_padding),
        "padding_naive": int(naive_padding),
        "compression_vs_naive": naive_padding / packed_padding if packed_padding else math.inf,
    }


def padded_batch_padding(lengths: np.ndarray, batch_size: int, *, seed: int = 0) -> int:
    """Padding of dynamic padding (the usual padded collator): shuffled batches of ``batch_size`` samples,
    each padded to its longest sample."""
    lengths = np.asarray(lengths, dtype=np.int64)
    shuffled = lengths[np.random.default_rng(seed).permutation(len(lengths))]
    pad = (-len(shuffled)) % batch_size
    grid = np.concatenate([shuffled, np.zeros(pad, np.int64)]).reshape(-1, batch_size)
    sizes = np.full(len(grid), batch_size)
    if pad:
        sizes[-1] = batch_size - pad
    return int((grid.max(axis=1) * sizes).sum() - lengths.sum())


def online_pack(lengths: np.ndarray, capacity: int, *, buffer_size: int = 64, seed: int = 0) -> dict[str, Any]:
    """The baseline LLaVA-OV-1.5 contrasts offline packing with: a dataloader-side packer that sees a stream
    (shuffled) through a rolling buffer of ``buffer_size`` samples. Whenever the buffer is full it emits one
    sequence: the longest buffered sample plus, best fit first, the buffered samples that still fit.
    Samples longer than ``capacity`` are skipped. Returns bins and padding (statistics only, no plan)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    stream = lengths[np.random.default_rng(seed).permutation(len(lengths))]
    stream = stream[stream <= capacity].tolist()
    buffer: list[int] = []  # kept sorted
    bins = 0
    position = 0
    while position < len(stream) or buffer:
        while len(buffer) < buffer_size and position < len(stream):
            bisect.insort(buffer, stream[position])
            position += 1
        room = capacity - buffer.pop()
        k = bisect.bisect_right(buffer, room) - 1
        while k >= 0 and buffer:
            room -= buffer.pop(k)
            k = min(k - 1, bisect.bisect_right(buffer, room) - 1)
        bins += 1
    tokens = int(sum(stream))
    return {"bins": bins, "tokens": tokens, "padding": bins * capacity - tokens,
            "fill_ratio": tokens / (bins * capacity) if bins else 0.0, "samples": len(stream)}


def plan_samples(
    samples: Sequence[Any],
    count: Callable[[Any], tuple[int, int]],
    capacity: int,
    *,
    workers: int = 1,
    source: str = "",
    model: dict[str, Any] | None = None,
    **options: Any,
) -> PackingPlan:
    """Count every sample's tokens (`sample_lengths`), pack (`pack_lengths` with ``options``), and record in the
    plan's sidecar the data file, the fingerprint of its ids, the model settings and the overlong samples."""
    prompt, lengths = sample_lengths(samples, count, workers=workers)
    plan = pack_lengths(lengths, capacity, prompt_lengths=prompt, **options)
    ids = [s.id for s in samples]
    plan.meta.update(
        data=source, ids_sha256=ids_fingerprint(ids), model=model or {},
        overlong=[{"id": ids[i], "tokens": int(lengths[i]), "action": action}
                  for action, rows in (("truncated", plan.truncated), ("dropped", plan.dropped)) for i in rows[:1000]],
    )
    return plan


# ----------------------------------------------------------------------------------------------- lengths
_COUNT_JOB: tuple[Sequence[Any], Callable[[Any], tuple[int, int]]] | None = None


def sample_lengths(
    samples: Sequence[Any], count: Callable[[Any], tuple[int, int]], *, workers: int = 1, chunk: int = 2048
) -> tuple[np.ndarray, np.ndarray]:
    """(prompt_lengths, lengths) of every sample, computed by ``count(sample) -> (prompt, total)`` in
    ``workers`` forked processes (the samples and the counter are inherited, not pickled). A sample that
    cannot be counted raises `PackingError` naming its file and line."""
    global _COUNT_JOB
    n = len(samples)
    spans = [(start, min(start + chunk, n)) for start in range(0, n, chunk)]
    _COUNT_JOB = (samples, count)
    try:
        if workers <= 1 or len(spans) <= 1:
            parts = [_count_span(span) for span in spans]
        else:
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
                parts = list(pool.map(_count_span, spans))
    finally:
        _COUNT_JOB = None
    for part in parts:
        if isinstance(part, str):
            raise PackingError(part)
    prompt = np.concatenate([p[0] for p in parts]) if parts else np.zeros(0, np.int64)
    total = np.concatenate([p[1] for p in parts]) if parts else np.zeros(0, np.int64)
    return prompt, total


def _count_span(span: tuple[int, int]) -> tuple[np.ndarray, np.ndarray] | str:
    samples, count = _COUNT_JOB  # type: ignore[misc]
    prompt = np.zeros(span[1] - span[0], np.int64)
    total = np.zeros(span[1] - span[0], np.int64)
    for k in range(span[0], span[1]):
        try:
            prompt[k - span[0]], total[k - span[0]] = count(samples[k])
        except (ValueError, KeyError) as err:  # SampleError, tokenizer/template errors
            where = getattr(samples[k], "source", "") or f"sample {k}"
            return f"{where}: cannot count the tokens of sample {getattr(samples[k], 'id', k)!r}: {err}"
    return prompt, total


def ids_fingerprint(ids: Sequence[str]) -> str:
    """SHA-256 of the sample ids in read order: a plan is only valid for the shard it was computed on."""
    digest = hashlib.sha256()
    for sample_id in ids:
        digest.update(sample_id.encode("utf-8"))
        digest.update(b"\0")
    return digest.hexdigest()
