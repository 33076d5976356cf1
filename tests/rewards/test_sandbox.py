import contextlib
import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

import vlrl
from vlrl.rewards.sandbox import SandboxLimits, isolation, run_python

FAST = SandboxLimits(cpu_seconds=1, wall_seconds=1.0, total_seconds=5)


def test_isolation_is_probed():
    assert isolation() in ("root", "user", "none")


def test_stdin_and_assert_tests():
    runs = run_python("a, b = map(int, input().split())\nprint(a + b)", [{"stdin": "1 2\n"}, {"stdin": "x\n"}], FAST)
    assert runs[0].ok and runs[0].stdout == "3\n"
    assert runs[1].status == "exit 1" and "ValueError" in runs[1].stderr
    runs = run_python("def add(a, b):\n    return a + b", [{"assert": "assert add(1, 2) == 3"},
                                                           {"assert": "assert add(1, 2) == 4"}], FAST)
    assert [r.ok for r in runs] == [True, False]


@pytest.mark.parametrize("mode", sorted({isolation(), "none"}))
def test_hostile_programs_are_contained(mode):
    cases = {
        "import time\ntime.sleep(100)": "timeout",
        "while True:\n    pass": "timeout",
        "import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=2)": "exit 1",
        "import os\nos._exit(0)": "exit 0",  # exit status 0 but the harness never finished: not ok
    }
    for source, status in cases.items():
        start = time.perf_counter()
        (run,) = run_python(source, [{"stdin": ""}], FAST, mode=mode)
        assert run.status == status, (source, run)
        assert time.perf_counter() - start < FAST.total_seconds + 1


def test_escaped_helper_does_not_hold_the_run():
    # the program forks a helper that leaves its process group and sleeps: the test still ends at once
    source = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(100)\nprint('done')"
    start = time.perf_counter()
    (run,) = run_python(source, [{"stdin": ""}], FAST)
    assert run.ok and run.stdout == "done\n" and time.perf_counter() - start < 4  # not the 100 s sleep


def test_namespaced_sandbox_hides_the_machine():
    source = "import os\nprint(os.getuid(), os.getcwd(), len([p for p in os.listdir('/proc') if p.isdigit()]))"
    (run,) = run_python(source, [{"stdin": ""}], FAST)
    if isolation() == "root":  # as root here (and in CI): a user of its own, its own /tmp and /proc
        uid, cwd, processes = run.stdout.split()
        assert (uid, cwd) == ("65534", "/tmp/work") and int(processes) <= 3  # runner, test (and maybe a zombie)
    else:  # without root there is no uid to drop to; the run still works
        assert run.ok


# ----------------------------------------------------------------------------------------------- filesystem (issue 22)
PSEUDO_FS = {"proc", "sysfs", "cgroup", "cgroup2", "devpts", "mqueue", "debugfs", "tracefs", "securityfs", "pstore",
             "bpf", "configfs", "fusectl", "binfmt_misc", "autofs", "efivarfs", "nsfs"}


def _namespaced_modes():
    """The namespaced isolation modes that work on this machine (root: both; CI runs as root)."""
    from vlrl.rewards.sandbox import _unshare

    modes = []
    for mode in ("root", "user") if os.geteuid() == 0 else ("user",):
        if subprocess.run([*_unshare(mode), "true"], capture_output=True, timeout=10).returncode == 0:
            modes.append(mode)
    return modes


NAMESPACED = _namespaced_modes()


def _host_places_to_try():
    """Every directory a sandboxed program could hope to write to, seen from outside: every mount point (pseudo
    filesystems aside), every world-writable or nobody-owned directory down to depth 4 of each mount, and every
    directory the sandbox binds from the host (the interpreter's, the standard library's, the loaded libraries')."""
    import sysconfig

    places = set()
    with open("/proc/self/mountinfo") as f:
        mounts = [(line.split()[4].encode().decode("unicode_escape"), line.split(" - ")[1].split()[0]) for line in f]
    for point, fstype in mounts:
        if fstype in PSEUDO_FS or point.startswith(("/proc", "/sys")) or not os.path.isdir(point):
            continue
        places.add(point)
        device = os.stat(point).st_dev
        for root, dirs, _ in os.walk(point):
            depth = root.rstrip("/").count("/") - point.rstrip("/").count("/")
            kept = []
            for name in dirs:
                path = os.path.join(root, name)
                try:
                    st = os.lstat(path)
                except OSError:
                    continue
                if not stat.S_ISDIR(st.st_mode) or st.st_dev != device:
                    continue  # a symlink, or another mount (walked on its own)
                if st.st_mode & 0o002 or st.st_uid == 65534:
                    places.add(path)
                if depth < 3:
                    kept.append(name)
            dirs[:] = kept
    with open("/proc/self/maps") as f:
        loaded = {line.split(maxsplit=5)[5].strip() for line in f if len(line.split(maxsplit=5)) == 6}
    places |= {os.path.dirname(os.path.realpath(p)) for p in loaded if p.startswith("/")}
    places |= {sys.prefix, sys.base_prefix, os.path.dirname(sys.executable), *sysconfig.get_paths().values(), "/", "/etc",
               "/root", "/home", "/work", os.getcwd()}
    return sorted(p for p in places if os.path.isdir(p))


