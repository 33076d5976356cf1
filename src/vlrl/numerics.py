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

The switches are read once, when each library first computes: `apply_numerics` must run before the process's
first tensor operation (the CLI calls it before building anything) and checks that it took effect.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Literal

Numerics = Literal["native", "portable"]

PORTABLE_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2,STRICT", "ONEDNN_MAX_CPU_ISA": "AVX2"}
_MKL_AVX2_STRICT = 10 | 0x10000  # mkl_service.h: MKL_CBWR_AVX2 | MKL_CBWR_STRICT
_MKL_ALL = -1  # MKL_CBWR_ALL: the branch and the flags


class NumericsError(RuntimeError):
    """``numerics: portable`` could not take effect in this process."""


def apply_numerics(mode: Numerics) -> None:
    """Pin the CPU kernels for ``mode`` (see the module docstring); ``native`` changes nothing."""
    if mode == "native":
        return
    clash = {k: os.environ[k] for k, v in PORTABLE_ENV.items() if os.environ.get(k, v) != v}
    if clash:
        raise NumericsError(f"numerics=portable sets {PORTABLE_ENV}, but the environment already sets {clash}: "
                            "unset them or use numerics=native")
    os.environ.update(PORTABLE_ENV)
    import torch

    if torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        raise NumericsError("numerics=portable: this CPU has no AVX2, so its kernels cannot match an AVX2 machine's; "
                            "use numerics=native")
    late = []
    if torch.backends.cpu.get_cpu_capability() != "AVX2":
        late.append(f"ATen's kernels are already {torch.backends.cpu.get_cpu_capability()}")
    branch = mkl_branch()
    if branch is not None and branch != _MKL_AVX2_STRICT:
        late.append(f"MKL's code branch is already {branch:#x}")
    if late:
        raise NumericsError("numerics=portable must take effect before the process's first tensor operation, but "
                            f"{' and '.join(late)}: run vlrl in a fresh process, or set "
                            f"{' '.join(f'{k}={v}' for k, v in PORTABLE_ENV.items())} in its environment")


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


def cpu_name() -> str | None:
    """The CPU's model name (Linux /proc/cpuinfo; the platform's processor string elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or None
