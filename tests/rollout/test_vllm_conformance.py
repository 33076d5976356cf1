"""Conformance with vLLM 0.32.0's own code (``.venv-vllm``): what vlrl's client sends to a vLLM server is replayed
through vLLM's pydantic request model, its FastAPI routers, its ``AsyncLLM`` methods and its GPU worker's weight-transfer
methods with its real ``NCCLWeightTransferEngine`` (`vllm_contract_check.py`). The calls are recorded on their way to
a stand-in server (`vllm_contract.recording_vllm`), made by the same client code the engine uses
(`vlrl.rollout.vllm_client`, `vlrl.rollout.vllm_transfer`).

The NCCL transfer cannot run here (no GPU): its calls, their order, their bodies and the tensors broadcast (handed to
vLLM's receive loop in order by a stand-in group) are what this file checks. It has never run on a GPU.
"""

import asyncio

import pytest
import torch

from vlrl.rollout import vllm_protocol as proto
from vlrl.rollout.http_settings import ClientSettings
from vlrl.rollout.server_pool import ServerPool
from vlrl.rollout.vllm_client import VLLMServers
from vlrl.rollout.vllm_transfer import VLLMTransfer, send_order
from vlrl.serving import ServerThread

from .vllm_contract import recording_vllm, replay, vllm_python

pytestmark = pytest.mark.usefixtures("one_thread")


class RecordingNCCL:
    """The trainer's NCCL calls, on the CPU: a fixed 128-byte unique id, the broadcasts kept in order."""

    def __init__(self):
        self.sent, self.joined = [], None

    def unique_id(self):
        return bytes(range(128))

    def join(self, world_size, unique_id):
        self.joined = (world_size, unique_id)
        return "comm"

    def broadcast(self, comm, tensor):
        self.sent.append(tensor.clone())

    def close(self, comm):
        pass


def _bodies():
    common = dict(n=4, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=16, stop=(), stop_token_ids=[2],
                  logit_bias={})
    return [
        proto.generate_body([5, 6, 7], **common),
        proto.generate_body([5, 6], **{**common, "top_k": 50, "top_p": 0.9, "temperature": 0.7,
                                       "logit_bias": {3: -1e4, 4: 2.5}, "stop": ["\n\n"], "stop_token_ids": [2, 9]}),
        proto.generate_body([1, 8, 8, 8, 9, 5], **common, image_urls=["data:image/png;base64,AAAA"] * 2,
                            request_id="vlrl-1"),
    ]


@pytest.fixture(scope="module")
def replayed(tmp_path_factory):
    python, why = vllm_python()
    if python is None:
        pytest.skip(why)
    calls: list[dict] = []
    server = ServerThread(recording_vllm(calls))
    pool = ServerPool([server.url], ClientSettings(api_key="k"))
    try:
        # a disk update as the engine brackets it: pause (finish → wait), reload, version, read back, resume
        vllm = VLLMServers(pool, checksum="off")
        pool.call(vllm.read_facts())
        path, body = vllm.pause_call("finish")
        pool.call(pool.post_each(pool.live(), path, [body], timeout=10))
        pool.call(vllm.load_everywhere(tmp_path_factory.mktemp("v1"), 1, state=dict, previous=None, timeout=10))
        pool.call(pool.post_each(pool.live(), *vllm.RESUME_CALL[:1], [vllm.RESUME_CALL[1]], timeout=10))
        disk_calls = len(calls)
        # a distributed update: the group, then one update in two buckets
        torch.manual_seed(0)
        state = {"model.embed_tokens.weight": torch.randn(16, 8), "model.norm.weight": torch.randn(8),
                 "lm_head.weight": torch.randn(16, 8).to(torch.bfloat16)}
        nccl = RecordingNCCL()
        transfer = VLLMTransfer(pool, timeout=30, update_timeout=30, bucket_mb=600 / 2**20, collective=nccl)
        sent_bytes = transfer.update(pool.live(), send_order(state, None), 2, torch.float32)
    finally:
        pool.close()
        server.stop()
    work = tmp_path_factory.mktemp("replay")
    report = replay(python, {"generate": _bodies(), "rl": calls}, nccl.sent, work)
    return {"calls": calls, "disk_calls": disk_calls, "nccl": nccl, "state": state, "report": report,
            "sent_bytes": sent_bytes}


