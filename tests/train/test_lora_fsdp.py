"""``model.lora`` under FSDP2 (``dist.strategy=fsdp``) on 2 gloo ranks: the peft model sharded by ``fully_shard`` (the
frozen base too), only the adapters trained. Its gradients and AdamW updates equal one process's; the KL reference
(adapters disabled on the sharded model) is exactly the base; the export is the merged model plain transformers
loads plus ``adapter/``, gathered from the shards; through ``torchrun … -m vlrl.cli rl --config
configs/shapes_lora_grpo.yaml dist.strategy=fsdp`` a run exports them, resumes exactly, and a rollout server
updated through disk ends with the exported merged weights.

One torchrun job (`dist_lora_worker.py`, the fixture ``two_ranks_lora``) produces the 2-rank results of the first
tests; they are compared with the same computation in this process.
"""

import json
import shutil
import subprocess

import pytest
import torch
from safetensors.torch import load_file

from vlrl.config import RLConfig, load_config
from vlrl.models import load_policy
from vlrl.models.forward import score
from vlrl.models.lora import merged_state_dict
from vlrl.rollout.weights import weight_checksum
from vlrl.train.distributed import check_scalable

from .dist_helpers import (
    REPO,
    lora_policy,
    lora_steps,
    quiet_env,
    rl_trajectories,
    run_checked,
    torchrun,
    write_rl_data,
)

CONFIG = REPO / "configs" / "shapes_lora_grpo.yaml"
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def two_ranks_lora(tiny_vlm_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora_fsdp")
    torch.save(rl_trajectories(load_policy(str(tiny_vlm_dir))), out / "trajectories.pt")
    run_checked(torchrun(2, str(REPO / "tests/train/dist_lora_worker.py"), str(tiny_vlm_dir), str(out)), timeout=600,
                retry_native_abort=True)
    return out, torch.load(out / "lora_fsdp.pt")


@pytest.fixture(scope="module")
def one_rank_lora(two_ranks_lora, tiny_vlm_dir):
    """The same 2 steps on the whole batch in one process: (first gradients, adapters, the merged weights after)."""
    out, _ = two_ranks_lora
    policy = lora_policy(tiny_vlm_dir)
    grads, adapters = lora_steps(policy, torch.load(out / "trajectories.pt", weights_only=False), policy.model)
    return grads, adapters, merged_state_dict(policy)


def test_lora_under_fsdp2_on_2_ranks_equals_1_rank(two_ranks_lora, one_rank_lora, tiny_vlm_dir):
    """The adapters' gradients of the whole batch (with the KL term to the adapter-free base) equal the 1-rank ones,
    the base gets none, and after 2 AdamW steps the adapters equal the 1-rank adapters (as the DDP test: rtol 1e-4 on
    gradients — summation order; 1 % of a 1e-3 step on weights) and each other exactly."""
    _, saved = two_ranks_lora
    grads, adapters, _ = one_rank_lora
    assert saved["sharded"]  # every parameter, the frozen base's included, was a DTensor shard
    assert saved["grads"].keys() == grads.keys() and grads and all(".lora_" in k for k in grads)
    assert any(".lora_A." in k and grads[k].abs().sum() > 0 for k in grads)  # B ≠ 0: A's gradients are not 0
    for name, grad in grads.items():
        torch.testing.assert_close(saved["grads"][name], grad, rtol=1e-4, atol=1e-7, msg=name)
    assert saved["ranks_equal"]
    assert saved["adapters"].keys() == adapters.keys()
    for name, weight in adapters.items():
        torch.testing.assert_close(saved["adapters"][name], weight, rtol=1e-3, atol=1e-5, msg=name)
    start = lora_policy(tiny_vlm_dir).model
    assert any(not torch.equal(w, start.get_parameter(n)) for n, w in adapters.items())  # they trained


def test_reference_on_the_sharded_model_is_the_base_model(two_ranks_lora, tiny_vlm_dir):
    """π_ref under FSDP2 (`reference_model`: the sharded policy with its adapters disabled) scores each rank's rows
    as the base model alone does in one process; with the adapters on (B ≠ 0) the scores differ."""
    out, saved = two_ranks_lora
    trajectories = torch.load(out / "trajectories.pt", weights_only=False)
    base = load_policy(str(tiny_vlm_dir))
    half = len(trajectories) // 2
    for rank, rows in enumerate((trajectories[:half], trajectories[half:])):  # each rank's share, padded alike
        expected = score(base.model, base, rows, 1.0)
        torch.testing.assert_close(saved["reference"][rank], expected, rtol=0, atol=1e-6)
        assert (saved["adapted"][rank] - expected).abs().max() > 1e-3


def test_export_from_the_shards_is_the_merged_model_and_its_adapter(two_ranks_lora, one_rank_lora, tiny_vlm_dir):
    """export_hf on 2 FSDP2 ranks: the directory plain transformers loads holds W + (α/r)·B·A (the 1-rank merge
    after the same steps, to the adapters' tolerance), adapter/ holds the 2-rank adapters exactly, and
    peft's own merge of that adapter onto the base gives the exported weights."""
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    out, saved = two_ranks_lora
    _, _, merged = one_rank_lora
    exported = AutoModelForImageTextToText.from_pretrained(out / "export").state_dict()  # plain transformers loads it
    assert exported.keys() == load_policy(str(tiny_vlm_dir)).model.state_dict().keys() == merged.keys()
    for key, value in merged.items():
        torch.testing.assert_close(exported[key], value, rtol=1e-3, atol=1e-5, msg=key)
    peft = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(tiny_vlm_dir), out / "export" / "adapter")
    for name, weight in saved["adapters"].items():
        assert torch.equal(peft.base_model.model.get_parameter(name), weight), name
    unloaded = peft.merge_and_unload().state_dict()
    for key, value in exported.items():
        torch.testing.assert_close(value, unloaded[key], rtol=0, atol=1e-6, msg=key)


