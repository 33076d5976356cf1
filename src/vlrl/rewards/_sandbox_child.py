"""Sandbox runner: executed as ``python -I _sandbox_child.py`` by `vlrl.rewards.sandbox`, never imported.

Standard library only (it runs in isolated mode, maybe in fresh namespaces). It reads one job (JSON) from
stdin, mounts a size-limited tmpfs on its working directory when it may, then runs every test in a forked
child with resource limits and lower privileges, and writes the results (JSON) to stdout.

In a mount namespace (as root there) it first mounts fresh size-limited tmpfs on ``/tmp`` (the working
directory is ``/tmp/work``), ``/var/tmp`` and ``/dev/shm``, so a test can write nowhere that outlives
it; and if the interpreter lives under a directory the test user cannot enter (e.g. ``/root/.pyenv``), it
covers that directory with a tmpfs holding only a bind mount of the interpreter's tree (which also hides
the rest of it).

A test child: its own process group; stdin/stdout/stderr redirected to files in the working directory;
rlimits on CPU time, address space, file size (= output cap), open files, processes, core dumps; uid/gid
dropped to ``drop_uid`` when running as root; sockets disabled when the caller could not cut the network
with a namespace. It runs the program as ``__main__``, then the test's assert code (if any) in the same
namespace, then copies a nonce from one pipe to another: exiting early (``sys.exit(0)``, ``os._exit(0)``)
does not fake a pass.
"""

import builtins
import ctypes
import errno
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
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MNT_DETACH = 1, 2, 4, 8, 32, 4096, 16384, 2
_libc = ctypes.CDLL(None, use_errno=True)


def main() -> None:
    job = json.loads(sys.stdin.buffer.read())
    result_fd = os.dup(1)
    os.set_inheritable(result_fd, False)
    _die_with_parent()
    mounted = _private_filesystem(job) if job["mount_tmpfs"] else False
    if job["drop_uid"] is not None and not mounted:
        _preload()  # the test user may not reach the interpreter's files: import the usual ones now
    deadline = time.monotonic() + job["budget_seconds"]
    results = []
    for i, test in enumerate(job["tests"]):
        remaining = deadline - time.monotonic()
        if remaining <= 0.05:
            results.append({"status": "not_run", "stdout": "", "stderr": "sandbox time budget used up", "seconds": 0.0})
            continue
        results.append(_run_test(job, i, test, min(job["wall_seconds"], remaining)))
    payload = json.dumps({"mounted": mounted, "results": results}).encode()
    view = memoryview(payload)
    while view:
        view = view[os.write(result_fd, view):]


def _die_with_parent() -> None:
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    _libc.prctl(PR_SET_CHILD_SUBREAPER, 1)  # orphans of a test become ours, so we can kill them


def _preload() -> None:
    import importlib

    for name in ("socket", "collections", "heapq", "bisect", "itertools", "functools", "math", "re", "string",
                 "json", "random", "fractions", "decimal", "typing", "dataclasses", "copy", "operator",
                 "statistics", "array", "datetime", "io", "time"):
        try:
            importlib.import_module(name)
        except ImportError:
            pass


def _mount(source: str, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    if _libc.mount(source.encode(), target.encode(), fstype.encode() if fstype else None, flags,
                   data.encode() if data else None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {target}: {os.strerror(err)}")


def _private_filesystem(job: dict) -> bool:
    """Fresh tmpfs on /tmp, /var/tmp, /dev/shm; the interpreter reachable by the test user; cwd /tmp/work."""
    try:
        interpreter = [sys.base_prefix, sys.prefix, *[p for p in sys.path if os.path.exists(p)]]
        for path, size in (("/tmp", job["disk_bytes"]), ("/var/tmp", 1 << 20), ("/dev/shm", 1 << 20)):
            if os.path.isdir(path):
                _fresh_tmpfs(path, size, keep=interpreter)
        if job["drop_uid"] is not None:
            _expose(interpreter, stash="/tmp/.stash")
        _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)  # this PID namespace's processes only
    except OSError:
        return False
    os.mkdir("/tmp/work", 0o777)
    os.chmod("/tmp/work", 0o777)
    os.chdir("/tmp/work")
    return True


def _fresh_tmpfs(path: str, size: int, *, keep: list[str]) -> None:
    """An empty tmpfs on ``path``, except that the entries of ``path`` holding any of ``keep`` (the interpreter,
    e.g. a virtualenv under /tmp) are bind-mounted back, read-only, from the covered directory (reached through
    a file descriptor opened before the mount)."""
    root = os.path.realpath(path)
    names = {os.path.relpath(os.path.realpath(p), root).split(os.sep)[0] for p in keep
             if os.path.realpath(p).startswith(root + os.sep)}
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size},mode=1777")
        for name in sorted(names):
            target = f"{root}/{name}"
            os.mkdir(target)
            _mount(f"/proc/self/fd/{fd}/{name}", target, None, MS_BIND | MS_REC)
            _mount("none", target, None, MS_REMOUNT | MS_BIND | MS_RDONLY)
    finally:
        os.close(fd)


