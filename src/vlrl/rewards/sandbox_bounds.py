"""The sandbox's bound on a program's whole process tree: memory and processes (`vlrl.rewards.sandbox`).

``RLIMIT_AS`` is per process and ``RLIMIT_NPROC`` per user, so a program that forks multiplies its memory by its
processes (6 forks × 450 MB took 3 GB with a 512 MB limit), and sandboxes sharing one user share one process count.
Here one sandboxed run — the runner and every process a test forks — is bounded as a whole, by the first of:

- ``cgroup2``: a cgroup v2 of its own (``memory.max``, ``memory.swap.max`` 0, ``pids.max``) made under this
  process's cgroup, where the ``memory`` and ``pids`` controllers are delegated to it;
- ``cgroup1``: a memory and a pids cgroup v1 of its own (``memory.limit_in_bytes``, ``memory.memsw.limit_in_bytes``
  where swap is accounted, ``pids.max``) — a host with the legacy hierarchies (this machine: cgroup v2 is mounted
  at ``/sys/fs/cgroup/unified`` with the ``hugetlb`` controller only; memory and pids are v1);
- ``rlimits`` (no cgroup can be made here: not root and nothing delegated, a container without the controllers):
  a test gets one process — ``RLIMIT_NPROC`` 1 for its own user, so it cannot fork — of at most the whole
  budget (``RLIMIT_AS``): the product of the two never passes the total. Logged (warning) with the cause, and
  recorded where the isolation is (`vlrl.rewards.sandbox.report_isolation`); ``sandbox.tree_bound: cgroup``
  refuses to run instead.

The run's processes join the cgroup before anything of the sandbox runs: the command is prefixed by
``sh -c 'echo $$ > …/cgroup.procs && exec "$@"'`` (no ``preexec_fn``: the trainer has threads). After the run
every process left in the cgroup is killed and the cgroup removed.

Each run also has a user of its own (as root: ``SANDBOX_UID_BASE`` + the run's host PID, unique while it runs),
so ``RLIMIT_NPROC`` counts only that run's processes: one program's forks never make another's fail.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import secrets
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

ENV_MEMORY = "VLRL_SANDBOX_MAX_MEMORY_MB"
ENV_PROCESSES = "VLRL_SANDBOX_MAX_PROCESSES"
ENV_BOUND = "VLRL_SANDBOX_TREE_BOUND"
BOUNDS = ("auto", "cgroup", "rlimits")
DEFAULT_MEMORY_MB = 512
DEFAULT_PROCESSES = 64
RUNNER_PROCESSES = 2  # besides the program's: `unshare` and the runner (setpriv and sh exec into them)
SANDBOX_UID_BASE = 1 << 30  # + the run's host PID (< 2^22): a user of its own per run, as root
_counter = itertools.count()
log = logging.getLogger(__name__)
_logged: set[str] = set()


class BoundUnavailable(RuntimeError):
    """``sandbox.tree_bound: cgroup`` where no cgroup can be made (the message names the cause)."""


@dataclass(frozen=True)
class TreeBound:
    """How one sandboxed run's process tree is bounded.

    Attributes:
        kind: ``cgroup2``, ``cgroup1`` or ``rlimits``.
        memory_bytes: the tree's total memory (the runner, every process, their tmpfs files).
        processes: the program's processes at once (``pids.max`` is this + `RUNNER_PROCESSES`); ``rlimits``: 1.
        bases: the cgroup directories under which each run's cgroup is made (cgroup kinds).
        cause: why no cgroup could be made (``rlimits``).
    """

    kind: str
    memory_bytes: int
    processes: int
    bases: tuple[str, ...] = ()
    cause: str = ""

    @property
    def process_bytes(self) -> int:
        """``RLIMIT_AS`` of each test process: the whole budget (with ``rlimits`` there is one process)."""
        return self.memory_bytes

    def describe(self) -> str:
        mb = self.memory_bytes >> 20
        if self.kind == "cgroup2":
            return f"cgroup v2 per run: memory.max {mb} MiB, no swap, pids.max {self.processes} (+ the runner's)"
        if self.kind == "cgroup1":
            return f"cgroup v1 per run: memory {mb} MiB (swap included), pids.max {self.processes} (+ the runner's)"
        return (f"no cgroup here ({self.cause}): one process per test (RLIMIT_NPROC 1, no fork) of at most {mb} "
                "MiB (RLIMIT_AS)")

    def open(self) -> RunCgroup | None:
        """The cgroup(s) of one run, made and limited now (None for ``rlimits``)."""
        return RunCgroup.make(self) if self.kind != "rlimits" else None


def configured() -> tuple[str, int, int]:
    """(``sandbox.tree_bound``, ``sandbox.max_memory_mb``, ``sandbox.max_processes``) as a run set them in the
    environment (`ENV_BOUND`, `ENV_MEMORY`, `ENV_PROCESSES`), else the defaults."""
    want = os.environ.get(ENV_BOUND) or "auto"
    if want not in BOUNDS:
        raise BoundUnavailable(f"{ENV_BOUND}={want!r}: expected one of {', '.join(BOUNDS)}")
    try:
        memory = int(os.environ.get(ENV_MEMORY) or DEFAULT_MEMORY_MB)
        processes = int(os.environ.get(ENV_PROCESSES) or DEFAULT_PROCESSES)
    except ValueError as err:
        raise BoundUnavailable(f"{ENV_MEMORY} / {ENV_PROCESSES}: not an integer ({err})") from None
    return want, memory, processes


def tree_bound(memory_mb: int, processes: int, want: str = "auto") -> TreeBound:
    """The bound a run of ``memory_mb`` and ``processes`` gets here (`BoundUnavailable` when ``want`` is
    ``cgroup`` and none can be made). The fallback is logged once per process."""
    if want not in BOUNDS:
        raise BoundUnavailable(f"sandbox.tree_bound {want!r}: expected one of {', '.join(BOUNDS)}")
    kind, bases, cause = ("rlimits", (), "sandbox.tree_bound is rlimits") if want == "rlimits" else cgroup_support()
    if want == "cgroup" and kind == "rlimits":
        raise BoundUnavailable(f"sandbox.tree_bound is cgroup, but no cgroup can be made here ({cause}); "
                               "sandbox.tree_bound=auto runs each test as one process within RLIMIT_AS instead")
    bound = TreeBound(kind, max(1, memory_mb) << 20, max(1, processes) if kind != "rlimits" else 1, bases, cause)
    if bound.kind == "rlimits" and bound.describe() not in _logged:
        _logged.add(bound.describe())
        log.warning("code sandbox: %s", bound.describe())
    return bound


@functools.lru_cache(maxsize=1)
def cgroup_support() -> tuple[str, tuple[str, ...], str]:
    """(kind, base directories, cause of the failure) — ``cgroup2`` or ``cgroup1`` where a test cgroup can be made,
    limited and removed under this process's own cgroup, else ``rlimits`` and why not. Probed once per process."""
    causes = []
    for kind, finder in (("cgroup2", _v2_bases), ("cgroup1", _v1_bases)):
        try:
            bases = finder()
            bound = TreeBound(kind, 64 << 20, 8, bases)
            RunCgroup.make(bound).close()
            return kind, bases, ""
        except OSError as err:
            causes.append(f"{kind}: {err.strerror or err}" + (f" ({err.filename})" if err.filename else ""))
    return "rlimits", (), "; ".join(causes)


