"""Run untrusted Python against tests in a separate, limited, network-less process.

`run_python(source, tests, limits)` starts ``python -I _sandbox_child.py`` (a stdlib-only runner, see that
file) in a throw-away working directory and returns one `TestRun` per test. What bounds the program:

====================  =================================================================================
CPU time              ``RLIMIT_CPU`` per test (SIGXCPU, then SIGKILL)
wall clock            per test, by the runner (SIGKILL to the test's process group); for the whole run, by
                      this process (SIGKILL to the runner's session), so ``sleep`` forever cannot hang us
memory                the whole process tree of a run (the runner, every process a test forks, its tmpfs files):
                      a cgroup per run where the host allows one, else one process per test within
                      ``RLIMIT_AS`` (`vlrl.rewards.sandbox_bounds`); ``RLIMIT_AS`` per process as well
output                ``RLIMIT_FSIZE`` (stdout/stderr go to files), and only ``output_bytes`` are read back
disk                  a tmpfs of ``disk_mb`` on ``/tmp`` (the working directory is ``/tmp/work``), 1 MB
                      tmpfs on every other writable place (namespaced modes)
filesystem            a new read-only root: the interpreter, its standard library and shared libraries,
                      the ``packages`` allow-listed, a few device nodes; no other host file is visible
                      (namespaced modes; see ``_sandbox_root.private_filesystem``)
processes             the cgroup's ``pids.max``, and ``RLIMIT_NPROC`` for the run's own user (as root each run
                      has a uid of its own, so runs never share a process count); a PID namespace, so every
                      process the program forks dies with the runner (namespaced modes)
network               a fresh network namespace with no interfaces (namespaced modes); otherwise the
                      ``socket`` module is disabled in-process (weak: ctypes could bypass it)
privileges            as root, tests run as a user of their own (uid 2^30 + the run's host PID), no groups
====================  =================================================================================

Isolation (`isolation`) follows one setting — ``sandbox.isolation`` in a run's config, else the
``VLRL_SANDBOX_ISOLATION`` environment variable, else ``namespaces`` — and is probed once per process:

- ``namespaces`` (the default): ``root`` where it works, else ``user``;
- ``root``: ``unshare --net --pid --mount --ipc --uts`` as root (this machine and CI), tests run as an
  unprivileged user of their own;
- ``user``: the same inside a user namespace (an unprivileged account with user namespaces enabled);
- ``none``: a plain child process with rlimits and the in-process socket block, nothing else — only when the
  setting says ``none``.

Where the setting cannot be had (no ``unshare``, user namespaces disabled, a container without the
capability), `isolation` raises `SandboxUnavailable` naming the cause and the setting: the sandbox never
falls back to less isolation than it was asked for. Parent death kills the sandbox (``setpriv --pdeathsig``).

Files on the program's side: the runner opens none by name. A test's stdin, stdout and stderr are anonymous
memory files (``memfd_create``) made before the test starts and handed over as descriptors; each test runs in
a directory of its own (``test<i>-<random>``), made by the runner with ``mkdir`` (which never follows a link) and entered by
descriptor. The work folder above them is the runner's (``0755``; in ``none`` mode as root ``0711``), so a
program running as its unprivileged user cannot plant anything there; whatever a program leaves in its own directory,
the runner never opens it. A work folder the runner cannot use (a program in ``user`` mode, which shares
the runner's uid, may break it) fails the tests that follow (status ``error``, score 0); nothing raises.

Assert-style tests run in the program's own interpreter, so a program written to inspect the harness
could fake a pass; stdin/stdout tests are compared by this process and cannot be faked that way.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

if __name__ == "vlrl.rewards.sandbox":
    from vlrl.rewards import sandbox_bounds as _bounds
else:  # loaded by path with the standard library only (a bare interpreter): its sibling the same way
    import importlib.util

    _spec = importlib.util.spec_from_file_location("_vlrl_sandbox_bounds", Path(__file__).with_name("sandbox_bounds.py"))
    _bounds = importlib.util.module_from_spec(_spec)
    sys.modules[_spec.name] = _bounds  # (dataclasses resolve the module by name)
    _spec.loader.exec_module(_bounds)
ENV_BOUND, ENV_MEMORY, ENV_PROCESSES = _bounds.ENV_BOUND, _bounds.ENV_MEMORY, _bounds.ENV_PROCESSES
SANDBOX_UID_BASE, BoundUnavailable, TreeBound = _bounds.SANDBOX_UID_BASE, _bounds.BoundUnavailable, _bounds.TreeBound

RUNNER = Path(__file__).with_name("_sandbox_child.py")
_NAMESPACES = ["--net", "--pid", "--fork", "--kill-child", "--mount", "--ipc", "--uts"]
ENV = "VLRL_SANDBOX_ISOLATION"
SETTINGS = ("namespaces", "root", "user", "none")
log = logging.getLogger(__name__)


class SandboxUnavailable(RuntimeError):
    """The configured isolation cannot be had on this machine; the message names the cause and the setting."""


_reported: set[tuple[str, str]] = set()  # (setting, mode) pairs logged by this process


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one sandboxed run. Per test unless named total; ``memory_mb`` and ``processes`` bound
    the run's whole process tree (`vlrl.rewards.sandbox_bounds`)."""

    cpu_seconds: float = 2.0
    wall_seconds: float = 4.0
    memory_mb: int = 512  # the tree's total (sandbox.max_memory_mb caps it)
    output_bytes: int = 1 << 20
    processes: int = 64  # the program's processes at once (sandbox.max_processes caps it)
    disk_mb: int = 32
    total_seconds: float = 20.0  # the whole run: start-up and every test


