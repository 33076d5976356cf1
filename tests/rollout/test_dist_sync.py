"""Distributed weight sync on SGLang's protocol (`vlrl.rollout.dist_sync`): the trainer broadcasts its weights over
a gloo group that two `vlrl serve` processes joined, bucket by bucket, and every server ends with the trainer's
checksum; the server's endpoints refuse malformed requests naming the field."""

import httpx
import pytest
import torch

import forked_runs  # tests/ is on sys.path
from vlrl.data import generate
from vlrl.models import load_policy
from vlrl.rollout import SamplingParams
from vlrl.rollout.dist_sync import Entry, StreamingChecksum, buckets, close_group, plan_entries
from vlrl.rollout.http_engine import HTTPEngine
from vlrl.rollout.http_settings import ClientSettings, SyncSettings
from vlrl.rollout.weights import weight_checksum

from .conftest import API_KEY, running_server, vlrl_serve

pytestmark = pytest.mark.usefixtures("one_thread")
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _info(url):
    return httpx.get(f"{url}/server_info", headers=AUTH, timeout=30).json()


def _nudge(model, amount):
    with torch.no_grad():
        for k, p in enumerate(model.parameters()):
            p.add_(amount * (k + 1) / 100)


def test_every_server_ends_with_the_trainers_checksum_after_a_distributed_update(tiny_vlm_dir, tmp_path):
    policy = load_policy(str(tiny_vlm_dir))
    with vlrl_serve(str(tiny_vlm_dir), tmp_path, n=2) as urls:
        engine = HTTPEngine(policy, urls, SyncSettings(tmp_path / "weights", method="distributed", bucket_mb=0.5),
                            ClientSettings(api_key=API_KEY, request_timeout=60))
        try:
            for version in (1, 2):  # the second update reuses the group formed by the first
                _nudge(policy.model, 0.01 * version)
                before = [_info(u)["weight_checksum"] for u in urls]
                engine.update_weights(version=version)
                expected = weight_checksum(policy.model)
                assert all(b != expected for b in before)  # the servers did not already hold these weights
                for url in urls:
                    info = _info(url)
                    assert info["weight_checksum"] == expected and info["weight_version"] == str(version)
                sync = engine.last_sync
                # 4.3 MB of float32 parameters in buckets of at most 0.5 MB (a larger tensor goes alone): ≥ 9 buckets
                numel = sum(t.numel() for t in policy.model.state_dict().values())
                assert sync.method == "distributed" and sync.servers == 2 and sync.bytes == 4 * numel
                assert sync.buckets >= 9
            assert not (tmp_path / "weights").exists()  # nothing went through the disk
            out = engine.generate([engine.encode(generate("shapes", 1, tasks=["count"])[0])],
                                  SamplingParams(n=2, max_new_tokens=3))
            assert [t.weight_version for t in out] == [2, 2]
        finally:
            engine.close()


def test_vlrl_serve_keeps_sglangs_weight_update_session(tiny_vlm):
    """SGLang 0.5.23's session (its scheduler's weight updater): a bucket outside it is refused with SGLang's message
    before anything is received; one session at a time; an end without a session is refused; /flush_cache answers
    as SGLang's does (plain text)."""
    bucket = {"names": ["x"], "dtypes": ["float32"], "shapes": [[2]], "group_name": "nope"}
    with running_server(tiny_vlm) as served, httpx.Client(base_url=served.url, headers=AUTH, timeout=30) as client:
        answer = client.post("/update_weights_from_distributed", json=bucket)
        assert answer.status_code == 400 and answer.json()["message"] == (
            "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()")
        assert client.post("/end_weight_update", json={}).json()["message"].startswith("no weight-update session")
        assert client.post("/begin_weight_update", json={}).json() == {"success": True, "message": "Success"}
        again = client.post("/begin_weight_update", json={"selector": "all"})
        assert again.status_code == 400 and "already open" in again.json()["message"]
        answer = client.post("/update_weights_from_distributed", json=bucket)  # in a session: the group is checked
        assert answer.status_code == 400 and "group_name" in answer.json()["message"]
        assert client.post("/end_weight_update", json={}).status_code == 200
        assert client.post("/begin_weight_update", json={"selector": "nope"}).status_code == 400
        flushed = client.post("/flush_cache")
        assert flushed.status_code == 200 and flushed.text == "Cache flushed.\n"
        assert served.batcher.version[0] == 0


