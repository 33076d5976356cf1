"""`HTTPEngine` reliability: load balancing, retries, dropping dead or stalled servers, weight-sync checks."""

import dataclasses

import pytest
import torch

from vlrl.data import generate
from vlrl.rollout import SamplingParams, Status
from vlrl.rollout.batcher import private_copy
from vlrl.rollout.http_engine import HTTPEngine
from vlrl.rollout.http_settings import ClientSettings, SyncSettings
from vlrl.rollout.server_pool import NoServersLeft, RolloutRequestError
from vlrl.rollout.weights import WeightSyncError

from .test_server import _Gate

pytestmark = pytest.mark.usefixtures("one_thread")


def _requests(engine, n=6):
    return [engine.encode(s) for s in generate("shapes", n, tasks=["count"])]


def test_load_is_balanced_across_servers(tiny_vlm, http_engine_factory):
    engine, _ = http_engine_factory(tiny_vlm, n_servers=2)
    trajectories = engine.generate(_requests(engine, 8), SamplingParams(n=2, max_new_tokens=4))
    assert len(trajectories) == 16
    assert all(s.served > 0 for s in engine.servers)


def test_a_dead_server_is_retried_then_dropped_and_no_prompt_is_lost(tiny_vlm, http_engine_factory, caplog):
    engine, servers = http_engine_factory(tiny_vlm, n_servers=2, max_server_failures=1)
    dead = engine.servers[0]
    servers[0].thread.stop()  # connections to the first server are refused from now on
    requests = _requests(engine)
    trajectories = engine.generate(requests, SamplingParams(n=2, max_new_tokens=4))
    assert [t.sample.id for t in trajectories] == [r.sample.id for r in requests for _ in range(2)]
    assert all(t.status is not Status.ABORTED for t in trajectories)
    assert not dead.alive and engine.live_servers() == [engine.servers[1]]
    assert any("dropping rollout server" in r.message for r in caplog.records)
    engine.update_weights(version=1)  # the dropped server is not asked, the live one confirms
    assert engine.weight_version == 1


def test_a_stalled_server_times_out_and_is_dropped(tiny_vlm, http_engine_factory):
    # 5 s: the healthy server (a thread of this process, beside a loaded suite) must answer within it — at 1 s a
    # full-suite run saw both servers time out together (2026-11-28) — and the stalled one is waited out after it
    engine, servers = http_engine_factory(tiny_vlm, n_servers=2, request_timeout=5.0, max_server_failures=1)
    stalled = engine.servers[0]
    gate = _Gate(servers[0].batcher)  # the first server's worker blocks inside its next batch
    try:
        trajectories = engine.generate(_requests(engine, 4), SamplingParams(max_new_tokens=3))
    finally:
        gate.release.set()
    assert len(trajectories) == 4 and all(t.status is not Status.ABORTED for t in trajectories)
    assert not stalled.alive and "ReadTimeout" in engine.dropped[0]


def test_every_server_gone_is_an_error(tiny_vlm, http_engine_factory):
    engine, servers = http_engine_factory(tiny_vlm, n_servers=1, max_server_failures=1, max_retries=1)
    servers[0].thread.stop()
    with pytest.raises((NoServersLeft, RolloutRequestError)):
        engine.generate(_requests(engine, 1), SamplingParams(max_new_tokens=2))
    assert engine.live_servers() == []


def test_a_rejected_request_raises_instead_of_retrying(tiny_vlm, http_engine_factory):
    engine, _ = http_engine_factory(tiny_vlm)
    bad = dataclasses.replace(_requests(engine, 1)[0], prompt_ids=[10**9])
    with pytest.raises(RolloutRequestError, match="400"):
        engine.generate([bad], SamplingParams(max_new_tokens=2))
    assert engine.servers[0].alive and engine.servers[0].failures == 0


