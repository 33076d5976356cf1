"""DAPO dynamic sampling under several ranks: 2 FSDP2 ranks keep, carry and train on exactly the groups one process
does (the ranks filter the gathered round, then shard), so the logged metrics and the final weights equal the
1-rank run's on the same data (a scripted engine: responses fixed per prompt)."""

import sys

import torch

from vlrl.train.runtime import Runtime

from .dist_helpers import REPO, run_checked, torchrun

sys.path.insert(0, str(REPO / "tests" / "train"))
import dist_dynamic_worker as worker  # noqa: E402


def test_dynamic_sampling_on_2_ranks_equals_1_rank(tiny_vlm_dir, tmp_path):
    out = tmp_path / "two_ranks.pt"
    run_checked(torchrun(2, str(REPO / "tests/train/dist_dynamic_worker.py"), str(tiny_vlm_dir), str(out)), timeout=600,
                retry_native_abort=True)
    two = torch.load(out, weights_only=False)
    records, state, _ = worker.run(str(tiny_vlm_dir), lambda policy: Runtime.single(policy.model))
    assert [r["step"] for r in two["records"]] == [r["step"] for r in records] == [1, 2, 3]
    for mine, theirs in zip(records, two["records"], strict=True):
        # the groups each round generated, dropped, kept and carried: identical counts
        for key in ("sampling/rounds", "sampling/prompts_generated", "sampling/groups_dropped",
                    "sampling/prompts_used", "sampling/carried_in", "sampling/carried_over"):
            assert theirs[key] == mine[key], (mine["step"], key)
        # every other logged number (perf/… and the record's time are timings): the batch's metrics, pooled over both ranks' shares, equal
        # up to float summation order — the loss too (the minibatch's loss, not a mean of per-rank partial losses,
        # which logged 2× on 2 ranks), and the per-token statistics as token means over the whole batch
        compared = sorted(k for k in mine if not k.startswith("perf/") and k not in ("step", "time"))
        assert sorted(k for k in theirs if not k.startswith("perf/") and k not in ("step", "time")) == compared, mine["step"]
        assert {"policy/loss", "policy/grad_norm", "policy/entropy", "policy/clip_low", "reward/mean"} <= set(compared)
        for key in compared:
            if isinstance(mine[key], float | int):
                assert abs(theirs[key] - mine[key]) <= 1e-4 * max(1.0, abs(mine[key])), (mine["step"], key)
            else:
                assert theirs[key] == mine[key], (mine["step"], key)
        assert abs(mine["policy/loss"]) > 1e-6  # a real loss to compare
    assert sum(r["sampling/groups_dropped"] for r in records) > 0  # the filter really dropped groups
    assert any(r["sampling/rounds"] > 1 for r in records)  # and back-filled with extra rounds
    initial = _initial(tiny_vlm_dir)
    gap = torch.sqrt(sum(((two["state"][k] - state[k]) ** 2).sum() for k in state))
    moved = torch.sqrt(sum(((state[k] - initial[k]) ** 2).sum() for k in state))
    # 3 Adam steps moved the weights by ~1.7 (L2); the two runs differ by float rounding only (measured ~5e-6)
    assert moved > 0.1 and gap < 1e-4 * moved
    # element by element: Adam divides each gradient by its own running scale, so an element whose gradient is near
    # zero turns a rounding difference into a visible one (seen on an AVX-512 CPU: 1 element of 1.06M, 0.00948 vs
    # 0.00952). Such elements are rare and Adam moves none by more than ~lr per step; every other element agrees.
    lr, steps = worker.stage().optim.lr, worker.stage().train.steps
    differs = {k: ~torch.isclose(two["state"][k], state[k], rtol=1e-3, atol=1e-5) for k in state}
    n_differ = sum(int(d.sum()) for d in differs.values())
    assert n_differ <= 1e-5 * sum(v.numel() for v in state.values()), f"weights differ: {n_differ} elements"
    for k, d in differs.items():
        if d.any():
            assert (two["state"][k][d] - state[k][d]).abs().max() <= 2 * lr * steps, k


def _initial(model_dir):
    from vlrl.models import load_policy

    return load_policy(str(model_dir)).model.state_dict()
