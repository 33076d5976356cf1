"""What a checkpoint is trusted with (README "Security model"): loading runs no code from it, every file is
checked against the manifest before use, a corrupt or incomplete newest checkpoint is reported and the previous
one used, a save that fails (a full disk) names the file and the cause and keeps the previous checkpoint.
The CLI tests replay the probes of issue 22 through `vlrl sft`."""

import json
import os
import pickle
import subprocess
import sys

import pytest
import torch

import forked_runs  # tests/ is on sys.path
from vlrl.config import CheckpointConfig
from vlrl.train.checkpoint import (
    Checkpointer,
    CheckpointError,
    carry_over_files,
    latest_checkpoint,
    read_checkpoint_carry_over,
    resolve_resume,
    verify_checkpoint,
    write_manifest,
)
from vlrl.train.distributed import DistContext

from .dist_helpers import SFT_ARGS, quiet_env
from .test_checkpoint import _fresh, _save, _train


class Payload:
    """Unpickling this runs ``open(marker, "w")``: the probe of issue 22 (a crafted carry_over/*.pt)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _two_checkpoints(root, carry_over=None):
    model, optimizer, scheduler = _fresh()
    checkpointer = Checkpointer(root / "checkpoints", CheckpointConfig(every=1, keep=3), DistContext())
    paths = []
    for step in (1, 2):
        _train(model, optimizer, scheduler, 1)
        paths.append(_save(checkpointer, step, model, optimizer, scheduler, carry_over=carry_over))
    return checkpointer, paths, (model, optimizer, scheduler)


def _flip(file, offset=None):
    data = bytearray(file.read_bytes())
    k = len(data) // 2 if offset is None else offset
    data[k] ^= 0x01
    file.write_bytes(bytes(data))


def test_a_malicious_pickle_in_any_file_that_is_read_is_refused_without_running(tmp_path):
    """The attacker may even rewrite the manifest: the pickle is still never executed — the carry-over is JSON +
    safetensors, the old .pt name is never opened, and DCP's .metadata goes through an allow-list unpickler."""
    carry = {"ema": torch.tensor([0.5]), "steps": (1, 2)}
    checkpointer, (_, path), _ = _two_checkpoints(tmp_path, carry_over=carry)
    marker = tmp_path / "pwned"
    payload = pickle.dumps(Payload(marker))
    json_file, tensors_file = carry_over_files(path)

    def load():
        model, optimizer, scheduler = _fresh(seed=1)  # into a fresh model, as a resumed run does
        return checkpointer.load(path, stage="sft", module=model, optimizer=optimizer, scheduler=scheduler)

    # the probe as reported: carry_over/rank_00000.pt beside the real files
    (path / "carry_over" / "rank_00000.pt").write_bytes(payload)
    with pytest.raises(CheckpointError, match=r"rank_00000.pt: not listed in manifest.json"):
        verify_checkpoint(path)
    write_manifest(path)  # re-sealed by the attacker: the file is simply never opened
    assert load()["carry_over"]["steps"] == (1, 2) and not marker.exists()
    (path / "carry_over" / "rank_00000.pt").unlink()

    # (issue 38: a bad carry-over is the one-line CheckpointError the CLI prints, not a raw CarryOverError)
    for target, error, message in ((json_file, CheckpointError, "cannot be resumed from \\(CarryOverError: .*rank_00000.json: unreadable"),
                                   (tensors_file, CheckpointError, "cannot be resumed from \\(CarryOverError: .*rank_00000.safetensors: unreadable"),
                                   (path / "dcp" / ".metadata", CheckpointError, r"\.metadata: refused \(.*open is not allowed")):
        original = target.read_bytes()
        target.write_bytes(payload)
        with pytest.raises(CheckpointError, match=f"{target.name}: (sha256 differs|.* bytes, the manifest says)"):  # caught by the manifest
            verify_checkpoint(path)
        write_manifest(path)
        with pytest.raises(error, match=message):  # and refused by the reader itself
            load()
        assert not marker.exists(), f"a pickle in {target.name} ran"
        target.write_bytes(original)
        write_manifest(path)
    assert torch.equal(load()["carry_over"]["ema"], torch.tensor([0.5]))