@pytest.mark.skipif(not NAMESPACED, reason="no namespaces here: the rlimit-only fallback has no filesystem isolation")
@pytest.mark.parametrize("mode", NAMESPACED)
def test_the_program_cannot_create_a_file_anywhere_on_the_host(mode):
    """Issue 22: /run/lock (world-writable, on the host's root) was not covered — a sandboxed program left 30 MB
    there. Now every place is tried from inside (create a 1 MB file and a directory); writes may succeed only in
    the sandbox's private tmpfs, and afterwards the host holds none of them."""
    places = _host_places_to_try()
    assert "/run/lock" in places or not os.path.isdir("/run/lock")
    name = f"vlrl-probe-{os.getpid()}-{mode}"
    source = f"""
import json, os
written = []
for place in {places!r}:
    try:
        with open(os.path.join(place, {name!r}), "wb") as f:
            f.write(b"x" * (1 << 20))
        written.append(place)
    except OSError:
        pass
    try:
        os.mkdir(os.path.join(place, {name!r} + ".d"))
        written.append(place + "/")
    except OSError:
        pass
print(json.dumps(written))
"""
    try:
        (run,) = run_python(source, [{"stdin": ""}], SandboxLimits(cpu_seconds=5, wall_seconds=10, total_seconds=20,
                                                                   output_bytes=4 << 20), mode=mode)
        left = [p for p in places if os.path.lexists(os.path.join(p, name)) or os.path.lexists(os.path.join(p, name + ".d"))]
    finally:  # a broken sandbox must not leave its probes behind
        for place in places:
            with contextlib.suppress(OSError):
                os.remove(os.path.join(place, name))
            with contextlib.suppress(OSError):
                os.rmdir(os.path.join(place, name + ".d"))
    assert run.ok, run
    written = json.loads(run.stdout)
    assert "/tmp" in written and "/run/lock" in written  # the program ran and wrote — into its private tmpfs
    assert left == [], f"the sandbox wrote to the host: {left}"


@pytest.mark.skipif(not NAMESPACED, reason="no namespaces here: the rlimit-only fallback has no filesystem isolation")
def test_files_next_to_the_interpreter_and_in_etc_are_not_readable(tmp_path):
    """Issue 22: with the interpreter under /tmp/X, all of /tmp/X was bound into the sandbox and a program read an
    API key from a neighbouring directory; /etc/hostname was readable. Here a virtualenv under a pytest temporary
    directory runs the sandbox; a key file beside the virtualenv, a note inside it and /etc are out of reach."""
    base = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    venv = tmp_path / "venv"
    subprocess.run([base, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    (tmp_path / "key.txt").write_text("API_KEY=do-not-read")
    (venv / "notes.txt").write_text("private")
    sandbox_py = Path(vlrl.__file__).parent / "rewards" / "sandbox.py"  # stdlib only: loads without vlrl's deps
    program = f"""
import os
for path in [{str(tmp_path / 'key.txt')!r}, {str(venv / 'notes.txt')!r}, "/etc/hostname", "/etc/passwd"]:
    try:
        print("read", path, open(path).read())
    except OSError:
        print("unreadable", path)
print(sorted(os.listdir({str(tmp_path)!r})))
"""
    driver = f"""
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("vlrl_sandbox", {str(sandbox_py)!r})
sandbox = importlib.util.module_from_spec(spec)
sys.modules["vlrl_sandbox"] = sandbox
spec.loader.exec_module(sandbox)
(run,) = sandbox.run_python({program!r}, [{{"stdin": ""}}], sandbox.SandboxLimits(total_seconds=20, wall_seconds=10))
print(json.dumps({{"executable": sys.executable, "status": run.status, "stdout": run.stdout, "stderr": run.stderr}}))
"""
    out = subprocess.run([str(venv / "bin" / "python"), "-c", driver], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    assert seen["executable"] == str(venv / "bin" / "python") and seen["status"] == "ok", seen
    lines = seen["stdout"].splitlines()
    assert lines[:4] == [f"unreadable {tmp_path / 'key.txt'}", f"unreadable {venv / 'notes.txt'}",
                         "unreadable /etc/hostname", "unreadable /etc/passwd"], seen
    assert lines[4] == "['venv']"  # the interpreter's own directory, nothing beside it


@pytest.mark.skipif(not NAMESPACED, reason="no namespaces here: the rlimit-only fallback has no filesystem isolation")
def test_only_allow_listed_packages_are_importable():
    program = "import numpy\nprint(int(numpy.arange(4).sum()))"
    limits = SandboxLimits(cpu_seconds=5, wall_seconds=10, total_seconds=20, memory_mb=2048)
    (hidden,) = run_python(program, [{"stdin": ""}], limits)
    assert hidden.status == "exit 1" and "No module named 'numpy'" in hidden.stderr
    (allowed,) = run_python(program, [{"stdin": ""}], limits, packages=["numpy"])
    assert allowed.ok and allowed.stdout == "6\n", allowed
    stdlib = "import ssl, sqlite3, decimal, lzma, bz2, zlib, ctypes, hashlib\nprint('ok')"  # their shared libraries load
    (run,) = run_python(stdlib, [{"stdin": ""}], limits)
    assert run.ok and run.stdout == "ok\n", run
    with pytest.raises(ValueError, match="top-level module names"):
        run_python(program, [{"stdin": ""}], limits, packages=["../etc"])
