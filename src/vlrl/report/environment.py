"""What a run's numbers depend on besides its config: package versions, torch threads, the machine.

Two runs of the same config and seed give the same numbers only with the same versions of these packages, the
same torch thread count (CPU kernels are deterministic for a given count, not across counts) and the same CPU
kernels (AVX2 or AVX-512 ones, MKL's branch: `vlrl.numerics`, pinned by ``numerics: portable``); a fresh install
on another day resolves other versions. `environment` records them for summary.json and report.html, so two runs
that differ can be told apart.
"""

from __future__ import annotations

import os
import platform
from importlib import metadata

from vlrl.numerics import PORTABLE_ENV, applied, cpu_name, cpu_vendor, describe_mkl, mkl_branch

PACKAGES = ("torch", "transformers", "tokenizers", "pillow", "numpy", "vlrl")


def environment() -> dict[str, str | int | None]:
    """Versions of the packages that change the numbers, the torch thread count and the platform."""
    import torch

    info: dict[str, str | int | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            info[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            info[name] = None
    info["torch_threads"] = torch.get_num_threads()
    info["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS")
    info["platform"] = platform.platform()
    info["cpus"] = os.cpu_count()
    info["cpu"] = cpu_name()
    info["cpu_vendor"] = cpu_vendor()
    # the kernels in use (vlrl.numerics): another CPU family picks others, and with them other roundings
    info["cpu_kernels"] = torch.backends.cpu.get_cpu_capability()
    info["mkl_cbwr"] = describe_mkl(mkl_branch())
    info["numerics"] = "portable" if all(os.environ.get(k) == v for k, v in PORTABLE_ENV.items()) else "native"
    decided = applied()  # the CLI's decision (numerics: auto records what it chose and why)
    if decided is not None:
        info["numerics_requested"], info["numerics_reason"] = decided.requested, decided.reason
    return info


def describe(info: dict) -> str:
    """One line: ``torch 2.13.0 · transformers 5.24.0 · … · 2 torch threads · numerics portable (AVX2 kernels)``."""
    versions = " · ".join(f"{name} {info[name]}" for name in PACKAGES if info.get(name))
    line = f"{versions} · {info.get('torch_threads')} torch thread(s) · Python {info.get('python')}"
    if info.get("numerics"):  # summaries written before the numerics were recorded have none
        line += f" · numerics {info['numerics']} ({info.get('cpu_kernels')} kernels)"
        if info.get("numerics_requested") == "auto":  # what auto chose, and why (vlrl.numerics)
            line += f" chosen by numerics=auto: {info.get('numerics_reason')}"
    return line
