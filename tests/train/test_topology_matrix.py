"""The production topology through the CLI: 2 gloo trainer ranks under torchrun beside one `vlrl serve`, in every
combination a user can pick — {sync, async} × {fsdp, ddp} × {disk, distributed} weight sync, plus LoRA with disk
(`shapes_lora_grpo.yaml`'s adapters merged before they are sent). Each case ends with the server at the trainer's
final ``weight_version`` and the checksum of the exported final weights (`checkpoints/final`), so every update
reached the server and the last one was exactly what the trainer saved.

The default pair (FSDP2, the default strategy, with disk sync, the default sync) failed at its first update before
this test existed: rank 0 predicted the checksum of an empty state dict (``e3b0c44298fc…``, SHA-256 of nothing).

Cost: one `vlrl serve` for the module (each run starts from the same saved weights; the server is sent them at
version 0 of every run), the smallest run that still updates the server after a training step (2 steps of 4
prompts × 2 samples), ~25-40 s per case on 2 shared cores.
"""

import json

import httpx
import pytest

from rollout.conftest import API_KEY, vlrl_serve  # tests/ is on sys.path (the test packages' root)
from vlrl.data import generate, write_samples
from vlrl.models import load_policy
from vlrl.rollout.weights import weight_checksum

from .dist_helpers import REPO, run_checked, torchrun

STEPS = 2
ARGS = [f"train.steps={STEPS}", "train.prompts_per_step=4", "rollout.n=2", "rollout.max_new_tokens=4",
        "train.micro_batch_size=4", "optim.lr=1e-3", "train.log_every=1", "data.n_test=2", "report.html=false",
        "check.enabled=false", "eval.samples=1", "eval.max_new_tokens=2", "rollout.temperature=1.5"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One `vlrl serve` of the tiny preset for every case, the prompts every case trains on, and the checksum of
    the weights the server started with. The trainer builds the same preset (init seed 0): a model built from its
    config, with no checkpoint conversion recorded — the case the FSDP2 + disk failure needed (a model loaded from
    a saved directory went another way through `save_pretrained`)."""
    root = tmp_path_factory.mktemp("topology")
    samples = generate("shapes", 16, tasks=["count"])
    for s in samples:  # DAPO's soft overlong punishment on characters: distinct rewards from an untrained model
        s.reward = {"overlong": 1.0}
        s.metadata = {"max_length": 12, "cache_length": 8, "unit": "chars"}
    data = write_samples(samples, root / "rl.jsonl")
    with vlrl_serve("tiny-qwen2-vl", root) as (url,):
        yield url, data, _server_info(url)["weight_checksum"]


def _server_info(url):
    return httpx.get(f"{url}/get_model_info", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30).json()


# Every combination of {sync, async} × {fsdp, ddp} × {disk, distributed}, plus LoRA with disk: ~25-30 s a case
# on 2 cores (the suite of 2026-11-28, at load), ~4 minutes for the file.
CASES = [(mode, strategy, sync, False) for mode in ("sync", "async") for strategy in ("fsdp", "ddp")
         for sync in ("disk", "distributed")] + [("sync", "fsdp", "disk", True)]


@pytest.mark.e2e
@pytest.mark.parametrize("mode, strategy, sync, lora", CASES,
                         ids=[f"{m}-{s}-{w}{'-lora' if lora else ''}" for m, s, w, lora in CASES])
def test_two_ranks_and_a_server_end_at_the_exported_weights(served, tmp_path, mode, strategy, sync, lora):
    url, data, initial = served
    out = tmp_path / "run"
    args = [*torchrun(2, "-m", "vlrl.cli"), "rl", "model.path=tiny-qwen2-vl", f"data.train={data}",
            f"data.test={data}", *ARGS, f"rollout.servers.urls=[{url}]", f"out={out}", f"rollout.mode={mode}",
            f"dist.strategy={strategy}", f"rollout.weight_sync.method={sync}"]
    if mode == "async":
        args.append("staleness.eta=1")
    if lora:
        args += ["model.lora={r: 4, alpha: 8}"]
    run_checked(args, timeout=600, cwd=REPO, env_extra={"VLRL_API_KEY": API_KEY}, retry_native_abort=True)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in records if r.get("stage") == "rl"]
    assert [r["step"] for r in rl] == list(range(1, STEPS + 1))
    assert rl[0]["policy/grad_norm"] > 0  # a real update was sent, not the weights the server started with
    info = _server_info(url)
    final = load_policy(str(out / "checkpoints" / "final"))
    assert info["weight_version"] == str(STEPS)
    assert info["weight_checksum"] == weight_checksum(final.model)
    assert info["weight_checksum"] != initial
    assert (out / "rollout_weights").exists() == (sync == "disk")  # distributed sync writes nothing for the server


@pytest.mark.e2e
def test_async_without_servers_on_two_fsdp_ranks(served, tmp_path):
    """`rollout.mode=async` with no rollout server on 2 FSDP2 ranks (the defaults otherwise): every rank's in-process
    engine takes a whole copy of the policy, so every rank loads the whole model even with ``dist.rank0_load``
    (the default) — rank 1 built on the meta device crashed copying it ("Cannot copy out of meta tensor") before."""
    _, data, _ = served
    out = tmp_path / "run"
    run_checked([*torchrun(2, "-m", "vlrl.cli"), "rl", "model.path=tiny-qwen2-vl", f"data.train={data}",
                 f"data.test={data}", *ARGS, f"out={out}", "rollout.mode=async", "staleness.eta=1"],
                timeout=600, cwd=REPO, retry_native_abort=True)
    rl = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r.get("stage") == "rl"]
    assert [r["step"] for r in rl] == list(range(1, STEPS + 1))
    assert all(r["dist/ranks"] == 2 and r["dist/lockstep"] == 1.0 for r in rl)
    assert rl[0]["policy/grad_norm"] > 0
    assert weight_checksum(load_policy(str(out / "checkpoints" / "final")).model) != \
        weight_checksum(load_policy("tiny-qwen2-vl").model)