def test_flipped_bytes_in_any_file_are_detected_and_auto_resumes_from_the_previous_one(tmp_path, caplog):
    _, (first, second), _ = _two_checkpoints(tmp_path, carry_over={"ema": torch.tensor([0.5])})
    files = sorted(p.relative_to(second) for p in second.rglob("*") if p.is_file())
    # dcp shard + metadata, carry-over json + safetensors, trainer state, manifest
    assert {f.parent.name or f.name for f in files} >= {"dcp", "carry_over", "trainer_state.json", "manifest.json"}
    for name in files:
        original = (second / name).read_bytes()
        _flip(second / name)
        with pytest.raises(CheckpointError, match=rf"{name.name}"):
            verify_checkpoint(second)
        caplog.clear()
        assert resolve_resume(CheckpointConfig(resume="auto"), tmp_path) == first
        assert str(name.name) in caplog.text and "skipping it" in caplog.text
        with pytest.raises(CheckpointError, match=rf"{name.name}"):  # asked for by name: refused, no fallback
            resolve_resume(CheckpointConfig(resume=str(second)), tmp_path)
        (second / name).write_bytes(original)
    # truncated and missing files are named as such
    shard = next((second / "dcp").glob("*.distcp"))
    original = shard.read_bytes()
    shard.write_bytes(original[:-10])
    with pytest.raises(CheckpointError, match=rf"{shard.name}: {len(original) - 10} bytes, the manifest says {len(original)}"):
        verify_checkpoint(second)
    shard.unlink()
    with pytest.raises(CheckpointError, match=rf"{shard.name}: missing"):
        verify_checkpoint(second)
    shard.write_bytes(original)
    assert resolve_resume(CheckpointConfig(resume="auto"), tmp_path) == second


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 32 MiB tmpfs at tmp_path/disk (root only), unmounted after the test."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs to fill needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(disk)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def _fill(disk, leave: int) -> None:
    """Fill ``disk`` until ``leave`` bytes are free."""
    free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
    with open(disk / "filler", "wb") as handle:
        handle.write(b"\0" * max(0, free - leave))


def test_a_save_on_a_full_disk_names_the_file_and_the_cause_and_keeps_the_previous_checkpoint(small_tmpfs):
    model, optimizer, scheduler = _fresh()
    checkpointer = Checkpointer(small_tmpfs / "checkpoints", CheckpointConfig(every=1, keep=1), DistContext())
    _train(model, optimizer, scheduler, 1)
    first = _save(checkpointer, 1, model, optimizer, scheduler, carry_over={"big": torch.zeros(64, 1024)})
    _fill(small_tmpfs, leave=64 * 1024)  # the 256 KiB carry-over of step 2 no longer fits
    _train(model, optimizer, scheduler, 1)
    with pytest.raises(CheckpointError, match=r"checkpoint step 2: writing .*step_00000002.partial/carry_over/rank_00000"
                                              r"\.json failed: .*No space left on device.*the previous checkpoint "
                                              r".*step_00000001 is kept"):
        _save(checkpointer, 2, model, optimizer, scheduler, carry_over={"big": torch.zeros(64, 1024)})
    assert sorted(p.name for p in (small_tmpfs / "checkpoints").iterdir()) == ["step_00000001"]  # no partial left
    verify_checkpoint(first)  # intact, not pruned
    assert torch.equal(read_checkpoint_carry_over(first)["big"], torch.zeros(64, 1024))
    # DCP's own shard write failing on the full disk (its error does not say so): the cause is still named
    _fill(small_tmpfs, leave=0)
    (small_tmpfs / "filler").unlink()
    _fill(small_tmpfs, leave=1024 * 1024 + 4096)
    with pytest.raises(CheckpointError, match=r"No space left on device"):
        _save(checkpointer, 2, model, optimizer, scheduler, carry_over={"big": torch.zeros(300, 1024)})


# ----------------------------------------------------------------------------------------------- through the CLI
def _vlrl(*args):
    return forked_runs.run([sys.executable, "-m", "vlrl.cli", "sft", *args], env=quiet_env(), timeout=600)


def _steps(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if json.loads(line)["stage"] == "sft"]