def test_checksum_mismatch_stops_the_sync(tiny_vlm, http_engine_factory):
    engine, servers = http_engine_factory(tiny_vlm)
    batcher = servers[0].batcher
    real_load = batcher.load
    batcher.load = lambda policy, *, version, abort=False: real_load(policy, version=version, abort=abort)[::-1]
    with pytest.raises(WeightSyncError, match="checksum"):
        engine.update_weights(version=1)
    assert engine.weight_version == 0  # never bumped


def test_versions_bump_only_after_every_server_loaded(tiny_vlm, http_engine_factory):
    engine, servers = http_engine_factory(tiny_vlm, n_servers=2)
    with torch.no_grad():
        next(tiny_vlm.model.parameters()).add_(1.0)
    engine.update_weights(version=4)
    assert engine.weight_version == 4
    assert [s.batcher.version[0] for s in servers] == [4, 4]
    assert all(t.weight_version == 4 for t in engine.generate(_requests(engine, 2), SamplingParams(max_new_tokens=2)))


def test_wrong_api_key_fails_at_start(tiny_vlm, http_engine_factory, tmp_path):
    _, servers = http_engine_factory(tiny_vlm)
    with pytest.raises(RolloutRequestError, match="401"):
        HTTPEngine(tiny_vlm, [servers[0].url], SyncSettings(tmp_path), ClientSettings(api_key="wrong", startup_timeout=5))


def test_publish_returns_before_the_servers_confirm_and_bumps_the_version_after(tiny_vlm, http_engine_factory):
    """The trainer may move its weights as soon as `publish` returns: the servers still load (and checksum)
    what was published; `weight_version` moves only when the slow server confirmed."""
    import threading

    from vlrl.rollout.weights import weight_checksum

    engine, servers = http_engine_factory(tiny_vlm)
    batcher = servers[0].batcher
    loading, release = threading.Event(), threading.Event()
    real_load = batcher.load_in_place

    def slow_load(weights, **kwargs):
        loading.set()
        release.wait(30)
        return real_load(weights, **kwargs)

    batcher.load_in_place = slow_load
    with torch.no_grad():
        next(tiny_vlm.model.parameters()).add_(1.0)
    published = weight_checksum(tiny_vlm.model)
    update = engine.publish(version=1)
    assert loading.wait(30) and not update.done() and engine.weight_version == 0
    with torch.no_grad():  # the next optimizer step, while the server loads
        next(tiny_vlm.model.parameters()).add_(1.0)
    release.set()
    assert update.result(30) == 1 and engine.weight_version == 1
    assert batcher.version == (1, published)  # what was published, not the moved weights


def test_a_sync_while_requests_are_in_flight_never_mis_tags_them(tiny_vlm, http_engine_factory):
    """Prompts decoding when version 1 is published finish on version 0's weights and say so; prompts sent
    after it are tagged 1. The log-probs of each equal a teacher-forced pass of the weights of its tag."""
    import concurrent.futures

    from .test_engine_contract import _teacher_forced

    engine, servers = http_engine_factory(tiny_vlm)
    old = private_copy(tiny_vlm)
    gate = _Gate(servers[0].batcher)
    sampling = SamplingParams(n=2, max_new_tokens=4)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        in_flight = pool.submit(engine.generate, _requests(engine, 2), sampling)
        assert gate.entered.wait(30)
        with torch.no_grad():
            for p in tiny_vlm.model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        engine.publish(version=1).result(30)  # confirmed while the old batch still decodes
        gate.release.set()
        before = in_flight.result(30)
    after = engine.generate(_requests(engine, 2), sampling)
    assert {t.weight_version for t in before} == {0} and {t.weight_version for t in after} == {1}
    for weights, trajectories in ((old, before), (tiny_vlm, after)):
        logp = _teacher_forced(weights, trajectories, 1.0)
        for i, t in enumerate(trajectories):
            assert torch.allclose(logp[i, : len(t.response_ids)], t.behaviour_logp, atol=1e-4)


