"""SGLang 0.5.23's own runtime code in the loop (`sglang_runtime`: its scheduler's weight updater and session, its
model runner's distributed receiver and bucket reader, its request structs — from the released wheel — behind a
loopback HTTP server, the model runner's model a plain module of the checkpoint's tensors).

vlrl's real client drives it through the updates of a run, built the way every recipe builds it (`build_engine`: the
servers get the trainer's weights as version 0), then one update as the synchronous recipe makes it
(``update_weights``) and one as the asynchronous recipe does (``publish``), in every ``on_weight_update`` mode: every
update must land by SGLang's distributed path (none by disk), in SGLang's session, with the cache flushed before it (the
flush retried while SGLang refuses it), the tensors SGLang loaded equal to the trainer's checkpoint, the version SGLang
recorded the trainer's — and the trainer computes no checksum (SGLang reports none).

The wheel is downloaded once (`sglang_contract.wheel_path`); where it cannot be (offline), the test is skipped and
says why.
"""

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from vlrl.config import RolloutConfig
from vlrl.models import load_policy
from vlrl.rollout import dist_sync
from vlrl.rollout.build import build_engine, close_engine

from .sglang_contract import WheelUnavailable, cache_dir, wheel_path
from .sglang_runtime import digest, extract

pytestmark = pytest.mark.usefixtures("one_thread")
BUSY_FLUSHES = 2  # /flush_cache refusals after each pause (requests still settling): the client must retry


@pytest.fixture(scope="module")
def sglang(tiny_vlm_dir, tmp_path_factory):
    """The URL of one SGLang weight-update server (a subprocess) serving ``tiny_vlm_dir``'s checkpoint."""
    try:
        folder = extract(wheel_path(), cache_dir() / "extracted")
    except WheelUnavailable as err:
        pytest.skip(str(err))
    log = open(tmp_path_factory.mktemp("sglang") / "server.log", "w+")
    process = subprocess.Popen([sys.executable, str(Path(__file__).with_name("sglang_runtime.py")), "--sglang",
                                str(folder), "--model", str(tiny_vlm_dir), "--busy-flushes", str(BUSY_FLUSHES)],
                               stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.time() + 120
        while True:
            log.seek(0)
            found = [line for line in log.read().splitlines() if line.startswith("listening on ")]
            if found:
                break
            if process.poll() is not None or time.time() > deadline:
                log.seek(0)
                raise RuntimeError(f"the SGLang weight-update server did not start: {log.read()[-3000:]}")
            time.sleep(0.1)
        yield found[0].removeprefix("listening on ")
    finally:
        process.terminate()
        process.wait(30)
        log.close()


def _state(url):
    return httpx.get(f"{url}/harness/state", timeout=30).json()


def _trainer_checkpoint(policy, folder):
    """``dtype|shape|crc32`` per checkpoint name of what ``save_pretrained`` writes (what SGLang's models load)."""
    policy.model.save_pretrained(folder)
    return digest(load_file(Path(folder) / "model.safetensors"))


MODES = ("finish", "abort", "retract", "in_place")


def test_every_update_of_a_run_lands_through_sglangs_own_distributed_path(sglang, tiny_vlm_dir, tmp_path, monkeypatch):
    """Version 0 as `build_engine` sends it, then per ``on_weight_update`` mode one update as the synchronous recipe
    sends it (``update_weights``) and one as the asynchronous recipe does (``publish``, then its future)."""
    from vlrl.rollout import publish

    checksums = []
    monkeypatch.setattr(dist_sync, "StreamingChecksum", lambda *a: checksums.append(a))
    monkeypatch.setattr(publish, "weight_checksum", lambda *a, **k: checksums.append(a))
    policy = load_policy(str(tiny_vlm_dir))
    cfg = RolloutConfig(servers={"urls": [sglang], "api_key_env": "VLRL_NO_KEY"},
                        weight_sync={"method": "distributed", "bucket_mb": 0.5, "dir": str(tmp_path / "weights")})
    seen = len(_state(sglang)["calls"])
    engine = build_engine(cfg, policy, run_dir=tmp_path)  # every recipe's start: the servers get version 0
    try:
        updates = [("finish", None)] + [(mode, call) for mode in MODES for call in ("update_weights", "publish")]
        for version, (mode, call) in enumerate(updates):
            engine.weights.on_weight_update = mode  # (rollout.servers.on_weight_update)
            if call is not None:
                with torch.no_grad():
                    for k, p in enumerate(policy.model.parameters()):
                        p.add_(0.01 * version * (k + 1) / 100)
                if call == "update_weights":  # the synchronous recipe's call
                    engine.update_weights(version=version)
                else:  # the asynchronous recipe's: returns at once, resolves once the servers confirmed
                    assert engine.publish(version=version).result(120) == version
            state = _state(sglang)
            calls, seen = state["calls"][seen:], len(state["calls"])
            _check_update(calls, mode, version, first=version == 0)
            assert state["weight_version"] == str(version)  # what SGLang's scheduler recorded
            assert state["weights"] == _trainer_checkpoint(policy, tmp_path / f"v{version}"), (mode, call)
            assert engine.last_sync.method == "distributed" and engine.weight_version == version
            assert state["hooks"] == {"restore": version + 1, "postprocess": version + 1, "post_load": 0}
    finally:
        close_engine(engine)
    assert not (tmp_path / "weights").exists()  # nothing went through the disk
    assert checksums == []  # SGLang reports no checksum: the trainer computed none
    assert [c["path"] for c in _state(sglang)["calls"][seen:]] == ["/destroy_weights_update_group"]


def _check_update(calls, mode, version, *, first):
    """One update's calls at the server, in order, each answered 200: pause → flush (refused BUSY_FLUSHES times, then
    done; none in place) → SGLang's session around the group's formation (the first update) and every bucket → continue."""
    paths = [c["path"] for c in calls]
    assert "/update_weights_from_disk" not in paths, calls
    buckets = [c for c in calls if c["path"] == "/update_weights_from_distributed"]
    flushes = [] if mode == "in_place" else ["/flush_cache"] * (BUSY_FLUSHES + 1)
    expected = (["/pause_generation", *flushes, "/begin_weight_update"]
                + ["/init_weights_update_group"] * first
                + ["/update_weights_from_distributed"] * len(buckets) + ["/end_weight_update", "/continue_generation"])
    assert paths == expected, calls
    assert calls[0]["mode"] == {"finish": "retract"}.get(mode, mode)
    assert [c["status"] for c in calls if c["path"] == "/flush_cache"] == [400] * BUSY_FLUSHES + [200] if flushes \
        else True
    assert all(c["status"] == 200 for c in calls if c["path"] != "/flush_cache"), calls
    assert len(buckets) >= 9 and sum(c["names"] for c in buckets) == 82  # 4.3 MB of tensors in ≤ 0.5 MB buckets
    assert all(c["load_format"] == "flattened_bucket" and c["flush_cache"] is False for c in buckets)  # flushed before
    assert [c["weight_version"] for c in buckets] == [None] * (len(buckets) - 1) + [str(version)]
    assert buckets[-1]["message"].endswith(f"Weight version updated to {version}.")