def test_lora_runs_under_fsdp2_with_either_weight_sync():
    check_scalable(load_config(RLConfig, None, ["model.lora.r=4"]), 2)  # dist.strategy=fsdp, the default
    check_scalable(load_config(RLConfig, None, ["model.lora.r=4", "dist.strategy=ddp"]), 2)
    servers = ["model.lora.r=4", "rollout.servers.urls=[http://127.0.0.1:30000]"]
    for sync in ("disk", "distributed"):  # servers get the merged weights either way
        cfg = load_config(RLConfig, None, [*servers, f"rollout.weight_sync.method={sync}"])
        check_scalable(cfg, 2)


# ----------------------------------------------------------------------------------------------- through the CLI
RUN_ARGS = ["dist.strategy=fsdp", "train.prompts_per_step=2", "rollout.n=4", "rollout.max_new_tokens=6",
            "train.log_every=1", "eval.samples=1", "eval.max_new_tokens=2", "report.html=false", "check.enabled=false",
            "optim.lr=1e-2", "algo.kl_coef=0.05"]


def _rl(out, model_dir, data, *extra, cwd=REPO, env=None):
    job = torchrun(2, "-m", "vlrl.cli", "rl", "--config", str(CONFIG), f"model.path={model_dir}", f"data.train={data}",
                   f"data.test={data}", *RUN_ARGS, f"out={out}", *extra)
    if env is None:
        run_checked(job, timeout=600, retry_native_abort=True, cwd=cwd)
    else:
        proc = subprocess.run(job, env=env, capture_output=True, text=True, timeout=600, cwd=cwd)
        assert proc.returncode == 0, f"{' '.join(job)}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["stage"] == "rl"}