def test_agenerate_calls_made_together_share_one_request_and_giving_up_cancels_it(tiny_vlm, http_engine_factory):
    """Three `agenerate` calls started together reach the server as one batched request (one job); when every
    caller of a request gives up, the HTTP request is cancelled too (nothing stays in flight)."""
    import asyncio
    import time

    engine, servers = http_engine_factory(tiny_vlm)
    batcher = servers[0].batcher
    requests = _requests(engine, 3)
    sampling = SamplingParams(n=2, max_new_tokens=3)

    async def together():
        return await asyncio.gather(*(engine.agenerate([r], sampling) for r in requests))

    jobs = []
    real_submit = batcher.submit
    batcher.submit = lambda requests, sampling, **kw: jobs.append(len(requests)) or real_submit(requests, sampling, **kw)
    groups = asyncio.run(together())
    assert [len(g) for g in groups] == [2, 2, 2] and jobs == [3]  # one job of three prompts
    assert [t.sample.id for g in groups for t in g] == [r.sample.id for r in requests for _ in range(2)]
    assert all(t.group_index == 0 for g in groups for t in g)  # each caller's own numbering
    gate = _Gate(batcher)

    async def give_up():
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(together(), 0.5)

    try:
        assert engine.servers[0].in_flight == 0
        asyncio.run(give_up())
        deadline = time.time() + 10
        while engine.servers[0].in_flight and time.time() < deadline:
            time.sleep(0.02)
        assert engine.servers[0].in_flight == 0
    finally:
        gate.release.set()


def test_a_call_larger_than_a_server_batch_goes_out_as_one_request_per_batch(tiny_vlm, http_engine_factory):
    """The server decodes 4 sequences at once: 5 prompts × n = 2 go out as requests of 2, 2 and 1 prompts, so
    the first answers do not wait for the last batch."""
    engine, servers = http_engine_factory(tiny_vlm, batcher_options={"max_batch_size": 4})
    batcher = servers[0].batcher
    jobs = []
    real_submit = batcher.submit
    batcher.submit = lambda requests, sampling, **kw: jobs.append(len(requests)) or real_submit(requests, sampling, **kw)
    requests = _requests(engine, 5)
    trajectories = engine.generate(requests, SamplingParams(n=2, max_new_tokens=2))
    assert sorted(jobs) == [1, 2, 2]
    assert [t.sample.id for t in trajectories] == [r.sample.id for r in requests for _ in range(2)]
    assert [t.group_index for t in trajectories] == [i for i in range(5) for _ in range(2)]


# ----------------------------------------------------------------------------------------------- issue 35: real SGLang
def test_a_weight_load_longer_than_the_request_timeout_keeps_the_server(tiny_vlm, http_engine_factory):
    """A disk update has its own timeout (rollout.weight_sync.update_timeout): a load that outlasts request_timeout
    (SGLang's waits for every /generate in flight) is not taken for a stalled server."""
    import time

    engine, servers = http_engine_factory(tiny_vlm, request_timeout=1.0, max_server_failures=1)
    batcher = servers[0].batcher
    real_load = batcher.load_in_place
    batcher.load_in_place = lambda weights, **kw: time.sleep(2.5) or real_load(weights, **kw)
    engine.update_weights(version=1)
    assert engine.weight_version == 1 and engine.servers[0].alive and batcher.version[0] == 1


@pytest.mark.parametrize("mode, paused", [("finish", []), ("abort", ["abort"]), ("retract", ["retract"]),
                                          ("in_place", ["in_place"])])
