"""Which CPU kernels compute a run — and how to pin them so that another x86 machine gives the same bits.

PyTorch on x86 chooses its kernels by the CPU it finds: ATen's vectorised kernels (AVX2 or AVX-512), MKL's GEMM
code branch, oneDNN's JIT ISA. Each choice sums floats in another order, so the same config, seed, packages and
thread count give different roundings on an AVX-512 machine and on an AVX2 one — and a few hundred RL steps turn
a rounding into another run: the demo's held-out accuracy moved by up to 16 points between two such machines.

``numerics: portable`` caps all three at AVX2 through the libraries' own switches — ``ATEN_CPU_CAPABILITY``,
``MKL_CBWR`` (MKL's Conditional Numerical Reproducibility, strict mode) and ``ONEDNN_MAX_CPU_ISA`` — so that a run
gives the same bits on any Intel CPU with AVX2 (Haswell, 2013, and later), for a given torch thread count: verified
bit for bit between an AVX-512 (Sapphire Rapids class) machine and an emulated Haswell (``qemu-x86_64 -cpu
Haswell-v4``). AMD CPUs compute other bits: MKL takes its AVX2 branch only on Intel CPUs (on an emulated EPYC it
falls back to its generic branch, and even ``MKL_CBWR=COMPATIBLE`` did not make the two agree). It costs speed
where the CPU has more than AVX2 (the tiny demo model: ~1.3x per SFT step, ~1.1x per RL step on AVX-512).
``native`` (the default) leaves each library its fastest choice. GPUs are not affected.

``auto`` is portable where it can be honoured (an x86 CPU from Intel with AVX2 and a torch built with MKL) and
native elsewhere (AMD, ARM, CPUs without AVX2), with one log line saying which and why: what the demo uses, so
that it runs on any machine and reproduces bit for bit where that is possible. ``portable`` asked for explicitly
where it cannot be honoured is refused with the cause (the CPU's vendor or ISA).

The switches are read once, when each library first computes: `apply_numerics` must run before the process's
first tensor operation (the CLI calls it before building anything) and checks that it took effect. What it decided
is kept for the process (`applied`) and recorded in summary.json.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Numerics = Literal["native", "portable", "auto"]
log = logging.getLogger(__name__)

PORTABLE_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2,STRICT", "ONEDNN_MAX_CPU_ISA": "AVX2"}
_MKL_AVX2_STRICT = 10 | 0x10000  # mkl_service.h: MKL_CBWR_AVX2 | MKL_CBWR_STRICT
_MKL_ALL = -1  # MKL_CBWR_ALL: the branch and the flags


class NumericsError(RuntimeError):
    """``numerics: portable`` could not take effect in this process."""


@dataclass(frozen=True)
class Applied:
    """What `apply_numerics` decided in this process: the mode asked for, the mode in effect, and why."""

    requested: Numerics
    mode: Literal["native", "portable"]
    reason: str


_applied: Applied | None = None


def applied() -> Applied | None:
    """The decision of this process's `apply_numerics` call; None if it was never called (a library user)."""
    return _applied


def apply_numerics(mode: Numerics) -> Applied:
    """Pin the CPU kernels for ``mode`` (see the module docstring); ``native`` changes nothing, ``auto`` pins them
    where portable can be honoured. Raises `NumericsError` when ``portable`` cannot be."""
    global _applied
    if mode == "native":
        _applied = Applied(mode, "native", "asked for")
        return _applied
    obstacle = portable_obstacle()
    if obstacle is not None:
        if mode == "portable":
            raise NumericsError(f"numerics=portable cannot take effect: {obstacle}. Use numerics=auto (portable where "
                                "it can be honoured, native elsewhere) or numerics=native")
        _applied = Applied(mode, "native", obstacle)
        log.info("numerics=auto: native kernels (%s)", obstacle)
        return _applied
    clash = {k: os.environ[k] for k, v in PORTABLE_ENV.items() if os.environ.get(k, v) != v}
    if clash:
        raise NumericsError(f"numerics={mode} sets {PORTABLE_ENV}, but the environment already sets {clash}: "
                            "unset them or use numerics=native")
    os.environ.update(PORTABLE_ENV)
    import torch

    late = []
    if torch.backends.cpu.get_cpu_capability() != "AVX2":
        late.append(f"ATen's kernels are already {torch.backends.cpu.get_cpu_capability()}")
    branch = mkl_branch()
    if branch is not None and branch != _MKL_AVX2_STRICT:
        late.append(f"MKL's code branch is already {describe_mkl(branch)} ({branch:#x})")
    if late:
        raise NumericsError(f"numerics={mode} must take effect before the process's first tensor operation, but "
                            f"{' and '.join(late)} on this Intel CPU with AVX2: something computed before vlrl "
                            f"applied it — set {' '.join(f'{k}={v}' for k, v in PORTABLE_ENV.items())} in the "
                            "process's environment, or use numerics=native")
    _applied = Applied(mode, "portable", "Intel CPU with AVX2: ATen, MKL and oneDNN capped at AVX2")
    if mode == "auto":
        log.info("numerics=auto: portable kernels (%s)", _applied.reason)
    return _applied