def test_generate_bodies_pass_vllms_request_model(replayed):
    parsed = replayed["report"]["generate"]
    assert [p["error"] for p in parsed] == [None, None, None]
    first, second, third = (p["sampling_params"] for p in parsed)
    # the engine's sampling: EOS only from the trainer (ignore_eos), the sampled token's log-prob only, no detokenizing
    assert first == {"n": 4, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_tokens": 16, "stop": [],
                     "stop_token_ids": [2], "ignore_eos": True, "logprobs": 0, "detokenize": False, "logit_bias": {}}
    # a suppressed token at vLLM's bound (−100), a stop string (which needs the text)
    assert second["logit_bias"] == {"3": -100.0, "4": 2.5} and second["stop"] == ["\n\n"] and second["detokenize"]
    assert second["top_k"] == 50 and second["stop_token_ids"] == [2, 9]
    assert parsed[2]["content_parts"] == [{"type": "image_url", "url": "data:image/png;base64,AAAA"}] * 2
    assert all(p["return_token_ids"] for p in parsed)


def test_disk_update_calls_run_through_vllms_routes(replayed):
    report, calls = replayed["report"], replayed["calls"][: replayed["disk_calls"]]
    assert [(c["method"], c["path"]) for c in calls] == [
        ("GET", "/weight_info"), ("POST", "/pause?mode=wait"), ("POST", "/collective_rpc"),
        ("POST", "/reset_prefix_cache"), ("POST", "/update_weight_version"), ("GET", "/weight_info"),
        ("POST", "/resume")]
    statuses = [status for status, _ in report["responses"][: len(calls)]]
    # /reset_prefix_cache is the dev cache router's (not replayed here: the answer is {"success": bool})
    assert [s for c, s in zip(calls, statuses, strict=True) if c["path"] != "/reset_prefix_cache"] == [200] * 6
    events = report["events"]
    assert "pause wait" in events and "resume" in events
    reload = next(e for e in events if e.startswith("reload_weights"))
    assert '"weights_path"' in reload  # the worker's reload_weights(weights_path=...) was called
    assert report["responses"][5][1] == {"weight_version": "1"}


def test_nccl_transfer_calls_and_tensors_through_vllms_worker(replayed):
    report, nccl, state = replayed["report"], replayed["nccl"], replayed["state"]
    calls = replayed["calls"][replayed["disk_calls"]:]
    assert [c["path"] for c in calls] == ["/init_weight_transfer_engine", "/start_weight_update", "/update_weights",
                                          "/update_weights", "/finish_weight_update"]
    statuses = [s for s, _ in report["responses"][replayed["disk_calls"]:]]
    assert statuses == [200] * 5, report["responses"]
    init = calls[0]["body"]["init_info"]
    assert init["rank_offset"] == 1 and init["world_size"] == 2 and nccl.joined == (2, bytes(range(128)))
    events = report["events"][report["events"].index("rpc init_weight_transfer_engine"):]
    order = [e for e in events if e.startswith(("joined", "layerwise", "rpc"))]
    assert order == ["rpc init_weight_transfer_engine", "joined rank 1 of 2", "rpc start_weight_update",
                     "layerwise reload started", "rpc update_weights", "rpc update_weights", "rpc finish_weight_update",
                     "layerwise reload finished"]
    # every tensor reached vLLM's load_weights under its checkpoint name, in the servers' dtype, byte for byte
    assert report["broadcasts_left"] == 0
    expected = {name: [("float32" if t.is_floating_point() else str(t.dtype).removeprefix("torch.")), list(t.shape),
                       proto.tensor_sha256(t, torch.float32)] for name, t in state.items()}
    assert report["received"] == expected
    assert replayed["sent_bytes"] == sum(t.numel() * 4 for t in state.values())


