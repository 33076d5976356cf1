"""benchmarks/gpu_check.py, the script a task lent a GPU runs (docs/gpu.md), runs here on the CPU: ``--smoke`` goes
through every measurement at the tiny preset and a tiny shape, and `vlrl plan`'s estimate it compares the GPU's
peak memory with is computed for the real shape (Qwen2.5-VL-3B, 8 prompts × n 8, 448² images, 512 new tokens)."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_smoke_run_measures_everything_and_writes_its_table(gpu_check, tmp_path):
    # the compiled arm traced by aot_eager: inductor's C++ build takes minutes here (test_decode_compile.py has one)
    report = gpu_check.main(["--smoke", "--out", str(tmp_path), "--compile-backend", "aot_eager"])
    (results,) = report["models"].values()
    expected = {"build", "generate (eager)", "sampler ≡ trainer", "generate (rollout.engine.compile)",
                *(f"update: {arm.name}" for arm in gpu_check.ARMS)}
    assert set(results) == expected
    failed = {k: v for k, v in results.items() if "error" in v or "skipped" in v}
    assert not failed, failed
    assert results["sampler ≡ trainer"]["logp_drift_max"] < 1e-4  # fp32 here: the decode loop ≡ teacher forcing
    for arm in gpu_check.ARMS:
        got = results[f"update: {arm.name}"]
        assert got["gradient_checkpointing"] == arm.checkpointing and 0 < got["mfu"] < 1
        assert (got["trainable_params"] < 200_000) == (arm.lora is not None)  # LoRA trains the adapters only
        assert (got["budget"] is not None) == arm.budget and got["micro_batches"] >= 1
    # the long tail: the count-based split puts the long rows together; the budget spreads them (same total tokens)
    count, budget = (results[f"update: full, checkpointing, long tail{x}"] for x in ("", ", token budget"))
    assert count["rows_tokens"] == budget["rows_tokens"] < results["update: full, checkpointing"]["rows_tokens"]
    assert budget["micro_batch_cost_max"] < count["micro_batch_cost_max"]
    profile = results["update: full, checkpointing"]["profile"]  # on a CPU: operators' own time by category
    assert profile["ms_by_category"]["matmul"] > 0 and len(profile["top"]) == 15
    assert (tmp_path / "profile_full_checkpointing.txt").read_text().count("aten::") > 10
    assert results["generate (rollout.engine.compile)"]["tokens"] == results["generate (eager)"]["tokens"] == 4 * 2 * 48
    assert json.loads((tmp_path / "gpu_check.json").read_text())["models"]["tiny-qwen2-vl"]["build"]
    table = (tmp_path / "gpu_check.md").read_text()
    assert table.count("| tiny-qwen2-vl |") == len(expected) and "tokens/s" in table and "MFU" in table


def test_the_plan_it_compares_with_is_the_real_shape(gpu_check):
    full = gpu_check.planned("qwen2_5_vl_3b", gpu_check.REAL, None, True, 80)
    lora = gpu_check.planned("qwen2_5_vl_3b", gpu_check.REAL, 16, True, 80)
    # 448² images → 256 vision tokens (+ the shapes prompt's text) per prompt
    assert 256 < full["plan_prompt_tokens"] < 400
    # pure bf16 full fine-tuning of 3.75B: 2 + 2 + 4 bytes per parameter ≈ 28 GiB of state before activations
    assert 28 < full["plan_train_gib"] < 80 and lora["plan_train_gib"] < full["plan_train_gib"] - 15
    assert full["plan_generate_gib"] > 20  # the parameters and moments stay on the device while it generates
    # the first GPU run measured 35.5 GiB where the plan said 31.4 (forward + backward): AdamW's foreach step holds one
    # more copy of the weights (√v̂ + ε for all of them at once), 2 bytes × 3.75B = 7 GiB over parameters + gradients
    # + moments: the optimizer step is the checkpointed update's peak, within 2 % of the measured 35.5
    assert full["plan_peak_phase"] == "optimizer step"
    assert full["plan_peak_gib"] == pytest.approx(35.5, rel=0.02)
    phases = full["plan_phases_gib"]
    assert phases["optimizer step"] - phases["forward + backward"] == pytest.approx(3.5, abs=0.2)
    # with a token budget the plan sizes the micro-batch from it: half the budget of 8 rows → 4 rows' activations
    row = full["plan_micro_rows"]
    assert row == 8
    budget = gpu_check.planned("qwen2_5_vl_3b", gpu_check.REAL, None, False, 80, max_tokens=4 * 1200)
    assert 3 < budget["plan_micro_rows"] < 5
    no_ckpt = gpu_check.planned("qwen2_5_vl_3b", gpu_check.REAL, None, False, 80)
    activations = no_ckpt["plan_phases_gib"]["forward + backward"] - no_ckpt["plan_phases_gib"]["optimizer step"]
    budgeted = budget["plan_phases_gib"]["forward + backward"] - budget["plan_phases_gib"]["optimizer step"]
    assert budgeted < activations * 0.7


def test_the_docs_plan_table_is_the_planners(gpu_check):
    table = gpu_check.plan_markdown(("qwen2_5_vl_3b",))
    assert "| qwen2_5_vl_3b | full, checkpointing |" in table and "(optimizer step)" in table
    assert table.count("\n") == 2 + len([a for a in gpu_check.ARMS if not a.long_tail])