def test_each_update_pauses_the_servers_in_the_configured_mode_and_continues_after(tiny_vlm, http_engine_factory,
                                                                                   mode, paused):
    """SGLang's /pause_generation before the load and /continue_generation after (mode: rollout.servers.on_weight_update);
    ``finish`` on the disk path pauses nothing (SGLang's load waits for the requests in flight by itself)."""
    engine, servers = http_engine_factory(tiny_vlm, sync_options={"on_weight_update": mode})
    batcher, seen = servers[0].batcher, []
    real_pause, real_resume, real_load = batcher.pause, batcher.resume, batcher.load_in_place
    batcher.pause = lambda m: seen.append(("pause", m, batcher.version[0])) or real_pause(m)
    batcher.resume = lambda: seen.append(("continue", batcher.version[0])) or real_resume()
    batcher.load_in_place = lambda weights, **kw: seen.append(("load",)) or real_load(weights, **kw)
    engine.update_weights(version=1)
    expected = [("load",)] if not paused else [("pause", paused[0], 0), ("load",), ("continue", 1)]
    assert seen == expected and batcher.paused is None


@pytest.mark.parametrize("mode, tag", [("retract", 1), ("in_place", 0)])
def test_requests_decoding_through_a_paused_update_are_tagged_with_the_weights_they_used(tiny_vlm, http_engine_factory,
                                                                                         mode, tag):
    """A batch is decoding when version 1 is published. ``retract``: vlrl serve stops it, re-queues it and decodes
    it again from its prompt after the update — every token from version 1, tagged 1. ``in_place``: it waits at its
    decode step through the update and finishes on the weights it started with — tagged 0. The log-probs of each
    equal a teacher-forced pass of the weights of its tag."""

    from .test_engine_contract import _teacher_forced
    from .test_server_hardening import never_ends

    engine, servers = http_engine_factory(tiny_vlm, sync_options={"on_weight_update": mode})
    batcher = servers[0].batcher
    never_ends(batcher)  # (EOS suppressed: the batch decodes its 40 tokens, long enough to be caught mid-way)
    old = private_copy(tiny_vlm)
    sampling = SamplingParams(n=2, max_new_tokens=40)
    steps_at_load, real_load = [], batcher.load_in_place
    batcher.load_in_place = lambda weights, **kw: steps_at_load.append(batcher.decode_steps) or real_load(weights, **kw)
    out = _update_mid_generation(engine, batcher, tiny_vlm, sampling)
    assert 3 <= steps_at_load[0] < 40 <= batcher.decode_steps  # the batch was mid-way through its 40 steps
    assert {t.weight_version for t in out} == {tag} and all(t.status is not Status.ABORTED for t in out)
    assert any(stop.why == "retracted" for stop in batcher.early_stops) == (mode == "retract")
    weights = tiny_vlm if tag == 1 else old
    logp = _teacher_forced(weights, out, 1.0)
    for i, t in enumerate(out):
        assert torch.allclose(logp[i, : len(t.response_ids)], t.behaviour_logp, atol=1e-4)


def _answers_from(server_module, monkeypatch, change):
    """vlrl serve answering each trajectory through ``change(answer)`` (what another server would report)."""
    real_output = server_module.sglang_output

    def changed(policy, t, sampling, **kwargs):
        answer = real_output(policy, t, sampling, **kwargs)
        change(answer)
        return answer

    monkeypatch.setattr(server_module, "sglang_output", changed)


@pytest.mark.parametrize("check", ["error", "warn", "off"])
def test_a_server_that_sampled_from_other_prompt_ids_of_the_same_length_is_caught(tiny_vlm, http_engine_factory,
                                                                                  monkeypatch, caplog, check):
    """The client asks for the ids a server sampled from (SGLang's return_prompt_token_ids) and compares them with the
    trainer's: here the server's prompt has the same length and one other id (a context re-split on decode → encode;
    a count cannot see it): an error naming the sample and where the ids differ (prompt_check=error), a counted
    warning (warn), or nothing (off — and the ids are not asked for)."""
    import logging

    from vlrl.rollout.prompt_check import PromptMismatchError
    from vlrl.rollout.server import app as server_module

    engine, _ = http_engine_factory(tiny_vlm, prompt_check=check)
    requests = _requests(engine, 2)
    assert engine.generate(requests, SamplingParams(max_new_tokens=2))  # the true ids: no complaint
    asked = []

    def resplit(answer):
        asked.append("prompt_token_ids" in answer)
        if "prompt_token_ids" in answer:
            answer["prompt_token_ids"][2] += 1

    _answers_from(server_module, monkeypatch, resplit)
    if check == "error":
        with pytest.raises(PromptMismatchError, match=rf"sample '{requests[0].sample.id}' from other prompt ids "
                                                      rf"\({len(requests[0].prompt_ids)} against the trainer's "
                                                      rf"{len(requests[0].prompt_ids)}, the first difference at "
                                                      r"position 2\)"):
            engine.generate(requests, SamplingParams(max_new_tokens=2))
        return
    with caplog.at_level(logging.WARNING, logger="vlrl.rollout.http_engine"):
        out = engine.generate(requests, SamplingParams(n=2, max_new_tokens=2))
    assert len(out) == 4 and all(asked) == (check != "off")
    assert engine.prompt_mismatches == (4 if check == "warn" else 0)
    assert ("from other prompt ids" in caplog.text) == (check == "warn")


