"""`vlrl launch`: Ray actors in a placement group run the same 2-rank training as torchrun, and a failing rank
stops the launch with an error that names it."""

import json

import pytest

from vlrl.config import LaunchConfig
from vlrl.train.launcher import LaunchError, RankSpec, launch, rendezvous_env

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