def test_the_server_refuses_malformed_distributed_requests_naming_the_field(tiny_vlm):
    with running_server(tiny_vlm) as served, httpx.Client(base_url=served.url, headers=AUTH, timeout=30) as client:
        assert client.post("/begin_weight_update", json={}).status_code == 200
        answer = client.post("/update_weights_from_distributed",
                             json={"names": ["x"], "dtypes": ["float32"], "shapes": [[2]], "group_name": "nope"})
        assert answer.status_code == 400 and "group_name" in answer.json()["message"]
        answer = client.post("/init_weights_update_group", json={"master_address": "127.0.0.1", "master_port": 1,
                                                                 "rank_offset": 1, "world_size": 2, "backend": "nccl"})
        assert answer.status_code == 400 and "'backend'" in answer.json()["error"]
        answer = client.post("/init_weights_update_group", json={"master_address": "127.0.0.1", "master_port": 1,
                                                                 "rank_offset": 2, "world_size": 2, "backend": "gloo"})
        assert answer.status_code == 400 and "'rank_offset'" in answer.json()["error"]
        assert served.batcher.version[0] == 0


def test_buckets_and_the_streamed_checksum_match_the_whole_model_checksum(tiny_vlm):
    model = tiny_vlm.model
    entries = plan_entries(model.state_dict(), None)
    assert [e.name for e in entries] == list(model.state_dict())  # no tied tensors in this preset: every one sent
    planned = buckets(entries, send_dtype=torch.float32, bucket_bytes=1 << 16)
    assert [e for b in planned for e in b] == entries
    # a bucket holds ≤ 64 KiB, unless it is a single larger tensor
    assert all(len(b) == 1 or sum(e.numel for e in b) * 4 <= 1 << 16 for b in planned)
    checksum = StreamingChecksum([None, torch.bfloat16])
    state = model.state_dict()
    for entry in entries:
        checksum.add(entry, state[entry.name])
    assert checksum.digest(None) == weight_checksum(model)
    assert checksum.digest(torch.bfloat16) == weight_checksum(model, dtype=torch.bfloat16)


def test_tied_tensors_are_sent_once_and_checksummed_under_every_name():
    model = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False))
    model[1].weight = model[0].weight  # tied, as an LM head tied to the embeddings
    entries = plan_entries(model.state_dict(), {"0.weight": "embed.weight"})
    assert entries == [Entry("0.weight", "embed.weight", (5, 3), 15, ("1.weight",), torch.float32)]
    checksum = StreamingChecksum([None])
    checksum.add(entries[0], model.state_dict()["0.weight"])
    assert checksum.digest(None) == weight_checksum(model)


def test_distributed_sync_needs_servers():
    from vlrl.config import RolloutConfig

    with pytest.raises(ValueError, match="rollout.weight_sync.method=distributed"):
        RolloutConfig(weight_sync={"method": "distributed"})