def _mounts() -> list[tuple[str, str, set[str]]]:
    """(mount point, fstype, super options) of every cgroup mount this process sees."""
    out = []
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        for line in f:
            fields = line.split()
            try:
                dash = fields.index("-")
                fstype, options = fields[dash + 1], set(fields[dash + 3].split(","))
            except (ValueError, IndexError):
                continue
            if fstype in ("cgroup", "cgroup2"):
                out.append((fields[4].encode().decode("unicode_escape"), fstype, options))
    return out


def _own_paths() -> dict[str, str]:
    """This process's cgroup per hierarchy: ``""`` → its v2 path, each v1 controller → its path."""
    out = {}
    with open("/proc/self/cgroup", encoding="utf-8") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for name in controllers.split(",") if controllers else [""]:
                out[name] = path
    return out


def _v2_bases() -> tuple[str, ...]:
    mounts = [point for point, fstype, _ in _mounts() if fstype == "cgroup2"]
    own = _own_paths().get("")
    if not mounts or own is None:
        raise OSError(2, "no cgroup v2 hierarchy")
    base = os.path.join(mounts[0], own.lstrip("/"))
    enabled = Path(base, "cgroup.controllers").read_text().split()
    missing = [c for c in ("memory", "pids") if c not in enabled]
    if missing:
        raise OSError(95, f"the {' and '.join(missing)} controller(s) are not delegated to this cgroup", base)
    subtree = Path(base, "cgroup.subtree_control")
    if not {"memory", "pids"} <= set(subtree.read_text().split()):
        subtree.write_text("+memory +pids")  # EBUSY where this cgroup holds processes (not the root)
    return (base,)