def test_a_server_that_returns_no_prompt_ids_is_compared_by_count(tiny_vlm, http_engine_factory, monkeypatch):
    """A server without return_prompt_token_ids (an older SGLang) is checked on meta_info.prompt_tokens."""
    from vlrl.rollout.prompt_check import PromptMismatchError
    from vlrl.rollout.server import app as server_module

    engine, _ = http_engine_factory(tiny_vlm)
    requests = _requests(engine, 2)
    expected = len(requests[0].prompt_ids)

    def longer(answer):
        answer.pop("prompt_token_ids", None)
        answer["meta_info"]["prompt_tokens"] += 4

    _answers_from(server_module, monkeypatch, longer)
    with pytest.raises(PromptMismatchError, match=rf"sample '{requests[0].sample.id}' from a prompt of "
                                                  rf"{expected + 4} tokens; the trainer scores {expected}"):
        engine.generate(requests, SamplingParams(max_new_tokens=2))


def test_a_server_whose_image_settings_differ_is_named_with_both_flags(tiny_vlm, http_engine_factory, caplog):
    """SGLang's /server_info carries its launch arguments: an image-processor backend other than PIL, or pixel bounds
    other than the trainer's, is named (with the flag that sets it) at start and in a mismatch's message."""
    import json
    import logging

    from vlrl.rollout.prompt_check import PromptCheck, trainer_pixel_bounds
    from vlrl.rollout.server_pool import ServerState

    engine, _ = http_engine_factory(tiny_vlm)
    low, high = trainer_pixel_bounds(tiny_vlm)
    server = ServerState("http://sglang")
    bounds = json.dumps({"image": {"min_pixels": low, "max_pixels": high * 2}})  # (as launched: a JSON string)
    engine.pool.read_facts(server, {"image_processor_backend": "auto", "mm_process_config": bounds})
    assert server.image_processor_backend == "auto" and server.pixel_bounds == (low, high * 2)
    engine.pool.servers.append(server)
    with caplog.at_level(logging.WARNING, logger="vlrl.rollout.http_engine"):
        PromptCheck(tiny_vlm, engine.pool)
    assert "http://sglang: its --image-processor-backend is 'auto'" in caplog.text
    assert f"image.max_pixels is {high * 2}, model.max_pixels is {high}" in caplog.text
    assert "min_pixels is" not in caplog.text  # (the same as the trainer's: not named)
    pil = ServerState("http://pil")
    engine.pool.read_facts(pil, {"disable_fast_image_processor": True, "image_processor_backend": "auto"})
    assert pil.image_processor_backend == "pil"  # (SGLang's deprecated flag wins, as its resolver reads it)


def test_answer_versions_tolerate_labels_and_take_the_oldest_span():
    from vlrl.rollout.versions import answer_version

    assert answer_version({"weight_version": "7"}, 3) == 7
    assert answer_version({"weight_version": "default"}, 3) == 3  # SGLang's --weight-version before vlrl's first
    assert answer_version({"weight_version": "v2-final"}, 3) == 3  # any label: the version at the request's start
    assert answer_version({}, 3) == 3
    spans = [{"version": "4", "start": 0, "end": 5}, {"version": "5", "start": 5, "end": 9}]
    assert answer_version({"weight_version": "5", "weight_versions": spans}, 4) == 4  # lived through an update


