"""`vlrl launch`: Ray actors in a placement group run the same 2-rank training as torchrun, and a failing rank
stops the launch with an error that names it."""

import json

import pytest

from vlrl.config import LaunchConfig, RLConfig, load_config
from vlrl.launch.launcher import (
    LaunchError,
    RankSpec,
    ServerPlan,
    _Server,
    _server_overrides,
    launch,
    rendezvous_env,
    server_plan,
)

from .dist_helpers import COMPARED, run_args


def test_rendezvous_env_numbers_local_ranks_per_node():
    where = [("10.0.0.1", 4000), ("10.0.0.1", 4001), ("10.0.0.2", 4002)]
    envs = rendezvous_env(where, 29500, extra={"NCCL_DEBUG": "WARN"})
    assert [e["RANK"] for e in envs] == ["0", "1", "2"]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "0"]  # the second node starts again at 0
    assert [e["LOCAL_WORLD_SIZE"] for e in envs] == ["2", "2", "1"]
    assert {(e["MASTER_ADDR"], e["MASTER_PORT"], e["WORLD_SIZE"], e["NCCL_DEBUG"]) for e in envs} == \
        {("10.0.0.1", "29500", "3", "WARN")}


@pytest.fixture(scope="module")
def local_ray():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.e2e
def test_ray_local_launch_trains_like_torchrun(local_ray, two_ranks, tiny_vlm_dir, tmp_path):
    """The torchrun job's uninterrupted 2-rank SFT run (FSDP2), launched as 2 Ray actors instead: same steps,
    same losses and gradient norms, bit for bit — the rendezvous, not the trainer, is what Ray provides."""
    out, _ = two_ranks
    args = (*run_args("sft", tiny_vlm_dir, None, nproc=2), "checkpoint.every=0", f"out={tmp_path}")
    results = launch(RankSpec("sft", None, args), LaunchConfig(nproc=2))
    assert results[0]["train"]["steps"] == 5 and results[1] == {}  # rank 0 evaluates and writes the summary
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    got = [r for r in map(json.loads, lines) if r["stage"] == "sft"]
    expected = [r for r in map(json.loads, (out / "reference_sft" / "metrics.jsonl").read_text().splitlines())
                if r["stage"] == "sft"]
    assert [{k: r[k] for k in COMPARED["sft"]} for r in got] == [{k: r[k] for k in COMPARED["sft"]} for r in expected]


@pytest.mark.e2e
def test_a_failing_rank_stops_the_launch(local_ray, tmp_path):
    spec = RankSpec("sft", None, (f"data.train={tmp_path / 'missing.jsonl'}", f"out={tmp_path}", "check.enabled=false"))
    with pytest.raises(LaunchError, match=r"rank \d failed, all ranks stopped: DataError: .*missing.jsonl: no such file"):
        launch(spec, LaunchConfig(nproc=2))


class _Pool:
    """`RolloutServers` as `_server_overrides` sees it: healthy servers on the given node IPs."""

    def __init__(self, ips, wire):
        self.plan = ServerPlan(len(ips), "m", wire_sync_address=wire)
        self.servers = [_Server(i, None, ip=ip) for i, ip in enumerate(ips)]

    def wait_ready(self):
        return [f"http://{s.ip}:3000{s.index}" for s in self.servers]


def test_server_urls_are_wired_and_the_sync_address_only_across_nodes():
    assert _server_overrides(_Pool(["10.0.0.1"], wire=True), "10.0.0.1") == ["rollout.servers.urls=[http://10.0.0.1:30000]"]
    # a server on another node joins the trainer's broadcast group at rank 0's IP, not at loopback
    assert _server_overrides(_Pool(["10.0.0.1", "10.0.0.2"], wire=True), "10.0.0.1") == [
        "rollout.servers.urls=[http://10.0.0.1:30000,http://10.0.0.2:30001]", "rollout.weight_sync.address=10.0.0.1"]
    # weight_sync=disk, or an address the user set: left alone
    assert _server_overrides(_Pool(["10.0.0.2"], wire=False), "10.0.0.1") == ["rollout.servers.urls=[http://10.0.0.2:30000]"]


def test_server_plan_defaults_to_the_trainers_device_and_compute_dtype():
    base = ["launch.rollout_servers=2", "launch.gpus_per_server=1", "model.device=cuda"]
    plan = server_plan(load_config(RLConfig, None, [*base, "dist.mixed_precision=bf16"]), "rl")
    assert (plan.count, plan.gpus, plan.device, plan.dtype) == (2, 1, "cuda", "bfloat16")
    assert plan.command(1)[-4:] == ["--device", "cuda", "--dtype", "bfloat16"]
    plan = server_plan(load_config(RLConfig, None, [*base, "model.dtype=float16", "launch.server_dtype=float32",
                                                     "launch.server_args=[--batch-window-ms, '{i}']"]), "rl")
    assert plan.dtype == "float32" and plan.command(1)[-2:] == ["--batch-window-ms", "1"]
    cfg = load_config(RLConfig, None, [*base, "model.dtype=float16", "rollout.servers.urls=[http://h:1]",
                                       "rollout.weight_sync.method=distributed"])
    assert server_plan(cfg, "rl").dtype == "float16" and server_plan(cfg, "rl").wire_sync_address


def test_vllm_servers_get_their_own_command_environment_and_port():
    """rollout.servers.engine=vllm: `vlrl launch` starts vLLM (its module, its key flag, a port the actor picks: vLLM
    takes no port 0), with its RL routes on and rollout.servers.launch's environment."""
    from vlrl.config import RLConfig

    cfg = RLConfig.model_validate({"model": {"path": "/m"}, "launch": {"rollout_servers": 2},
                                   "rollout": {"servers": {"urls": ["http://127.0.0.1:1"], "engine": "vllm",
                                                           "launch": {"python": "/v/python", "env": {"A": "1"}}},
                                               "weight_sync": {"method": "distributed"}}})
    plan = server_plan(cfg, "rl")
    command = plan.command(1)
    assert command[:3] == ["/v/python", "-m", "vllm.entrypoints.openai.api_server"] and "--enable-scale-out" in command
    assert command[command.index("--port") + 1] == "{port}" and "--api-key={api_key}" in command
    assert command[command.index("--weight-transfer-config") + 1] == '{"backend": "nccl"}' and plan.env == (("A", "1"),)
    assert "--attn-implementation" not in command  # vlrl serve's flags are not vLLM's
