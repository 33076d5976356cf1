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
                *(f"update: {name}" for name, _, _ in gpu_check.ARMS)}
    assert set(results) == expected
    failed = {k: v for k, v in results.items() if "error" in v or "skipped" in v}
    assert not failed, failed
    assert results["sampler ≡ trainer"]["logp_drift_max"] < 1e-4  # fp32 here: the decode loop ≡ teacher forcing
    for name, lora, checkpointing in gpu_check.ARMS:
        arm = results[f"update: {name}"]
        assert arm["gradient_checkpointing"] == checkpointing and 0 < arm["mfu"] < 1
        assert (arm["trainable_params"] < 200_000) == (lora is not None)  # LoRA trains the adapters only
    assert results["generate (rollout.engine.compile)"]["tokens"] == results["generate (eager)"]["tokens"] == 16
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
    assert full["plan_generate_gib"] > 28  # the state stays on the device while it generates