def test_server_facts_are_read_in_sglangs_spellings_and_ranks_follow_tp_size(tiny_vlm, http_engine_factory):
    from vlrl.rollout.server_pool import ServerState

    engine, _ = http_engine_factory(tiny_vlm)
    a, b = ServerState("http://a"), ServerState("http://b")
    engine.pool.read_facts(a, {"dtype": "half", "tp_size": 2, "max_running_requests": 64})
    engine.pool.read_facts(b, {"dtype": "auto", "tp_size": 4})
    assert (a.dtype, a.ranks, a.max_batch_size) == ("float16", 2, 64) and (b.dtype, b.ranks) == (None, 4)
    bodies = engine.weights.group.init_bodies([a, b], 29500, "g", "nccl")
    assert [(x["rank_offset"], x["world_size"]) for x in bodies] == [(1, 7), (3, 7)]  # trainer 0, a 1-2, b 3-6
    engine.pool.distributed = True  # (rollout.weight_sync.method=distributed)
    with pytest.raises(RolloutRequestError, match="dp_size 2"):
        engine.pool.read_facts(a, {"tp_size": 1, "dp_size": 2})


def test_an_admin_key_guards_the_weight_routes_and_the_client_sends_it(tiny_vlm, tmp_path):
    import httpx

    from vlrl.rollout.batcher import ContinuousBatcher
    from vlrl.rollout.server import create_app
    from vlrl.serving import ServerThread

    batcher = ContinuousBatcher(private_copy(tiny_vlm))
    server = ServerThread(create_app(batcher, api_key="user", admin_api_key="admin"))
    try:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            user, admin = {"Authorization": "Bearer user"}, {"Authorization": "Bearer admin"}
            assert client.post("/pause_generation", json={}, headers=user).status_code == 401
            assert client.post("/generate", json={"text": "hi"}, headers=admin).status_code == 401
            assert client.post("/pause_generation", json={"mode": "retract"}, headers=admin).status_code == 200
            assert client.post("/continue_generation", json={}, headers=admin).status_code == 200
        without = HTTPEngine(tiny_vlm, [server.url], SyncSettings(tmp_path / "a"), ClientSettings(api_key="user"))
        try:
            with pytest.raises(WeightSyncError, match="401"):
                without.update_weights(version=1)
        finally:
            without.close()
        engine = HTTPEngine(tiny_vlm, [server.url], SyncSettings(tmp_path / "b", on_weight_update="retract"),
                            ClientSettings(api_key="user", admin_api_key="admin"))
        try:
            engine.update_weights(version=1)
            out = engine.generate(_requests(engine, 1), SamplingParams(max_new_tokens=2))
            assert engine.weight_version == 1 and out[0].weight_version == 1
        finally:
            engine.close()
    finally:
        server.stop()
        batcher.close()


def test_a_server_that_never_answers_at_start_is_given_up_on_at_the_startup_timeout(tiny_vlm, tmp_path):
    """A server that accepts the connection and never answers /server_info: the start-up probe waits startup_timeout,
    not request_timeout (before the fix: the whole request_timeout, here 120 s)."""
    import socket
    import time

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # (the kernel accepts the connection; nobody ever answers)
        started = time.monotonic()
        with pytest.raises(RolloutRequestError, match="not ready after 2s"):
            HTTPEngine(tiny_vlm, [f"http://127.0.0.1:{silent.getsockname()[1]}"], SyncSettings(tmp_path),
                       ClientSettings(startup_timeout=2.0, request_timeout=120.0))
        assert time.monotonic() - started < 15


