"""The GPU check (issue 36 item 6): vlrl at a real shape on one lent GPU, in one `device` call of ≤ 8 minutes.

Random-weight Qwen2.5-VL-3B (and 7B when the GPU holds it) built from their published ``config.json``
(tests/fixtures/model_configs; `vlrl.models.config_only`: stand-in tokenizer and image processor) in bf16 on CUDA,
a GRPO step at a real shape — 8 prompts × n 8, 448² images (256 vision tokens each), 512 new tokens — measured piece
by piece:

- **the ceilings**: a bf16 8192³ matmul (median of 10 after 3 warm-ups, random data) and a 1 GiB device-to-device
  copy (bytes read + written) — the rates the figures below are compared with, beside the datasheet peak;
- **generation** (`vlrl.rollout.decode`, the in-process engine's loop; EOS suppressed so all 64 rows decode 512
  tokens): tokens/s, ms per decode step, and the step's memory bound (weights + the KV cache read once per step,
  over the measured copy bandwidth) — eager, and with ``rollout.engine.compile`` (a static cache, one decode step in a CUDA
  graph; its first call, the compile, timed apart);
- **sampler ≡ trainer**: max and mean |behaviour − teacher-forced| log-prob of the generated tokens in bf16;
- **the update** (`prepare_batch` + `ppo_update`, what a GRPO step runs after generation; rewards set so every group
  has a signal) for each arm — full fine-tuning and LoRA r=16, each with and without gradient checkpointing, pure
  bf16 weights — `perf/mfu` over the datasheet peak (and the measured matmul rate), seconds, and the peak GPU memory
  (``torch.cuda.max_memory_allocated``) beside `vlrl plan`'s estimate of the same step on one device.

Each measurement runs in its own ``try``: a failure (an out-of-memory arm, say) is written down and the rest go on.
A time budget (``--budget``) skips what would not fit, in priority order; the 7B model runs only when the budget and
the GPU's memory leave room. Output: ``OUT/gpu_check.json`` (every number, versions, device) and
``OUT/gpu_check.md`` (the table docs/gpu.md takes), the table also printed last.

**On a lent GPU** (one `device` call; docs/gpu.md). First, here, once: ``bash benchmarks/gpu_wheels.sh`` (the wheels
the device image lacks, into ``.whl/``, git-ignored). Then the `run` tool with ``carry: [".whl"]``,
``timeout_s: 420`` (7 minutes: with the machine's start, a second call still fits the task's 15 minutes of device
time) and this command:

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 && python3 benchmarks/gpu_check.py --out $OUT --budget 330

The 3B model's measurements take ~5 minutes (the compiled decode step's compile the longest); the 7B runs when the
budget leaves ~200 s — or alone in a second call: ``… gpu_check.py --out $OUT --models qwen2_5_vl_7b --budget 330``.

**On this CPU** (the test suite: tests/test_gpu_check.py): ``--smoke`` runs the same code on the tiny preset at a
tiny shape, one update step per arm, in about a minute.

    PYTHONPATH=src python benchmarks/gpu_check.py --smoke --out /tmp/gpu_check
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import platform
import statistics
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures" / "model_configs"
GiB = 2**30


@dataclass(frozen=True)
class Shape:
    prompts: int
    n: int
    new_tokens: int
    side: int  # image side, pixels
    micro_batch: int


REAL = Shape(prompts=8, n=8, new_tokens=512, side=448, micro_batch=8)
SMOKE = Shape(prompts=4, n=2, new_tokens=48, side=112, micro_batch=4)


@dataclass(frozen=True)
class Arm:
    """One update measurement: full fine-tuning or LoRA (rank), gradient checkpointing, and the rows it trains on —
    every response ``new_tokens`` long, or a long tail (the first quarter of the prompts' groups keep all their tokens,
    every other response is cut to 1/8: a micro-batch of 8 rows then holds 8 long ones or 8 short ones) — cut into micro-batches of
    ``micro_batch`` rows or by ``train.max_tokens_per_micro_batch`` (``budget``: the count-based split's mean
    micro-batch cost, ×1.05). ``profile``: one more update under torch.profiler (its time by kernel category)."""

    name: str
    lora: int | None
    checkpointing: bool
    long_tail: bool = False
    budget: bool = False
    profile: bool = False


# In the order they run: what round one measured (for comparison, now with per-phase peaks and a profile), the token
# budget against the count-based split on a long tail, then the arms round one did not reach. A LoRA arm's adapters
# are removed again when it ends. An arm `vlrl plan` says does not fit the GPU is skipped, with the plan's figure.
ARMS = [Arm("full, checkpointing", None, True, profile=True),
        Arm("full, checkpointing, long tail", None, True, long_tail=True),
        Arm("full, checkpointing, long tail, token budget", None, True, long_tail=True, budget=True),
        Arm("full", None, False),
        Arm("LoRA r=16, checkpointing", 16, True),
        Arm("LoRA r=16", 16, False)]
ARMS_7B = [Arm("LoRA r=16, checkpointing", 16, True), Arm("LoRA r=16", 16, False), Arm("full, checkpointing", None, True)]
COMPILE_AFTER = 2  # the rollout.engine.compile measurement (with --generate) runs after this many arms


# ----------------------------------------------------------------------------------------------- ceilings
def ceilings(device: torch.device, smoke: bool) -> dict[str, Any]:
    """Measured bf16 (fp32 on CPU) matmul rate and device-to-device copy bandwidth, and the datasheet peak."""
    from vlrl.report.perf import device_peak

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    n = 1024 if smoke else 8192
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    times = []
    for k in range(13):
        _sync(device)
        start = time.perf_counter()
        a @ b
        _sync(device)
        if k >= 3:
            times.append(time.perf_counter() - start)
    matmul = 2 * n**3 / statistics.median(times)
    nbytes = (64 if smoke else 1024) * 2**20
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    times = []
    for k in range(8):
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        if k >= 3:
            times.append(time.perf_counter() - start)
    peak = device_peak(device, dtype)
    return {"matmul_tflops": matmul / 1e12, "copy_gbs": 2 * nbytes / statistics.median(times) / 1e9,
            "datasheet_tflops": peak.tflops, "peak_source": peak.source}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_memory(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / GiB if device.type == "cuda" else None


def _reset_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


# ----------------------------------------------------------------------------------------------- model + data
def build_policy(model: str, device: torch.device, smoke: bool):
    """The random-weight policy: a fixture config in bf16 on the GPU, or the tiny preset (fp32) for --smoke."""
    from vlrl.models import load_policy
    from vlrl.models.config_only import stand_in_policy

    if smoke:
        return load_policy("tiny-qwen2-vl", device=str(device))
    return stand_in_policy(FIXTURES / f"{model}.json", device=device, dtype=torch.bfloat16)


def requests(policy, shape: Shape):
    from vlrl.data import generate
    from vlrl.rollout import HFEngine

    engine = HFEngine(policy)
    samples = generate("shapes", shape.prompts, tasks=["count", "color"], image_size=shape.side)
    return [engine.encode(s) for s in samples]


# ----------------------------------------------------------------------------------------------- generation
def generation(policy, prompts, shape: Shape, ceiling: dict, *, compiled: bool,
               backend: str = "inductor") -> tuple[dict, list]:
    """One rollout of ``shape`` (EOS suppressed: every row decodes ``new_tokens``); with ``compiled``, a first call
    compiles the step and the second is measured. Returns (figures, per-row (tokens, behaviour log-probs))."""
    from vlrl.rollout import SamplingParams, decode

    model = policy.model
    model.eval()
    rows = [r for r in prompts for _ in range(shape.n)]
    eos = model.config.image_token_id  # a suppressed token: never sampled, so every row runs to the budget
    suppress = sorted(set(policy.adapter.special_token_ids()) - set(policy.eos_token_ids))
    sampling = SamplingParams(n=1, temperature=1.0, max_new_tokens=shape.new_tokens)
    step = decode.CompiledStep(backend=backend) if compiled else None
    out: dict[str, Any] = {}
    device = next(model.parameters()).device

    def run():
        stats = decode.DecodeStats()
        _sync(device)
        start = time.perf_counter()
        decoded = decode.sample(model, policy.adapter, rows, sampling, pad_token_id=policy.pad_token_id,
                                eos_token_ids=[eos], suppress=suppress, stats=stats, compiled=step)
        _sync(device)
        return decoded, stats, time.perf_counter() - start

    if compiled:
        _, _, first = run()
        out["compile_and_first_rollout_s"] = first
    decoded, stats, seconds = run()
    tokens = sum(len(t) for t in decoded.tokens)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    text = model.config.get_text_config()
    heads = getattr(text, "num_key_value_heads", text.num_attention_heads)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    prompt = max(len(r.prompt_ids) for r in rows)
    kv_per_token = 2 * text.num_hidden_layers * heads * head_dim * next(model.parameters()).element_size()
    kv_mean = kv_per_token * len(rows) * (prompt + shape.new_tokens / 2)  # the cache read once per step, on average
    bound_ms = (params + kv_mean) / (ceiling["copy_gbs"] * 1e9) * 1e3
    ms = stats.decode_seconds / max(stats.steps - 1, 1) * 1e3
    out.update(rollout_s=seconds, tokens=tokens, tokens_per_s=tokens / seconds, prefill_s=stats.prefill_seconds,
               decode_s=stats.decode_seconds, decode_steps=stats.steps, decode_ms_per_step=ms,
               hbm_bound_ms_per_step=bound_ms, bound_share=bound_ms / ms, prompt_tokens=prompt, rows=len(rows),
               peak_memory_gib=_peak_memory(device))
    return out, list(zip(decoded.tokens, decoded.logp, strict=True))


def trajectories(prompts, decoded, shape: Shape):
    """The rollout as `Trajectory` records, rewards 0.1·k within each group (every group has a signal)."""
    from vlrl.rollout.types import Status, Trajectory

    out = []
    for k, (tokens, logp) in enumerate(decoded):
        request = prompts[k // shape.n]
        out.append(Trajectory(sample=request.sample, prompt_ids=torch.as_tensor(request.prompt_ids),
                              response_ids=torch.tensor(tokens, dtype=torch.long),
                              loss_mask=torch.ones(len(tokens), dtype=torch.long), behaviour_logp=logp.float().cpu(),
                              vision=request.vision, images=request.images, weight_version=0,
                              status=Status.TRUNCATED, response_text="", group_index=k // shape.n,
                              reward=0.1 * (k % shape.n)))
    return out


def synthetic(policy, prompts, shape: Shape):
    """Rows without a rollout (``--no-generate``): each response ``new_tokens`` random non-special token ids, behaviour
    log-probs −1 (the update's ratios come from its own π_old; only the drift metric reads them)."""
    generator = torch.Generator().manual_seed(0)
    special = set(policy.adapter.special_token_ids())
    vocab = [t for t in range(min(policy.model.config.get_text_config().vocab_size, 50_000)) if t not in special]
    pool = torch.tensor(vocab)
    rows = []
    for _ in range(len(prompts) * shape.n):
        tokens = pool[torch.randint(len(pool), (shape.new_tokens,), generator=generator)].tolist()
        rows.append((tokens, torch.full((shape.new_tokens,), -1.0)))
    return rows


def long_tail(rows, shape: Shape):
    """The rows with the first quarter of the prompts' responses kept whole and every other one cut to 1/8."""
    import dataclasses

    keep = max(1, shape.prompts // 4) * shape.n
    out = []
    for k, t in enumerate(rows):
        n = len(t.response_ids) if k < keep else max(1, len(t.response_ids) // 8)
        out.append(dataclasses.replace(t, response_ids=t.response_ids[:n], loss_mask=t.loss_mask[:n],
                                       behaviour_logp=t.behaviour_logp[:n]))
    return out


def drift(policy, rows, micro_batch: int) -> dict[str, float]:
    """|teacher-forced − behaviour| log-prob over every generated token (the sampler ≡ trainer check, bf16), the
    teacher-forced pass in micro-batches (its fp32 logits: rows × R × V × 4 bytes)."""
    from vlrl.train.batch import teacher_logprobs

    gaps = []
    for start in range(0, len(rows), micro_batch):
        part = rows[start : start + micro_batch]
        with torch.no_grad():
            logp = teacher_logprobs(policy.model, policy, part, 1.0).float().cpu()
        gaps += [(logp[i, : len(t.behaviour_logp)] - t.behaviour_logp).abs() for i, t in enumerate(part)]
    gaps = torch.cat(gaps)
    return {"logp_drift_max": float(gaps.max()), "logp_drift_mean": float(gaps.mean()),
            "logp_drift_p99": float(gaps.quantile(0.99))}


# ----------------------------------------------------------------------------------------------- updates
def stage_for(shape: Shape, lora: int | None, checkpointing: bool, extra: list[str], budget: int | None = None):
    from vlrl.config import RLStage, RLTrainConfig, apply_overrides

    raw: dict[str, Any] = {"rollout": {"n": shape.n, "max_new_tokens": shape.new_tokens},
                           "train": {"prompts_per_step": shape.prompts, "micro_batch_size": shape.micro_batch,
                                     "gradient_checkpointing": checkpointing},
                           "optim": {"lr": 1e-6}}
    if "logprob_chunk" in RLTrainConfig.model_fields:  # the chunked LM head (issue 36 item 1), where it exists
        raw["train"]["logprob_chunk"] = "auto"
    if budget is not None:
        raw["train"]["max_tokens_per_micro_batch"] = budget
    apply_overrides(raw, extra, cls=RLStage)
    return RLStage.model_validate(raw)


def mean_micro_cost(policy, rows, stage) -> int:
    """×1.05 the mean cost of the count-based split's micro-batches (`vlrl.train.microbatch.CostModel`): the budget of
    as many micro-batches, each near the mean instead of up to the costliest."""
    from vlrl.train.microbatch import CostModel, by_count

    train = stage.train
    cost = CostModel.of(policy.model, padding_free=train.padding_free, shared_prefix=train.shared_prefix)
    sizes = [cost.size(t.prompt_ids, t.response_ids, t.vision, prompt_key=str(t.group_index)) for t in rows]
    micro = by_count(range(len(rows)), train.micro_batch_size)
    return int(1.05 * sum(cost.micro([sizes[r] for r in m.rows]) for m in micro) / len(micro)) + 1


class PhasePeaks:
    """``torch.cuda.max_memory_allocated`` per phase of an update, read and reset at its boundaries: while ``active``,
    hooks on the model's forward and the optimizer's step split each micro-batch into ``forward`` (the model call) and
    ``head + backward`` (the LM head's chunks, the loss, the backward, up to the next forward or the step), then the
    ``optimizer step``; `measure` reads one call (the no-grad scoring pass). The maximum over micro-batches, GiB. On a
    CPU nothing is read (no allocator statistics)."""

    def __init__(self, model, optimizer, device: torch.device) -> None:
        self.device, self.peaks, self.open, self.active = device, {}, None, False
        self.handles = [model.register_forward_pre_hook(lambda *_: self._hook("forward")),
                        model.register_forward_hook(lambda *_: self._hook("head + backward")),
                        optimizer.register_step_pre_hook(lambda *_: self._hook("optimizer step")),
                        optimizer.register_step_post_hook(lambda *_: self._hook(None))]

    def start(self, phase: str | None) -> None:
        self.open = phase
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def record(self) -> None:
        if self.open is not None and self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device) / GiB
            self.peaks[self.open] = max(self.peaks.get(self.open, 0.0), peak)

    def _hook(self, then: str | None) -> None:
        if self.active:
            self.record()
            self.start(then)

    def measure(self, phase: str, fn) -> None:
        self.start(phase)
        fn()
        self.record()
        self.start(None)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def update(policy, rows, shape: Shape, arm: Arm, steps: int, extra: list[str], ceiling: dict,
           out_dir: Path | None = None, budget: int | None = None) -> dict[str, Any]:
    """``steps`` update phases of one arm (the first one warms up and is left out of the timings), the last with its
    memory read per phase (`PhasePeaks`; a no-grad scoring pass of one micro-batch first, as π_old / π_ref run), and
    with ``arm.profile`` one more under torch.profiler (`profiled`)."""
    from vlrl.config import LoraConfig
    from vlrl.models.lora import apply_lora
    from vlrl.train.batch import build_algorithm, prepare_batch, teacher_logprobs
    from vlrl.train.budget import PhaseMeter
    from vlrl.train.common import make_optimizer
    from vlrl.train.modules import stage_modules
    from vlrl.train.update import ppo_update

    device = next(policy.model.parameters()).device
    if arm.lora is not None and policy.lora is None:
        apply_lora(policy, LoraConfig(r=arm.lora, alpha=2 * arm.lora))
    rows = long_tail(rows, shape) if arm.long_tail else rows
    stage = stage_for(shape, arm.lora, arm.checkpointing, extra, budget)
    _reset_memory(device)
    algorithm = build_algorithm(stage, policy, apply_behaviour_weight=False)
    measured, out = [], {"budget": budget, "rows_tokens": sum(len(t.prompt_ids) + len(t.response_ids) for t in rows)}
    with stage_modules(policy, stage.train) as modules:
        optimizer, scheduler = make_optimizer(policy.model, stage.optim, policy.adapter.module_groups)
        peaks = PhasePeaks(policy.model, optimizer, device)
        for step in range(steps + int(arm.profile)):
            last, profiling = step == steps - 1, step == steps
            if last:  # the phases of the last timed step, a no-grad pass over one micro-batch first
                with torch.no_grad():
                    peaks.measure("old/ref log-probs", lambda: teacher_logprobs(
                        policy.model, policy, rows[: shape.micro_batch], 1.0))
            with PhaseMeter(policy.model, device, next(policy.model.parameters()).dtype) as perf, \
                    profiled(device, out if profiling else None, out_dir, arm):
                perf.begin()
                batch = prepare_batch(algorithm, policy, rows, step=step, max_new_tokens=shape.new_tokens)
                peaks.active = last
                stats = ppo_update(policy, batch, algorithm.settings, optimizer, scheduler, seed=0, step=step)
                peaks.active = False
                _sync(device)
                perf.phase("")
                flops, seconds = perf._phases[""]
            if not profiling:
                measured.append({**perf.metrics(), "seconds": seconds, "tflop": flops / 1e12})
            if last:
                split = stats.metrics()
                out.update(phase_peaks_gib=dict(peaks.peaks), micro_batches=split.get("perf/micro_batches"),
                           micro_batch_cost_max=split.get("perf/micro_batch_cost_max"))
        peaks.remove()
        out.update(trainable_params=modules.trainable_params, gradient_checkpointing=modules.gradient_checkpointing)
    timed = measured[1:] or measured
    seconds = statistics.median(m["seconds"] for m in timed)
    out.update(update_s=seconds, tflop=timed[0]["tflop"], tflops=timed[0]["tflop"] / seconds,
               mfu=statistics.median(m.get("perf/mfu", 0.0) for m in timed),
               mfu_of_measured=timed[0]["tflop"] / seconds / max(ceiling["matmul_tflops"], 1e-9),
               peak_memory_gib=_peak_memory(device), steps=steps)
    optimizer.zero_grad(set_to_none=True)
    if policy.lora is not None:  # the next arm starts from the base model again
        policy.model, policy.lora = policy.lora.unload(), None
    return out


CATEGORIES = [("attention", r"flash|fmha|attention|sdpa"),
              ("matmul", r"gemm|cutlass|xmma|nvjet|matmul|addmm|\bmm\b|bmm|linear|sm\d\d_"),
              ("optimizer (AdamW, clipping)", r"adam|multi_tensor|foreach|lerp|addcdiv|addcmul|norm_kernel"),
              ("copies, casts, host ↔ device", r"memcpy|memset|copy|to_copy|cast|\bcat\b|index"),
              ("normalisation, activations, elementwise",
               r"elementwise|vectorized|reduce|norm|silu|gelu|mul|add|pow|softmax|exp")]


@contextlib.contextmanager
def profiled(device: torch.device, out: dict | None, out_dir: Path | None, arm: Arm):
    """With ``out``: the block under torch.profiler — time by kernel category (GPU kernels' own time; on a CPU the
    operators' own time), the top 15, and the device's busy share of the wall time, into ``out["profile"]``; the
    full table into ``out_dir/profile_<arm>.txt``."""
    if out is None:
        yield
        return
    import re

    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        yield
    wall = time.perf_counter() - start
    events = prof.key_averages()
    kernels = [e for e in events if "cuda" in str(getattr(e, "device_type", "")).lower()]
    own = (lambda e: getattr(e, "self_device_time_total", 0.0)) if kernels else (lambda e: e.self_cpu_time_total)
    chosen = kernels or [e for e in events if e.key.startswith("aten::")]
    by_category: dict[str, float] = {}
    for e in chosen:
        name = e.key.lower()
        category = next((c for c, pattern in CATEGORIES if re.search(pattern, name)), "other")
        by_category[category] = by_category.get(category, 0.0) + own(e) / 1e3  # ms
    busy = sum(by_category.values()) / 1e3
    top = sorted(chosen, key=own, reverse=True)[:15]
    out["profile"] = {"wall_s": wall, "device_busy_share": busy / wall if kernels else None,
                      "ms_by_category": dict(sorted(by_category.items(), key=lambda kv: -kv[1])),
                      "top": [[e.key[:90], round(own(e) / 1e3, 2), e.count] for e in top]}
    if out_dir is not None:
        sort = "self_device_time_total" if kernels else "self_cpu_time_total"
        name = re.sub(r"[^a-z0-9]+", "_", arm.name.lower()).strip("_")
        (out_dir / f"profile_{name}.txt").write_text(events.table(sort_by=sort, row_limit=60))


def planned(model: str, shape: Shape, lora: int | None, checkpointing: bool, memory_gib: float | None = None,
            max_tokens: int | None = None) -> dict[str, Any]:
    """`vlrl plan`'s estimate for this step on one device, per phase (`vlrl.launch.memory.phase_memory`; GiB):
    generation, the no-grad scoring pass, forward + backward, the optimizer step (AdamW's foreach temporaries) —
    what ``torch.cuda.max_memory_allocated`` per phase is compared with; ``plan_train_gib`` is the training phases'
    peak (as before: without generation), ``plan_peak_gib`` / ``plan_peak_phase`` the step's."""
    from vlrl.config import RLConfig, load_config
    from vlrl.launch import planner

    overrides = [f"model.path={FIXTURES / f'{model}.json'}", "model.dtype=bfloat16", f"rollout.n={shape.n}",
                 f"train.prompts_per_step={shape.prompts}", f"rollout.max_new_tokens={shape.new_tokens}",
                 f"train.micro_batch_size={shape.micro_batch}", f"rollout.engine.max_batch_size={shape.prompts * shape.n}",
                 f"train.gradient_checkpointing={str(checkpointing).lower()}", "data.tasks=[count,color]",
                 f"data.suite_options={{image_size: {shape.side}}}", "algo.kl_coef=0"]
    if lora is not None:
        overrides += [f"model.lora.r={lora}", f"model.lora.alpha={2 * lora}"]
    if max_tokens is not None:
        overrides.append(f"train.max_tokens_per_micro_batch={max_tokens}")
    cfg = load_config(RLConfig, None, overrides)
    meta, adapter, shape_ = _meta(cfg.model.path)
    work = planner.workload(cfg, adapter, model=meta)
    memory = planner.phase_memory(shape_, work, 1, ranks=1, generate_rows=work.sequences)
    phases = {name: memory.total(name) / GiB for name in memory.phases}
    if "old/ref log-probs" not in phases:  # a scoring pass runs whenever π_old or π_ref is needed
        phases["old/ref log-probs"] = (sum(t.value for t in memory.resident)
                                       + sum(t.value for t in planner.memory_scoring(shape_, work))) / GiB
    train = {k: v for k, v in phases.items() if k != "generate"}
    return {"plan_train_gib": max(train.values()), "plan_generate_gib": phases["generate"],
            "plan_peak_gib": max(phases.values()), "plan_peak_phase": max(phases, key=phases.get),
            "plan_phases_gib": phases, "plan_micro_rows": planner.micro_rows(work),
            "plan_prompt_tokens": work.prompt_tokens}


@functools.cache
def _meta(path: str):
    """(meta model, adapter, `ModelShape`) of a fixture config, built once per process."""
    from vlrl.launch import planner

    meta, adapter = planner.meta_model(path)
    return meta, adapter, planner.model_shape(meta)


# ----------------------------------------------------------------------------------------------- the run
SAVE = None  # set by `main`: writes gpu_check.json as it stands


class Budget:
    def __init__(self, seconds: float) -> None:
        self.start, self.seconds = time.perf_counter(), seconds

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.start)


def attempt(results: dict, key: str, fn, budget: Budget, needs: float) -> Any:
    """Run ``fn`` into ``results[key]`` if ``needs`` seconds are left; a failure is recorded, not raised."""
    if budget.left() < needs:
        results[key] = {"skipped": f"time budget: {budget.left():.0f} s left, ~{needs:.0f} s needed"}
        return None
    start = time.perf_counter()
    try:
        value = fn()
    except Exception as err:  # an OOM or a compile failure must not lose the other figures
        results[key] = {"error": f"{type(err).__name__}: {str(err)[:400]}", "traceback": traceback.format_exc()[-2000:]}
        print(f"[{key}] failed: {type(err).__name__}: {str(err)[:200]}", flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return None
    results[key] = value[0] if isinstance(value, tuple) else value
    results[key]["wall_s"] = time.perf_counter() - start
    print(f"[{key}] {json.dumps(results[key], default=str)[:600]}", flush=True)
    if SAVE is not None:  # after every measurement: a run stopped at its time limit keeps what it measured
        SAVE()
    return value


def check_model(model: str, shape: Shape, device: torch.device, ceiling: dict, budget: Budget, args,
                arms: list[Arm] = ARMS) -> dict:
    results: dict[str, Any] = {}
    seconds = {"build": 60, "generate": 90, "compiled": 150, "update": 45}
    if args.smoke:
        seconds = dict.fromkeys(seconds, 0)
    policy = attempt(results, "build", lambda: _built(model, device, args.smoke), budget, seconds["build"])
    if policy is None:
        return results
    policy = policy[1]  # (figures, policy)
    prompts = requests(policy, shape)
    if args.no_generate:  # random responses: the update arms need no rollout
        rows = trajectories(prompts, synthetic(policy, prompts, shape), shape)
    else:
        got = attempt(results, "generate (eager)", lambda: generation(policy, prompts, shape, ceiling, compiled=False),
                      budget, seconds["generate"])
        if got is None:
            return results
        rows = trajectories(prompts, got[1], shape)
        attempt(results, "sampler ≡ trainer (bf16)" if not args.smoke else "sampler ≡ trainer",
                lambda: drift(policy, rows, shape.micro_batch), budget, 10)
    memory = torch.cuda.get_device_properties(device).total_memory / GiB if device.type == "cuda" else None
    for k, arm in enumerate([*arms, None]):
        if k == min(COMPILE_AFTER, len(arms)) and not (args.no_compile or args.no_generate):  # no adapters in the model
            attempt(results, "generate (rollout.engine.compile)", lambda: generation(
                policy, prompts, shape, ceiling, compiled=True, backend=args.compile_backend), budget,
                seconds["compiled"])
        if arm is None:
            break
        tokens = mean_micro_cost(policy, long_tail(rows, shape) if arm.long_tail else rows,
                                 stage_for(shape, arm.lora, arm.checkpointing, args.set)) if arm.budget else None
        plan = planned(model, shape, arm.lora, arm.checkpointing, memory, tokens) if not args.smoke else {}
        if memory is not None and plan["plan_peak_gib"] > 0.97 * memory:  # vlrl plan says it does not fit
            results[f"update: {arm.name}"] = {"skipped": f"vlrl plan: {plan['plan_peak_gib']:.1f} GiB "
                                              f"({plan['plan_peak_phase']}) > 0.97 × {memory:.1f}", **plan}
            continue

        def run(arm=arm, plan=plan, tokens=tokens):
            return {**update(policy, rows, shape, arm, 1 if args.smoke else 2, args.set, ceiling, args.out_dir,
                             tokens), **plan}
        attempt(results, f"update: {arm.name}", run, budget, seconds["update"])
    policy.model.to("meta")  # frees the weights before the next model (the policy is not used again)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return results


def _built(model: str, device: torch.device, smoke: bool):
    start = time.perf_counter()
    policy = build_policy(model, device, smoke)
    _sync(device)
    return ({"parameters_b": policy.num_parameters() / 1e9, "build_s": time.perf_counter() - start,
             "memory_gib": _peak_memory(device)}, policy)


def versions() -> dict[str, str]:
    import transformers

    out = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "cuda": str(torch.version.cuda)}
    try:
        import peft

        out["peft"] = peft.__version__
    except ImportError:
        out["peft"] = "missing"
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for gpu_check.json and gpu_check.md")
    parser.add_argument("--smoke", action="store_true", help="the tiny preset at a tiny shape (runs on a CPU)")
    parser.add_argument("--budget", type=float, default=330.0,
                        help="seconds for everything; what would not fit is skipped")
    parser.add_argument("--models", nargs="*", default=["qwen2_5_vl_3b", "qwen2_5_vl_7b"])
    parser.add_argument("--no-compile", action="store_true", help="leave out the rollout.engine.compile arm")
    parser.add_argument("--no-generate", action="store_true",
                        help="no rollout: the update arms train on random responses (round two: the update only)")
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend of that arm")
    parser.add_argument("--set", nargs="*", default=[], help="RL stage overrides for the update arms")
    args = parser.parse_args(argv)
    out_dir = Path(args.out)
    args.out_dir = out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        torch.set_num_threads(1)  # a tiny model gains nothing from a second thread on a shared machine
    budget = Budget(args.budget)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    shape = SMOKE if args.smoke else REAL
    report: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "versions": versions(),
                              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else
                              f"CPU ({platform.processor() or platform.machine()}), {torch.get_num_threads()} threads",
                              "memory_gib": (torch.cuda.get_device_properties(device).total_memory / GiB
                                             if device.type == "cuda" else None),
                              "shape": vars(shape), "smoke": args.smoke, "models": {}}
    global SAVE
    SAVE = lambda: (out_dir / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))  # noqa: E731
    report["ceilings"] = ceilings(device, args.smoke)
    print(f"device {report['device']}, versions {report['versions']}, ceilings {report['ceilings']}", flush=True)
    models = ["tiny-qwen2-vl"] if args.smoke else args.models
    for k, model in enumerate(models):
        arms = ARMS_7B if "7b" in model else ARMS  # (an arm `vlrl plan` says does not fit is skipped, with its figure)
        if k and not args.smoke:  # a bigger model only with the time for it
            if budget.left() < 200:
                report["models"][model] = {"skipped": f"time budget: {budget.left():.0f} s left, ~200 s needed"}
                continue
        report["models"][model] = check_model(model, shape, device, report["ceilings"], budget, args, arms)
        (out_dir / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))
    report["wall_s"] = budget.seconds - budget.left()
    (out_dir / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))
    table = markdown(report)
    (out_dir / "gpu_check.md").write_text(table)
    print("\n" + table, flush=True)
    return report


