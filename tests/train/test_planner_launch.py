"""`vlrl plan` and `vlrl launch` agree: every placement the planner ranks prints the `vlrl launch` command that
starts exactly it — checked by the launcher's own pre-start checks (`prepare`) — a placement the launch would
refuse is shown with the launch's reason instead of a rank, and `--apply` writes a config the launch takes as it
is; one applied "separate" placement runs through `vlrl launch --ray local`."""

import json
import re
import shlex
import subprocess
import sys

import pytest
import yaml
from typer.testing import CliRunner

from vlrl.cli import app
from vlrl.launch.launcher import prepare

from .dist_helpers import REPO, quiet_env
from .test_launch_servers import _gone

runner = CliRunner()
CONFIG = REPO / "configs" / "shapes_grpo.yaml"
NAME = re.compile(r"^#(\d+) (colocated (fsdp|ddp)×(\d+)|separate: trainer fsdp×(\d+) \+ (\d+) rollout server\(s\)):")


def _plan(*args: str) -> str:
    result = runner.invoke(app, ["plan", str(CONFIG), "--gpu-mem", "1", *args])
    assert result.exit_code == 0, result.output
    return result.output


def _ranked(text: str) -> list[tuple[re.Match, list[str]]]:
    """(the ``#k name`` match, the launch command's argv) of every ranked placement, in rank order."""
    lines = text.splitlines()
    out = []
    for i, line in enumerate(lines):
        if m := NAME.match(line):
            assert lines[i + 1].startswith("  launch: vlrl launch --ray local "), lines[i + 1]
            out.append((m, shlex.split(lines[i + 1].removeprefix("  launch: "))))
    return out


def _expected(m: re.Match) -> tuple[str, int, int]:
    """(dist.strategy, trainer ranks, rollout servers) the placement's name says."""
    if m[3]:
        return m[3], int(m[4]), 0
    return "fsdp", int(m[5]), int(m[6])


@pytest.mark.parametrize(("gpus", "device", "placements"), [
    (2, "cpu", 3),  # colocated fsdp×2, ddp×2, separate 1 + 1
    (4, "cpu", 5),  # colocated fsdp×4, ddp×4, separate 3 + 1, 2 + 2, 1 + 3
    (4, "cuda", 5),
])
def test_every_ranked_placement_is_a_launch_the_launcher_accepts(gpus, device, placements):
    # 12 prompts split evenly over 1, 2, 3 and 4 trainer ranks: nothing is refused, every placement is ranked
    text = _plan("--gpus", str(gpus), "train.prompts_per_step=12", f"model.device={device}")
    ranked = _ranked(text)
    assert [int(m[1]) for m, _ in ranked] == list(range(1, placements + 1)), text
    assert "refuses" not in text
    for m, argv in ranked:
        assert argv[:5] == ["vlrl", "launch", "--ray", "local", str(CONFIG)]
        ready = prepare("rl", CONFIG, argv[5:])  # the launch's own checks, before it starts anything
        strategy, ranks, servers = _expected(m)
        launch = ready.cfg.launch
        assert (ready.cfg.dist.strategy, launch.nproc, launch.rollout_servers) == (strategy, ranks, servers), m[0]
        gpu = 1 if device == "cuda" else 0  # one device per rank and per server: a GPU, or a CPU bundle
        assert launch.gpus_per_rank == gpu and (ready.servers is None) == (servers == 0), m[0]
        if servers:
            assert (ready.servers.count, ready.servers.gpus, ready.servers.device) == (servers, gpu, device)


def test_lora_placements_are_ranked_under_fsdp2_and_ddp_and_launch():
    """model.lora (configs/shapes_lora_grpo.yaml) on 4 devices: every placement is ranked — colocated FSDP2 and the
    FSDP2 trainers beside servers too (until issue 24 `vlrl launch` refused LoRA under FSDP2) — and its launch
    command passes the launcher's checks with the placement's strategy."""
    config = REPO / "configs" / "shapes_lora_grpo.yaml"
    result = runner.invoke(app, ["plan", str(config), "--gpu-mem", "1", "--gpus", "4", "train.prompts_per_step=12"])
    assert result.exit_code == 0, result.output
    ranked = _ranked(result.output)
    assert "refuses" not in result.output and len(ranked) == 5, result.output
    assert {_expected(m) for m, _ in ranked} == {("fsdp", 4, 0), ("ddp", 4, 0), ("fsdp", 3, 1), ("fsdp", 2, 2),
                                                 ("fsdp", 1, 3)}
    for m, argv in ranked:
        ready = prepare("rl", config, argv[5:])
        assert ready.cfg.model.lora is not None and (ready.cfg.dist.strategy, ready.cfg.launch.nproc) == _expected(m)[:2]


