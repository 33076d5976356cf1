"""Model-FLOPs utilisation (MFU): the FLOPs a step's passes needed over what the device could have done.

    MFU = model FLOPs of the phase / (phase seconds · peak FLOP/s of one device)

The model FLOPs are the ones `vlrl.train.budget.FlopMeter` counts (the planner's formulas — 6Ψ per trained token,
2Ψ per scored or generated token, attention terms, the vision tower — for the tokens each pass processed; a
recomputed forward under gradient checkpointing is *not* counted, so this is MFU, not hardware FLOPs utilisation,
as in PaLM §B and verl's ``perf/mfu``). Each rank divides its own FLOPs by its own device's peak; under torchrun
the logged value is the mean over the ranks.

**The peak** (`device_peak`):

- an NVIDIA GPU: its dense (no sparsity) tensor-core peak from the datasheet for the compute dtype (`GPU_PEAKS`,
  matched on ``torch.cuda.get_device_name``), bf16/fp16 for ``dist.mixed_precision`` or a bf16/fp16
  ``model.dtype``, TF32 for float32 when torch allows TF32 matmuls, else plain FP32; an unknown GPU has no peak
  (no MFU logged, a warning once);
- the CPU: the best rate of ``n × n`` fp32 (the compute dtype's) matmuls this machine has shown at the run's torch
  thread count (`cpu_peak`): each process measures once (`measured_cpu_peak`, ~0.1 s) and keeps the best measurement
  ever made on the machine in a small cache file (``$VLRL_CACHE_DIR`` or ``~/.cache/vlrl``, ``cpu_peak.json``, keyed
  by CPU model, cores, threads, dtype and torch version), so a run started under load divides by the same peak as
  one started on an idle machine (before, each run divided by its own start-up measurement and ``perf/mfu`` swung ~3×
  with the machine's load); ``VLRL_CPU_PEAK_TFLOPS`` names a nominal peak instead. The peak only rises, toward the
  machine's idle matmul rate: ``perf/mfu`` then falls when other jobs take the cores, as the achieved rate does.

`phase_metrics` turns (FLOPs, seconds) of a phase into ``perf/<prefix>mfu`` and ``perf/<prefix>tflops``.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# Dense peak TFLOP/s per GPU from NVIDIA's datasheets: (bf16/fp16 tensor core, TF32 tensor core, plain FP32).
# Matched in this order on the lower-case device name (first hit wins: "h100 pcie" before "h100").
GPU_PEAKS: list[tuple[str, tuple[float, float, float]]] = [
    ("gh200", (989.0, 494.0, 67.0)),
    ("h200", (989.0, 494.0, 67.0)),  # same SXM compute as the H100; more and faster HBM
    ("h100 pcie", (756.0, 378.0, 51.0)),
    ("h100 nvl", (835.0, 418.0, 60.0)),
    ("h100", (989.0, 494.0, 67.0)),  # SXM5
    ("h800", (989.0, 494.0, 67.0)),
    ("h20", (148.0, 74.0, 44.0)),
    ("b200", (2250.0, 1100.0, 75.0)),
    ("b100", (1750.0, 875.0, 60.0)),
    ("a100", (312.0, 156.0, 19.5)),
    ("a800", (312.0, 156.0, 19.5)),
    ("a10g", (70.0, 35.0, 31.2)),  # AWS A10G: a reduced-clock A10
    ("a10", (125.0, 62.5, 31.2)),
    ("a6000", (154.8, 77.4, 38.7)),  # RTX A6000 (dense; NVIDIA quotes 309.7 with sparsity)
    ("l40s", (362.0, 183.0, 91.6)),
    ("l40", (181.0, 90.5, 90.5)),
    ("l4", (121.0, 60.0, 30.3)),
    ("v100", (125.0, 0.0, 15.7)),  # fp16 tensor cores; no bf16 or TF32 (0: not available)
    ("t4", (65.0, 0.0, 8.1)),
    ("rtx 4090", (165.2, 82.6, 82.6)),
    ("rtx 3090", (71.0, 35.6, 35.6)),
]
_WARNED: set[str] = set()


@dataclass(frozen=True)
class Peak:
    """The peak FLOP/s of one device in the run's compute dtype, and where the number comes from."""

    flops: float  # FLOP/s; 0 when unknown
    source: str  # e.g. "NVIDIA H100 80GB HBM3, bf16 dense datasheet" or "CPU fp32 matmul measured, 2 threads"

    @property
    def tflops(self) -> float:
        return self.flops / 1e12


def gpu_peak(name: str, dtype: torch.dtype, *, tf32: bool = False) -> float:
    """Datasheet dense peak FLOP/s of the GPU called ``name`` in ``dtype`` (0 when not in `GPU_PEAKS`)."""
    lowered = name.lower()
    for key, (half, tf32_peak, fp32) in GPU_PEAKS:
        if key in lowered:
            if dtype in (torch.bfloat16, torch.float16):
                return half * 1e12
            return (tf32_peak if tf32 and tf32_peak else fp32) * 1e12
    return 0.0


