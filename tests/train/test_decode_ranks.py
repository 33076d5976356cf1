"""In-process generation under FSDP2 keeps the ranks in step: every forward of a sharded model all-gathers its
units' parameters (a collective), so a rank whose rows all ended goes on stepping until every rank's have
(`vlrl.rollout.decode._sharded_ranks`). Before, the first rank done moved on to its next batch's prefill while the
other was still decoding: gloo aborted with "Received data size doesn't match expected size" (NCCL would hang)."""

import ast
import re

import pytest

from .dist_helpers import REPO, run_checked, torchrun

WORKER = str(REPO / "tests" / "train" / "dist_decode_worker.py")


@pytest.mark.e2e
def test_fsdp2_ranks_whose_rows_end_at_different_steps_generate_without_a_collective_mismatch(tiny_vlm_dir):
    done = run_checked([*torchrun(2, WORKER), str(tiny_vlm_dir)], timeout=300, cwd=REPO, retry_native_abort=False)
    lengths = {}
    # (findall, not per line: the two ranks share the pipe, and a CI run saw both reports on one line)
    for rank, values in re.findall(r"rank (\d+) lengths (\[[^\]]*\])", done.stdout):
        lengths.setdefault(int(rank), []).append(ast.literal_eval(values))
    assert sorted(lengths) == [0, 1] and all(len(calls) == 3 for calls in lengths.values())
    # the ranks' rows did end at different steps (what needs the lockstep): not one length shared by every row
    assert len({n for calls in lengths.values() for call in calls for n in call}) > 2
    assert max(max(call) for call in lengths[0]) <= 16 and min(min(call) for call in lengths[0]) >= 1
