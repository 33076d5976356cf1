"""Issue 47, item 2: the sandbox bounds a run's whole process tree, not each process — a cgroup per run where the
host allows one (here: cgroup v1's memory and pids controllers; v2 has only hugetlb), else one process per test
within RLIMIT_AS, logged — and no two runs share a process count. Small bounds: each test touches ~120 MB at most."""

from __future__ import annotations

import logging
import os
import threading
import time

import pytest

from vlrl.rewards.sandbox import SandboxLimits, run_python
from vlrl.rewards.sandbox_bounds import RUNNER_PROCESSES, TreeBound, cgroup_support, tree_bound

LIMITS = SandboxLimits(cpu_seconds=2, wall_seconds=4, total_seconds=10, memory_mb=96, processes=8)
# three children touch 40 MB each at once: 120 MB, over the tree's 96 MB; each alone is within any per-process limit
FORKS = """
import os, time
kids = []
for i in range(3):
    pid = os.fork()
    if pid == 0:
        block = b"\\x01" * (40 << 20)
        time.sleep(1.0)
        os._exit(0)
    kids.append(pid)
codes = [os.waitpid(k, 0)[1] for k in kids]
print(codes)
raise SystemExit(0 if all(c == 0 for c in codes) else 1)
"""
CGROUP = cgroup_support()[0] != "rlimits"


@pytest.mark.skipif(not CGROUP, reason=f"no cgroup can be made here ({cgroup_support()[2]}); the fallback is tested below")
def test_forked_children_share_one_memory_bound():
    """Before: RLIMIT_AS per process, so 6 forks × 450 MB took 3 GB. Now the run's cgroup holds them all: a child
    is killed (SIGKILL from the cgroup's OOM killer) once the tree passes 96 MB, and the run's cgroup is gone after."""
    (run,) = run_python(FORKS, [{"stdin": ""}], LIMITS)
    assert run.status == "exit 1", run
    codes = eval(run.stdout)  # the parent's view of its children's wait statuses
    assert 9 in codes, run  # killed by SIGKILL: the bound held
    base = cgroup_support()[1][0]
    assert not [name for name in os.listdir(base) if name.startswith(f"vlrl-sandbox-{os.getpid()}-")]
    (run,) = run_python(FORKS.replace("40 << 20", "8 << 20"), [{"stdin": ""}], LIMITS)
    assert run.ok and run.stdout == "[0, 0, 0]\n", run  # within the bound, forking works


def test_without_a_cgroup_a_test_is_one_process_within_the_whole_budget(caplog):
    """The documented fallback (sandbox.tree_bound=rlimits, or auto where no cgroup can be made): RLIMIT_NPROC 1 for
    the test's own user and RLIMIT_AS = the whole budget, so the product stays within it — and it is logged."""
    caplog.set_level(logging.WARNING, logger="vlrl.rewards.sandbox_bounds")
    bound = tree_bound(96, 8, "rlimits")
    assert (bound.kind, bound.processes, bound.process_bytes) == ("rlimits", 1, 96 << 20)
    (run,) = run_python(FORKS, [{"stdin": ""}], LIMITS, bound=bound)
    assert run.status == "exit 1" and "BlockingIOError" in run.stderr, run  # the first fork is refused
    (run,) = run_python("print(len(b'x' * (200 << 20)))", [{"stdin": ""}], LIMITS, bound=bound)
    assert run.status == "exit 1" and "MemoryError" in run.stderr, run
    assert "no cgroup here (sandbox.tree_bound is rlimits): one process per test (RLIMIT_NPROC 1, no fork) of at " \
           "most 96 MiB (RLIMIT_AS)" in bound.describe()
    tree_bound(95, 8, "rlimits")
    assert any("RLIMIT_NPROC 1" in r.getMessage() for r in caplog.records)


def test_cgroup_is_refused_where_none_can_be_made(monkeypatch):
    from vlrl.rewards import sandbox_bounds
    from vlrl.rewards.sandbox_bounds import BoundUnavailable

    monkeypatch.setattr(sandbox_bounds, "cgroup_support", lambda: ("rlimits", (), "cgroup2: no cgroup v2 hierarchy"))
    with pytest.raises(BoundUnavailable, match=r"sandbox.tree_bound is cgroup, but no cgroup can be made here "
                                               r"\(cgroup2: no cgroup v2 hierarchy\)"):
        tree_bound(96, 8, "cgroup")
    assert tree_bound(96, 8, "auto").kind == "rlimits"


def test_a_v2_cgroup_gets_memory_max_no_swap_and_pids_max(tmp_path):
    """cgroup v2 is not delegated on this machine (its memory and pids controllers are v1): the files a v2 run
    writes, checked on a directory laid out as a delegated v2 cgroup."""
    (tmp_path / "memory.swap.max").write_text("max")
    bound = TreeBound("cgroup2", 96 << 20, 8, (str(tmp_path),))
    group = bound.open()
    (path,) = group.paths
    assert {name: (tmp_path / path / name).read_text() for name in ("memory.max", "pids.max")} == {
        "memory.max": str(96 << 20), "pids.max": str(8 + RUNNER_PROCESSES)}
    assert group.prefix()[:3] == ["/bin/sh", "-c", 'echo $$ > "$1" && shift 1 && exec "$@"']
    os.remove(os.path.join(path, "memory.max"))
    os.remove(os.path.join(path, "pids.max"))
    group.close()
    assert not os.path.exists(path)


SLEEPERS = """
import os, sys, time
n = int(sys.stdin.read())
kids = []
for i in range(n):
    pid = os.fork()
    if pid == 0:
        time.sleep(2.5)
        os._exit(0)
    kids.append(pid)
print(sum(os.waitpid(k, 0)[1] == 0 for k in kids))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="runs have users of their own only as root")
def test_two_runs_never_share_a_process_count():
    """Before: every run's tests ran as nobody with RLIMIT_NPROC 8 (say): one program's 7 sleeping children made the
    other program's first fork fail. Now each run has a user of its own (and, here, its own pids cgroup)."""
    limits = SandboxLimits(cpu_seconds=2, wall_seconds=5, total_seconds=10, memory_mb=256, processes=8)
    first: list = []
    holder = threading.Thread(target=lambda: first.extend(run_python(SLEEPERS, [{"stdin": "7"}], limits)))
    holder.start()
    time.sleep(1.0)  # its 7 children are asleep now
    (second,) = run_python(SLEEPERS, [{"stdin": "3"}], limits)
    holder.join()
    assert first[0].ok and first[0].stdout == "7\n", first
    assert second.ok and second.stdout == "3\n", second