def measured_cpu_peak(dtype: torch.dtype = torch.float32, threads: int | None = None, n: int = 512) -> float:
    """The best FLOP/s of ``n × n × n`` matmuls in ``dtype`` on this CPU at ``threads`` torch threads (default: the
    current count), measured once per process and thread count (the default resolved first, so ``threads=None``
    and the same count given are one measurement): two warm-ups, then the fastest of 5 timed rounds of 4 products
    (2·n³ FLOPs each). ~0.1 s at 100 GFLOP/s per thread."""
    return _measured_cpu_peak(dtype, threads or torch.get_num_threads(), n)


@cache
def _measured_cpu_peak(dtype: torch.dtype, threads: int, n: int) -> float:
    previous = torch.get_num_threads()
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=generator).to(dtype)
    b = torch.randn(n, n, generator=generator).to(dtype)
    out = torch.empty(n, n, dtype=dtype)
    torch.set_num_threads(threads)
    try:
        for _ in range(2):
            torch.mm(a, b, out=out)
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(4):
                torch.mm(a, b, out=out)
            best = min(best, (time.perf_counter() - start) / 4)
    finally:
        torch.set_num_threads(previous)
    return 2 * n**3 / best


def cache_dir() -> Path:
    """Where vlrl keeps per-machine measurements: ``$VLRL_CACHE_DIR``, else ``$XDG_CACHE_HOME/vlrl``, else
    ``~/.cache/vlrl``."""
    if os.environ.get("VLRL_CACHE_DIR"):
        return Path(os.environ["VLRL_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vlrl"


def _machine_key(dtype: torch.dtype, threads: int) -> str:
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model} | {os.cpu_count()} cores | {threads} threads | {dtype} | torch {torch.__version__}"


def cpu_peak(dtype: torch.dtype = torch.float32, threads: int | None = None) -> Peak:
    """The CPU's peak for ``dtype`` at ``threads`` (module docstring): ``VLRL_CPU_PEAK_TFLOPS`` if set, else the best of
    this process's measurement and every earlier one on this machine (the cache file, updated when this one is
    better; a cache that cannot be read or written is skipped)."""
    threads = threads or torch.get_num_threads()
    short = str(dtype).removeprefix("torch.").replace("float", "fp").replace("bfp16", "bf16")
    where = f"{threads} thread{'s' if threads > 1 else ''}"
    if os.environ.get("VLRL_CPU_PEAK_TFLOPS"):
        return Peak(float(os.environ["VLRL_CPU_PEAK_TFLOPS"]) * 1e12, f"CPU nominal peak (VLRL_CPU_PEAK_TFLOPS), {where}")
    measured, key, path = measured_cpu_peak(dtype, threads), _machine_key(dtype, threads), cache_dir() / "cpu_peak.json"
    try:
        cached = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):
        cached = {}
    best = max(measured, float(cached.get(key, 0.0)))
    if best > float(cached.get(key, 0.0)):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({**cached, key: best}, indent=1))
            os.replace(tmp, path)
        except OSError:
            pass
    return Peak(best, f"CPU {short} matmul, best measured on this machine ({path}), {where}")


def device_peak(device: torch.device | str, dtype: torch.dtype = torch.float32) -> Peak:
    """The peak of one ``device`` for compute in ``dtype`` (module docstring)."""
    device = torch.device(device)
    short = str(dtype).removeprefix("torch.").replace("float", "fp").replace("bfp16", "bf16")
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        tf32 = dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32
        flops = gpu_peak(name, dtype, tf32=tf32)
        if not flops and name not in _WARNED:
            _WARNED.add(name)
            log.warning("%s: no datasheet peak in vlrl.report.perf.GPU_PEAKS, so no perf/mfu is logged", name)
        return Peak(flops, f"{name}, {'tf32' if tf32 else short} dense datasheet peak")
    if device.type == "cpu":
        return cpu_peak(dtype)
    return Peak(0.0, f"{device.type}: no peak known")


def phase_metrics(flops: float, seconds: float, peak: Peak, *, prefix: str = "") -> dict[str, float]:
    """``perf/{prefix}tflops`` (achieved TFLOP/s) and ``perf/{prefix}mfu`` (its share of ``peak``; left out when the
    peak is unknown) of a phase that did ``flops`` model FLOPs in ``seconds``; empty for an empty phase."""
    if flops <= 0 or seconds <= 0:
        return {}
    achieved = flops / seconds
    out = {f"perf/{prefix}tflops": achieved / 1e12}
    if peak.flops > 0:
        out[f"perf/{prefix}mfu"] = achieved / peak.flops
    return out