def _expose(paths: list[str], stash: str) -> None:
    """Make each path reachable by an unprivileged user: a directory on its way that others cannot enter
    is covered by a tmpfs (mode 0755) holding bind mounts of just the entries those paths need."""
    needed: dict[str, set[str]] = {}
    for path in paths:
        parts = os.path.realpath(path).strip("/").split("/")
        for depth in range(1, len(parts)):
            ancestor = "/" + "/".join(parts[:depth])
            if not os.stat(ancestor).st_mode & 0o001:
                needed.setdefault(ancestor, set()).add(parts[depth])
                break
    if not needed:
        return
    os.mkdir(stash, 0o700)
    for k, (ancestor, entries) in enumerate(sorted(needed.items())):
        for name in entries:
            os.mkdir(f"{stash}/{k}-{name}")
            _mount(f"{ancestor}/{name}", f"{stash}/{k}-{name}", None, MS_BIND | MS_REC)
        _mount("tmpfs", ancestor, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=0755")
        for name in entries:
            os.mkdir(f"{ancestor}/{name}")
            _mount(f"{stash}/{k}-{name}", f"{ancestor}/{name}", None, MS_BIND | MS_REC)
            _libc.umount2(f"{stash}/{k}-{name}".encode(), MNT_DETACH)
            os.rmdir(f"{stash}/{k}-{name}")
    os.rmdir(stash)


def _run_test(job: dict, i: int, test: dict, wall: float) -> dict:
    paths = {name: f"{name}{i}" for name in ("in", "out", "err")}  # relative: cwd may be a covered path
    with open(paths["in"], "w", encoding="utf-8") as f:
        f.write(test.get("stdin", ""))
    nonce = secrets.token_hex(16).encode()
    marker_r, marker_w = os.pipe()
    nonce_r, nonce_w = os.pipe()
    os.write(nonce_w, nonce)
    os.close(nonce_w)
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        try:
            _child(job, test, paths, marker_w, nonce_r)
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
    stdout = _read_file(paths["out"], job["output_bytes"])
    stderr = _read_file(paths["err"], 4096)
    if timed_out:
        state = "timeout"
    elif os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        state = {signal.SIGXCPU: "timeout", signal.SIGXFSZ: "output_limit"}.get(sig, f"signal {sig}")
    elif os.WEXITSTATUS(status) == 0 and marker == nonce:
        state = "ok"
    else:
        state = f"exit {os.WEXITSTATUS(status)}"
    return {"status": state, "stdout": stdout, "stderr": stderr, "seconds": round(seconds, 4)}


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


def _read_file(path: str, limit: int) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(limit).decode("utf-8", "replace")
    except OSError:
        return ""


def _child(job: dict, test: dict, paths: dict, marker_w: int, nonce_r: int) -> None:
    os.setpgid(0, 0)
    fds = [os.open(paths["in"], os.O_RDONLY),
           os.open(paths["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666),
           os.open(paths["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)]
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    os.dup2(marker_w, 3)
    os.dup2(nonce_r, 4)
    os.closerange(5, 65536)
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
    if job["drop_uid"] is None or os.geteuid() != 0:
        return
    try:
        os.setgroups([])
        os.setgid(job["drop_uid"])
        os.setuid(job["drop_uid"])
    except OSError as err:
        if err.errno not in (errno.EINVAL, errno.EPERM):
            raise


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
