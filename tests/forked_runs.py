"""Processes of vlrl for the tests that start already imported: stand-ins for ``torchrun --standalone
--nproc_per_node N …`` and ``python -m vlrl.cli …`` run to their end (`run`), and for a `vlrl serve` process the
test stops itself (`popen`).

Each process of a real job pays ~5 CPU-s before its first line of vlrl runs (python, torch, the transformers modelling
modules, which pull in torch._dynamo, sympy and scipy), and torchrun's launcher ~2 more: ~12 CPU-s of a 2-rank job
that trains for 3-8 CPU-s — most of the cost of the suite's ~40 torchrun jobs on 2 cores (measured: the 13 files with
2-rank jobs, 907 → 442 CPU-s; test_dist_sync.py with its 10 `vlrl serve` processes, 66 → 17). Here a process per
pytest worker and import-time environment (the *zygote*, this file run as a script) imports all of that once, then
forks what each job runs; a zygote whose forked server is alive waits on it, and the next job goes to another.

A torchrun job's ranks are started as torchrun's elastic agent starts them, by a forked agent: each rank in a session
of its own, with torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, ROLE_RANK,
MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RUN_ID, TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_USE_AGENT_STORE: the agent
hosts the TCPStore the ranks rendezvous on, as torchrun's agent does), stdin from /dev/null, every rank's stdout and
stderr into the job's two streams; when one rank fails the agent stops the others (SIGTERM, then SIGKILL) and exits 1
naming the rank and its exit code or signal ("SIGABRT" included, which `train.dist_helpers.run_checked` retries on).
A plain ``python -m vlrl.cli …`` is one forked process with the caller's environment and working directory; its exit
code is the process's (a signal's: minus its number, as `subprocess` says it).

The code that runs is vlrl's own (``-m vlrl.cli …`` or a worker script, through `runpy`, as ``python`` runs them),
so what the tests assert is unchanged; what is not exercised is torchrun itself and a cold interpreter start — the
session's shared 2-rank job (tests/train/conftest.py ``two_ranks``), the runs the tests kill (tests/train/
test_resume.py, test_syn_grpo_ranks.py's ``run_killed``), test_launcher.py's torchrun-vs-Ray comparison, the
numerics and environment tests, the README's commands and the demo's end-to-end run still start real processes
(``VLRL_TEST_FORK=0`` runs every job so).

The zygote runs no tensor operation before it forks (so ``numerics: portable`` can still pin the kernels in each
process, and no OpenMP pool exists to be copied) and holds no thread (fork copies only the calling one).
"""

import json
import os
import resource
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import uuid
from pathlib import Path

PRELOAD = ("torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.checkpoint",
           "torch.distributed.tensor", "transformers", "transformers.models.qwen2.modeling_qwen2",
           "transformers.models.qwen2_vl.modeling_qwen2_vl", "peft", "safetensors.torch", "vlrl.cli.app",
           "vlrl.recipes.rl", "vlrl.recipes.sft", "vlrl.train.distributed", "vlrl.rollout.http_engine")
STOP_GRACE = 10.0  # seconds between SIGTERM and SIGKILL for the surviving ranks of a failed job


# ------------------------------------------------------------------------------------------------ the test side
# Variables read when the modules are imported (huggingface_hub's HF_HUB_OFFLINE, HF_HOME, …) or when the native
# libraries load (OpenMP, MKL): a job whose values differ from a zygote's gets a zygote of its own.
IMPORT_TIME = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TORCH", "PYTORCH_", "OMP_", "KMP_", "MKL_", "ATEN_", "ONEDNN_",
               "DNNL_", "PYTHONPATH", "PYTHONHASHSEED", "LD_")


class Zygote:
    """A pytest worker's handle on one zygote process: started at its first job, restarted after a timeout. While a
    process it spawned (`popen`) lives, it waits on that one and takes no other job (``busy``)."""

    def __init__(self, env: dict[str, str]):
        self.env = env
        self.proc: subprocess.Popen | None = None
        self.busy = False

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            from train.dist_helpers import kill_process_tree  # noqa: PLC0415 (tests/ is on sys.path)

            kill_process_tree(self.proc.pid)
            self.proc.kill()
            self.proc.wait()
        self.proc, self.busy = None, False

    def send(self, request: dict) -> None:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         env=self.env, text=True, bufsize=1)
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()

    def answer(self, timeout: float | None) -> dict | None:
        """The zygote's next answer; None when ``timeout`` passed first. RuntimeError when the zygote died."""
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            return None
        line = self.proc.stdout.readline()
        if not line:
            self.close()
            raise RuntimeError("the zygote (tests/forked_runs.py) exited")
        return json.loads(line)


