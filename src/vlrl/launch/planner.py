"""Placement planner (`vlrl plan CONFIG --gpus N --gpu-mem GB`): HybridFlow's auto-mapping idea, kept honest.

For a run config it estimates, per device, the memory of every role — actor (trained), reference (frozen,
only with a KL term), critic (trained, only for ``gae``), rollout (generation) — for each placement:

- ``colocated fsdp``: every role on all N devices, the actor FSDP2-sharded N ways, rollout in-process on the
  sharded actor (vlrl's in-process engine; each decode step all-gathers the weights);
- ``colocated ddp``: the same with a full replica per device;
- ``separate``: rollout servers on G devices (one full replica each, data parallel), the trainer FSDP2 over
  the other N − G, weights shipped to the servers after every step (OpenRLHF-style; `rollout.servers.urls`).

and prints the feasible placements ranked by estimated step time, with the formula beside every number. Each
ranked placement comes with the `vlrl launch` command that starts exactly it (`Placement.overrides`), checked by
the launcher's own pre-start checks (`vlrl.launch.launcher.prepare`): one that fits but that the launch would
refuse is listed with the launch's reason instead of a rank, so the planner recommends only what the runtime
starts; ``vlrl plan --apply OUT.yaml`` writes #1's (``--pick N``: #N's) settings into a config (`applied_config`).

**Memory**: `vlrl.launch.memory` — per device and per phase of a step (generation, the π_old / π_ref / critic
scoring passes, forward + backward, the optimizer step), each term with its formula; the peak is the costliest phase.

**A config alone.** ``model.path`` may be a ``config.json`` (or a directory with one and no tokenizer): the model is
built on the meta device from it, with the family's stand-in tokenizer and image processor
(`vlrl.models.config_only`), so a model can be planned before it is downloaded.

**Time** (per step; F peak FLOP/s, η the MFU assumption, W memory bandwidth, Λ link bandwidth):

    train      (c·Ψ_t·T + c_v·Ψ_v·T_v + 12·n_layers·h·L·T) · epochs / (n_train·F·η)   (Kaplan et al. 2020)
               c = 2 forward + 2 input gradients + 2·(share of the text weights trained) + 2 with checkpointing
               (the recomputed forward); c_v the same for the vision tower, 2 when it trains nothing
    extra passes (π_old when several optimizer steps, π_ref with a KL term) 2Ψ·T / (n_train·F·η) each
               ``train.shared_prefix``: a group's prompt runs once in the π_old / π_ref passes and in the update
               (`vlrl.train.shared_prefix`; also under DDP / FSDP2 and checkpointing — not for recurrent layers): there
               T = prompts·P + rows·R and T_v = prompts·N_p instead of rows·L and rows·N_p (the critic's pass does
               not share)
    generate   prefill 2Ψ·P·prompts / (n_gen·F·η) + R · ⌈rows/(n_gen·B)⌉ · (Ψ·b_c + KV/2)/W   (each prompt is
               prefilled once for its n samples, `vlrl.rollout.decode` — rows = prompts · n; decode is
               memory-bound; the cache is half full on average)
               + colocated fsdp: R · ⌈…⌉ · Ψ·b_c·(d−1)/d / Λ   (the all-gather of every decode step)
    gradients  DDP: steps·2Ψ·b_w·(n−1)/n / Λ; FSDP2: steps·(2·micro-batches + 1)·Ψ·b_c·(n−1)/n / Λ
               (LoRA: DDP steps·2Ψ_lora·4·(n−1)/n / Λ; FSDP2 steps·(2·micro-batches·Ψ·b_c + Ψ_lora·4)·(n−1)/n / Λ:
               the frozen base is gathered, only the adapters' gradients are reduced)
    weight sync (separate) Ψ·b_c / Λ;  step = generate + train (+ sync), or max(generate, train) + sync when
               ``rollout.mode=async`` on separate devices.

These are estimates to rank placements, not promises; the defaults describe an A100-80GB with NVLink.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vlrl.launch.measure import measure_train_step  # noqa: F401  (`vlrl plan --measure` asks planner.…)
from vlrl.launch.memory import (  # noqa: F401  (the memory terms, by phase; tests and the GPU check read planner.…)
    PhaseMemory,
    Term,
    activations,
    count_text,
    estimate_phases,
    estimate_train_step,
    generation,
    human_bytes,
    human_seconds,
    micro_rows,
    model_state,
    phase_memory,
    rows_text,
    trained_state,
)
from vlrl.launch.memory import scoring as memory_scoring  # noqa: F401
from vlrl.launch.shapes import (  # noqa: F401  (`vlrl plan` reads the model and workload through planner.…)
    GB,
    Device,
    ModelShape,
    Workload,
    is_config_only,
    meta_model,
    model_shape,
    workload,
)


@dataclass(frozen=True)
class Placement:
    """What `vlrl launch` starts for a plan: ``trainer_ranks`` ranks (one device each) with ``strategy``, and
    ``servers`` rollout servers (one device each, a full replica)."""

    strategy: str  # fsdp | ddp
    trainer_ranks: int
    servers: int = 0
    asynchronous: bool = False  # the plan overlaps generation and training (rollout.mode=async)

    def overrides(self, *, gpu: bool, replace_servers: bool = False) -> list[str]:
        """The `vlrl launch` settings that start exactly this placement. ``gpu``: a device is a GPU (one per bundle);
        otherwise a CPU bundle of launch.cpus_per_rank / launch.server_cpus. ``replace_servers``: the config names
        rollout.servers.urls of its own, which this placement replaces (none colocated, the launch's own when separate)."""
        out = [f"launch.nproc={self.trainer_ranks}", f"dist.strategy={self.strategy}",
               f"launch.gpus_per_rank={int(gpu)}", f"launch.rollout_servers={self.servers}"]
        if self.servers:
            out.append(f"launch.gpus_per_server={int(gpu)}")
        if replace_servers:
            out.append("rollout.servers.urls=[]")
        if self.asynchronous:
            out.append("rollout.mode=async")
        return out


@dataclass
class Plan:
    name: str
    memory: dict[str, list[Term]]  # device group → terms (summed = per-device peak of that group)
    time: list[Term]
    step_seconds: float
    notes: list[str] = field(default_factory=list)
    placement: Placement | None = None
    host: dict[str, list[Term]] = field(default_factory=dict)  # dist.cpu_offload: per-rank host memory, by group
    phases: dict[str, PhaseMemory] = field(default_factory=dict)  # device group → its memory per phase (the peak's
    # terms are ``memory``'s)

    def peak(self, group: str) -> float:
        return sum(t.value for t in self.memory[group])

    def feasible(self, device: Device) -> bool:
        return all(self.peak(g) <= device.memory_gb * GB for g in self.memory)


# ----------------------------------------------------------------------------------------------- placements
def train_seconds(s: ModelShape, w: Workload, dev: Device, n: int) -> list[Term]:
    T = w.sequences * w.length
    shares = w.shared_prefix and 0 < w.prompts < w.sequences  # a group's prompt once (`vlrl.train.shared_prefix`)
    T_shared = w.prompts * w.prompt_tokens + w.sequences * w.response_tokens if shares else T
    T_train = T_shared  # the update's forward shares too: one grouped forward, any ranks, checkpointing or not
    Tv = (w.prompts if T_train != T else w.sequences) * w.patches
    rate = n * dev.tflops * 1e12 * dev.mfu
    c, c_v = train_flop_factors(s, w)
    flops = (c * s.params_text * T_train + c_v * s.params_vision * Tv
             + 12 * s.layers * s.hidden * w.length * T_train) * w.epochs
    terms = [Term("train", flops / rate, "(c·Ψ_t·T + c_v·Ψ_v·T_v + 12·n_layers·h·L·T)·epochs/(n·F·η)",
                  f"({c:g}·{count_text(s.params_text)}·{T_train} + {c_v:g}·{count_text(s.params_vision)}·{Tv} + 12·{s.layers}·"
                  f"{s.hidden}·{w.length}·{T_train})·{w.epochs}/({n}·{dev.tflops:g}T·{dev.mfu:g})")]
    shared_passes, critic = int(w.old_pass) + int(w.reference), int(w.critic)
    tokens = shared_passes * T_shared + critic * T
    if tokens:
        terms.append(Term("scoring passes", 2 * s.params * tokens / rate, "2Ψ·(passes·T + critic·rows·L)/(n·F·η)",
                          f"2·{count_text(s.params)}·({shared_passes}·{T_shared} + {critic}·{T})/({n}·{dev.tflops:g}T·"
                          f"{dev.mfu:g})"))
    if w.teacher_params:  # algo.distill: the teacher's no-grad pass over the step's rows
        terms.append(Term("teacher pass", 2 * w.teacher_params * T_shared / rate, "2Ψ_T·T/(n·F·η)",
                          f"2·{count_text(w.teacher_params)}·{T_shared}/({n}·{dev.tflops:g}T·{dev.mfu:g})"))
    return terms


def train_flop_factors(s: ModelShape, w: Workload) -> tuple[float, float]:
    """FLOPs per parameter per token of a training pass, text and vision: 2 forward + 2 input gradients + 2 × the
    share of weights trained (+ 2 for the recomputed forward under checkpointing); 6 for full training, ~4 under
    LoRA, 2 for a vision tower that trains nothing (no backward through it)."""
    recompute = 2 if w.checkpointing else 0
    text_trained = 1.0 if w.trained_params is None else \
        (w.trained_params - (w.trained_vision or 0)) / max(s.params_text, 1)
    vision_trained = 1.0 if w.trained_vision is None else w.trained_vision / max(s.params_vision, 1)
    c = 4 + 2 * text_trained + recompute
    c_v = 2 if w.trained_vision == 0 else 4 + 2 * vision_trained + recompute
    return c, c_v


def sync_seconds(s: ModelShape, w: Workload, dev: Device, n: int, strategy: str) -> list[Term]:
    """Gradient communication per step on n ranks: DDP all-reduces the gradients once per optimizer step
    (ring: 2·(n−1)/n of them); FSDP2 all-gathers the weights for every micro-batch's forward and backward and
    reduce-scatters the gradients once per optimizer step. Under LoRA only the Ψ_lora fp32 adapters have gradients:
    DDP all-reduces those, FSDP2 still all-gathers the whole (sharded, frozen) base but reduce-scatters only them."""
    if n == 1:
        return []
    steps = w.epochs * w.minibatches  # optimizer steps per step
    rows = math.ceil(w.sequences / (n * w.minibatches))  # a rank's rows per minibatch
    micro = math.ceil(rows / max(1.0, min(micro_rows(w, n), rows)))  # micro-batches per minibatch (or the budget's)
    frac = (n - 1) / n
    link = f"{n - 1}/{n}/{dev.link_gbs:g}G"
    a = w.adapter_params
    if strategy == "ddp":
        if a:
            return [Term("gradient all-reduce", steps * 2 * a * 4 * frac / (dev.link_gbs * 1e9),
                         "steps·2Ψ_lora·4·(n−1)/n/Λ", f"{steps}·2·{count_text(a)}·4·{link}")]
        volume = steps * 2 * s.params * w.weight_bytes * frac
        return [Term("gradient all-reduce", volume / (dev.link_gbs * 1e9), "steps·2Ψ·b_w·(n−1)/n/Λ",
                     f"{steps}·2·{count_text(s.params)}·{w.weight_bytes}·{link}")]
    if a:
        volume = steps * (2 * micro * s.params * w.compute_bytes + a * 4) * frac
        return [Term("FSDP gathers + reduce", volume / (dev.link_gbs * 1e9), "steps·(2·micro·Ψ·b_c + Ψ_lora·4)·(n−1)/n/Λ",
                     f"{steps}·(2·{micro}·{count_text(s.params)}·{w.compute_bytes} + {count_text(a)}·4)·{link}")]
    volume = steps * (2 * micro + 1) * s.params * w.compute_bytes * frac
    return [Term("FSDP gathers + reduce", volume / (dev.link_gbs * 1e9), "steps·(2·micro+1)·Ψ·b_c·(n−1)/n/Λ",
                 f"{steps}·(2·{micro}+1)·{count_text(s.params)}·{w.compute_bytes}·{link}")]


def generate_seconds(s: ModelShape, w: Workload, dev: Device, replicas: int, *, shard: int = 1,
                     offload: bool = False) -> list[Term]:
    rows = w.sequences
    per_replica = math.ceil(rows / replicas)
    calls = math.ceil(per_replica / w.gen_batch)
    B = min(per_replica, w.gen_batch)
    R, b = w.response_tokens, w.compute_bytes
    kv = 2 * s.layers * s.kv_dim * w.length * B * b / 2  # the cache is half full on average
    prompts = w.prompts or rows  # each distinct prompt prefilled once for its n rows
    prefill = 2 * s.params * w.prompt_tokens * prompts / (replicas * dev.tflops * 1e12 * dev.mfu)
    decode = R * calls * (s.params * b + kv) / (dev.bandwidth_gbs * 1e9)  # every decode step reads all weights
    terms = [
        Term("prefill", prefill, "2Ψ·P·prompts/(n_gen·F·η)",
             f"2·{count_text(s.params)}·{w.prompt_tokens}·{prompts}/({replicas}·{dev.tflops:g}T·{dev.mfu:g})"),
        Term("decode", decode, "R·calls·(Ψ·b_c + KV/2)/W", f"{R}·{calls}·({count_text(s.params)}·{b} + {count_text(kv)})"
             f"/{dev.bandwidth_gbs:g}G"),
    ]
    if shard > 1:
        gathered = s.params * b * (shard - 1) / shard
        terms.append(Term("decode all-gathers", R * calls * gathered / (dev.link_gbs * 1e9), "R·calls·Ψ·b_c·(d−1)/d/Λ",
                          f"{R}·{calls}·{count_text(s.params)}·{b}·{shard - 1}/{shard}/{dev.link_gbs:g}G"))
    if offload:  # every decode step copies the rank's offloaded shards to the device before gathering them
        copied = s.params * w.weight_bytes / shard
        terms.append(Term("decode offload copies", R * calls * copied / (dev.pcie_gbs * 1e9), "R·calls·Ψ·b_w/d/P_cie",
                          f"{R}·{calls}·{count_text(s.params)}·{w.weight_bytes}/{shard}/{dev.pcie_gbs:g}G"))
    return terms


def offload_seconds(s: ModelShape, w: Workload, dev: Device, n: int) -> list[Term]:
    """``dist.cpu_offload`` per step on n FSDP2 ranks: each micro-batch's forward and backward copy a rank's
    parameter shards host → device before their all-gathers, the reduce-scattered gradient shards go back once
    per optimizer step (PCIe, P_cie), and AdamW steps on the host: read parameter, gradient and two moments, write
    three, 28 bytes per fp32 parameter of the shard (host bandwidth H per rank)."""
    steps = w.epochs * w.minibatches
    rows = math.ceil(w.sequences / (n * w.minibatches))
    micro = math.ceil(rows / max(1.0, min(micro_rows(w, n), rows)))
    trained = (s.params if w.trained_params is None else w.trained_params) + w.adapter_params
    copies = steps * (2 * micro * s.params * w.weight_bytes + trained * w.weight_bytes) / n
    adam = steps * trained * 7 * w.weight_bytes / n
    return [Term("offload copies", copies / (dev.pcie_gbs * 1e9), "steps·(2·micro·Ψ + Ψ_t)·b_w/n/P_cie",
                 f"{steps}·(2·{micro}·{count_text(s.params)} + {count_text(trained)})·{w.weight_bytes}/{n}/{dev.pcie_gbs:g}G"),
            Term("host AdamW step", adam / (dev.host_gbs * 1e9), "steps·7·Ψ_t·b_w/n/H",
                 f"{steps}·7·{count_text(trained)}·{w.weight_bytes}/{n}/{dev.host_gbs:g}G")]


def plan_placements(s: ModelShape, w: Workload, dev: Device) -> list[Plan]:
    """Every placement of the run's roles on ``dev.count`` devices, with memory (per phase, `vlrl.launch.memory`)
    and time terms."""
    N = dev.count
    plans = []
    for strategy in ("fsdp", "ddp"):
        d = N if strategy == "fsdp" else 1
        offload = w.cpu_offload and strategy == "fsdp" and N > 1  # one process wraps nothing: no FSDP, no offload
        memory = phase_memory(s, w, d, ranks=N, offload=offload,
                              generate_rows=math.ceil(w.sequences / N) if w.recipe == "rl" else None)
        time = train_seconds(s, w, dev, N) + sync_seconds(s, w, dev, N, strategy)
        if offload:
            time += offload_seconds(s, w, dev, N)
        if w.recipe == "rl":
            time = generate_seconds(s, w, dev, N, shard=d, offload=offload) + time
        plans.append(Plan(f"colocated {strategy}×{N}", {"all devices": memory.peak_terms()}, time,
                          sum(t.value for t in time), [f"peak phase: {memory.peak_phase}"],
                          Placement(strategy, N, asynchronous=w.asynchronous),
                          host={"all devices": model_state(s, w, d)} if offload else {},
                          phases={"all devices": memory}))
    if w.recipe == "rl" and N > 1:
        for g in range(1, N):
            d = N - g
            offload = w.cpu_offload and d > 1
            trainer = phase_memory(s, w, d, ranks=d, offload=offload)
            server = PhaseMemory([Term("rollout parameters", s.params * w.compute_bytes, "Ψ·b_c",
                                       f"{count_text(s.params)}·{w.compute_bytes}")],
                                 {"generate": generation(s, w, math.ceil(w.sequences / g))})
            gen, train = generate_seconds(s, w, dev, g), train_seconds(s, w, dev, d) + sync_seconds(s, w, dev, d, "fsdp")
            if offload:
                train += offload_seconds(s, w, dev, d)
            sync = Term("weight sync", s.params * w.compute_bytes / (dev.link_gbs * 1e9), "Ψ·b_c/Λ",
                        f"{count_text(s.params)}·{w.compute_bytes}/{dev.link_gbs:g}G")
            g_sec, t_sec = sum(t.value for t in gen), sum(t.value for t in train)
            step = (max(g_sec, t_sec) if w.asynchronous else g_sec + t_sec) + sync.value
            notes = [f"trainer peak phase: {trainer.peak_phase}"]
            notes += ["rollout.mode=async: generation overlaps training"] if w.asynchronous else []
            groups = {f"trainer ({d})": trainer, f"rollout ({g})": server}
            plans.append(Plan(f"separate: trainer fsdp×{d} + {g} rollout server(s)",
                              {name: m.peak_terms() for name, m in groups.items()}, gen + train + [sync], step, notes,
                              Placement("fsdp", d, g, asynchronous=w.asynchronous),
                              host={f"trainer ({d})": model_state(s, w, d)} if offload else {}, phases=groups))
    return plans


def ranked(plans: list[Plan], dev: Device, launches: dict[str, LaunchSettings] | None = None) -> list[Plan]:
    """``#1``, ``#2``, … of `format_plans` (``vlrl plan --pick N``): the plans that fit, fastest first — with
    ``launches``, only those `vlrl launch` accepts."""
    fits = sorted((p for p in plans if p.feasible(dev)), key=lambda p: p.step_seconds)
    return [p for p in fits if launches is None or launches[p.name].problem is None]


def format_plans(plans: list[Plan], dev: Device, w: Workload, s: ModelShape,
                 launches: dict[str, LaunchSettings] | None = None) -> str:
    """The report: the ranked plans, then those that fit but `vlrl launch` refuses, then those that do not fit.
    With ``launches`` (`launch_settings` of every plan that fits, by name), each ranked plan shows the `vlrl launch`
    command that starts it, and a refused one why."""
    feasible = ranked(plans, dev, launches)
    refused = [p for p in ranked(plans, dev) if p not in feasible]
    infeasible = [p for p in plans if not p.feasible(dev)]
    lines = [
        f"model: Ψ = {count_text(s.params)} parameters (vision Ψ_v = {count_text(s.params_vision)}), {s.layers} layers, h = {s.hidden}, "
        f"I = {s.intermediate}, k = {s.kv_dim}, V = {s.vocab}, largest FSDP unit U = {count_text(s.largest_unit)}",
        f"step ({w.recipe}): {w.sequences} sequences of L = P + R = {w.prompt_tokens} + {w.response_tokens} tokens "
        f"({w.patches} vision patches each), "
        + (f"train.max_tokens_per_micro_batch {w.max_tokens} (m = B / (L + w_v·N_p) = {w.max_tokens} / ({w.length} + "
           f"{w.patch_weight:.3g}·{w.patches}) = {rows_text(micro_rows(w))} rows, ≥ 1, at most a rank's share)"
           if w.max_tokens is not None else
           f"train.micro_batch_size {w.micro_batch} (m = the smaller of it and a rank's share)")
        + f", b_w = {w.weight_bytes}, b_c = {w.compute_bytes}"
        + (", gradient checkpointing" if w.checkpointing else "")
        + (f", LoRA Ψ_lora = {count_text(w.adapter_params)} (base frozen)" if w.adapter_params else "")
        + (f", trained Ψ_t = {count_text(w.trained_params)}" if w.trained_params and not w.adapter_params else ""),
        f"devices: {dev.count} × {dev.memory_gb:g} GiB, F = {dev.tflops:g} TFLOP/s, η = {dev.mfu:g}, "
        f"W = {dev.bandwidth_gbs:g} GB/s, Λ = {dev.link_gbs:g} GB/s"
        + ("; each launch line starts its placement (--ray ADDRESS instead of local on a cluster)" if launches else ""),
        "",
    ]
    for rank, plan in enumerate(feasible, 1):
        lines.append(f"#{rank} {plan.name}: ~{human_seconds(plan.step_seconds)}/step" + "".join(f" ({n})" for n in plan.notes))
        if launches is not None:
            lines.append(f"  launch: {launches[plan.name].command}")
        lines += _plan_lines(plan, dev)
    for plan in refused:
        lines.append(f"✗ {plan.name}: fits (~{human_seconds(plan.step_seconds)}/step), but vlrl launch refuses it: "
                     f"{launches[plan.name].problem}")
        lines += _plan_lines(plan, dev)
    for plan in infeasible:
        over = ", ".join(f"{g} {human_bytes(plan.peak(g))}" for g in plan.memory if plan.peak(g) > dev.memory_gb * GB)
        lines.append(f"✗ {plan.name}: does not fit ({over} > {dev.memory_gb:g} GiB)")
        lines += _plan_lines(plan, dev)
    if not feasible:
        lines.append("no placement fits: more devices, bf16 (model.dtype / dist.mixed_precision) or smaller micro-batches"
                     if not refused else "no placement that fits can be launched with these settings (✗ above: why)")
    return "\n".join(lines)


def _plan_lines(plan: Plan, dev: Device) -> list[str]:
    """A plan's memory per device group — what is held throughout, then each phase's own terms and total (the peak
    marked) — its host memory under dist.cpu_offload, and its time terms."""
    lines = []
    for group, terms in plan.memory.items():
        lines.append(f"  memory per device, {group}: {human_bytes(plan.peak(group))} of {dev.memory_gb:g} GiB")
        phases = plan.phases.get(group)
        if phases is None:
            lines += [t.line("bytes") for t in terms]
            continue
        lines += [t.line("bytes") for t in phases.resident]
        for name, own in phases.phases.items():
            mark = "  ← peak" if name == phases.peak_phase else ""
            lines.append(f"   phase {name}: {human_bytes(phases.total(name))}{mark}")
            lines += ["  " + t.line("bytes") for t in own]
    for group, terms in plan.host.items():
        lines.append(f"  host memory per rank, {group} (dist.cpu_offload, not on the device): "
                     f"{human_bytes(sum(t.value for t in terms))}")
        lines += [t.line("bytes") for t in terms]
    lines.append("  time:")
    lines += [t.line("seconds") for t in plan.time]
    lines.append("")
    return lines


# ----------------------------------------------------------------------------------------------- launching a plan
@dataclass(frozen=True)
class LaunchSettings:
    """A placement as `vlrl launch` settings: the command, and why `vlrl launch` refuses it (None: it accepts;
    `vlrl.launch.launcher.prepare` decided, the same checks the launch makes before it starts anything)."""

    command: str
    overrides: tuple[str, ...]  # the placement's own (after the run's overrides in the command)
    problem: str | None = None


def launch_settings(plan: Plan, cfg, recipe: str, config: Path | None, overrides: list[str]) -> LaunchSettings:
    """``plan``'s placement as `vlrl launch` settings for the run ``config`` + ``overrides`` (``cfg`` loaded from
    them), checked by the launcher's own `prepare`."""
    import shlex

    from vlrl.config import ConfigError
    from vlrl.launch.launcher import LaunchRefused, prepare

    rollout = getattr(cfg, "rollout", None)
    own = tuple(plan.placement.overrides(gpu=cfg.model.device.startswith("cuda"),
                                         replace_servers=bool(rollout is not None and rollout.servers.urls)))
    given = [*overrides, *own]
    command = shlex.join(["vlrl", "launch", "--ray", "local", *([str(config)] if config else []), *given])
    try:
        prepare(recipe, config, given)
    except (ConfigError, LaunchRefused) as err:
        return LaunchSettings(command, own, " ".join(str(err).split()))
    return LaunchSettings(command, own)


def applied_config(cfg_cls, config: Path | None, overrides: list[str], header: str) -> str:
    """The run's YAML with ``overrides`` (the run's and a placement's) written in: a config `vlrl launch` takes as
    it is. Input paths are made absolute (the file may be written anywhere); everything else stays as written."""
    import yaml

    from vlrl.config import apply_overrides, resolve_paths
    from vlrl.safe_yaml import load_file

    raw: dict[str, Any] = {}
    if config is not None:
        raw = load_file(config) or {}
        resolve_paths(cfg_cls, raw, config.resolve().parent)
    apply_overrides(raw, list(overrides), cls=cfg_cls, base=Path.cwd())
    comment = "".join(f"# {line}\n" for line in header.splitlines())
    return comment + yaml.safe_dump(raw, sort_keys=False, allow_unicode=True)


def format_measurement(measured: dict[str, float], s: ModelShape, w: Workload) -> str:
    estimate = estimate_train_step(s, w)
    lines = ["measured on this CPU (one training step, torch MemTracker peak) vs estimate, 1 device:"]
    for key, label in (("param", "parameters"), ("grad", "gradients"), ("opt", "AdamW moments"), ("act", "activations")):
        got = measured.get(key, 0.0)
        lines.append(f"    {label:<16s} measured {got / 2**20:9.2f} MiB   estimate {estimate[key] / 2**20:9.2f} MiB"
                     f"   ({(estimate[key] - got) / max(got, 1) * 100:+.1f} %)")
    total, est = measured.get("total", 0.0), sum(estimate.values())
    lines.append(f"    {'peak total':<16s} measured {total / 2**20:9.2f} MiB   estimate {est / 2**20:9.2f} MiB"
                 f"   ({(est - total) / max(total, 1) * 100:+.1f} %; measured also holds {measured.get('temp', 0) / 2**20:.2f} MiB temporaries)")
    return "\n".join(lines)