@pytest.mark.e2e
def test_vlrl_rl_with_distributed_weight_sync_leaves_the_servers_with_the_final_weights(tiny_vlm_dir, tmp_path):
    """`vlrl rl … rollout.weight_sync.method=distributed` against two `vlrl serve` processes: the run trains, every
    update goes by broadcast (nothing under rollout_weights/), and both servers end with the checksum of the
    exported final weights."""
    import os
    import sys

    out = tmp_path / "run"
    with vlrl_serve(str(tiny_vlm_dir), tmp_path, n=2) as urls:
        args = [f"model.path={tiny_vlm_dir}", "train.steps=2", "train.prompts_per_step=2", "rollout.n=2",
                "rollout.max_new_tokens=4", "data.n_train=8", "data.n_test=2", "report.html=false",
                "check.enabled=false", "eval.samples=1", "eval.max_new_tokens=2", f"rollout.servers.urls=[{','.join(urls)}]",
                "rollout.weight_sync.method=distributed", f"out={out}"]
        env = {**os.environ, "VLRL_API_KEY": API_KEY, "OMP_NUM_THREADS": "1"}
        proc = forked_runs.run([sys.executable, "-m", "vlrl.cli", "rl", *args], env=env, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        final = load_policy(str(out / "checkpoints" / "final"))
        for url in urls:
            info = _info(url)
            assert info["weight_version"] == "2" and info["weight_checksum"] == weight_checksum(final.model)
    assert not (out / "rollout_weights").exists()


def test_a_server_killed_between_updates_sends_that_update_by_disk_and_the_next_over_a_new_group(tiny_vlm_dir,
                                                                                                 tmp_path):
    import signal

    policy = load_policy(str(tiny_vlm_dir))
    with vlrl_serve(str(tiny_vlm_dir), tmp_path, n=2, keep_processes=True) as (urls, processes):
        engine = HTTPEngine(policy, urls, SyncSettings(tmp_path / "weights", method="distributed"),
                            ClientSettings(api_key=API_KEY, request_timeout=60, max_server_failures=1))
        try:
            engine.update_weights(version=1)
            processes[0].send_signal(signal.SIGKILL)
            processes[0].wait(30)
            _nudge(policy.model, 0.01)
            engine.update_weights(version=2)  # the group is broken: this one goes by disk, to the survivor
            assert engine.last_sync.method == "disk" and [s.url for s in engine.live_servers()] == [urls[1]]
            assert _info(urls[1])["weight_groups"] == []  # the group the dead server broke is gone on the survivor
            _nudge(policy.model, 0.01)
            engine.update_weights(version=3)  # a new group: the trainer and the survivor
            assert engine.last_sync.method == "distributed" and engine.last_sync.servers == 1
            info = _info(urls[1])
            assert info["weight_version"] == "3" and info["weight_checksum"] == weight_checksum(policy.model)
            assert len(info["weight_groups"]) == 1
            engine.close()
            assert _info(urls[1])["weight_groups"] == []  # destroyed (/destroy_weights_update_group) at the close
        finally:
            engine.close()


def test_a_server_dying_mid_broadcast_sends_that_update_by_disk_and_the_next_over_a_new_group(tiny_vlm_dir, tmp_path,
                                                                                              caplog):
    """Server 0 exits (status 86, `dist_sync.EXIT_AT_BUCKET_ENV`) when the 2nd bucket of the first update is
    announced, before it joins that bucket's broadcast — while the trainer broadcasts it and server 1 receives it.
    The trainer must notice (the dead server's connection drops), close the group so server 1's receive ends too,
    and load that version by disk on server 1 — not wait out ``sync_timeout`` — then form a new group next time."""
    import logging
    import time

    from vlrl.rollout.dist_sync import EXIT_AT_BUCKET_ENV

    policy = load_policy(str(tiny_vlm_dir))
    sync_timeout = 60.0
    with vlrl_serve(str(tiny_vlm_dir), tmp_path, n=2, keep_processes=True,
                    env=[{EXIT_AT_BUCKET_ENV: "2"}, {}]) as (urls, processes):
        engine = HTTPEngine(policy, urls, SyncSettings(tmp_path / "weights", method="distributed", bucket_mb=0.5,
                                                       timeout=sync_timeout),
                            ClientSettings(api_key=API_KEY, request_timeout=60, max_server_failures=1))
        try:
            _nudge(policy.model, 0.01)
            started = time.monotonic()
            with caplog.at_level(logging.WARNING, logger="vlrl.rollout.http_engine"):
                engine.update_weights(version=1)
            elapsed = time.monotonic() - started
            assert processes[0].wait(30) == 86  # it died inside the update, where the hook put it
            assert engine.last_sync.method == "disk" and [s.url for s in engine.live_servers()] == [urls[1]]
            assert "distributed weight update 1 failed" in caplog.text
            assert elapsed < sync_timeout  # the failure was detected, not waited out
            info = _info(urls[1])
            assert info["weight_version"] == "1" and info["weight_checksum"] == weight_checksum(policy.model)
            _nudge(policy.model, 0.01)
            engine.update_weights(version=2)  # a new group: the trainer and the survivor
            sync = engine.last_sync
            assert sync.method == "distributed" and sync.servers == 1 and sync.buckets >= 9
            info = _info(urls[1])
            assert info["weight_version"] == "2" and info["weight_checksum"] == weight_checksum(policy.model)
        finally:
            engine.close()


def test_a_server_dead_before_the_first_update_fails_it_at_once(tiny_vlm_dir, tmp_path, caplog):
    """A server that died before the group is formed: its first call of the update (/begin_weight_update, before any
    group is formed) fails, so no rendezvous is even tried — the trainer gives up at once (the warning names that
    server's failed call, not a rendezvous timeout), loads the version by disk on the survivor, and the next update
    forms a group with it."""
    import logging
    import signal

    policy = load_policy(str(tiny_vlm_dir))
    with vlrl_serve(str(tiny_vlm_dir), tmp_path, n=2, keep_processes=True) as (urls, processes):
        # a short rendezvous timeout: the trainer's abandoned rendezvous ends soon after, and with it the survivor's
        engine = HTTPEngine(policy, urls, SyncSettings(tmp_path / "weights", method="distributed", timeout=5),
                            ClientSettings(api_key=API_KEY, request_timeout=60, max_server_failures=1))
        try:
            processes[1].send_signal(signal.SIGKILL)
            processes[1].wait(30)
            with caplog.at_level(logging.WARNING, logger="vlrl.rollout.http_engine"):
                engine.update_weights(version=1)
            assert f"SessionRefused: {urls[1]}/begin_weight_update: ConnectError" in caplog.text
            assert engine.last_sync.method == "disk" and [s.url for s in engine.live_servers()] == [urls[0]]
            _nudge(policy.model, 0.01)
            engine.update_weights(version=2)
            assert engine.last_sync.method == "distributed" and engine.last_sync.servers == 1
            info = _info(urls[0])
            assert info["weight_version"] == "2" and info["weight_checksum"] == weight_checksum(policy.model)
        finally:
            engine.close()


def test_a_flattened_bucket_mixing_dtypes_arrives_intact():
    """`pack`, then `receive` from the same buffer over a one-rank gloo group (rank 0 broadcasts to itself: the bytes
    stay; what is tested is the cutting back into tensors): a bool tensor of 3 bytes puts the float32 after it at an
    offset that is not a multiple of 4 (it cannot be viewed in place: `receive` copies it out), the int64 after
    that at offset 3 + 8 = 11; every tensor comes back equal, in order, with its dtype and shape."""
    from vlrl.rollout.dist_sync import ByteBuffer, open_group, pack, receive
    from vlrl.serving import bind_socket

    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    sock.close()
    group = open_group("127.0.0.1", port, rank=0, world_size=1, group_name="mixed", timeout=30)
    try:
        tensors = [torch.tensor([True, False, True]), torch.tensor([[1.5], [-2.25]]), torch.tensor([7], dtype=torch.int64)]
        dtypes = [t.dtype for t in tensors]
        buffer = ByteBuffer()
        flat, slices = pack(tensors, dtypes, buffer)
        assert flat.numel() == 3 + 8 + 8 and [s.numel() for s in slices] == [3, 8, 8]
        out = receive(group, [t.shape for t in tensors], dtypes, flattened=True, buffer=buffer)  # (its own bytes)
        for sent, got in zip(tensors, out, strict=True):
            assert got.dtype == sent.dtype and got.shape == sent.shape and torch.equal(got, sent)
        # a float32 bucket cast to bfloat16 on the way: packed in one pass, 2 bytes each
        flat, _ = pack([torch.tensor([1.0, 2.0])], [torch.bfloat16], buffer)
        assert flat.numel() == 4 and torch.equal(flat.view(torch.bfloat16), torch.tensor([1.0, 2.0], dtype=torch.bfloat16))
    finally:
        close_group(group)


def test_a_bucket_is_received_straight_into_the_weights_once_they_are_views_of_its_storage(tiny_vlm):
    """`FlatBuckets`: the first time a bucket layout comes, a fresh flat tensor receives it (here: filled by `pack`,
    as a broadcast would) and the model's tensors become views of it; the next time the same layout comes, that
    very storage is handed out again — received into, it *is* the weights (no copy). Layouts that cannot be taken
    in place get None: another dtype (the copy must cast), a name the model lacks."""
    from vlrl.rollout.batcher import private_copy
    from vlrl.rollout.dist_sync import ByteBuffer, pack
    from vlrl.rollout.weights import FlatBuckets, WeightWriter

    model = private_copy(tiny_vlm).model
    state = model.state_dict()
    names = list(state)[:5]
    shapes = [list(state[n].shape) for n in names]
    dtypes = [state[n].dtype for n in names]
    new = [state[n] + 1 for n in names]
    flats = FlatBuckets(model)
    flat, fresh = flats.storage(names, dtypes, shapes)
    assert fresh and flat.numel() == sum(t.numel() * 4 for t in new)
    flat.copy_(pack(new, dtypes, ByteBuffer())[0])  # what the broadcast writes
    flats.adopt(names, dtypes, shapes, flat)
    writer = WeightWriter(model)
    writer.written_in_place(names)
    after = model.state_dict()
    for name, expected in zip(names, new, strict=True):
        assert torch.equal(after[name], expected)
        assert after[name].untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    assert writer.missing() == sorted(set(state) - set(names))  # the 5 count as written, nothing else does
    again, fresh = flats.storage(names, dtypes, shapes)
    assert not fresh and again is flat
    again.copy_(pack([t + 1 for t in new], dtypes, ByteBuffer())[0])  # the next update's broadcast ...
    assert torch.equal(model.state_dict()[names[0]], new[0] + 1)  # ... is the weights, with no copy
    assert flats.storage(names, [torch.bfloat16] * 5, shapes) is None
    assert flats.storage(["no.such.tensor"], [torch.float32], [[1]]) is None


def test_tied_tensors_are_not_split_by_receiving_in_place():
    """Two entries sharing storage through different tensor objects cannot be moved one at a time (the tie would
    break): that layout is refused. A tie through one shared parameter (how transformers ties) moves as one."""
    from vlrl.rollout.weights import FlatBuckets

    model = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False))
    model[1].weight = model[0].weight  # one Parameter object under two names
    flats = FlatBuckets(model)
    placed = flats.storage(["0.weight"], [torch.float32], [[5, 3]])
    assert placed is not None
    flats.adopt(["0.weight"], [torch.float32], [[5, 3]], placed[0])
    assert model[1].weight is model[0].weight and model[1].weight.data_ptr() == placed[0].data_ptr()
    other = torch.nn.Sequential(torch.nn.Linear(3, 3, bias=False), torch.nn.Linear(3, 3, bias=False))
    other[1].weight = torch.nn.Parameter(other[0].weight.data)  # same storage, two objects
    assert FlatBuckets(other).storage(["0.weight"], [torch.float32], [[3, 3]]) is None