class ForkedProcess:
    """What `popen` gives for a forkable command: the parts of `subprocess.Popen` the tests use."""

    def __init__(self, zygote: Zygote, pid: int, args: list[str]):
        self.zygote, self.pid, self.args = zygote, pid, args
        self.returncode: int | None = None

    def _ended(self, timeout: float | None) -> bool:
        if self.returncode is None:
            answer = self.zygote.answer(timeout)
            if answer is None:
                return False
            self.returncode = answer["rc"]
            CPU_SECONDS[0] += answer["cpu"]
            self.zygote.busy = False
        return True

    def poll(self) -> int | None:
        self._ended(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


_ZYGOTES: dict[frozenset, list[Zygote]] = {}
_LOCK = threading.Lock()
CPU_SECONDS = [0.0]  # every forked job's CPU time in this pytest worker (tests/conftest.py adds it to a test's)


def _idle_zygote(env: dict[str, str]) -> Zygote:
    """An idle zygote started with ``env``'s import-time variables (a new one if every such zygote is busy)."""
    pool = _ZYGOTES.setdefault(frozenset((k, v) for k, v in env.items() if k.startswith(IMPORT_TIME)), [])
    for zygote in pool:
        if not zygote.busy:
            return zygote
    pool.append(Zygote(env))
    return pool[-1]


def forkable(cmd: list[str]) -> tuple[int, list[str]] | None:
    """(ranks, target) of a command the zygote can run: ``python -m torch.distributed.run --standalone
    --nproc_per_node=N …`` (`train.dist_helpers.torchrun`'s) → (N, …), ``python -m vlrl.cli …`` → (0, …) (one
    process, no torchrun environment); None for any other command, or with VLRL_TEST_FORK=0."""
    if os.environ.get("VLRL_TEST_FORK") == "0" or not cmd or cmd[0] != sys.executable:
        return None
    if cmd[1:4] == ["-m", "torch.distributed.run", "--standalone"] and cmd[4].startswith("--nproc_per_node="):
        return int(cmd[4].split("=", 1)[1]), list(cmd[5:])
    if cmd[1:3] == ["-m", "vlrl.cli"]:
        return 0, list(cmd[1:])
    return None


def run(cmd: list[str], *, env: dict[str, str] | None = None, cwd=None, timeout: float = 600
        ) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)``, on forked
    processes where the command is `forkable`."""
    env = dict(os.environ) if env is None else env
    forked = forkable(cmd)
    if forked is None:
        return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    job = uuid.uuid4().hex[:8]
    out, err = (Path(tempfile.gettempdir()) / f"forked_runs_{job}.{name}" for name in ("out", "err"))
    with _LOCK:
        zygote = _idle_zygote(env)
        zygote.send({"nproc": forked[0], "target": forked[1], "env": env, "cwd": str(cwd or os.getcwd()),
                     "stdout": str(out), "stderr": str(err), "run_id": job})
        try:
            answer = zygote.answer(timeout)
            if answer is None:
                zygote.close()
                raise subprocess.TimeoutExpired(cmd, timeout, _read(out), _read(err))
            CPU_SECONDS[0] += answer["cpu"]
            return subprocess.CompletedProcess(cmd, answer["rc"], _read(out), _read(err))
        finally:
            out.unlink(missing_ok=True)
            err.unlink(missing_ok=True)


def popen(cmd: list[str], *, log: Path, env: dict[str, str] | None = None, cwd=None
          ) -> subprocess.Popen | ForkedProcess:
    """``subprocess.Popen(cmd, env=env, cwd=cwd, stdout=<log>, stderr=STDOUT, start_new_session=True)`` (``log``
    appended to), forked where the command is `forkable`: a `vlrl serve` the test stops, a run it kills (a torchrun
    job's agent is the process, its ranks its children: `train.dist_helpers.kill_process_tree` kills them all)."""
    env = dict(os.environ) if env is None else env
    forked = forkable(cmd)
    if forked is None:
        with open(log, "a") as stream:
            return subprocess.Popen(cmd, env=env, cwd=cwd, stdout=stream, stderr=subprocess.STDOUT,
                                    start_new_session=True)
    with _LOCK:
        zygote = _idle_zygote(env)
        zygote.send({"nproc": forked[0], "spawn": True, "target": forked[1], "env": env, "cwd": str(cwd or os.getcwd()),
                     "stdout": str(log), "stderr": str(log), "run_id": uuid.uuid4().hex[:8]})
        answer = zygote.answer(120)
        if answer is None:
            zygote.close()
            raise RuntimeError(f"the zygote did not start {cmd}")
        zygote.busy = True
        return ForkedProcess(zygote, answer["pid"], cmd)


# ------------------------------------------------------------------------------------------------ the zygote side
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _process(request: dict, rank: int | None = None, nproc: int = 0, port: int = 0) -> None:
    """In a forked process, in a session of its own: its streams, working directory and environment (a rank's:
    torchrun's), then the target as ``python`` runs it. Never returns."""
    code = 1
    try:
        os.setsid()  # as torchrun starts a rank, and `start_new_session=True` a process the tests kill as a tree
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644), fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        if rank is not None:
            os.environ.update({
                "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
                "ROLE_NAME": "default", "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
                "ROLE_WORLD_SIZE": str(nproc), "GROUP_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": request["run_id"], "TORCHELASTIC_RESTART_COUNT": "0",
                "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_USE_AGENT_STORE": "True"})
        import runpy

        target = request["target"]
        if target[0] == "-m":
            sys.argv = [target[1], *target[2:]]
            sys.path[0] = request["cwd"]
            runner = lambda: runpy.run_module(target[1], run_name="__main__", alter_sys=True)  # noqa: E731
        else:
            sys.argv = list(target)
            sys.path[0] = str(Path(target[0]).resolve().parent)
            runner = lambda: runpy.run_path(target[0], run_name="__main__")  # noqa: E731
        try:
            runner()
            code = 0
        except SystemExit as stop:
            if stop.code is None or isinstance(stop.code, int):
                code = stop.code or 0
            else:
                print(stop.code, file=sys.stderr)
                code = 1
        except BaseException:  # as the interpreter does with an uncaught exception: the traceback, exit code 1
            import traceback

            traceback.print_exc()
            code = 1
        threading._shutdown()  # the interpreter's own exit: join non-daemon threads, then the atexit handlers
        import atexit

        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 (a closed stream: nothing left to flush)
                pass
        os._exit(code)


