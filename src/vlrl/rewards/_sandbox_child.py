"""Sandbox runner: executed as ``python -I _sandbox_child.py`` by `vlrl.rewards.sandbox`, never imported.

Standard library only (it runs in isolated mode, maybe in fresh namespaces). It reads one job (JSON) from
stdin, builds its private filesystem when it may (`_sandbox_root`), then runs every test in a forked child with resource limits
and lower privileges, and writes the results (JSON) to stdout.

In a mount namespace (as root there) it first switches to a new root that holds only what a program needs —
the interpreter, its standard library, its shared libraries and the allow-listed packages, all read-only —
with a fresh size-limited tmpfs on every writable place (``/tmp``, the working directory ``/tmp/work``;
``/var/tmp``, ``/dev/shm``, ``/run/lock``, ``/run/user`` and every other world-writable mount point of the
machine): no other file of the host is visible and nothing written outlives the run
(`_sandbox_root.private_filesystem`).

A test: its own directory (``test<i>-<random>`` in the work folder, made with ``mkdir`` and entered by descriptor), its
own process group, stdin/stdout/stderr on anonymous memory files (``memfd_create``) made by the runner before
the test starts — the runner never opens a file by name on the program's side, so no link a program plants
is ever followed with the runner's privileges; rlimits on CPU time, address space, file size (= output cap), open files, processes, core dumps (the whole
tree's memory and processes are bounded by the caller's cgroup, `vlrl.rewards.sandbox_bounds`); uid/gid
dropped to ``drop_uid`` (a user of this run's own) when running as root; sockets disabled when the caller could not cut the network
with a namespace. It runs the program as ``__main__``, then the test's assert code (if any) in the same
namespace, then copies a nonce from one pipe to another: exiting early (``sys.exit(0)``, ``os._exit(0)``)
does not fake a pass.
"""

import builtins
import ctypes
import errno
import fcntl
import json
import math
import os
import resource
import secrets
import select
import signal
import sys
import time
import traceback

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
_libc = ctypes.CDLL(None, use_errno=True)


def main() -> None:
    job = json.loads(sys.stdin.buffer.read())
    result_fd = os.dup(1)
    os.set_inheritable(result_fd, False)
    _die_with_parent()
    _oom_score(-1000)  # the run's memory bound kills a test's process, never the runner (as root; else no-op)
    if job["mount_tmpfs"]:
        error = _load_sibling("_sandbox_root").private_filesystem(job)
        if error is not None:  # never run a program on a half-built filesystem
            _write(result_fd, {"mounted": False, "error": error, "results": []})
            return
    elif job["drop_uid"] is not None:
        _preload(job.get("packages", []))  # the test user may not reach the interpreter's files: import them now
    deadline = time.monotonic() + job["budget_seconds"]
    results = []
    for i, test in enumerate(job["tests"]):
        remaining = deadline - time.monotonic()
        if remaining <= 0.05:
            results.append({"status": "not_run", "stdout": "", "stderr": "sandbox time budget used up", "seconds": 0.0})
            continue
        results.append(_run_test(job, i, test, min(job["wall_seconds"], remaining)))
    _write(result_fd, {"mounted": job["mount_tmpfs"], "results": results})


def _load_sibling(name: str):
    """The stdlib-only module ``name`` beside this file, loaded by path (``python -I`` puts no folder of ours on
    ``sys.path``, and nothing is added to it: the programs under test inherit this interpreter)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write(fd: int, result: dict) -> None:
    view = memoryview(json.dumps(result).encode())
    while view:
        view = view[os.write(fd, view):]


def _die_with_parent() -> None:
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    _libc.prctl(PR_SET_CHILD_SUBREAPER, 1)  # orphans of a test become ours, so we can kill them


def _oom_score(value: int) -> None:
    """Set this process's ``oom_score_adj`` where allowed (raising it always is; lowering it needs root)."""
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write(str(value))
    except OSError:
        pass


def _preload(packages: list) -> None:
    """Import the usual standard modules and the allow-listed packages before the test user takes over (rlimit-only
    mode as root: the interpreter may live where ``nobody`` cannot read, e.g. under /root)."""
    import importlib

    for name in (*packages, "socket", "contextvars", "collections", "heapq", "bisect", "itertools", "functools", "math", "re", "string",
                 "json", "random", "fractions", "decimal", "typing", "dataclasses", "copy", "operator",
                 "statistics", "array", "datetime", "io", "time"):
        try:
            importlib.import_module(name)
        except ImportError:
            pass


