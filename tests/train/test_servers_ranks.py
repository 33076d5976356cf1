"""``rollout.servers.urls`` under torchrun: 2 gloo trainer ranks (FSDP2) share one `vlrl serve` process — each rank
generates its share of every step's prompts on it, and after each update rank 0 alone broadcasts the weights to it
(SGLang's distributed protocol), every rank joining the FSDP2 gathers bucket by bucket. The run, through
`torchrun … -m vlrl.cli rl`, leaves the server with the checksum of its exported final weights, and logs the same
metrics as the 1-rank run against the same server.

Determinism: the server samples with its own random stream in arrival order, so the test samples greedily
(``rollout.top_k=1``: one token left, the draw is the argmax) with REINFORCE++'s batch-whitened advantages (the
prompts' greedy responses differ) and DAPO's soft overlong punishment on characters, its window set where this
model's 6-token responses end (21–24 characters: distinct rewards, so the advantages are not zero)."""

import json
import os
import subprocess

import httpx
import pytest

from cli_runner import in_process  # tests/ is on sys.path (the test packages' root)
from rollout.conftest import API_KEY, vlrl_serve  # tests/ is on sys.path (the test packages' root)
from vlrl.data import generate, write_samples
from vlrl.models import load_policy
from vlrl.rollout.weights import weight_checksum

from .dist_helpers import REPO, quiet_env, torchrun

STEPS = 3
ARGS = [f"train.steps={STEPS}", "train.prompts_per_step=4", "rollout.n=2", "rollout.top_k=1", "rollout.max_new_tokens=6",
        "train.micro_batch_size=3", "algo.advantage=reinforce_pp", "optim.lr=1e-3", "train.log_every=1",
        "data.n_test=2", "report.html=false", "check.enabled=false", "eval.samples=1", "eval.max_new_tokens=2",
        "rollout.weight_sync.method=distributed"]
COMPARED = ("reward/mean", "reward/std", "response/length_mean", "policy/loss", "policy/grad_norm", "policy/entropy",
            "policy/approx_kl_old", "policy/zero_adv_groups_frac")


def _write_data(path):
    samples = generate("shapes", 16, tasks=["count"])
    for s in samples:  # 0 up to 19 characters, then −1/6 per character, −1 from 25 on
        s.reward = {"overlong": 1.0}
        s.metadata = {"max_length": 25, "cache_length": 6, "unit": "chars"}
    return write_samples(samples, path)


def _run(cmd, out, url, data, *extra):
    """``cmd`` None: the one process is the vlrl app in this one (tests/cli_runner.py)."""
    args = ["rl", f"model.path={data['model']}", f"data.train={data['file']}", f"data.test={data['file']}",
            *ARGS, f"rollout.servers.urls=[{url}]", f"out={out}", *extra]
    if cmd is None:
        in_process(*args, env={"VLRL_API_KEY": API_KEY})
    else:
        proc = subprocess.run([*cmd, *args], env=quiet_env(VLRL_API_KEY=API_KEY), capture_output=True, text=True,
                              timeout=900, cwd=REPO)
        assert proc.returncode == 0, f"{' '.join(args)}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r.get("stage") == "rl"]


def _server_info(url):
    return httpx.get(f"{url}/get_model_info", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30).json()


@pytest.mark.e2e
def test_two_ranks_share_a_rollout_server_and_equal_the_one_rank_run(tiny_vlm_dir, tmp_path):
    data = {"model": str(tiny_vlm_dir), "file": _write_data(tmp_path / "rl.jsonl")}
    with vlrl_serve(str(tiny_vlm_dir), tmp_path) as (url,):
        two = _run(torchrun(2, "-m", "vlrl.cli"), tmp_path / "two", url, data)
        info = _server_info(url)
        final_two = load_policy(str(tmp_path / "two" / "checkpoints" / "final"))
        # every update reached the server by broadcast (nothing written for it on disk), the last one the final weights
        assert info["weight_version"] == str(STEPS) and info["weight_checksum"] == weight_checksum(final_two.model)
        assert not (tmp_path / "two" / "rollout_weights").exists()
        one = _run(None, tmp_path / "one", url, data)
        info = _server_info(url)
        final_one = load_policy(str(tmp_path / "one" / "checkpoints" / "final"))
        assert info["weight_version"] == str(STEPS) and info["weight_checksum"] == weight_checksum(final_one.model)
    assert [r["step"] for r in two] == [r["step"] for r in one] == list(range(1, STEPS + 1))
    for mine, theirs in zip(one, two, strict=True):
        for key in COMPARED:  # the whole batch's metrics, gathered from both ranks: float summation order apart
            assert theirs[key] == pytest.approx(mine[key], rel=1e-4, abs=1e-6), (mine["step"], key)
    # a real signal was trained at step 1 (the loss itself is ~0 on-policy: whitened advantages have mean 0); measured:
    # reward/std 0.22, grad norm 9.5 — after that update the responses are all short (reward 0, nothing to learn)
    assert one[0]["reward/std"] > 0 and one[0]["policy/grad_norm"] > 0.1
    one_state, two_state = final_one.model.state_dict(), final_two.model.state_dict()
    moved = load_policy(str(tiny_vlm_dir)).model.state_dict()
    gap = sum(float(((two_state[k] - one_state[k]) ** 2).sum()) for k in one_state) ** 0.5
    distance = sum(float(((one_state[k] - moved[k]) ** 2).sum()) for k in one_state) ** 0.5
    assert distance > 1e-2 and gap < 1e-3 * distance, (gap, distance)  # the same weights, up to float rounding
    assert os.path.exists(tmp_path / "two" / "summary.json")


# The other corners of the topology — {sync, async} × {fsdp, ddp} × {disk, distributed} and LoRA with disk — each
# end at the exported weights' checksum in test_topology_matrix.py.