@pytest.mark.e2e
def test_cli_resume_auto_skips_a_corrupt_newest_checkpoint_and_never_runs_a_planted_pickle(tiny_vlm_dir, tmp_path):
    """`vlrl sft --resume auto` after the newest checkpoint's shard got flipped bytes, and a pickle was planted in
    the older one (manifest re-sealed, as an attacker with write access would): the warning names the flipped
    file, step 1's checkpoint is used without running the pickle, metrics.jsonl continues from step 1 exactly."""
    base = [f"model.path={tiny_vlm_dir}", *SFT_ARGS, "checkpoint.every=1", "checkpoint.keep=3", "report.html=false"]
    reference, run = tmp_path / "reference", tmp_path / "run"
    assert _vlrl(*base, "train.steps=3", f"out={reference}").returncode == 0
    assert _vlrl(*base, "train.steps=2", f"out={run}").returncode == 0
    newest = run / "checkpoints" / "step_00000002"
    shard = next((newest / "dcp").glob("*.distcp"))
    _flip(shard)
    marker = tmp_path / "pwned"
    older = run / "checkpoints" / "step_00000001"
    (older / "carry_over" / "rank_00000.pt").write_bytes(pickle.dumps(Payload(marker)))
    write_manifest(older)
    done = _vlrl(*base, "train.steps=3", f"out={run}", "--resume", "auto")
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"{shard.name}: sha256 differs from the manifest" in done.stderr
    assert "resuming from" in done.stderr and "step_00000001" in done.stderr
    assert not marker.exists()
    got, expected = _steps(run), _steps(reference)
    assert [r["step"] for r in got] == [1, 2, 3]  # step 2's first record was cut back, after the load
    assert [r["sft/loss"] for r in got] == [r["sft/loss"] for r in expected]  # resumed exactly from step 1


@pytest.mark.e2e
def test_cli_a_full_disk_at_a_save_is_one_message_and_the_run_resumes_later(tiny_vlm_dir, tmp_path, small_tmpfs):
    base = [f"model.path={tiny_vlm_dir}", *SFT_ARGS, "checkpoint.every=1", "checkpoint.keep=1", "report.html=false",
            f"out={small_tmpfs}"]
    assert _vlrl(*base, "train.steps=1").returncode == 0
    _fill(small_tmpfs, leave=1024 * 1024)  # a 13 MB checkpoint cannot be written
    done = _vlrl(*base, "train.steps=2", "--resume", "auto")
    assert done.returncode == 1
    stderr = " ".join(done.stderr.split())  # the console wraps long lines
    assert "Traceback" not in stderr
    assert "vlrl sft: checkpoint step 2: writing" in stderr and "No space left on device" in stderr, stderr[-1500:]
    assert "step_00000001 is kept" in stderr
    verify_checkpoint(small_tmpfs / "checkpoints" / "step_00000001")  # kept intact
    (small_tmpfs / "filler").unlink()
    assert _vlrl(*base, "train.steps=2", "--resume", "auto").returncode == 0
    assert [r["step"] for r in _steps(small_tmpfs)] == [1, 2]


# ----------------------------------------------------------------------------------------------- issue 38
def test_a_symlinked_step_directory_is_refused_and_a_later_save_replaces_the_link(tmp_path):
    """Finding 10: a newest `step_N` that is a symbolic link (here to a copy of step 2 outside the run) was resumed
    from without a word, and every later save at step N failed (`rmtree` on a link). Now `--resume auto` refuses
    it in one line, and a save at that step replaces the link itself, leaving its target alone."""
    import shutil

    run = tmp_path / "run"
    checkpointer, (_, second), trained = _two_checkpoints(run)
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(second, elsewhere)
    link = run / "checkpoints" / "step_00000009"
    link.symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(CheckpointError) as err:
        resolve_resume(CheckpointConfig(resume="auto"), run)
    assert str(err.value) == (f"{link} is a symbolic link (to {elsewhere}), not a checkpoint this run wrote: refused; "
                              "remove the link, or name the checkpoint with checkpoint.resume=DIR")
    assert latest_checkpoint(run / "checkpoints") == second  # never the link
    saved = _save(checkpointer, 9, *trained)
    assert saved == link and not link.is_symlink() and (link / "manifest.json").is_file()
    assert sorted(p.name for p in elsewhere.iterdir()) == sorted(p.name for p in second.iterdir())  # target untouched


def test_a_step_directory_whose_name_and_trainer_state_disagree_is_refused(tmp_path):
    """Finding 10: the step in a directory's name must be its trainer_state's (a renamed or moved checkpoint would
    resume at the wrong step, its data cursor and schedule off by the difference)."""
    run = tmp_path / "run"
    _, (first, second), _ = _two_checkpoints(run)
    renamed = second.with_name("step_00000007")
    second.rename(renamed)  # files and manifest intact: only the name lies
    with pytest.raises(CheckpointError, match=r"trainer_state.json: step 2, but the directory is named for step 7: refused"):
        verify_checkpoint(renamed)
    assert resolve_resume(CheckpointConfig(resume="auto"), run) == first  # auto: reported, the previous one used


