"""Micro-batches by a token budget (``train.max_tokens_per_micro_batch``), balanced across data-parallel ranks.

A VLM row's cost is not 1: a row with four 1,344² images and a long answer costs what forty short text rows do. With
a budget, every teacher-forced pass (the update, π_old, π_ref, the critic's values and its update; SFT's step) cuts
its rows into micro-batches whose *cost* stays within the budget instead of into ``micro_batch_size`` rows:

    cost(row)   = P + R + w_v · N_p          prompt tokens (one per merged vision token included) + response tokens
                                             + the vision tower's patches N_p (`VisionInputs.patches`) weighted by
    w_v         = (depth·(12h_v + 3I_v) + C) / (n_layers·(8h + 2k + 4I) + 2h)
                                             what the tower keeps for backward per patch over what the decoder keeps
                                             per token (`vlrl.launch.planner`'s activation formulas; `patch_weight`)
    cost(micro) = Σ cost(row)                packed (``train.padding_free``): tokens are summed, no padding
                = b · (max P + max R) + w_v Σ N_p   padded: every row is as long as the longest prompt + response
    with ``train.shared_prefix`` a prompt shared by rows of the micro-batch (a GRPO group) counts once, its rows'
    responses beside it: the grouped forward of `vlrl.models.shared_prefix` (where vlrl falls back to the plain pass,
    said once in the log, the micro-batch costs more than this)

- **forming** (`form`): first-fit decreasing over units — a prompt's rows together under ``train.shared_prefix``,
  else single rows — largest first, each into the first micro-batch it fits. A unit over the budget is cut in order;
  a row over the budget alone is a micro-batch of its own, named in a warning once.
- **ranks** (`balance`): the rows (units) of each minibatch, every rank's, are split into W parts of equal cost by
  the largest differencing method (Karmarkar & Karp 1982 — what verl's ``get_seqlen_balanced_partitions`` uses), each
  part given to the rank that already holds most of its rows; the rows travel once per step (`exchange`).
  ``perf/rank_imbalance`` = max / mean rank cost (logged for the count-based split too, as it falls).
- **lockstep** (`lockstep`): FSDP2 all-gathers in every forward, so every rank runs the same number of
  micro-batches — the most any rank needs: a rank with fewer splits its largest micro-batches, and one with fewer
  rows than that runs *no-op* micro-batches (a row of its own, loss × 0: nothing counted, nothing learnt).

The gradient does not depend on any of this: every loss is divided by the normaliser of the whole minibatch over
every rank (`vlrl.train.distributed`), so any split of its rows gives the same sum (tests/train/test_microbatch.py).
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)
_WARNED: set[str] = set()


# ----------------------------------------------------------------------------------------------- costs
def patch_weight(config: Any) -> float:
    """w_v of a model ``config``: the vision tower's kept activations per patch over the decoder's per token (0 for
    a model without a vision tower). The planner's formulas (`vlrl.launch.planner.activations`): a decoder layer
    keeps 8h + 2k + 4I values per token, the embeddings 2h; a vision block 12h_v + 3I_v per patch, the pixels C."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv = getattr(text, "num_key_value_heads", None) or heads
    experts = getattr(text, "num_experts_per_tok", None)
    inter = (experts * text.moe_intermediate_size + (getattr(text, "shared_expert_intermediate_size", 0) or 0)
             if experts and getattr(text, "moe_intermediate_size", None) else text.intermediate_size)
    per_token = text.num_hidden_layers * (8 * text.hidden_size + 2 * kv * head_dim + 4 * inter) + 2 * text.hidden_size
    vision = getattr(config, "vision_config", None)
    if vision is None:
        return 0.0
    width = getattr(vision, "embed_dim", None) or vision.hidden_size
    v_inter = getattr(vision, "intermediate_size", None) or int(width * getattr(vision, "mlp_ratio", 4))
    depth = getattr(vision, "depth", None) or vision.num_hidden_layers
    channels = getattr(vision, "in_channels", None) or getattr(vision, "num_channels", 3)
    values = channels * getattr(vision, "temporal_patch_size", 1) * patch_size(config) ** 2
    return (depth * (12 * width + 3 * v_inter) + values) / per_token


def patch_size(config: Any) -> int:
    """The vision tower's patch side in pixels (14 when the config names none)."""
    patch = getattr(getattr(config, "vision_config", None), "patch_size", 14) or 14
    return patch[0] if isinstance(patch, list | tuple) else patch


@dataclass(frozen=True)
class RowSize:
    """One row's sizes: prompt and response tokens, vision patches, a name for the warning (a sample id) and the
    key of its prompt (rows with the same key share it: a GRPO group; None: its own)."""

    prompt: int
    response: int
    patches: int = 0
    name: str = ""
    prompt_key: str | None = None