@dataclass
class TestRun:
    """Outcome of one test: ``status`` is ``ok`` (ran to the end, exit 0), ``timeout``, ``output_limit``,
    ``exit N``, ``signal N``, ``not_run`` (the total budget was used up) or ``error`` (the runner could not
    set the test up, e.g. a work folder an earlier test broke; ``stderr`` says why)."""

    status: str
    stdout: str = ""
    stderr: str = ""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def setting() -> str:
    """The isolation asked for: ``VLRL_SANDBOX_ISOLATION`` (a run sets it from ``sandbox.isolation``), else
    ``namespaces``."""
    value = os.environ.get(ENV) or "namespaces"
    if value not in SETTINGS:
        raise SandboxUnavailable(f"{ENV}={value!r}: expected one of {', '.join(SETTINGS)}")
    return value


def isolation(asked: str | None = None) -> str:
    """The mode the sandbox runs in for the setting ``asked`` (default: `setting()`): ``root``, ``user`` or
    ``none``. Raises `SandboxUnavailable` (the cause, and the setting that accepts less) when the setting
    cannot be had here — never a weaker mode than asked for. Probed once per process and setting."""
    asked = asked or setting()
    if asked not in SETTINGS:
        raise SandboxUnavailable(f"sandbox isolation {asked!r}: expected one of {', '.join(SETTINGS)}")
    mode, causes = _obtain(asked, os.environ.get("PATH", ""))
    if mode is not None and (asked, mode) not in _reported:
        _reported.add((asked, mode))
        log.info("code sandbox: isolation %s (setting %s): %s", mode, asked, describe(mode))
    if mode is None:
        raise SandboxUnavailable(
            f"the code sandbox cannot have isolation {asked!r} here ({'; '.join(causes)}), and it does not run "
            "model-written programs with less: fix the cause (run as root, or enable user namespaces: "
            "sysctl user.max_user_namespaces / kernel.unprivileged_userns_clone), or accept rlimits only — no "
            f"filesystem, network or process isolation — with sandbox.isolation=none ({ENV}=none)")
    return mode


@functools.lru_cache(maxsize=16)
def _obtain(asked: str, path: str) -> tuple[str | None, tuple[str, ...]]:
    """(mode, causes of the modes that failed) for ``asked``; ``path``: the PATH the probe ran with (a cache key)."""
    if asked == "none":
        return "none", ()
    candidates = [asked] if asked in ("root", "user") else (["root", "user"] if os.geteuid() == 0 else ["user"])
    causes = []
    for mode in candidates:
        cause = _probe(mode)
        if cause is None:
            return mode, ()
        causes.append(f"{mode}: {cause}")
    if asked == "root" and os.geteuid() != 0:
        causes.append("root: this process is not root")
    return None, tuple(causes)