def test_every_bucket_is_aligned_to_its_dtypes_as_sglang_requires():
    """SGLang refuses a flattened bucket whose tensors do not start at a multiple of their element size
    (``srt/weight_sync/tensor_bucket.py``): the trainer orders each bucket by element size, largest first, so a
    model of mixed dtypes (float weights sent in bfloat16, an int64 buffer, a bool mask) needs no padding."""
    from vlrl.rollout.dist_sync import unaligned_entry

    state = {"mask": torch.ones(3, dtype=torch.bool), "w": torch.zeros(5, 3), "position_ids": torch.arange(7),
             "b": torch.zeros(3), "flag": torch.zeros(1, dtype=torch.bool), "v": torch.zeros(2, 2)}
    entries = plan_entries(state, None)
    for bucket_bytes in (1, 40, 1 << 20):
        planned = buckets(entries, send_dtype=torch.bfloat16, bucket_bytes=bucket_bytes)
        assert sorted(e.name for b in planned for e in b) == sorted(state)
        for bucket in planned:
            dtypes = [e.send_dtype(torch.bfloat16) for e in bucket]
            assert unaligned_entry(dtypes, [e.shape for e in bucket]) is None, [e.name for e in bucket]
    (whole,) = buckets(entries, send_dtype=torch.bfloat16, bucket_bytes=1 << 20)
    assert [e.name for e in whole] == ["position_ids", "w", "b", "v", "mask", "flag"]  # 8, then 2, then 1 byte