@dataclass(frozen=True)
class CostModel:
    """How rows and micro-batches are costed (module docstring): w_v, the patch side, padded or packed, and whether
    a prompt shared by several rows of a micro-batch runs once (``train.shared_prefix``)."""

    patch_weight: float = 0.0
    patch_size: int = 14
    padded: bool = True
    shared: bool = False

    @classmethod
    def of(cls, model: Any, *, padding_free: bool, shared_prefix: bool = False) -> CostModel:
        """The cost model of a (possibly wrapped) transformers ``model``."""
        config = getattr(model, "config", None) or getattr(getattr(model, "module", None), "config", None)
        if config is None:
            return cls(padded=not padding_free, shared=shared_prefix)
        return cls(patch_weight(config), patch_size(config), padded=not padding_free, shared=shared_prefix)

    def size(self, prompt_ids: Sequence[int], response_ids: Sequence[int], vision: Any, name: str = "",
             prompt_key: str | None = None) -> RowSize:
        return RowSize(len(prompt_ids), len(response_ids), vision.patches(self.patch_size) if vision is not None else 0,
                       name, prompt_key)

    def row(self, size: RowSize) -> float:
        return size.prompt + size.response + self.patch_weight * size.patches

    def micro(self, sizes: Sequence[RowSize]) -> float:
        """A micro-batch's cost: Σ tokens (packed) or rows × the longest (padded), + w_v · patches; with ``shared``
        each distinct prompt counted once, its rows' responses beside it (the grouped forward: one row per prompt)."""
        if not sizes:
            return 0.0
        units: dict[Any, list[int]] = {}  # prompt → [P, N_p, Σ R]
        for k, s in enumerate(sizes):
            key = s.prompt_key if self.shared and s.prompt_key is not None else ("row", k)
            unit = units.setdefault(key, [s.prompt, s.patches, 0])
            unit[2] += s.response
        if not self.shared:
            units = {k: [s.prompt, s.patches, s.response] for k, s in enumerate(sizes)}
        vision = self.patch_weight * sum(u[1] for u in units.values())
        if not self.padded:
            return sum(u[0] + u[2] for u in units.values()) + vision
        if self.shared:
            return len(units) * max(u[0] + u[2] for u in units.values()) + vision
        return len(units) * (max(u[0] for u in units.values()) + max(u[2] for u in units.values())) + vision


# ----------------------------------------------------------------------------------------------- micro-batches
@dataclass(frozen=True)
class MicroBatch:
    """Rows run in one forward/backward. ``noop``: run only so that every rank makes the same number of passes
    (FSDP2's all-gathers): its loss is multiplied by 0 and nothing of it is counted."""

    rows: tuple[int, ...]
    noop: bool = False


def by_count(rows: Sequence[int], size: int) -> list[MicroBatch]:
    """``rows`` in consecutive micro-batches of ``size`` (``train.micro_batch_size``)."""
    return [MicroBatch(tuple(rows[k : k + size])) for k in range(0, len(rows), size)]


def form(rows: Sequence[int], sizes: Callable[[int], RowSize], budget: float, cost: CostModel) -> list[list[int]]:
    """``rows`` cut into micro-batches of cost ≤ ``budget`` by first-fit decreasing over units — a prompt's rows
    together when ``cost.shared`` (a unit over the budget is cut in order), else single rows. A row over the budget
    alone is its own micro-batch (warned once)."""
    units: list[list[int]] = []
    for unit in _units(rows, sizes, cost):
        if cost.micro([sizes(r) for r in unit]) <= budget:
            units.append(unit)
            continue
        for r in unit:  # next-fit within the unit
            if cost.row(sizes(r)) > budget:
                _warn_oversized(sizes(r), cost, budget)
            if units and units[-1][0] in unit and cost.micro([sizes(x) for x in [*units[-1], r]]) <= budget:
                units[-1].append(r)
            else:
                units.append([r])
    bins: list[list[int]] = []
    for unit in sorted(units, key=lambda u: (-cost.micro([sizes(r) for r in u]), u[0])):
        for b in bins:
            if cost.micro([sizes(r) for r in [*b, *unit]]) <= budget:
                b.extend(unit)
                break
        else:
            bins.append(list(unit))
    return [sorted(b) for b in bins]


