"""Issue 47 (degraded): two runs could write one output directory at once (interleaved metrics.jsonl, the other
run's config.yaml). A run holds ``out/run.lock`` from before it writes anything to after its report; a second run
is refused in one line naming the first's PID, and the directory is left as the first run has it."""

from __future__ import annotations

import fcntl
import json
import os

from typer.testing import CliRunner

from vlrl.cli import app

COMMON = ["model.path=tiny-qwen2", "train.steps=1", "train.batch_size=2", "train.micro_batch_size=2", "eval.samples=1",
          "eval.max_new_tokens=2", "check.samples_per_task=1", "report.html=false"]


def test_a_second_run_in_a_locked_directory_is_refused_naming_the_first(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"id": f"q{k}", "task": "t", "prompt": "What is 2+2?", "answer": "4",
                                        "reward": "number", "response": "<answer>4</answer>"}) + "\n" for k in range(4)))
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.yaml").write_text("# the first run's\n")
    holder = os.open(out / "run.lock", os.O_RDWR | os.O_CREAT)  # the first run (here: this process, its own fd)
    fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(holder, f"{os.getpid()} on here\n".encode())
    try:
        result = CliRunner().invoke(app, ["sft", "--data", str(data), "--test", str(data), f"out={out}", *COMMON])
    finally:
        os.close(holder)
    assert result.exit_code == 1, result.output
    assert result.output.strip().splitlines()[-1] == (f"vlrl sft: out={out}: another run is writing this directory "
                                                      f"(PID {os.getpid()} on here, run.lock); wait for it to end or "
                                                      "choose another out="), result.output
    assert (out / "config.yaml").read_text() == "# the first run's\n" and not (out / "metrics.jsonl").exists()
    result = CliRunner().invoke(app, ["sft", "--data", str(data), "--test", str(data), f"out={out}", *COMMON])
    assert result.exit_code == 0, result.output  # the lock is free again: the run goes, and frees it at its end
    probe = os.open(out / "run.lock", os.O_RDWR)
    try:
        fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(probe)