def _probe(mode: str) -> str | None:
    """None if ``unshare`` in ``mode`` works here, else why not."""
    if mode == "root" and os.geteuid() != 0:
        return "this process is not root"
    if shutil.which("unshare") is None:
        return "no `unshare` on PATH (util-linux)"
    command = [*_unshare(mode), "true"]
    try:
        probe = subprocess.run(command, capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"`{' '.join(command)}` failed: {type(err).__name__}: {err}"
    if probe.returncode != 0:
        said = probe.stderr.decode(errors="replace").strip().splitlines()
        return f"`{' '.join(command)}` exited {probe.returncode}" + (f": {said[-1][:200]}" if said else "")
    return None


def describe(mode: str) -> str:
    """One line: what isolation ``mode`` gives a program."""
    return {
        "root": "network, PID, mount, IPC and UTS namespaces (unshare as root), a private read-only root "
                "filesystem, programs run as an unprivileged user of their own",
        "user": "network, PID, mount, IPC and UTS namespaces inside a user namespace, a private read-only root "
                "filesystem, programs run as this user",
        "none": "rlimits and a disabled socket module only: programs can read this machine's files"
                + (" (as an unprivileged user)" if os.geteuid() == 0 else " (as this user)"),
    }[mode]


def report_isolation(asked: str | None = None, *, tree: TreeBound | None = None) -> dict[str, str]:
    """The isolation a run's programs get, as summary.json records it (``{"setting", "isolation",
    "description", "tree_bound"}``; the recipes log it once per run); raises `SandboxUnavailable` like
    `isolation`, and where the process-tree bound ``tree`` (default: the configured one) cannot be had."""
    asked = asked or setting()
    mode = isolation(asked)
    try:
        tree = tree or configured_bound()
    except BoundUnavailable as err:
        raise SandboxUnavailable(str(err)) from None
    return {"setting": asked, "isolation": mode, "description": describe(mode), "tree_bound": tree.describe()}


def sandbox_env(isolation: str, *, tree_bound: str, max_memory_mb: int, max_processes: int) -> dict[str, str]:
    """The ``sandbox`` section as the environment variables the sandbox follows in every process of a run (the
    reward workers included): `ENV` and `vlrl.rewards.sandbox_bounds`' three."""
    return {ENV: isolation, ENV_BOUND: tree_bound, ENV_MEMORY: str(max_memory_mb), ENV_PROCESSES: str(max_processes)}


def configured_bound(limits: SandboxLimits | None = None) -> TreeBound:
    """The process-tree bound of a run of ``limits`` (default: the configured maximums) under the configured
    ``sandbox.tree_bound`` (`vlrl.rewards.sandbox_bounds.configured`)."""
    want, memory_mb, processes = _bounds.configured()
    if limits is not None:
        memory_mb, processes = min(limits.memory_mb, memory_mb), min(limits.processes, processes)
    return _bounds.tree_bound(memory_mb, processes, want)


def _unshare(mode: str) -> list[str]:
    return ["unshare", *(["--user", "--map-root-user"] if mode == "user" else []), *_NAMESPACES, "--"]


def _command(mode: str) -> list[str]:
    prefix = ["setpriv", "--pdeathsig", "KILL", "--"] if shutil.which("setpriv") else []
    if mode != "none":
        prefix += _unshare(mode)
    return [*prefix, sys.executable, "-I", str(RUNNER)]


def run_python(source: str, tests: list[dict], limits: SandboxLimits = SandboxLimits(), *,
               mode: str | None = None, packages: Sequence[str] = (), bound: TreeBound | None = None) -> list[TestRun]:
    """Run ``source`` once per test. A test is ``{"stdin": "..."}`` (the program reads it; compare its
    ``stdout`` yourself) or ``{"assert": "assert f(1) == 2"}`` (run after the program, same namespace).
    ``packages``: top-level names of installed packages the program may import besides the standard library
    (e.g. ``["numpy"]``); in the namespaced modes nothing else of the interpreter's site-packages is visible.

    ``mode``: ``root``, ``user`` or ``none`` as the caller has established it; default: `isolation()`, which
    raises `SandboxUnavailable` where the configured isolation cannot be had. ``bound``: how the run's process
    tree is bounded; default: `configured_bound` of ``limits`` (`SandboxUnavailable` where ``sandbox.tree_bound:
    cgroup`` cannot be had).

    Never raises for anything the program does; raises ``RuntimeError`` if the runner itself breaks.
    """
    mode = mode or isolation()
    if mode not in ("root", "user", "none"):
        raise ValueError(f"sandbox mode must be root, user or none, got {mode!r}")
    bad = [name for name in packages if not isinstance(name, str) or not name.isidentifier()]
    if bad:
        raise ValueError(f"sandbox packages: top-level module names expected, got {bad!r}")
    try:
        bound = bound or configured_bound(limits)
    except BoundUnavailable as err:
        raise SandboxUnavailable(str(err)) from None
    job = {
        "source": source, "tests": tests, "cpu_seconds": limits.cpu_seconds, "wall_seconds": limits.wall_seconds,
        "memory_bytes": bound.process_bytes, "output_bytes": limits.output_bytes, "processes": bound.processes,
        "disk_bytes": limits.disk_mb << 20, "mount_tmpfs": mode != "none", "drop_uid": None,
        "block_network": mode == "none", "budget_seconds": max(0.1, limits.total_seconds - 1.0),
        "packages": list(packages),
    }
    result = _launch(job, mode, bound, limits.total_seconds)
    if result is None:
        return [TestRun("timeout", stderr="sandbox wall-clock limit") for _ in tests]
    if job["mount_tmpfs"] and not result["mounted"]:
        raise SandboxUnavailable(f"sandbox (isolation {mode}) could not build its private filesystem "
                                 f"({result.get('error', 'unknown error')}); nothing was run. sandbox.isolation=none "
                                 f"({ENV}=none) runs with rlimits only (no filesystem isolation)")
    return [TestRun(**r) for r in result["results"]]


def _launch(job: dict, mode: str, bound: TreeBound, total_seconds: float) -> dict | None:
    """Start the runner inside the run's cgroup (if the bound has one), hand it ``job``, and return its result
    (None: the whole-run wall clock passed). As root, the tests run as a user of this run's own
    (`SANDBOX_UID_BASE` + the runner's host PID), so no two runs share ``RLIMIT_NPROC``'s count."""
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
           "MKL_NUM_THREADS": "1"}
    drop = mode == "root" or (mode == "none" and os.geteuid() == 0)
    with tempfile.TemporaryDirectory(prefix="vlrl-sandbox-", ignore_cleanup_errors=True) as work:
        if drop and mode == "none":
            os.chmod(work, 0o711)  # the runner's: the test user may enter its own test directory, not write here
        env["HOME"] = env["TMPDIR"] = work if mode == "none" else "/tmp/work"  # (its private tmpfs)
        group = bound.open()
        try:
            proc = subprocess.Popen([*(group.prefix() if group else []), *_command(mode)], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=work, env=env,
                                    start_new_session=True)
            job["drop_uid"] = SANDBOX_UID_BASE + proc.pid if drop else None
            try:
                out, err = proc.communicate(json.dumps(job).encode(), timeout=total_seconds)
            except subprocess.TimeoutExpired:
                _kill_session(proc)
                proc.communicate()
                return None
            finally:
                _kill_session(proc)  # anything left in the runner's session
        finally:
            if group is not None:
                group.close()  # anything left in the run's cgroup
    if proc.returncode != 0 or not out:
        raise RuntimeError(f"sandbox runner failed (exit {proc.returncode}, isolation {mode}, {bound.kind}): "
                           f"{err.decode(errors='replace')[-2000:]}")
    return json.loads(out)


def _kill_session(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