def _run_test(job: dict, i: int, test: dict, wall: float) -> dict:
    """Run test ``i``; never raises: what the runner cannot set up (a broken work folder) is status ``error``."""
    fds: list[int] = []
    try:
        try:
            fds.append(_test_directory(job, i))
        except OSError as err:
            return _error(f"the work folder is unusable ({err.strerror or err}): test {i} not run")
        fds += _streams(test.get("stdin", ""))
        return _run_in(job, test, wall, *fds)
    except Exception as err:  # a harness failure on one test must not lose the others  # noqa: BLE001
        return _error(f"harness error on test {i}: {type(err).__name__}: {err}")
    finally:
        for fd in fds:
            os.close(fd)


def _error(message: str) -> dict:
    return {"status": "error", "stdout": "", "stderr": f"vlrl sandbox: {message}", "seconds": 0.0}


def _test_directory(job: dict, i: int) -> int:
    """A new directory ``test<i>-<random>`` in the work folder (the runner's cwd), opened without following links
    and given to the test user; its descriptor. ``mkdir`` fails on anything already there (never follows a link);
    the random part keeps an earlier test (in ``user`` mode it may write the work folder) from planting it."""
    name = f"test{i}-{secrets.token_hex(6)}"
    os.mkdir(name, 0o700)
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if job["drop_uid"] is not None and os.geteuid() == 0:
            os.fchown(fd, job["drop_uid"], job["drop_uid"])
    except OSError:
        os.close(fd)
        raise
    return fd


def _streams(stdin: str) -> list[int]:
    """(stdin, stdout, stderr) of a test: anonymous memory files, stdin filled and sealed against writes."""
    fds = []
    try:
        fds.append(os.memfd_create("stdin", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING))
        view = memoryview(stdin.encode("utf-8", "replace"))
        while view:
            view = view[os.write(fds[0], view):]
        os.lseek(fds[0], 0, os.SEEK_SET)
        try:
            fcntl.fcntl(fds[0], fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK
                        | fcntl.F_SEAL_SEAL)
        except (AttributeError, OSError):
            pass  # an old kernel: the test could rewrite its own stdin, nothing more
        fds.append(os.memfd_create("stdout", os.MFD_CLOEXEC))
        fds.append(os.memfd_create("stderr", os.MFD_CLOEXEC))
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds


def _run_in(job: dict, test: dict, wall: float, directory: int, stdin: int, stdout: int, stderr: int) -> dict:
    nonce = secrets.token_hex(16).encode()
    marker_r, marker_w = os.pipe()
    nonce_r, nonce_w = os.pipe()
    os.write(nonce_w, nonce)
    os.close(nonce_w)
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        try:
            _child(job, test, (directory, stdin, stdout, stderr), marker_w, nonce_r)
        except BaseException:  # a harness error, not the program's: say so on the test's stderr  # noqa: BLE001
            os.write(2, f"vlrl sandbox harness error:\n{traceback.format_exc()}".encode())
        finally:
            os._exit(70)
    os.close(marker_w)
    os.close(nonce_r)
    timed_out = not _wait(pid, wall)
    for sig_target in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
        try:
            sig_target()  # the test's whole process group: forked helpers die with it
        except OSError:
            pass
    _, status = os.waitpid(pid, 0)
    seconds = time.monotonic() - start
    os.set_blocking(marker_r, False)  # a forked helper may still hold the write end: do not wait for EOF
    marker = _read_all(marker_r, 64)
    os.close(marker_r)
    _kill_orphans()
    out = _read_memory_file(stdout, job["output_bytes"])
    err = _read_memory_file(stderr, 4096)
    if timed_out:
        state = "timeout"
    elif os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        state = {signal.SIGXCPU: "timeout", signal.SIGXFSZ: "output_limit"}.get(sig, f"signal {sig}")
    elif os.WEXITSTATUS(status) == 0 and marker == nonce:
        state = "ok"
    else:
        state = f"exit {os.WEXITSTATUS(status)}"
    return {"status": state, "stdout": out, "stderr": err, "seconds": round(seconds, 4)}


