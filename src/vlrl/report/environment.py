"""What a run's numbers depend on besides its config: package versions, torch threads, the machine.

Two runs of the same config and seed give the same numbers only with the same versions of these packages, the
same torch thread count (CPU kernels are deterministic for a given count, not across counts) and the same CPU
kernels (AVX2 or AVX-512 ones, MKL's branch: `vlrl.numerics`, pinned by ``numerics: portable``); a fresh install
on another day resolves other versions. `environment` records them for summary.json and report.html, so two runs
that differ can be told apart. `bug_report` adds what a bug report needs besides (`vlrl env` prints it).
"""

from __future__ import annotations

import os
import platform
import re
from importlib import metadata
from pathlib import Path

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


# ----------------------------------------------------------------------------------------------- `vlrl env`
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile",
             "amx_bf16", "amx_int8")


def cpu_info() -> dict[str, str | None]:
    """The CPU's vendor and the instruction sets that pick torch's, MKL's and oneDNN's kernels (`ISA_FLAGS` that
    /proc/cpuinfo lists; None where there is no /proc/cpuinfo)."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
            if key.strip() == "flags":
                break
    except OSError:
        return {"vendor": platform.machine() or None, "isa": None}
    flags = set(fields.get("flags", "").split())
    return {"vendor": fields.get("vendor_id"), "isa": " ".join(f for f in ISA_FLAGS if f in flags) or "no AVX2"}


def gpus() -> list[str]:
    """One line per visible CUDA device: name, memory, compute capability (empty without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return []
    out = []
    for index in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(index)
        out.append(f"cuda:{index} {p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}")
    return out


def _requirement_name(line: str) -> tuple[str, list[str]]:
    """``name[extra, …] >=1 ; marker`` → (name, [extra, …])."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[([^\]]*)\])?", line)
    assert match is not None, line
    return match[1], [e.strip() for e in (match[2] or "").split(",") if e.strip()]


def extras() -> dict[str, list[str]]:
    """{extra: the distributions it needs that are not installed} for every extra of vlrl's own metadata but
    ``dev`` and ``all`` (an empty list: the extra is present); extras that name vlrl's own extras are followed."""
    try:
        provided = metadata.metadata("vlrl").get_all("Provides-Extra") or []
        requires = metadata.requires("vlrl") or []
    except metadata.PackageNotFoundError:
        return {}
    needs: dict[str, list[tuple[str, list[str]]]] = {extra: [] for extra in provided}
    for line in requires:
        marker = re.search(r"""extra\s*==\s*["']([^"']+)["']""", line)
        if marker and marker[1] in needs:
            needs[marker[1]].append(_requirement_name(line.split(";", 1)[0]))

    def missing(extra: str, seen: frozenset = frozenset()) -> list[str]:
        out = []
        for name, own in needs.get(extra, []):
            if name == "vlrl":
                out += [m for e in own if e not in seen for m in missing(e, seen | {extra})]
                continue
            try:
                metadata.version(name)
            except metadata.PackageNotFoundError:
                out.append(name)
        return sorted(set(out))

    return {extra: missing(extra) for extra in provided if extra not in ("dev", "all")}


def bug_report() -> list[tuple[str, str]]:
    """What `vlrl env` prints, as (field, value) lines: `environment` (what summary.json records) and, beside it,
    every core dependency's version, the CPU's vendor and instruction sets, CUDA and its GPUs, the extras present."""
    import torch

    info = environment()
    try:
        core = [_requirement_name(line)[0] for line in metadata.requires("vlrl") or [] if "extra ==" not in line]
    except metadata.PackageNotFoundError:
        core = list(PACKAGES)
    versions = []
    for name in dict.fromkeys(n for n in [*PACKAGES, *core] if n != "vlrl"):
        try:
            versions.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            versions.append(f"{name} (not installed)")
    cpu = cpu_info()
    present = extras()
    cuda = torch.version.cuda
    lines = [
        ("vlrl", f"{info.get('vlrl') or '(not installed)'} ({Path(__file__).resolve().parents[1]})"),
        ("python", f"{info['python']} ({platform.python_implementation()}) on {info['platform']}"),
        ("packages", ", ".join(versions)),
        ("cpu", f"{info['cpu']} · {cpu['vendor']} · {info['cpus']} logical CPUs"),
        ("cpu isa", f"{cpu['isa']} · torch kernels {info['cpu_kernels']} · MKL branch {info['mkl_cbwr'] or 'n/a'}"),
        ("torch threads", f"{info['torch_threads']} (OMP_NUM_THREADS={info['OMP_NUM_THREADS'] or 'unset'})"),
        ("numerics", f"{info['numerics']} (" + ", ".join(f"{k}={os.environ.get(k) or 'unset'}" for k in PORTABLE_ENV)
         + ")"),
        ("cuda", f"{cuda} · " + ("; ".join(gpus()) or "no GPU visible") if cuda else "none (a CPU build of torch)"),
        ("extras", ", ".join(name if not absent else f"{name} (missing {', '.join(absent)})"
                             for name, absent in present.items()) or "(vlrl is not installed)"),
    ]
    return lines


def format_bug_report(lines: list[tuple[str, str]]) -> str:
    """The lines as one block to paste into a bug report."""
    width = max(len(field) for field, _ in lines)
    return "\n".join(f"{field + ':':<{width + 1}} {value}" for field, value in lines)
