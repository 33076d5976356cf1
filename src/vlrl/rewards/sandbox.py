"""Run untrusted Python against tests in a separate, limited, network-less process.

`run_python(source, tests, limits)` starts ``python -I _sandbox_child.py`` (a stdlib-only runner, see that
file) in a throw-away working directory and returns one `TestRun` per test. What bounds the program:

====================  =================================================================================
CPU time              ``RLIMIT_CPU`` per test (SIGXCPU, then SIGKILL)
wall clock            per test, by the runner (SIGKILL to the test's process group); for the whole run, by
                      this process (SIGKILL to the runner's session), so ``sleep`` forever cannot hang us
memory                ``RLIMIT_AS`` per test
output                ``RLIMIT_FSIZE`` (stdout/stderr go to files), and only ``output_bytes`` are read back
disk                  a tmpfs of ``disk_mb`` on ``/tmp`` (the working directory is ``/tmp/work``), 1 MB
                      tmpfs on every other writable place (namespaced modes)
filesystem            a new read-only root: the interpreter, its standard library and shared libraries,
                      the ``packages`` allow-listed, a few device nodes; no other host file is visible
                      (namespaced modes; see ``_sandbox_child._private_filesystem``)
processes             ``RLIMIT_NPROC`` once running as an unprivileged user; a PID namespace, so every
                      process the program forks dies with the runner (namespaced modes)
network               a fresh network namespace with no interfaces (namespaced modes); otherwise the
                      ``socket`` module is disabled in-process (weak: ctypes could bypass it)
privileges            as root, tests run as ``nobody`` (uid 65534)
====================  =================================================================================

Isolation is probed once per process (`isolation()`): ``root`` — ``unshare --net --pid --mount --ipc --uts``
as root (this machine and CI); ``user`` — the same inside a user namespace (an unprivileged account with
user namespaces enabled); ``none`` — plain child process with rlimits and the in-process socket block.
Set ``VLRL_SANDBOX_ISOLATION`` to force one. Parent death kills the sandbox (``setpriv --pdeathsig``).

Assert-style tests run in the program's own interpreter, so a program written to inspect the harness
could fake a pass; stdin/stdout tests are compared by this process and cannot be faked that way.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

RUNNER = Path(__file__).with_name("_sandbox_child.py")
NOBODY = 65534
_NAMESPACES = ["--net", "--pid", "--fork", "--kill-child", "--mount", "--ipc", "--uts"]


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one sandboxed run. Per test unless named total."""

    cpu_seconds: float = 2.0
    wall_seconds: float = 4.0
    memory_mb: int = 512
    output_bytes: int = 1 << 20
    processes: int = 64
    disk_mb: int = 32
    total_seconds: float = 20.0  # the whole run: start-up and every test


@dataclass
class TestRun:
    """Outcome of one test: ``status`` is ``ok`` (ran to the end, exit 0), ``timeout``, ``output_limit``,
    ``exit N``, ``signal N`` or ``not_run`` (the total budget was used up)."""

    status: str
    stdout: str = ""
    stderr: str = ""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@functools.lru_cache(maxsize=1)
def isolation() -> str:
    """``root``, ``user`` or ``none``: the strongest isolation that works here (probed once)."""
    forced = os.environ.get("VLRL_SANDBOX_ISOLATION")
    if forced:
        if forced not in ("root", "user", "none"):
            raise ValueError(f"VLRL_SANDBOX_ISOLATION must be root, user or none, got {forced!r}")
        return forced
    if shutil.which("unshare") is None:
        return "none"
    for mode in ("root", "user") if os.geteuid() == 0 else ("user",):
        try:
            probe = subprocess.run([*_unshare(mode), "true"], capture_output=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if probe.returncode == 0:
            return mode
    return "none"


def _unshare(mode: str) -> list[str]:
    return ["unshare", *(["--user", "--map-root-user"] if mode == "user" else []), *_NAMESPACES, "--"]


def _command(mode: str) -> list[str]:
    prefix = ["setpriv", "--pdeathsig", "KILL", "--"] if shutil.which("setpriv") else []
    if mode != "none":
        prefix += _unshare(mode)
    return [*prefix, sys.executable, "-I", str(RUNNER)]


def run_python(source: str, tests: list[dict], limits: SandboxLimits = SandboxLimits(), *,
               mode: str | None = None, packages: Sequence[str] = ()) -> list[TestRun]:
    """Run ``source`` once per test. A test is ``{"stdin": "..."}`` (the program reads it; compare its
    ``stdout`` yourself) or ``{"assert": "assert f(1) == 2"}`` (run after the program, same namespace).
    ``packages``: top-level names of installed packages the program may import besides the standard library
    (e.g. ``["numpy"]``); in the namespaced modes nothing else of the interpreter's site-packages is visible.

    Never raises for anything the program does; raises ``RuntimeError`` if the runner itself breaks.
    """
    mode = mode or isolation()
    bad = [name for name in packages if not isinstance(name, str) or not name.isidentifier()]
    if bad:
        raise ValueError(f"sandbox packages: top-level module names expected, got {bad!r}")
    drop_uid = NOBODY if (mode == "root" or (mode == "none" and os.geteuid() == 0)) else None
    job = {
        "source": source, "tests": tests, "cpu_seconds": limits.cpu_seconds, "wall_seconds": limits.wall_seconds,
        "memory_bytes": limits.memory_mb << 20, "output_bytes": limits.output_bytes, "processes": limits.processes,
        "disk_bytes": limits.disk_mb << 20, "mount_tmpfs": mode != "none", "drop_uid": drop_uid,
        "block_network": mode == "none", "budget_seconds": max(0.1, limits.total_seconds - 1.0),
        "packages": list(packages),
    }
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
           "MKL_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory(prefix="vlrl-sandbox-") as work:
        if drop_uid is not None and mode == "none":
            os.chmod(work, 0o777)  # no tmpfs here: let the unprivileged test user write
        env["HOME"] = env["TMPDIR"] = work if mode == "none" else "/tmp/work"  # (its private tmpfs)
        proc = subprocess.Popen(_command(mode), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                cwd=work, env=env, start_new_session=True)
        try:
            out, err = proc.communicate(json.dumps(job).encode(), timeout=limits.total_seconds)
        except subprocess.TimeoutExpired:
            _kill_session(proc)
            proc.communicate()
            return [TestRun("timeout", stderr="sandbox wall-clock limit") for _ in tests]
        finally:
            _kill_session(proc)  # anything left in the runner's session
    if proc.returncode != 0 or not out:
        raise RuntimeError(f"sandbox runner failed (exit {proc.returncode}, isolation {mode}): "
                           f"{err.decode(errors='replace')[-2000:]}")
    result = json.loads(out)
    if job["mount_tmpfs"] and not result["mounted"]:
        raise RuntimeError(f"sandbox (isolation {mode}) could not build its private filesystem "
                           f"({result.get('error', 'unknown error')}); nothing was run. "
                           "VLRL_SANDBOX_ISOLATION=none runs with rlimits only (no filesystem isolation)")
    return [TestRun(**r) for r in result["results"]]


def _kill_session(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