def _describe(status: int) -> str:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return f"exitcode -{sig}: Signal {sig} ({signal.Signals(sig).name}) received"
    return f"exitcode {os.WEXITSTATUS(status)}"


def _agent(request: dict) -> None:
    """In the forked agent: fork the ranks, host their TCPStore, wait; exit 0 when every rank did. Never returns."""
    code = 1
    try:
        os.setsid()
        nproc, port = request["nproc"], _free_port()
        ranks = {}
        for rank in range(nproc):
            pid = os.fork()
            if pid == 0:
                _process(request, rank, nproc, port)
            ranks[pid] = rank
        from datetime import timedelta

        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", port, nproc, is_master=True, timeout=timedelta(seconds=900),
                              wait_for_workers=False)
        failed, alive = [], dict(ranks)
        while alive:
            pid, status = os.waitpid(-1, 0)
            rank = alive.pop(pid, None)
            if rank is None:
                continue
            if status != 0 and not failed:
                failed.append(f"rank {rank} (local_rank {rank}, pid {pid}): {_describe(status)}")
                _stop(alive)
            elif status != 0:
                failed.append(f"rank {rank} (pid {pid}, stopped after the first failure): {_describe(status)}")
        del store
        if failed:
            with open(request["stderr"], "a") as err:
                err.write("forked_runs: the job failed (standing in for torchrun's ChildFailedError)\n"
                          + "".join(f"  {line}\n" for line in failed))
        code = 1 if failed else 0
    finally:
        os._exit(code)


def _stop(alive: dict[int, int]) -> None:
    """SIGTERM the surviving ranks' sessions, SIGKILL what is left after `STOP_GRACE` seconds (as torchrun does)."""
    import time

    for pid in alive:
        try:
            os.killpg(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + STOP_GRACE
    while time.monotonic() < deadline and any(_running(pid) for pid in alive):
        time.sleep(0.05)
    for pid in alive:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def serve() -> None:
    """The zygote: import what the ranks import, then one job per line of stdin, one answer per line of stdout."""
    import importlib

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:  # an extra not installed (peft): the processes that need it fail as they would anyway
            pass
    assert threading.active_count() == 1, threading.enumerate()
    requests, answers = sys.stdin, sys.stdout
    for line in requests:
        request = json.loads(line)
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        answers.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # a torchrun job's agent, or the one process of a plain command
            _agent(request) if request["nproc"] else _process(request)
        if request.get("spawn"):  # the caller waits for the process's end in its own time
            answers.write(json.dumps({"pid": pid}) + "\n")
            answers.flush()
        _, status = os.waitpid(pid, 0)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
        rc = os.WEXITSTATUS(status) if os.WIFEXITED(status) else -os.WTERMSIG(status)
        answers.write(json.dumps({"rc": rc, "cpu": cpu}) + "\n")
        answers.flush()


if __name__ == "__main__":
    serve()