def _v1_bases() -> tuple[str, ...]:
    own, bases = _own_paths(), []
    for controller in ("memory", "pids"):
        points = [point for point, fstype, options in _mounts() if fstype == "cgroup" and controller in options]
        if not points or controller not in own:
            raise OSError(2, f"no cgroup v1 {controller} hierarchy")
        bases.append(os.path.join(points[0], own[controller].lstrip("/")))
    return tuple(bases)


@dataclass
class RunCgroup:
    """The cgroup(s) of one sandboxed run: `prefix` puts a command in them; `close` kills what is left, removes
    them and says whether the memory limit killed a process (``oom_kills``)."""

    bound: TreeBound
    paths: list[str] = field(default_factory=list)

    @classmethod
    def make(cls, bound: TreeBound) -> RunCgroup:
        group = cls(bound)
        name = f"vlrl-sandbox-{os.getpid()}-{next(_counter)}-{secrets.token_hex(3)}"
        try:
            for base in bound.bases:
                path = os.path.join(base, name)
                os.mkdir(path, 0o755)
                group.paths.append(path)
            group._limit()
        except OSError:
            group.close()
            raise
        return group

    def _limit(self) -> None:
        memory, pids = str(self.bound.memory_bytes), str(self.bound.processes + RUNNER_PROCESSES)
        if self.bound.kind == "cgroup2":
            (path,) = self.paths
            _write(path, "memory.max", memory)
            if os.path.exists(os.path.join(path, "memory.swap.max")):
                _write(path, "memory.swap.max", "0")
            _write(path, "pids.max", pids)
            return
        memory_path, pids_path = self.paths
        _write(memory_path, "memory.limit_in_bytes", memory)
        if os.path.exists(os.path.join(memory_path, "memory.memsw.limit_in_bytes")):
            _write(memory_path, "memory.memsw.limit_in_bytes", memory)  # (after limit_in_bytes: it must be ≥)
        _write(pids_path, "pids.max", pids)

    def prefix(self) -> list[str]:
        """A command prefix that moves itself into the cgroup(s), then runs the rest of the command line there."""
        joins = " && ".join(f'echo $$ > "${k + 1}"' for k in range(len(self.paths)))
        return ["/bin/sh", "-c", f'{joins} && shift {len(self.paths)} && exec "$@"', "vlrl-sandbox",
                *(os.path.join(p, "cgroup.procs") for p in self.paths)]

    def oom_kills(self) -> int:
        """Processes the memory limit killed so far."""
        path, name = (self.paths[0], "memory.events") if self.bound.kind == "cgroup2" else (self.paths[0],
                                                                                             "memory.oom_control")
        try:
            for line in Path(path, name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def close(self) -> None:
        """Kill every process left in the cgroup(s), then remove them (a few tries while the killed exit)."""
        for path in reversed(self.paths):
            for _ in range(200):
                pids = _pids(path)
                if not pids:
                    break
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
                time.sleep(0.005)
            for _ in range(200):
                try:
                    os.rmdir(path)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.005)
            else:
                log.warning("code sandbox: could not remove cgroup %s", path)
        self.paths = []


def _write(path: str, name: str, value: str) -> None:
    with open(os.path.join(path, name), "w", encoding="ascii") as f:
        f.write(value)


def _pids(path: str) -> list[int]:
    try:
        return [int(p) for p in Path(path, "cgroup.procs").read_text().split()]
    except (OSError, ValueError):
        return []
