"""What a run's numbers depend on besides its config: package versions, torch threads, the machine.

Two runs of the same config and seed give the same numbers only with the same versions of these packages
and the same torch thread count (CPU kernels are deterministic for a given count, not across counts); a
fresh install on another day resolves other versions. `environment` records them for summary.json and
report.html, so two runs that differ can be told apart.
"""

from __future__ import annotations

import os
import platform
from importlib import metadata

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
    return info


def describe(info: dict) -> str:
    """One line: ``torch 2.13.0 · transformers 5.24.0 · … · 2 torch threads``."""
    versions = " · ".join(f"{name} {info[name]}" for name in PACKAGES if info.get(name))
    return f"{versions} · {info.get('torch_threads')} torch thread(s) · Python {info.get('python')}"