def test_vlrl_serve_refuses_an_unaligned_bucket_as_sglang_does():
    """Before joining its broadcast (nothing is received, the group stays usable), naming the tensor."""
    from vlrl.rollout.dist_sync import Receiver, open_group
    from vlrl.serving import bind_socket

    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    sock.close()
    receiver = Receiver(timeout=30)
    receiver.groups["g"] = open_group("127.0.0.1", port, rank=0, world_size=1, group_name="unaligned", timeout=30)
    try:
        with pytest.raises(ValueError, match="'w' .* would start at byte 3"):
            receiver.receive("g", ["mask", "w"], ["bool", "float32"], [[3], [2]], load_format="flattened_bucket")
        assert receiver.buckets == 0 and "g" in receiver.groups
    finally:
        receiver.close()


def test_the_bucket_buffer_lives_on_the_groups_device(tiny_vlm, monkeypatch):
    """NCCL broadcasts only GPU memory: over an NCCL group every bucket is gathered and packed on the GPU (the
    CPU has none here, so the engine's calls are recorded instead); over gloo, on the CPU."""
    from vlrl.rollout import dist_sync
    from vlrl.rollout.http_engine import HTTPEngine

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert dist_sync.group_device("nccl") == torch.device("cuda", 0)
    assert dist_sync.group_device("gloo") == torch.device("cpu")
    # pack puts the bytes on the device it is given, whatever the tensors' ("meta": a device with no memory)
    flat, _ = dist_sync.pack([torch.ones(3)], [torch.bfloat16], dist_sync.ByteBuffer(), torch.device("meta"))
    assert flat.device.type == "meta" and flat.numel() == 6

    seen = []

    class Stop(Exception):
        pass

    def gather(state, bucket, device="cpu"):
        seen.append(("gather", torch.device(device)))
        return [state[e.name] for e in bucket]

    def pack(tensors, dtypes, buffer, device=None):
        seen.append(("pack", torch.device(device)))
        raise Stop

    with running_server(tiny_vlm) as served:
        engine = HTTPEngine(tiny_vlm, [served.url], SyncSettings("/nonexistent", method="distributed"),
                            ClientSettings(api_key=API_KEY))
        try:
            monkeypatch.setattr(dist_sync, "full_tensors", gather)
            monkeypatch.setattr(dist_sync, "pack", pack)
            live = engine.live_servers()
            group = engine.weights.group
            plan = group.bucket_plan(live)
            group.device = dist_sync.group_device("nccl")  # what `WeightGroup.form` sets for an NCCL group
            with pytest.raises(Stop):
                group.broadcast(1, tiny_vlm.model.state_dict(), live, plan, on_weight_update="finish")
        finally:
            engine.close()
    assert seen[:2] == [("gather", torch.device("cuda", 0)), ("pack", torch.device("cuda", 0))]