def _units(rows: Sequence[int], sizes: Callable[[int], RowSize], cost: CostModel) -> list[list[int]]:
    """``rows`` as units that stay together: a prompt's rows (``cost.shared``, rows with the same prompt key), else
    one row each; in ascending row order."""
    if not cost.shared:
        return [[r] for r in sorted(rows)]
    units: dict[Any, list[int]] = {}
    for r in sorted(rows):
        key = sizes(r).prompt_key
        units.setdefault(key if key is not None else ("row", r), []).append(r)
    return list(units.values())


def _warn_oversized(size: RowSize, cost: CostModel, budget: float) -> None:
    key = size.name or f"{size.prompt}+{size.response}+{size.patches}"
    if key not in _WARNED:
        _WARNED.add(key)
        log.warning("train.max_tokens_per_micro_batch = %g: row %s costs %.0f (%d prompt + %d response tokens, %d vision "
                    "patches × %.3g) and runs as a micro-batch of its own, over the budget", budget, key,
                    cost.row(size), size.prompt, size.response, size.patches, cost.patch_weight)


def lockstep(bins: list[list[int]], count: int, sizes: Callable[[int], RowSize], cost: CostModel,
             spare: int | None) -> list[MicroBatch]:
    """``bins`` made ``count`` micro-batches: the costliest of those with ≥ 2 rows split in two (rows alternately,
    by cost) until there are enough, then no-op micro-batches on ``spare`` (a row this rank holds)."""
    bins = [list(b) for b in bins]
    while len(bins) < count:
        splittable = [b for b in bins if len(b) > 1]
        if not splittable:
            break
        largest = max(splittable, key=lambda b: (cost.micro([sizes(r) for r in b]), -b[0]))
        ranked = sorted(largest, key=lambda r: (-cost.row(sizes(r)), r))
        bins.remove(largest)
        bins += [sorted(ranked[0::2]), sorted(ranked[1::2])]
    out = [MicroBatch(tuple(b)) for b in bins]
    if len(out) < count:
        if spare is None:
            raise ValueError("a rank with no rows cannot run its no-op micro-batches")
        out += [MicroBatch((spare,), noop=True)] * (count - len(out))
    return out


# ----------------------------------------------------------------------------------------------- ranks
def karmarkar_karp(costs: dict[int, float], k: int) -> list[list[int]]:
    """``costs`` (row → cost) split into ``k`` parts of near-equal sums by the largest differencing method
    (Karmarkar & Karp 1982; multi-way as in verl's ``seqlen_balancing``): every row starts as a k-tuple with the row
    in one part; the two tuples with the largest spread merge, the heaviest part of one with the lightest of the other,
    until one tuple is left. Deterministic: ties break by row id. Parts sorted heaviest first, rows ascending."""
    heap: list[tuple[float, int, list[tuple[float, list[int]]]]] = []
    for n, (row, c) in enumerate(sorted(costs.items(), key=lambda rc: (-rc[1], rc[0]))):
        heap.append((-c, n, [(c, [row])] + [(0.0, []) for _ in range(k - 1)]))
    heapq.heapify(heap)
    counter = len(heap)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)  # each tuple's parts are kept heaviest first
        merged = sorted(((ca + cb, ra + rb) for (ca, ra), (cb, rb) in zip(a, reversed(b), strict=True)),
                        key=lambda part: (-part[0], part[1][:1]))
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), counter, merged))
        counter += 1
    parts = heap[0][2] if heap else [(0.0, []) for _ in range(k)]
    return [sorted(rows) for _, rows in parts]


def balance(held: Sequence[Sequence[int]], sizes: Callable[[int], RowSize], cost: CostModel) -> list[list[int]]:
    """The rows every rank holds (``held[r]``) reassigned so that the ranks' costs are near-equal
    (`karmarkar_karp` over units: a prompt's rows stay together under ``cost.shared``); each part goes to the rank
    that holds most of its rows already (fewest rows moved)."""
    W = len(held)
    units = _units([r for rows in held for r in rows], sizes, cost)
    parts = [[r for u in part for r in units[u]] for part in
             karmarkar_karp({u: cost.micro([sizes(r) for r in unit]) for u, unit in enumerate(units)}, W)]
    owner = {r: rank for rank, rows in enumerate(held) for r in rows}
    out: list[list[int] | None] = [None] * W
    for part in parts:  # heaviest first
        free = [rank for rank in range(W) if out[rank] is None]
        best = max(free, key=lambda rank: (sum(owner[r] == rank for r in part), -rank))
        out[best] = part
    return [sorted(p) if p is not None else [] for p in out]


@dataclass
class RankPlan:
    """A minibatch split over the ranks: every rank's micro-batches (lockstep) and rows."""

    micro_batches: list[list[MicroBatch]]  # per rank
    rows: list[list[int]]  # per rank, the rows it trains (no-op rows not included)


