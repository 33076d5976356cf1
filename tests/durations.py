"""The suite's cost per test file, from the per-test log `make test-durations` writes (tests/conftest.py:
``VLRL_TEST_CPU_LOG``, one ``nodeid<TAB>cpu seconds<TAB>wall seconds`` line per test): prints the files by CPU-seconds
(the top ``--top``, then the totals) and, with ``--write``, stores each file's CPU-seconds in tests/durations.json,
the order `make test` hands files to its workers in (longest first).

    python tests/durations.py LOG [--top 30] [--write]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

DURATIONS = Path(__file__).with_name("durations.json")


def per_file(lines: list[str]) -> dict[str, tuple[float, float, int]]:
    """file → (CPU-seconds, wall seconds, tests) summed over its tests."""
    files: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    for line in lines:
        nodeid, cpu, wall = line.rstrip("\n").split("\t")
        entry = files[nodeid.split("::")[0]]
        entry[0] += float(cpu)
        entry[1] += float(wall)
        entry[2] += 1
    return {name: (cpu, wall, int(n)) for name, (cpu, wall, n) in files.items()}


def table(files: dict[str, tuple[float, float, int]], top: int) -> str:
    rows = sorted(files.items(), key=lambda kv: -kv[1][0])
    cpu, wall = sum(v[0] for v in files.values()), sum(v[1] for v in files.values())
    lines = [f"{'file':60s} {'CPU s':>8s} {'wall s':>8s} {'tests':>6s} {'CPU %':>6s}"]
    lines += [f"{name:60s} {c:8.1f} {w:8.1f} {n:6d} {c / cpu:6.1%}" for name, (c, w, n) in rows[:top]]
    lines.append(f"{'all ' + str(len(files)) + ' files':60s} {cpu:8.1f} {wall:8.1f} "
                 f"{sum(v[2] for v in files.values()):6d}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("log", type=Path)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--write", action="store_true", help=f"store the CPU-seconds per file in {DURATIONS.name}")
    args = parser.parse_args()
    files = per_file(args.log.read_text(encoding="utf-8").splitlines())
    print(table(files, args.top))
    if args.write:
        costs = {name: round(cpu, 1) for name, (cpu, _, _) in sorted(files.items())}
        DURATIONS.write_text(json.dumps(costs, indent=1) + "\n")


if __name__ == "__main__":
    main()