def test_a_group_the_trainer_replaces_is_destroyed_on_its_servers(tiny_vlm, monkeypatch):
    """Each formation is a new group: the one it replaces (here: a server still holds group "old") is destroyed on
    the servers that joined it (/destroy_weights_update_group) before the new one forms — else each re-formation
    leaves one dead group per server. The new formation is made to fail at once here (no second process)."""
    from vlrl.rollout import dist_sync
    from vlrl.rollout.dist_sync import open_group
    from vlrl.serving import bind_socket

    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    sock.close()
    with running_server(tiny_vlm) as served:
        engine = HTTPEngine(tiny_vlm, [served.url], SyncSettings("/nonexistent", method="distributed", timeout=5),
                            ClientSettings(api_key=API_KEY))
        try:
            receiver = served.thread.app.state.weights.receiver
            receiver.groups["old"] = open_group("127.0.0.1", port, rank=0, world_size=1, group_name="old", timeout=30)
            engine.weights.group.name, engine.weights.group.servers = "old", [served.url]  # as if "old" had been formed
            assert _info(served.url)["weight_groups"] == ["old"]

            def refuse(*args, **kwargs):
                raise RuntimeError("no second rank here")

            monkeypatch.setattr(dist_sync, "open_group", refuse)
            with pytest.raises(RuntimeError):
                engine.weights.group.form(engine.live_servers())
            assert _info(served.url)["weight_groups"] == []
        finally:
            engine.close()
