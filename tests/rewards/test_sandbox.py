import json
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


def test_a_fresh_tmpfs_keeps_the_interpreter_reachable(tmp_path):
    """A virtualenv under /tmp (a CI clone there) must survive the sandbox's private /tmp: `_fresh_tmpfs` covers
    a directory with an empty tmpfs but binds back, read-only, the entries holding the interpreter. Checked in a
    private mount namespace on a directory of our own (``unshare --mount`` as in the sandbox's namespaced modes)."""
    mode = isolation()
    assert mode in ("root", "user", "none")
    if mode == "none":  # no namespaces on this machine: the function is never called (mount_tmpfs is off)
        return
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "python").write_text("interpreter")
    (tmp_path / "secret.txt").write_text("hidden")
    script = f"""
import json, os, sys
sys.path.insert(0, {str(Path(vlrl.__file__).resolve().parents[1])!r})
from vlrl.rewards._sandbox_child import _fresh_tmpfs
root = {str(tmp_path)!r}
_fresh_tmpfs(root, 1 << 20, keep=[root + "/venv/bin"])
try:
    open(root + "/venv/new", "w")
    writable = True
except OSError:
    writable = False
print(json.dumps({{"listing": sorted(os.listdir(root)), "kept": open(root + "/venv/bin/python").read(),
                  "writable": writable}}))
"""
    user = ["--user", "--map-root-user"] if mode == "user" else []
    out = subprocess.run(["unshare", *user, "--mount", "--", sys.executable, "-c", script], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    assert seen == {"listing": ["venv"], "kept": "interpreter", "writable": False}
    assert (tmp_path / "secret.txt").read_text() == "hidden"  # outside the namespace nothing changed