def update_figures(r: dict) -> str:
    """One update arm's cell: time, MFU, the split, the peak and each phase's peak against the plan's."""
    out = (f"{r['update_s']:.2f} s/update, {r['tflops']:.3g} TFLOP/s, MFU {r['mfu']:.1%} of datasheet "
           f"({r['mfu_of_measured']:.1%} of measured matmul); {r.get('micro_batches') or 0:.0f} micro-batches"
           + (f" (budget {r['budget']} tokens)" if r.get("budget") else "")
           + f", costliest {r.get('micro_batch_cost_max') or 0:.0f}; peak {_fmt(r['peak_memory_gib'], '.1f')} GiB")
    if "plan_peak_gib" in r:
        out += f" (plan: {r['plan_train_gib']:.1f} GiB, {r['plan_peak_phase']})"
    measured, plan = r.get("phase_peaks_gib") or {}, r.get("plan_phases_gib") or {}
    if measured:
        fb = max(measured.get("forward", 0.0), measured.get("head + backward", 0.0))
        pairs = [("old/ref log-probs", measured.get("old/ref log-probs"), plan.get("old/ref log-probs")),
                 ("forward + backward", fb, plan.get("forward + backward")),
                 ("optimizer step", measured.get("optimizer step"), plan.get("optimizer step"))]
        out += "; by phase, measured / plan GiB: " + ", ".join(
            f"{name} {_fmt(got, '.1f')} / {_fmt(want, '.1f')}" for name, got, want in pairs)
    profile = r.get("profile")
    if profile:
        share = profile.get("device_busy_share")
        top = ", ".join(f"{k} {v / 1e3:.2f} s" for k, v in list(profile["ms_by_category"].items())[:4])
        out += f"; profile ({profile['wall_s']:.1f} s" + (f", GPU busy {share:.0%}" if share else "") + f"): {top}"
    return out