@pytest.mark.parametrize("reports, verify, computed", [(True, True, 1), (True, False, 0), (False, True, 0)])
def test_the_trainer_computes_a_checksum_only_for_servers_that_report_one(tiny_vlm, http_engine_factory, monkeypatch,
                                                                          reports, verify, computed):
    """vlrl serve reports a weight checksum, SGLang none: the trainer's own (every weight read once more — on a GPU
    copied to the host) is computed only for servers that report one at start, and only with verify_checksum."""
    from vlrl.rollout import publish

    engine, servers = http_engine_factory(tiny_vlm, sync_options={"verify_checksum": verify})
    engine.servers[0].reports_checksum = reports  # (an SGLang server: its /server_info has no weight_checksum)
    real, calls = publish.weight_checksum, []
    monkeypatch.setattr(publish, "weight_checksum", lambda *a, **k: calls.append(1) or real(*a, **k))
    engine.update_weights(version=1)
    assert len(calls) == computed and servers[0].batcher.version[0] == 1 and engine.weight_version == 1


def test_partial_rollout_on_vlrl_serve_continues_from_the_kept_tokens(tiny_vlm, http_engine_factory):
    """``on_weight_update=partial`` against vlrl serve: the client sends vlrl's own pause mode ``partial``; the batch
    decoding 40 tokens when version 1 is published keeps its tokens and goes on from them on version 1 (no token
    sampled twice). The answer reports its spans (``meta_info.weight_versions``) and the client's trajectory carries
    them as per-token versions — the first tokens 0, the rest 1, tagged 0 — each token's log-prob that of a
    teacher-forced pass of its own version's weights."""

    from .test_engine_contract import _teacher_forced
    from .test_server_hardening import never_ends

    engine, servers = http_engine_factory(tiny_vlm, sync_options={"on_weight_update": "partial"})
    batcher = servers[0].batcher
    never_ends(batcher)
    old = private_copy(tiny_vlm)
    sampling = SamplingParams(n=2, max_new_tokens=40)
    modes, real_pause = [], batcher.pause
    batcher.pause = lambda mode: modes.append(mode) or real_pause(mode)
    out = _update_mid_generation(engine, batcher, tiny_vlm, sampling)
    assert modes == ["partial"]
    for t in out:
        versions = t.versions.tolist()
        kept = versions.count(0)
        assert len(t.response_ids) == 40 and t.weight_version == 0 and t.status is not Status.ABORTED
        assert 3 <= kept < 40 and versions == [0] * kept + [1] * (40 - kept)
        assert torch.allclose(_teacher_forced(old, [t], 1.0)[0, :kept], t.behaviour_logp[:kept], atol=1e-4)
        assert torch.allclose(_teacher_forced(tiny_vlm, [t], 1.0)[0, kept:40], t.behaviour_logp[kept:], atol=1e-4)


def test_token_versions_are_read_from_spans_and_written_back():
    from vlrl.rollout.versions import token_versions, version_spans

    spans = [{"version": "4", "start": 0, "end": 3}, {"version": "5", "start": 3, "end": 5}]
    assert token_versions({"weight_versions": spans}, 5, 0).tolist() == [4, 4, 4, 5, 5]
    assert version_spans(torch.tensor([4, 4, 4, 5, 5])) == spans
    assert token_versions({"weight_version": "4"}, 5, 0) is None  # no spans: every token is the answer's version
    assert token_versions({"weight_versions": spans[:1]}, 5, 0) is None  # spans that leave tokens out: not trusted


def _update_mid_generation(engine, batcher, model, sampling):
    """Generate one request's group; once the batch is 3 decode steps in, perturb ``model``'s weights and publish them
    as version 1. Returns the trajectories."""
    import concurrent.futures
    import time

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        in_flight = pool.submit(engine.generate, _requests(engine, 1), sampling)
        deadline = time.time() + 30
        while batcher.decode_steps < 3 and time.time() < deadline:
            time.sleep(0.005)
        with torch.no_grad():
            for p in model.model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        engine.publish(version=1).result(60)
        return in_flight.result(60)
