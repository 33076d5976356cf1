"""PPO with GAE under several ranks: the critic is wrapped like the actor (DDP, or FSDP2 sharded), each rank values
its own responses, GAE and its whitening run over the gathered batch, the value loss shares the actor's all-reduced
normaliser and the critic's gradients are reduced — so 2 ranks log the metrics and end with the actor and critic
weights of 1 process on the same data (a scripted engine: responses fixed per prompt)."""

import sys

import pytest
import torch

from cli_runner import in_process  # tests/ is on sys.path (the test packages' root)

from .dist_helpers import REPO, run_checked, torchrun

sys.path.insert(0, str(REPO / "tests" / "train"))
import dist_gae_worker as worker  # noqa: E402


@pytest.fixture(scope="module")
def one_rank(tiny_vlm_dir, tmp_path_factory):
    records, actor, critic, _ = worker.run(str(tiny_vlm_dir), "fsdp", str(tmp_path_factory.mktemp("one_rank")))
    return records, actor, critic


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_gae_on_2_ranks_equals_1_rank(tiny_vlm_dir, tmp_path, one_rank, strategy):
    out = tmp_path / "two_ranks.pt"
    run_checked(torchrun(2, str(REPO / "tests/train/dist_gae_worker.py"), str(tiny_vlm_dir), str(out), strategy),
                timeout=600, retry_native_abort=True)
    two = torch.load(out, weights_only=False)
    records, actor, critic = one_rank
    assert [r["step"] for r in two["records"]] == [r["step"] for r in records] == [1, 2]
    for mine, theirs in zip(records, two["records"], strict=True):
        # every logged number but timings: the batch's metrics pooled over both ranks' shares, equal up to float
        # summation order — the critic's value loss (the minibatch's, not a mean of per-rank partial losses) and
        # its grad norm (of the reduced gradient) among them
        compared = sorted(k for k in mine if not k.startswith("perf/") and k not in ("step", "time"))
        assert sorted(k for k in theirs if not k.startswith("perf/") and k not in ("step", "time")) == compared
        assert {"critic/value_loss", "critic/grad_norm", "critic/values_mean", "critic/value_clip_frac",
                "policy/loss", "policy/grad_norm", "policy/kl_ref", "reward/mean"} <= set(compared)
        for key in compared:
            if isinstance(mine[key], float | int):
                assert abs(theirs[key] - mine[key]) <= 1e-4 * max(1.0, abs(mine[key])), (mine["step"], key)
            else:
                assert theirs[key] == mine[key], (mine["step"], key)
        assert abs(mine["critic/value_loss"]) > 1e-6 and abs(mine["policy/loss"]) > 1e-6  # real losses to compare
    # the head starts at zero (V ≡ 0 in step 1's first epoch): nonzero logged values come from the critic's updates
    assert all(abs(r["critic/values_mean"]) > 1e-3 for r in records)
    initial_actor, initial_critic = _initial(tiny_vlm_dir)
    for name, final, two_final, initial in (("actor", actor, two["actor"], initial_actor),
                                            ("critic", critic, two["critic"], initial_critic)):
        assert sorted(two_final) == sorted(final), name
        gap = torch.sqrt(sum(((two_final[k] - final[k]) ** 2).sum() for k in final))
        moved = torch.sqrt(sum(((final[k] - initial[k]) ** 2).sum() for k in final))
        # 4 Adam steps moved both models; the two runs differ by float rounding only
        assert moved > 0.05 and gap < 1e-4 * moved, (name, float(moved), float(gap))
        bad = [k for k in final if not torch.allclose(two_final[k], final[k], rtol=1e-3, atol=1e-5)]
        assert not bad, f"{name} weights differ: {bad[:5]}"


def _initial(model_dir):
    from vlrl.models import load_policy
    from vlrl.train.critic import ValueModel

    policy = load_policy(str(model_dir))
    return policy.model.state_dict(), ValueModel(policy).state_dict()