def plan_ranks(held: Sequence[Sequence[int]], sizes: Callable[[int], RowSize], cost: CostModel, budget: float, *,
               rebalance: bool = True) -> RankPlan:
    """The micro-batches of a minibatch whose rows the ranks hold (``held[r]``): rebalanced over the ranks
    (``rebalance``), cut by cost within ``budget`` and made lockstep. Every rank computes every rank's split from the
    same inputs, so the ranks agree without a collective."""
    costs = {r: cost.row(sizes(r)) for rows in held for r in rows}
    parts = balance(held, sizes, cost) if rebalance and len(held) > 1 else [list(rows) for rows in held]
    splits = [form(rows, sizes, budget, cost) for rows in parts]
    count = max(len(s) for s in splits)
    cheapest = min(costs, key=lambda r: (costs[r], r)) if costs else None
    every = [lockstep(split, count, sizes, cost, min(rows, key=lambda r: (costs[r], r)) if rows else cheapest)
             for split, rows in zip(splits, parts, strict=True)]
    return RankPlan(every, parts)


def rank_imbalance(parts: Sequence[Sequence[int]], cost: Callable[[int], float]) -> float:
    """max / mean of the ranks' costs (Σ row costs); 1 for one rank or no cost."""
    totals = [sum(cost(r) for r in rows) for rows in parts]
    mean = sum(totals) / len(totals) if totals else 0.0
    return max(totals) / mean if mean > 0 else 1.0


def local_plan(rows: Sequence[int], sizes: Callable[[int], RowSize], cost: CostModel, budget: float, *,
               ctx: Any = None) -> list[MicroBatch]:
    """Micro-batches of this rank's own ``rows`` (the no-grad passes: π_old, π_ref, the critic's values), as many on
    every rank as the rank that needs the most (one all-reduce of the counts)."""
    bins = form(rows, sizes, budget, cost)
    count = len(bins)
    if ctx is not None and ctx.enabled:
        count = int(max(ctx.gather_objects(count)))
    spare = min(rows, key=lambda r: (cost.row(sizes(r)), r)) if rows else None
    return lockstep(bins, count, sizes, cost, spare)


# ----------------------------------------------------------------------------------------------- an RL step
@dataclass
class StepLayout:
    """Every rank's rows of an RL step: their sizes by global row id (rank r's row i is ``offsets[r] + i``) and the
    minibatches each rank cut its own rows into (``chunks[rank][epoch][minibatch]``, local rows; one seeded shuffle,
    the same on every rank). Gathered once per step (`of`); every rank then plans every rank's split alike."""

    sizes: list[RowSize]
    offsets: list[int]  # W + 1 cumulative row counts
    chunks: list[list[list[list[int]]]]
    cost: CostModel

    @classmethod
    def of(cls, batch: Any, chunks: list[list[list[int]]], cost: CostModel, ctx: Any) -> StepLayout:
        """The layout of ``batch`` (this rank's `UpdateBatch`) cut into ``chunks``: one gather of sizes and chunks."""
        local = [cost.size(t.prompt_ids, t.response_ids, t.vision, str(t.sample.id), f"{ctx.rank}:{t.group_index}")
                 for t in batch.trajectories]
        parts = ctx.gather_objects((local, chunks))
        offsets = [0]
        for sizes, _ in parts:
            offsets.append(offsets[-1] + len(sizes))
        return cls([s for sizes, _ in parts for s in sizes], offsets, [c for _, c in parts], cost)

    def size(self, row: int) -> RowSize:
        return self.sizes[row]

    def held(self, epoch: int, minibatch: int) -> list[list[int]]:
        """Every rank's rows of a minibatch, as global row ids."""
        return [[self.offsets[r] + i for i in chunks[epoch][minibatch]] for r, chunks in enumerate(self.chunks)]

    def global_rows(self, epoch: int, minibatch: int) -> list[int]:
        return [g for rows in self.held(epoch, minibatch) for g in rows]

    def plan(self, epoch: int, minibatch: int, budget: float, skippable: Any) -> tuple[RankPlan, RankPlan, list[int]]:
        """(the actor's plan, the critic's plan, the rows trained) of a minibatch under ``budget``. In one process rows
        whose advantages are all 0 may be left out of the actor's (``skippable``, `zero_advantage_rows`), not the
        critic's."""
        held = self.held(epoch, minibatch)
        if len(held) > 1:
            actor = plan_ranks(held, self.size, self.cost, budget)
            return actor, actor, [g for rows in held for g in rows]
        rows = held[0]
        trained = [r for r in rows if not skippable[r]] or rows[:1]
        actor = plan_ranks([trained], self.size, self.cost, budget)
        return actor, actor if trained == rows else plan_ranks([rows], self.size, self.cost, budget), trained

    @staticmethod
    def rows_of(plans: Sequence[Sequence[tuple[RankPlan, RankPlan, list[int]]]]) -> list[set[int]]:
        """Per rank, every row it runs in any of ``plans`` (what `gather_rows` must bring it)."""
        needs: list[set[int]] = []
        for epoch in plans:
            for actor, critic, _ in epoch:
                for plan in (actor, critic):
                    for rank, micro in enumerate(plan.micro_batches):
                        while len(needs) <= rank:
                            needs.append(set())
                        needs[rank].update(r for m in micro for r in m.rows)
        return needs

    def metrics(self, epoch: int, minibatch: int, micro: Sequence[MicroBatch], trained: Sequence[int],
                rows: Sequence[int], *, parts: Sequence[Sequence[int]] | None = None) -> dict[str, float]:
        """``policy/skipped_rows_frac``, this rank's ``perf/micro_batches`` and ``perf/noop_micro_batches``, and with
        several ranks ``perf/rank_imbalance`` of ``parts`` (every rank's rows; unset: as each rank holds them)."""
        out = {"policy/skipped_rows_frac": 1 - len(trained) / max(len(rows), 1),
               "perf/micro_batches": float(len(micro)), "perf/noop_micro_batches": float(sum(m.noop for m in micro))}
        if len(self.chunks) > 1:
            parts = parts if parts is not None else self.held(epoch, minibatch)
            out["perf/rank_imbalance"] = rank_imbalance(parts, lambda g: self.cost.row(self.sizes[g]))
        return out

    def largest(self, micro: Sequence[MicroBatch], offset: int) -> float:
        """The cost of the costliest real micro-batch of ``micro`` (rows ``offset`` + i)."""
        return max((self.cost.micro([self.sizes[offset + r] for r in m.rows]) for m in micro if not m.noop), default=0.0)