def test_a_placement_the_launch_refuses_is_not_ranked_and_says_why(tmp_path):
    # 3 devices, 16 prompts: 3 trainer ranks cannot split them (the ranks would stop at step 1), 2 + 1 and 1 + 2 can
    text = _plan("--gpus", "3")
    assert sorted(_expected(m) for m, _ in _ranked(text)) == [("fsdp", 1, 2), ("fsdp", 2, 1)], text
    refused = [line for line in text.splitlines() if "but vlrl launch refuses it" in line]
    assert len(refused) == 2 and all("train.prompts_per_step: 16 does not split evenly over launch.nproc=3" in line
                                     for line in refused), text
    result = runner.invoke(app, ["plan", str(CONFIG), "--gpus", "3", "--gpu-mem", "1", "--apply",
                                 str(tmp_path / "x.yaml"), "--pick", "3"])
    assert result.exit_code == 2 and "--pick 3: 2 placement(s) are ranked" in result.output
    assert not (tmp_path / "x.yaml").exists()


def test_an_async_run_plans_async_launches():
    text = _plan("--gpus", "2", "rollout.mode=async", "train.prompts_per_step=12")
    ranked = _ranked(text)
    assert ranked, text
    for _, argv in ranked:  # the plan assumes generation overlaps training: the launch runs the async recipe
        assert "rollout.mode=async" in argv and prepare("rl", CONFIG, argv[5:]).cfg.rollout.mode == "async"
    refused = [line for line in text.splitlines() if "but vlrl launch refuses it" in line]
    assert len(ranked) + len(refused) == 3, text  # each of the 3 placements: ranked, or refused with the reason


def test_apply_writes_the_picked_placement_as_a_config_the_launch_takes(tmp_path):
    out = tmp_path / "placed.yaml"
    text = _plan("--gpus", "4", "train.prompts_per_step=12", "data.n_train=64", "--apply", str(out), "--pick", "2")
    m, argv = _ranked(text)[1]
    ready = prepare("rl", out, [])
    strategy, ranks, servers = _expected(m)
    assert (ready.cfg.dist.strategy, ready.cfg.launch.nproc, ready.cfg.launch.rollout_servers) == (strategy, ranks, servers)
    assert (ready.cfg.train.prompts_per_step, ready.cfg.data.n_train) == (12, 64)  # the run's overrides are kept
    assert f"placement #2 {m[2]}" in out.read_text().splitlines()[0]
    assert f"start it with: vlrl launch --ray local {out}" in text


@pytest.mark.e2e
def test_an_applied_separate_placement_runs_through_vlrl_launch(tiny_vlm_dir, tmp_path):
    """2 devices → the planner's "separate: trainer fsdp×1 + 1 rollout server(s)", applied to a file and started
    with `vlrl launch --ray local FILE`: the ranks train 2 steps on the server the launch started, and everything is
    stopped at the end."""
    run = [f"model.path={tiny_vlm_dir}", "train.steps=2", "train.prompts_per_step=4", "rollout.n=2",
           "rollout.max_new_tokens=4", "train.micro_batch_size=8", "train.log_every=1", "data.n_train=8",
           "data.n_test=2", "eval.samples=1", "eval.max_new_tokens=2", "report.html=false", "check.enabled=false",
           f"out={tmp_path / 'run'}"]
    listing = _plan("--gpus", "2", *run)
    pick = next(int(m[1]) for m, _ in _ranked(listing) if m[5])
    placed = tmp_path / "placed.yaml"
    _plan("--gpus", "2", *run, "--apply", str(placed), "--pick", str(pick))
    proc = subprocess.run([sys.executable, "-m", "vlrl.cli", "launch", "--ray", "local", str(placed)], env=quiet_env(),
                          capture_output=True, text=True, timeout=900, cwd=REPO)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-6000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r.get("stage") == "rl"] == [1, 2]
    assert len(set(re.findall(r"\(RankActor pid=(\d+)", text))) == 1  # one trainer rank
    final = re.search(r"rollout server 0 \((http://[\d.]+:\d+), pid (\d+)\) ends with weight_version 2 ", text)
    assert final, text[-4000:]  # the one server the launch started served the run, up to the last update
    assert "rollout server 1" not in text
    assert _gone(int(final[2]))  # the server was stopped
    assert yaml.safe_load(placed.read_text())["launch"]["rollout_servers"] == 1


def test_a_config_with_servers_of_its_own_gets_them_replaced_by_the_placements():
    # colocated: no servers at all; separate: the launch's own instead of the config's (one or the other)
    text = _plan("--gpus", "2", "train.prompts_per_step=12", "rollout.servers.urls=[http://10.0.0.9:30000]")
    ranked = _ranked(text)
    assert len(ranked) == 3 and "refuses" not in text, text
    for m, argv in ranked:
        assert "rollout.servers.urls=[]" in argv
        ready = prepare("rl", CONFIG, argv[5:])
        _, _, servers = _expected(m)
        assert ready.cfg.launch.rollout_servers == servers
        # colocated: the ranks generate in-process; separate: the placeholder for the servers the launch starts
        assert ready.cfg.rollout.servers.urls == ([] if servers == 0 else ["http://127.0.0.1:1"])