def test_metrics_are_cut_to_the_checkpoint_never_extended(tmp_path):
    """Finding 11: resuming after metrics.jsonl was shortened padded it with NUL bytes up to the recorded length.
    Now a longer file is cut back to it and a shorter one kept to its last whole line, never extended."""
    metrics = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"stage": "sft", "step": k, "loss": 1.0 / (k + 1)}) + "\n" for k in range(1, 6)]
    metrics.write_text("".join(lines[:3]))
    model, optimizer, scheduler = _fresh()
    checkpointer = Checkpointer(tmp_path / "checkpoints", CheckpointConfig(every=1), DistContext(), metrics_path=metrics)
    path = _save(checkpointer, 3, model, optimizer, scheduler)
    recorded = len("".join(lines[:3]).encode())

    def load():
        fresh = _fresh(seed=1)
        checkpointer.load(path, stage="sft", module=fresh[0], optimizer=fresh[1], scheduler=fresh[2])
        return metrics.read_bytes()

    metrics.write_text("".join(lines))  # the run went on past the checkpoint: cut back
    assert load() == "".join(lines[:3]).encode()
    metrics.write_text(lines[0] + lines[1][:10])  # shortened since, mid-line
    cut = load()
    assert cut == lines[0].encode() and b"\0" not in cut and len(cut) < recorded


def test_a_bad_carry_over_under_a_resealed_manifest_is_one_checkpoint_error(tmp_path):
    """Finding 12: a carry-over that decodes to nothing a recipe can use (a record without its fields; a tuple of
    a number), under a manifest rewritten to match, ended in a raw traceback. Now: one CheckpointError line."""
    checkpointer, (_, path), _ = _two_checkpoints(tmp_path, carry_over={"steps": (1, 2)})
    json_file, _ = carry_over_files(path)
    document = json.loads(json_file.read_text())
    for value in ({"$record": "SyncState", "fields": {}}, {"$tuple": 5}, {"$bytes": "not base64!"}):
        json_file.write_text(json.dumps({**document, "value": value}))
        write_manifest(path)
        model, optimizer, scheduler = _fresh(seed=1)
        with pytest.raises(CheckpointError) as err:
            checkpointer.load(path, stage="sft", module=model, optimizer=optimizer, scheduler=scheduler)
        message = str(err.value)
        assert message.startswith(f"{path}: cannot be resumed from (") and "\n" not in message, message


def test_cli_a_planted_step_link_and_a_bad_carry_over_are_one_line_each(tmp_path):
    """Issue 38, findings 10 and 12 through `vlrl sft --resume auto`: exit 1 and one line, never a traceback."""
    from typer.testing import CliRunner

    from vlrl.cli import app

    run = tmp_path / "run"
    args = ["sft", "model.path=tiny-qwen2", "data.suite=arith", "data.tasks=[add]", "data.n_train=16", "data.n_test=2",
            "train.steps=2", "train.batch_size=2", "train.micro_batch_size=2", "checkpoint.every=1", "checkpoint.keep=2",
            "eval.samples=1", "eval.max_new_tokens=2", "check.samples_per_task=1", "report.html=false", f"out={run}"]
    assert CliRunner().invoke(app, args).exit_code == 0
    (run / "checkpoints" / "step_00000003").symlink_to(tmp_path, target_is_directory=True)
    result = CliRunner().invoke(app, [*args, "train.steps=3", "--resume", "auto"])
    assert result.exit_code == 1 and result.output.strip().splitlines() == [
        f"vlrl sft: {run / 'checkpoints' / 'step_00000003'} is a symbolic link (to {tmp_path}), not a checkpoint this "
        "run wrote: refused; remove the link, or name the checkpoint with checkpoint.resume=DIR"], result.output
    (run / "checkpoints" / "step_00000003").unlink()
    newest = run / "checkpoints" / "step_00000002"
    json_file, _ = carry_over_files(newest)
    json_file.write_text(json.dumps({**json.loads(json_file.read_text()), "value": {"$tuple": 5}}))
    write_manifest(newest)  # re-sealed, as someone with write access would
    result = CliRunner().invoke(app, [*args, "train.steps=3", "--resume", "auto"])
    assert result.exit_code == 1, result.output
    last = result.output.strip().splitlines()[-1]
    assert last.startswith(f"vlrl sft: {newest}: cannot be resumed from (") and "Traceback" not in result.output, result.output