# ----------------------------------------------------------------------------------------------- moving rows
def exchange(ctx: Any, outgoing: Sequence[Any]) -> list[Any]:
    """``outgoing[r]`` sent to rank r by every rank (one scatter per source rank: each rank receives only its own
    rows, not everyone's); returns what each rank sent to this one, in rank order."""
    if not ctx.enabled:
        return [outgoing[0]]
    import torch.distributed as dist

    received = []
    for src in range(ctx.world_size):
        out: list[Any] = [None]
        dist.scatter_object_list(out, list(outgoing) if ctx.rank == src else None, src=src)
        received.append(out[0])
    return received


def gather_rows(batch: Any, ctx: Any, offsets: Sequence[int], needs: Sequence[set[int]]) -> Any:
    """``batch`` (an `UpdateBatch`, this rank's rows) as the step's rows of every rank side by side, rank r's row i
    at ``offsets[r] + i``: its tensor fields for every row (per-token values, small: gathered), its trajectories only
    for the rows this rank runs (``needs[rank]``, sent by the rank that holds them, `exchange`; None elsewhere)."""
    import dataclasses

    import torch

    tensors = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)
               if isinstance(getattr(batch, f.name), torch.Tensor)}
    parts = ctx.gather_objects(tensors)
    merged = {}
    for name in tensors:
        values = [part[name] for part in parts]
        width = max(v.shape[1] for v in values) if values[0].dim() >= 2 else 0  # (B, R, …): padded along R
        merged[name] = torch.cat([torch.nn.functional.pad(v, (0, 0) * (v.dim() - 2) + (0, width - v.shape[1]))
                                  if v.dim() >= 2 else v for v in values])
    start = offsets[ctx.rank]
    mine = {start + i: t for i, t in enumerate(batch.trajectories)}
    outgoing = [[] if dst == ctx.rank else [(g, _light(t)) for g, t in mine.items() if g in needs[dst]]
                for dst in range(ctx.world_size)]
    trajectories: list[Any] = [None] * offsets[-1]
    for g in needs[ctx.rank] & mine.keys():
        trajectories[g] = mine[g]
    for received in exchange(ctx, outgoing):
        for g, t in received or []:
            trajectories[g] = t
    return dataclasses.replace(batch, trajectories=trajectories, **merged)


def _light(t: Any) -> Any:
    """A trajectory without what a teacher-forced pass never reads (decoded images, text), to send to another rank."""
    import dataclasses

    return dataclasses.replace(t, images=[None] * len(t.images), response_text="",
                               sample=dataclasses.replace(t.sample, images=[None] * len(t.sample.images)))