@pytest.mark.e2e  # three 2-rank launches: ~50 s on 2 shared cores
def test_shapes_ppo_under_torchrun_checkpoints_and_resumes_the_critic(tiny_vlm_dir, tmp_path):
    """configs/shapes_ppo.yaml as a user runs it, `torchrun -m vlrl.cli rl` on 2 FSDP2 ranks: 1 step, then
    `--resume auto` to 3, logs the critic's value loss and grad norm of the 3 steps run at once, bit for bit, and
    ends with the same weights — the critic's full state (weights, AdamW, scheduler) is in the checkpoint."""
    import json

    from safetensors.torch import load_file

    from vlrl.train.checkpoint import read_checkpoint_carry_over

    from .dist_helpers import COMMON_ARGS, write_rl_data

    data = write_rl_data(tmp_path / "data" / "train.jsonl")
    args = ["rl", "--config", str(REPO / "configs/shapes_ppo.yaml"), f"model.path={tiny_vlm_dir}", f"data.train={data}",
            f"data.test={data}", "train.steps=3", "train.prompts_per_step=2", "rollout.n=4", "rollout.max_new_tokens=6",
            "train.micro_batch_size=4", "dist.strategy=fsdp", *COMMON_ARGS]
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    run_checked(torchrun(2, "-m", "vlrl.cli", *args, f"out={reference}"), timeout=600)
    run_checked(torchrun(2, "-m", "vlrl.cli", *args, f"out={resumed}", "train.steps=1"), timeout=600)
    carry = read_checkpoint_carry_over(resumed / "checkpoints" / "step_00000001", rank=1)
    head = carry.algorithm.critic["model"]["head.weight"]
    assert head.shape[0] == 1 and float(head.abs().sum()) > 0  # the full head (not a shard), trained from zero
    assert carry.algorithm.critic["optimizer"]["state"]["head.weight"]["exp_avg"].shape == head.shape
    run_checked(torchrun(2, "-m", "vlrl.cli", *args, f"out={resumed}", "--resume", "auto"), timeout=600)

    def records(run_dir):
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        return [r for r in map(json.loads, lines) if r["stage"] == "rl"]

    expected, got = records(reference), records(resumed)
    assert [r["step"] for r in got] == [r["step"] for r in expected] == [1, 2, 3]
    keys = ("reward/mean", "policy/loss", "policy/grad_norm", "policy/kl_ref", "critic/value_loss", "critic/grad_norm",
            "critic/values_mean")
    for a, b in zip(expected, got, strict=True):
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}, f"step {a['step']}"
    weights_a = load_file(reference / "checkpoints" / "final" / "model.safetensors")
    weights_b = load_file(resumed / "checkpoints" / "final" / "model.safetensors")
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)


@pytest.mark.e2e  # one 1-process run and one 2-rank launch: ~40 s on 2 shared cores
def test_a_one_process_ppo_checkpoint_resumes_on_2_ranks(tiny_vlm_dir, tmp_path):
    """configs/shapes_ppo.yaml, 1 step in one process, then `--resume auto` under torchrun on 2 FSDP2 ranks to step
    3: rank 1, which the checkpoint never had, restores the critic (and shapers) from rank 0's copy. Before, it
    started a fresh critic while rank 0 loaded the saved one and the run hung in their mismatched collectives
    (measured: killed by a 600 s timeout after the resume warning)."""
    import json

    from .dist_helpers import COMMON_ARGS, write_rl_data

    data = write_rl_data(tmp_path / "data" / "train.jsonl")
    args = ["rl", "--config", str(REPO / "configs/shapes_ppo.yaml"), f"model.path={tiny_vlm_dir}", f"data.train={data}",
            f"data.test={data}", "train.steps=3", "train.prompts_per_step=2", "rollout.n=4", "rollout.max_new_tokens=6",
            "train.micro_batch_size=4", *COMMON_ARGS, f"out={tmp_path / 'run'}"]
    in_process(*args, "train.steps=1")  # the one process: the vlrl app in this one (tests/cli_runner.py)
    proc = run_checked(torchrun(2, "-m", "vlrl.cli", *args, "dist.strategy=fsdp", "--resume", "auto"), timeout=300)
    assert "written by 1 rank(s), resumed on 2" in proc.stdout + proc.stderr
    records = [r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
               if r["stage"] == "rl"]
    assert [r["step"] for r in records] == [1, 2, 3]