def _wait(pid: int, wall: float) -> bool:
    """True if the child exited within ``wall`` seconds (it is not reaped here)."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        fd = None
    if fd is not None:
        try:
            ready, _, _ = select.select([fd], [], [], wall)
            return bool(ready)
        finally:
            os.close(fd)
    end = time.monotonic() + wall
    while time.monotonic() < end:
        if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
            return True
        time.sleep(0.005)
    return False


def _kill_orphans() -> None:
    """Kill every remaining descendant (a test's helpers that left its process group), then reap them.

    Orphans are re-parented to us (child subreaper, or PID 1 of the namespace). In a PID namespace /proc
    has been remounted for it; anything missed still dies with the namespace when we exit.
    """
    while True:
        try:
            with open(f"/proc/self/task/{os.getpid()}/children") as f:
                children = [int(p) for p in f.read().split()]
        except (OSError, ValueError):
            break
        if not children:
            break
        for child in children:
            try:
                os.kill(child, signal.SIGKILL)
            except OSError:
                pass
        _reap()
    _reap()


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _read_all(fd: int, limit: int) -> bytes:
    chunks, size = [], 0
    while size < limit:
        try:
            chunk = os.read(fd, limit - size)
        except OSError:
            break
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def _read_memory_file(fd: int, limit: int) -> str:
    """The first ``limit`` bytes a test wrote to its stdout / stderr (by descriptor, from offset 0)."""
    chunks, size = [], 0
    while size < limit:
        try:
            chunk = os.pread(fd, limit - size, size)
        except OSError:
            break
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks).decode("utf-8", "replace")


def _child(job: dict, test: dict, fds: tuple[int, int, int, int], marker_w: int, nonce_r: int) -> None:
    """The forked test process: descriptors only — the test directory (entered with ``fchdir``) and the three
    memory files made by the runner — so nothing here opens a path the program could have planted."""
    os.setpgid(0, 0)
    directory, streams = fds[0], fds[1:]
    os.fchdir(directory)
    for target, fd in enumerate(streams):
        os.dup2(fd, target)
    os.dup2(marker_w, 3)
    os.dup2(nonce_r, 4)
    os.closerange(5, 65536)
    os.environ["HOME"] = os.environ["TMPDIR"] = os.getcwd()
    _oom_score(1000)  # the first process the run's memory bound kills
    _limit(job)
    _drop_privileges(job)
    if job["block_network"]:
        _block_sockets()
    sys.stdin = open(0, encoding="utf-8", errors="replace", closefd=False)
    sys.stdout = open(1, "w", encoding="utf-8", closefd=False)
    sys.stderr = open(2, "w", encoding="utf-8", closefd=False)
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    if not _execute(job["source"], "solution.py", namespace, allow_exit=True):
        _finish(1)
    if test.get("assert") and not _execute(test["assert"], "tests.py", namespace, allow_exit=False):
        _finish(1)
    _flush()
    os.write(3, os.read(4, 64))
    _finish(0)


def _execute(source: str, filename: str, namespace: dict, *, allow_exit: bool) -> bool:
    try:
        exec(compile(source, filename, "exec"), namespace)
    except SystemExit as err:
        if allow_exit and err.code in (None, 0):
            return True
        print(f"SystemExit({err.code!r})", file=sys.stderr)
        return False
    except BaseException:  # the program's own error: report it like Python would  # noqa: BLE001
        traceback.print_exc()
        return False
    return True


def _limit(job: dict) -> None:
    cpu = max(1, math.ceil(job["cpu_seconds"]))
    limits = [(resource.RLIMIT_CPU, cpu, cpu + 1), (resource.RLIMIT_AS, job["memory_bytes"], job["memory_bytes"]),
              (resource.RLIMIT_FSIZE, job["output_bytes"], job["output_bytes"]), (resource.RLIMIT_NOFILE, 64, 64),
              (resource.RLIMIT_CORE, 0, 0)]
    limits.append((resource.RLIMIT_NPROC, job["processes"], job["processes"]))  # the kernel exempts real root
    for kind, soft, hard in limits:
        try:
            resource.setrlimit(kind, (soft, hard))
        except (ValueError, OSError):
            pass


def _drop_privileges(job: dict) -> None:
    """As root: become ``drop_uid`` (no groups). A failure raises (the test fails as a harness error): a program
    never runs with privileges it was meant to lose."""
    if job["drop_uid"] is None or os.geteuid() != 0:
        return
    os.setgroups([])
    os.setgid(job["drop_uid"])
    os.setuid(job["drop_uid"])
    if os.geteuid() != job["drop_uid"] or os.getegid() != job["drop_uid"]:
        raise OSError(errno.EPERM, f"still uid {os.geteuid()} after setuid({job['drop_uid']})")


def _block_sockets() -> None:
    """Weak fallback when no network namespace is available: the socket module refuses to work."""
    import socket

    def refuse(*args, **kwargs):
        raise PermissionError("network access is disabled in the vlrl sandbox")

    class NoSocket(socket.socket):
        def __init__(self, *args, **kwargs):
            refuse()

    socket.socket = NoSocket
    for name in ("create_connection", "create_server", "socketpair", "getaddrinfo", "fromfd"):
        setattr(socket, name, refuse)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass


def _finish(code: int) -> None:
    _flush()
    os._exit(code)


if __name__ == "__main__":
    main()