def portable_obstacle(*, cpuinfo: str | Path = "/proc/cpuinfo") -> str | None:
    """Why ``portable`` cannot be honoured on this machine, or None where it can: it needs an x86-64 CPU from Intel
    with AVX2 (MKL takes its reproducible AVX2 branch only on Intel CPUs: on AMD ones ``MKL_CBWR=AVX2,STRICT`` reads
    back as its AUTO branch) and a torch with MKL. Decided from the CPU's own description, before any computation."""
    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64"):
        return f"it caps x86 kernels and this machine is {platform.machine() or 'of unknown architecture'}"
    vendor, flags = _cpu_vendor_and_flags(cpuinfo)
    name = cpu_name(cpuinfo) or "unknown model"
    if vendor is not None and vendor != "GenuineIntel":
        return f"MKL has its reproducible AVX2 branch only on Intel CPUs, and this one is {name} ({vendor})"
    if flags is not None and "avx2" not in flags:
        return f"this CPU ({name}) has no AVX2, so its kernels cannot match an AVX2 machine's"
    if vendor is None:  # no /proc/cpuinfo (macOS, Windows): ask torch, which reads the CPU without computing
        import torch

        if torch.backends.cpu.get_cpu_capability() == "DEFAULT":
            return f"this CPU ({name}) has no AVX2, so its kernels cannot match an AVX2 machine's"
    if not _has_mkl():
        return "this torch build has no MKL, whose reproducible mode it relies on"
    return None


def _cpu_vendor_and_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> tuple[str | None, set[str] | None]:
    """``vendor_id`` and ``flags`` of /proc/cpuinfo's first processor; (None, None) where it cannot be read."""
    vendor = flags = None
    try:
        for line in Path(cpuinfo).read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "vendor_id" and vendor is None:
                vendor = value.strip()
            elif key == "flags" and flags is None:
                flags = set(value.split())
            if vendor is not None and flags is not None:
                break
    except OSError:
        pass
    return vendor, flags


def cpu_vendor() -> str | None:
    """``GenuineIntel``, ``AuthenticAMD``, … (Linux /proc/cpuinfo); None where it cannot be read."""
    return _cpu_vendor_and_flags()[0]


def _has_mkl() -> bool:
    import torch

    return bool(torch.backends.mkl.is_available())


def mkl_branch() -> int | None:
    """MKL's code branch and CNR flags as ``mkl_cbwr_get(MKL_CBWR_ALL)`` reports them (reading it fixes them for the
    process, as any MKL call does); None where torch has no MKL (ARM, some builds)."""
    import torch

    try:
        lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
        get = lib.mkl_serv_cbwr_get  # MKL is linked into libtorch_cpu; this is mkl_cbwr_get under its service name
    except (OSError, AttributeError):
        return None
    return int(get(_MKL_ALL))


_MKL_BRANCHES = {1: "off", 2: "AUTO", 3: "COMPATIBLE", 4: "SSE2", 7: "SSE4_1", 8: "SSE4_2", 10: "AVX2", 12: "AVX512",
                 14: "AVX512_E1"}


def describe_mkl(branch: int | None) -> str | None:
    """``AVX2,STRICT``, ``off`` (MKL picks per CPU), … — the spelling of ``MKL_CBWR``."""
    if branch is None:
        return None
    name = _MKL_BRANCHES.get(branch & 0xFFFF, f"{branch & 0xFFFF:#x}")
    return name + (",STRICT" if branch & 0x10000 else "")


def cpu_name(cpuinfo: str | Path = "/proc/cpuinfo") -> str | None:
    """The CPU's model name (Linux /proc/cpuinfo; the platform's processor string elsewhere)."""
    try:
        for line in Path(cpuinfo).read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or None
