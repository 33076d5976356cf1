"""The two constraint files the Makefile installs with, written from pyproject.toml and pip's own resolution.

    python constraints/pins.py floor [EXTRA]      the declared floors: `name==floor` for every direct dependency
                                                  of vlrl and of vlrl[EXTRA] (default dev), extras followed
                                                  (`make test-floor`)
    python constraints/pins.py lock REPORT.json   the lock: `name==version` for every package of a
                                                  `pip install --dry-run --report` resolution (`make lock`)

The lock leaves out vlrl itself and the CUDA runtime that a CUDA build of torch pulls (nvidia-*, cuda-*, triton):
on a CPU machine it then holds nothing that makes pip fetch a CUDA build, and on a GPU machine the torch build
installed first brings its own. torch is pinned without its local label (``2.13.0``, not ``2.13.0+cpu``), so
any build of that release satisfies it. Standard library only: it runs before the venv has anything.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# `name[extras] >=1.2, <2 ; marker` → name, extras, specifiers (PEP 508 without URLs, which vlrl does not use)
_REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[([^\]]*)\])?\s*([^;]*)")
_CUDA_RUNTIME = re.compile(r"^(nvidia-|cuda-|triton$)")


def normalize(name: str) -> str:
    """PEP 503: ``Latex2Sympy2_Extended`` and ``latex2sympy2-extended`` are one project."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pyproject(path: Path = ROOT / "pyproject.toml") -> dict:
    """``[project]`` of pyproject.toml (tomllib: Python ≥ 3.11; the Makefile's maintainer targets need that)."""
    import tomllib

    return tomllib.loads(path.read_text())["project"]


def requirements(project: dict, extras: list[str]) -> list[tuple[str, str]]:
    """(normalized name, specifiers) of vlrl's core dependencies and of ``extras``, its own extras
    (``vlrl[report,rewards]``) followed; each requirement once, in order."""
    own = normalize(project["name"])
    lines, todo, done = list(project["dependencies"]), list(extras), set()
    out: dict[str, str] = {}
    while lines or todo:
        if not lines:
            extra = todo.pop(0)
            if extra not in done:
                done.add(extra)
                lines = list(project["optional-dependencies"][extra])
            continue
        match = _REQUIREMENT.match(lines.pop(0))
        name, specifiers = normalize(match[1]), match[3].strip()
        if name == own:
            todo += [e.strip() for e in (match[2] or "").split(",") if e.strip()]
        else:
            out.setdefault(name, specifiers)
    return list(out.items())


def floor_of(specifiers: str) -> str | None:
    """The version after ``>=`` (None without one)."""
    match = re.search(r">=\s*([0-9][0-9A-Za-z.]*)", specifiers)
    return match[1] if match else None


def floor_pins(project: dict, extra: str = "dev") -> list[str]:
    """``name==floor`` for every direct dependency with a floor; one without a floor is an error."""
    pins = []
    for name, specifiers in requirements(project, [extra]):
        floor = floor_of(specifiers)
        if floor is None:
            raise ValueError(f"{name} has no floor (>=) in pyproject.toml")
        pins.append(f"{name}=={floor}")
    return pins


def lock_pins(report: dict) -> list[str]:
    """``name==version`` of every package in a pip installation report, sorted; vlrl itself and the CUDA
    runtime left out, local version labels dropped."""
    pins = {}
    for item in report["install"]:
        name = normalize(item["metadata"]["name"])
        if name == "vlrl" or _CUDA_RUNTIME.match(name):
            continue
        pins[name] = item["metadata"]["version"].split("+", 1)[0]
    return [f"{name}=={version}" for name, version in sorted(pins.items())]


def read_pins(path: Path) -> dict[str, str]:
    """{normalized name: version} of a constraints file's ``name==version`` lines (comments skipped)."""
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[normalize(name)] = version.strip()
    return pins


def main(argv: list[str]) -> int:
    if len(argv) >= 1 and argv[0] == "floor":
        print("# make test-floor: the floors of pyproject.toml (written by constraints/pins.py floor)")
        print("\n".join(floor_pins(read_pyproject(), argv[1] if len(argv) > 1 else "dev")))
        return 0
    if len(argv) == 2 and argv[0] == "lock":
        report = json.loads(Path(argv[1]).read_text())
        python = report.get("environment", {})
        print("# The lock of `make test`: every package of vlrl[dev] as pip resolved it, under constraints/demo.txt.")
        print("# Regenerate with `make lock` (never by hand). Resolved for Python "
              f"{python.get('python_full_version', '?')} on {python.get('sys_platform', '?')} "
              f"{python.get('platform_machine', '?')}; torch is installed first (Makefile TORCH).")
        print("\n".join(lock_pins(report)))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
