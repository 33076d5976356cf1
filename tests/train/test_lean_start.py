"""FSDP2's memory-lean start (``dist.rank0_load``) and CPU offload (``dist.cpu_offload``) on 2 gloo ranks.

One torchrun job (`dist_start_worker.py`) starts the recipes' way (`_load` + `make_runtime`: the actor and the
frozen KL reference, plain and with LoRA) with every rank loading the model and with rank 1 built on the meta
device and sent its shards by rank 0, and runs one SFT step with and without offload."""

import pytest
import torch

from .dist_helpers import REPO, run_checked, torchrun


@pytest.fixture(scope="module")
def started(tiny_vlm_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("lean_start")
    run_checked(torchrun(2, str(REPO / "tests/train/dist_start_worker.py"), str(tiny_vlm_dir), str(out)),
                timeout=900, retry_native_abort=True)
    return out


@pytest.mark.parametrize("variant", ["plain", "lora"])
@pytest.mark.parametrize("rank", [0, 1])
def test_a_meta_device_start_gives_every_rank_the_shards_of_a_full_start(started, variant, rank):
    full = torch.load(started / f"shards_full_{variant}_{rank}.pt")
    lean = torch.load(started / f"shards_lean_{variant}_{rank}.pt")
    for role in ("actor", "reference"):  # LoRA's reference is the actor with its adapters off: no copy
        assert lean[role].keys() == full[role].keys()
        # every parameter shard and every buffer (the rotary inv_freq is no parameter and not in the state dict)
        differ = [k for k in full[role] if not torch.equal(lean[role][k], full[role][k])]
        assert not differ, f"{variant} {role} rank {rank}: {differ[:5]}"
    assert len(full["actor"]) > 80 and (variant == "lora" or len(full["reference"]) > 80)
    assert any("inv_freq" in k for k in full["actor"])
    assert torch.load(started / f"meta_{rank}.pt") == (rank == 1)  # rank 1 read no weights: built on meta


@pytest.mark.parametrize("rank", [0, 1])
def test_cpu_offload_reaches_fully_shard_and_trains_as_without_it(started, rank):
    on = torch.load(started / f"offload_on_{rank}.pt")
    off = torch.load(started / f"offload_off_{rank}.pt")
    assert on["policies"] == ["CPUOffloadPolicy"] and off["policies"] == ["OffloadPolicy"]  # (the no-op base class)
    assert on["devices"] == ["cpu"]
    # on a CPU mesh the offload moves nothing, but runs FSDP2's offload path (host shards, gradients copied back,
    # the optimizer on the host shards): the same gradients and the same weights after the AdamW step
    assert on["grads"].keys() == off["grads"].keys() and any("visual" in k for k in on["grads"])
    for name, grad in off["grads"].items():
        assert torch.equal(on["grads"][name], grad), name
    moved = [k for k in off["shards"] if not torch.equal(off["shards"][k], torch.load(
        started / f"shards_full_plain_{rank}.pt")["actor"][k])]
    assert moved  # the step changed the weights
    for name, shard in off["shards"].items():
        assert torch.equal(on["shards"][name], shard), name