@pytest.mark.e2e
def test_lora_fsdp2_rl_through_the_cli_exports_merged_and_adapter_and_resumes_exactly(tiny_vlm_dir, tmp_path):
    """2 FSDP2 ranks, the shipped LoRA preset (r = 16), 3 steps with a checkpoint after each: checkpoints/final is a
    model plain transformers loads whose logits are peft's merged forward of base + the exported adapter, only
    adapted projections moved; the run resumed from its step-2 checkpoint logs the same step 3 and ends with the
    same adapters, bit for bit."""
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    data = write_rl_data(tmp_path / "data" / "train.jsonl")  # a dense reward: the adapters get a signal
    straight = tmp_path / "straight"
    records = _rl(straight, tiny_vlm_dir, data, "train.steps=3", "checkpoint.every=1")
    assert sorted(records) == [1, 2, 3]
    assert {r["policy/trainable_params"] for r in records.values()} == {131072}  # r=16 on 7 projections × 4 layers
    assert records[3]["policy/grad_norm"] > 0 and records[3]["policy/kl_ref"] > 0  # off the base, KL in the loss

    final = straight / "checkpoints" / "final"
    assert json.loads((final / "adapter" / "adapter_config.json").read_text())["r"] == 16
    merged = AutoModelForImageTextToText.from_pretrained(final).eval()
    base = AutoModelForImageTextToText.from_pretrained(tiny_vlm_dir).eval()
    peft = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(tiny_vlm_dir), final / "adapter").eval()
    base_sd, merged_sd = base.state_dict(), merged.state_dict()
    changed = [k for k in base_sd if not torch.equal(base_sd[k], merged_sd[k])]
    assert changed and all(k.split(".")[-2] in TARGETS for k in changed)  # the frozen base stayed as it was
    ids = torch.tensor([[1, 5, 9, 13, 2, 7]])
    with torch.no_grad():
        expected = peft(input_ids=ids).logits
        torch.testing.assert_close(merged(input_ids=ids).logits, expected, rtol=0, atol=1e-5)
        assert (expected - base(input_ids=ids).logits).abs().max() > 1e-4

    # resume: the run's directory as it stood after step 2 (its step-3 checkpoint and export removed), --resume auto
    resumed = tmp_path / "resumed"
    shutil.copytree(straight, resumed)
    for leftover in ("step_00000003", "final"):
        shutil.rmtree(resumed / "checkpoints" / leftover)
    again = _rl(resumed, tiny_vlm_dir, data, "train.steps=3", "checkpoint.every=1", "--resume", "auto")
    assert sorted(again) == [1, 2, 3]
    for key in ("reward/mean", "policy/loss", "policy/grad_norm", "policy/kl_ref", "policy/entropy"):
        assert again[3][key] == records[3][key], key
    a = load_file(final / "adapter" / "adapter_model.safetensors")
    b = load_file(resumed / "checkpoints" / "final" / "adapter" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.e2e
@pytest.mark.parametrize("sync", ["disk", "distributed"])
def test_lora_fsdp2_ranks_update_a_rollout_server(tiny_vlm_dir, tmp_path, sync):
    """2 FSDP2 ranks with `rollout.servers.urls`: each update merges the adapters on the shards; with
    `rollout.weight_sync.method=disk` the merged weights are gathered onto rank 0, which writes them for the server, with
    `distributed` they are gathered bucket by bucket and broadcast under the transformers names (nothing written).
    Either way the server ends at the last version with the checksum of the exported (merged) final weights."""
    import httpx

    from rollout.conftest import API_KEY, vlrl_serve  # tests/ is on sys.path (the test packages' root)

    data = write_rl_data(tmp_path / "data" / "train.jsonl")
    out = tmp_path / "run"
    with vlrl_serve(str(tiny_vlm_dir), tmp_path) as (url,):
        records = _rl(out, tiny_vlm_dir, data, "train.steps=2", f"rollout.servers.urls=[{url}]", f"rollout.weight_sync.method={sync}",
                      env=quiet_env(VLRL_API_KEY=API_KEY))
        info = httpx.get(f"{url}/get_model_info", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30).json()
    final = load_policy(str(out / "checkpoints" / "final"))
    assert sorted(records) == [1, 2] and records[2]["policy/grad_norm"] > 0
    assert info["weight_version"] == "2" and info["weight_checksum"] == weight_checksum(final.model)
    assert info["weight_checksum"] != weight_checksum(load_policy(str(tiny_vlm_dir)).model)  # the adapters moved it
    written = (out / "rollout_weights").is_dir() and any((out / "rollout_weights").iterdir())
    assert written == (sync == "disk")  # the broadcast writes nothing
