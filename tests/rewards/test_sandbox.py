import contextlib
import json
import os
import re
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


def _here() -> str:
    """The mode the default setting obtains here; "none" where namespaces are refused (then tests ask for none)."""
    from vlrl.rewards.sandbox import SandboxUnavailable

    try:
        return isolation("namespaces")
    except SandboxUnavailable:
        return "none"


@pytest.mark.parametrize("mode", sorted({_here(), "none"}))
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
        assert int(uid) >= 1 << 30 and re.fullmatch("/tmp/work/test0-[0-9a-f]{12}", cwd) and int(processes) <= 3  # runner, test (and maybe a zombie)
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


# ----------------------------------------------------------------------------------------------- links and isolation (issue 38)
PLANT = """
import json, os, sys
stdin = sys.stdin.read()
if stdin == "plant":  # every name the runner or the test child used to open, here and in the folder above
    for folder in (".", ".."):
        for name, target in {targets!r}.items():
            for index in (1, 2):
                try:
                    os.symlink(target, os.path.join(folder, name + str(index)))
                except OSError:
                    pass
        for name in ("test1", "test2"):
            try:
                os.symlink({victim!r}, os.path.join(folder, name))
            except OSError:
                pass
elif stdin == "report":
    seen = {{}}
    for name, target in {targets!r}.items():
        try:
            st = os.stat(target)
            seen[name] = [st.st_uid, open(target).read()]
        except OSError:
            seen[name] = None
    print(json.dumps(seen))
else:
    print("read", stdin)
"""


@pytest.mark.parametrize("mode", ["none", *NAMESPACED])
def test_the_runner_never_writes_through_a_link_the_program_plants(mode, tmp_path):
    """Issue 38, finding 1: a program planted `in1` → any file; the runner (root) wrote the next test's stdin through
    it (a host sysctl changed), and the child opened `out1` / `err1` as root before dropping privileges. Here the
    targets are a file only root may write and names in a root-only folder (rlimit-only mode: on the host; namespaced
    modes: in the sandbox's own /tmp, where a root-owned file can only appear if the runner followed the link). The
    test after the planting runs normally; nothing is written or created through the links."""
    if mode == "none":
        private = tmp_path / "root-only"
        private.mkdir(mode=0o700)
        victim = tmp_path / "victim"
        victim.write_text("original")
        victim.chmod(0o644)
        targets = {"in": str(victim), "out": str(private / "out"), "err": str(private / "err")}
    else:
        victim = None
        targets = {"in": "/tmp/witness-in", "out": "/tmp/witness-out", "err": "/tmp/witness-err"}
    source = PLANT.format(targets=targets, victim=str(victim or "/tmp/witness-in"))
    runs = run_python(source, [{"stdin": "plant"}, {"stdin": "written-as-root"}, {"stdin": "report"}], FAST, mode=mode)
    assert [r.status for r in runs] == ["ok", "ok", "ok"], runs
    assert runs[1].stdout == "read written-as-root\n"
    if mode == "none":
        assert victim.read_text() == "original" and sorted(os.listdir(private)) == []
    else:
        assert json.loads(runs[2].stdout) == {"in": None, "out": None, "err": None}, runs[2].stdout


@pytest.mark.parametrize("mode", ["none", *NAMESPACED])
def test_a_program_that_breaks_the_work_folder_scores_zero_and_never_raises(mode):
    """Issue 38, finding 1: a program that made `in1` a directory crashed the runner, so `code` raised instead of
    scoring 0. Now whatever a program makes of its folder (and of the folder above, where it may write at all:
    in `user` mode it shares the runner's uid), the run returns one result per test: later tests run, or fail with
    status `error` saying why — never an exception."""
    source = """
import os, sys
if sys.stdin.read() == "break":
    for folder in (".", ".."):
        for name in ("in1", "out1", "err1", "test1", "test2"):
            try:
                os.mkdir(os.path.join(folder, name), 0)
            except OSError:
                pass
    try:
        os.chmod("..", 0)
    except OSError:
        pass
print("fine")
"""
    runs = run_python(source, [{"stdin": "break"}, {"stdin": ""}, {"stdin": ""}], FAST, mode=mode)
    assert len(runs) == 3 and runs[0].ok
    for run in runs[1:]:
        assert run.ok and run.stdout == "fine\n" or run.status == "error" and "work folder" in run.stderr, run


def _failing_unshare(tmp_path) -> dict:
    """The environment of a machine where `unshare` fails (many containers, hardened clusters): a fake one first
    on PATH that exits 1."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "unshare").write_text("#!/bin/sh\necho 'unshare: unshare failed: Operation not permitted' >&2\nexit 1\n")
    (fake / "unshare").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "VLRL_SANDBOX_ISOLATION"}
    return {**env, "PATH": f"{fake}:{env['PATH']}", "PYTHONPATH": str(Path(vlrl.__file__).parents[1])}


def test_when_unshare_fails_the_code_reward_refuses_instead_of_running_unisolated(tmp_path):
    """Issue 38, finding 2 (its reproduction, in a fresh process): with a failing `unshare` first on PATH the `code`
    reward ran the program with no isolation — it read the project's README and scored 1.0. Now it refuses, naming
    the cause and the setting; only an explicit `none` runs it (rlimits only, as asked)."""
    import tempfile

    public = Path(tempfile.mkdtemp(prefix="vlrl-readme-"))  # world-readable, like a checkout's README
    public.chmod(0o755)
    readme = public / "README.md"
    readme.write_text("# vlrl\n")
    readme.chmod(0o644)
    program, tests = f"print(open({str(readme)!r}).read(6))", '[{"input":"","output":"# vlrl"}]'
    script = f"from vlrl.rewards import get_reward as g; print(g('code')({program!r}, {tests!r}).overall)"
    env = _failing_unshare(tmp_path)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode != 0 and done.stdout == "", done.stdout
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("vlrl.rewards.sandbox.SandboxUnavailable: the code sandbox cannot have isolation "
                           "'namespaces' here"), last
    assert "exited 1: unshare: unshare failed: Operation not permitted" in last and "sandbox.isolation=none" in last
    try:
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                              env={**env, "VLRL_SANDBOX_ISOLATION": "none"})
    finally:
        readme.unlink()
        public.rmdir()
    assert done.returncode == 0 and done.stdout.strip() == "1.0", done.stderr  # what `none` means: it can read files


def test_isolation_follows_the_setting_and_never_weakens_it(monkeypatch):
    from vlrl.rewards.sandbox import SandboxUnavailable, report_isolation

    assert isolation("none") == "none"
    monkeypatch.setenv("VLRL_SANDBOX_ISOLATION", "none")
    assert report_isolation() == {"setting": "none", "isolation": "none", "description": report_isolation()["description"],
                                  "tree_bound": report_isolation()["tree_bound"]}
    monkeypatch.setenv("VLRL_SANDBOX_ISOLATION", "chroot")
    with pytest.raises(SandboxUnavailable, match="expected one of namespaces, root, user, none"):
        isolation()
    monkeypatch.setenv("PATH", "/nonexistent")  # no unshare at all
    with pytest.raises(SandboxUnavailable, match=r"cannot have isolation 'namespaces' here \(.*no `unshare` on PATH"):
        isolation("namespaces")