def test_checksum_prediction_follows_vllms_fused_layout():
    torch.manual_seed(0)
    q, k, v = torch.randn(4, 4), torch.randn(2, 4), torch.randn(2, 4)
    embed = torch.randn(70, 4)
    state = {"model.layers.0.self_attn.q_proj.weight": q, "model.layers.0.self_attn.k_proj.weight": k,
             "model.layers.0.self_attn.v_proj.weight": v, "model.embed_tokens.weight": embed}
    padded = torch.cat([embed, torch.zeros(58, 4)])  # 70 rows → 128 (a multiple of 64), zero-filled
    reported = {proto.CHECKSUM_PREFIX + "model.layers.0.self_attn.qkv_proj.weight": proto.tensor_sha256(torch.cat([q, k, v])),
                proto.CHECKSUM_PREFIX + "model.embed_tokens.weight": proto.tensor_sha256(padded),
                proto.CHECKSUM_PREFIX + "model.layers.0.mlp.down_proj.weight": proto.EMPTY_SHA256,
                proto.CHECKSUM_PREFIX + "model.layers.0.mlp.gate_up_proj.weight": "0" * 64}
    report = proto.checksum_report(reported, state)
    assert sorted(report.verified) == ["model.embed_tokens.weight", "model.layers.0.self_attn.qkv_proj.weight"]
    assert report.repacked == ["model.layers.0.mlp.down_proj.weight"]
    assert report.unpredicted == ["model.layers.0.mlp.gate_up_proj.weight"] and not report.mismatched
    state["model.embed_tokens.weight"] = embed + 1e-3
    assert proto.checksum_report(reported, state).mismatched == ["model.embed_tokens.weight"]


def test_parse_generate_refuses_what_vlrl_cannot_train_on():
    good = {"prompt_token_ids": [1, 2], "choices": [
        {"index": 1, "finish_reason": "length", "token_ids": [7], "logprobs": {"content": [{"token_id": 7, "logprob": -1.5}]},
         "weight_versions": [{"version": "3", "start": 0, "end": 1}]},
        {"index": 0, "finish_reason": "stop", "token_ids": [5, 2],
         "logprobs": {"content": [{"token_id": 5, "logprob": -0.5}, {"token_id": 2, "logprob": -0.25}]}}]}
    prompt, choices = proto.parse_generate(good, n=2, url="http://s")
    assert prompt == [1, 2] and [c.token_ids for c in choices] == [[5, 2], [7]]  # index order
    assert [c.status for c in choices] == ["completed", "truncated"] and choices[1].weight_versions[0]["version"] == "3"
    with pytest.raises(proto.VLLMProtocolError, match="asked for n = 3"):
        proto.parse_generate(good, n=3, url="http://s")
    bad = {"choices": [{**good["choices"][1], "logprobs": None}]}
    with pytest.raises(proto.VLLMProtocolError, match="no token_ids or no logprobs"):
        proto.parse_generate(bad, n=1, url="http://s")


def test_logprob_mode_problems():
    assert proto.logprob_mode_problem("raw_logprobs", temperature=1.0, top_k=50, top_p=1.0) is None
    assert "processed_logprobs" in proto.logprob_mode_problem("raw_logprobs", temperature=1.3, top_k=0, top_p=1.0)
    assert proto.logprob_mode_problem("processed_logprobs", temperature=1.3, top_k=0, top_p=1.0) is None
    assert "renormalised" in proto.logprob_mode_problem("processed_logprobs", temperature=1.3, top_k=50, top_p=1.0)


def test_pause_modes_are_vllms():
    assert set(proto.PAUSE_MODES.values()) <= {"abort", "wait", "keep"}  # vllm.v1.engine.PauseMode
    assert asyncio.iscoroutinefunction(VLLMServers.read_facts)
