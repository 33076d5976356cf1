"""`vlrl launch --ray local` with ``launch.rollout_servers``: the launch starts `vlrl serve` beside the 2 trainer
ranks, wires its URL and a generated key into the run, and stops it when the run ends — or stops everything
when one part fails, with one line naming the part."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

import forked_runs  # tests/ is on sys.path
from vlrl.models import load_policy
from vlrl.rollout.weights import weight_checksum

from .dist_helpers import REPO, quiet_env

ray = pytest.importorskip("ray")

STEPS = 3
ARGS = [f"train.steps={STEPS}", "train.prompts_per_step=4", "rollout.n=2", "rollout.max_new_tokens=6",
        "train.micro_batch_size=4", "train.log_every=1", "data.n_train=16", "data.n_test=2", "report.html=false",
        "check.enabled=false", "eval.samples=1", "eval.max_new_tokens=2", "launch.nproc=2",
        "launch.rollout_servers=1"]
SERVER = re.compile(r"rollout server 0 \((http://[\d.]+:\d+), pid (\d+)\)")


def _cmd(model, out, *extra):
    return [sys.executable, "-m", "vlrl.cli", "launch", "--ray", "local", str(REPO / "configs/shapes_grpo.yaml"),
            f"model.path={model}", *ARGS, f"out={out}", *extra]


def _gone(pid: int) -> bool:
    """The process has exited (a zombie not yet reaped counts as gone: it runs nothing)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _actors_gone(text: str) -> bool:
    """Every rank actor and server actor whose output Ray streamed (``(RankActor pid=N)``, ``(vlrl serve 0
    pid=N)``) has exited."""
    ranks = {int(p) for p in re.findall(r"\(RankActor pid=(\d+)", text)}
    servers = {int(p) for p in re.findall(r"\(vlrl serve \d+ pid=(\d+)", text)}
    assert ranks and servers, text[-4000:]
    return all(_gone(pid) for pid in ranks | servers)


def test_launch_starts_a_rollout_server_for_two_ranks_and_stops_it(tiny_vlm_dir, tmp_path):
    out = tmp_path / "run"
    cmd = _cmd(tiny_vlm_dir, out, "rollout.weight_sync.method=distributed", "launch.server_args=[--batch-window-ms, '1{i}']")
    proc = subprocess.run(cmd, env=quiet_env(), capture_output=True, text=True, timeout=900, cwd=REPO)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{text[-8000:]}"
    records = [r for r in map(__import__("json").loads, (out / "metrics.jsonl").read_text().splitlines())
               if r.get("stage") == "rl"]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    # the server it started is the one the ranks used: it ends with the exported final weights (version STEPS),
    # which it got by broadcast (nothing saved for it on disk)
    final = re.search(r"rollout server 0 \(.*\) ends with weight_version (\S+) weight_checksum (\S+)", text)
    assert final, text[-4000:]
    assert final[1] == str(STEPS)
    assert final[2] == weight_checksum(load_policy(str(out / "checkpoints" / "final")).model)
    assert not (out / "rollout_weights").exists()
    # {i}: the server's index; bound to the node's IP, not loopback, and reached there by the ranks
    assert "serve --model" in text and "--batch-window-ms 10 --host " in text
    assert SERVER.search(text)[1].startswith(f"http://{ray.util.get_node_ip_address()}:")
    pid = int(SERVER.search(text)[2])
    assert _gone(pid) and _actors_gone(text)  # stopped when the run ended


@pytest.mark.parametrize(("victim", "said"), [
    ("server", " was killed by SIGKILL: stopped during the run; all ranks stopped"),
    # the actor hosting the server: the server dies with it (PR_SET_PDEATHSIG), the launch names the server
    ("actor", ": its Ray actor is gone (ActorDiedError): stopped during the run; all ranks stopped"),
])
def test_a_server_killed_mid_run_stops_the_launch(tiny_vlm_dir, tmp_path, victim, said):
    out = tmp_path / "run"
    cmd = _cmd(tiny_vlm_dir, out, "train.steps=200")  # far longer than the test waits
    lines: list[str] = []
    launcher = subprocess.Popen(cmd, env=quiet_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                cwd=REPO)
    try:
        pid = None
        deadline = time.time() + 600
        for line in launcher.stdout:  # wait for the server, then for the ranks' first step
            lines.append(line)
            if pid is None and (m := SERVER.search(line)):
                pid = int(m[2])
            if pid and (out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text().strip():
                break
            assert time.time() < deadline, "".join(lines[-50:])
        assert pid, "".join(lines[-50:])
        actor = int(re.search(r"\(vlrl serve 0 pid=(\d+)\)", "".join(lines))[1])
        os.kill(pid if victim == "server" else actor, signal.SIGKILL)
        lines.extend(launcher.stdout)
        code = launcher.wait(120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    text = "".join(lines)
    assert code == 1, text[-6000:]
    errors = [line for line in lines if line.startswith("vlrl launch: rollout server 0") and said in line]
    assert len(errors) == 1, text[-6000:]
    steps = len((out / "metrics.jsonl").read_text().splitlines())
    assert 0 < steps < 200  # it did train, and did not go on without its server
    assert _actors_gone(text) and _gone(pid)
    print(errors[0])


def test_a_server_that_cannot_start_ends_the_launch_before_the_ranks(tmp_path):
    cmd = _cmd(tmp_path / "no-such-model", tmp_path / "run", "launch.server_model=" + str(tmp_path / "no-such-model"))
    proc = subprocess.run(cmd, env=quiet_env(), capture_output=True, text=True, timeout=300, cwd=REPO)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 1, text[-6000:]
    error = [line for line in text.splitlines() if line.startswith("vlrl launch: rollout server 0")]
    assert len(error) == 1 and "exited with code 2: could not start" in error[0] and "no-such-model" in error[0], text
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # no rank trained
    assert _gone(int(re.search(r"rollout server 0 \(not listening yet, pid (\d+)\)", error[0])[1]))


@pytest.mark.parametrize(("config", "extra", "code", "message"), [
    ("shapes_sft.yaml", ["launch.rollout_servers=1"], 2, "launch.rollout_servers=1: rollout servers serve RL runs"),
    ("shapes_grpo.yaml", ["launch.rollout_servers=1", "rollout.servers.urls=[http://127.0.0.1:30000]"], 2,
     "rollout.servers.urls is set too"),
])
def test_settings_the_servers_cannot_honour_are_refused_before_anything_starts(tmp_path, config, extra, code, message):
    cmd = [sys.executable, "-m", "vlrl.cli", "launch", str(REPO / "configs" / config), f"out={tmp_path}", *extra]
    proc = forked_runs.run(cmd, env=quiet_env(), timeout=120, cwd=REPO)
    assert proc.returncode == code and message in proc.stderr, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "starting" not in proc.stdout  # no server was started