def plan_markdown(models: tuple[str, ...] = ("qwen2_5_vl_3b", "qwen2_5_vl_7b")) -> str:
    """`vlrl plan`'s per-phase estimate of the check's update arms at the real shape on one device (`planned`), as the
    docs show it (docs/gpu.md renders this at build time: the figures are the current planner's)."""
    lines = ["| model | arm | generate | old/ref log-probs | forward + backward | optimizer step | peak |",
             "| --- | --- | ---: | ---: | ---: | ---: | --- |"]
    for model in models:
        arms = [a for a in (ARMS_7B if "7b" in model else ARMS) if not a.long_tail]
        for arm in arms:
            plan = planned(model, REAL, arm.lora, arm.checkpointing)
            phases = plan["plan_phases_gib"]
            cells = " | ".join(f"{phases[p]:.1f}" for p in ("generate", "old/ref log-probs", "forward + backward",
                                                             "optimizer step"))
            lines.append(f"| {model} | {arm.name} | {cells} | {plan['plan_peak_gib']:.1f} GiB ({plan['plan_peak_phase']}) |")
    return "\n".join(lines) + "\n"


def _fmt(value: Any, spec: str) -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "–"


def markdown(report: dict) -> str:
    c = report["ceilings"]
    s = report["shape"]
    lines = [f"GPU check, {report['date']}: {report['device']}"
             + (f" ({report['memory_gib']:.0f} GiB)" if report["memory_gib"] else "")
             + f"; {', '.join(f'{k} {v}' for k, v in report['versions'].items())}",
             f"shape: {s['prompts']} prompts × n {s['n']}, {s['side']}² images, {s['new_tokens']} new tokens, "
             f"micro-batches of {s['micro_batch']}; measured matmul {c['matmul_tflops']:.3g} TFLOP/s "
             f"({c['peak_source']}: {c['datasheet_tflops']:.3g}), copy {c['copy_gbs']:.0f} GB/s",
             "",
             "| model | measurement | figures |", "| --- | --- | --- |"]
    for model, results in report["models"].items():
        if "skipped" in results:
            lines.append(f"| {model} | – | skipped: {results['skipped']} |")
            continue
        for key, r in results.items():
            if "skipped" in r or "error" in r:
                lines.append(f"| {model} | {key} | {'skipped: ' + r['skipped'] if 'skipped' in r else 'failed: ' + r['error'][:160]} |")
            elif key == "build":
                lines.append(f"| {model} | build | {r['parameters_b']:.2f}B parameters in {r['build_s']:.0f} s |")
            elif key.startswith("generate"):
                extra = (f"; first call (compile) {r['compile_and_first_rollout_s']:.0f} s"
                         if "compile_and_first_rollout_s" in r else "")
                lines.append(f"| {model} | {key} | {r['tokens_per_s']:.0f} tokens/s ({r['rows']} rows × "
                             f"{r['decode_steps']} steps, prompt {r['prompt_tokens']} tokens); decode "
                             f"{r['decode_ms_per_step']:.1f} ms/step vs {r['hbm_bound_ms_per_step']:.1f} ms memory "
                             f"bound ({r['bound_share']:.0%}); prefill {r['prefill_s']:.2f} s; peak "
                             f"{_fmt(r['peak_memory_gib'], '.1f')} GiB{extra} |")
            elif key.startswith("sampler"):
                lines.append(f"| {model} | {key} | max {r['logp_drift_max']:.3f}, p99 {r['logp_drift_p99']:.3f}, "
                             f"mean {r['logp_drift_mean']:.4f} nats |")
            elif key.startswith("update"):
                lines.append(f"| {model} | {key} | {update_figures(r)} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
