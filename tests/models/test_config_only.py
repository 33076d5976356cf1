"""A model from its config.json alone (`vlrl.models.config_only`): the fixtures of real checkpoints build with
their published sizes, and `vlrl plan` plans them with no weights and no tokenizer."""

import json
import shutil
from pathlib import Path

import pytest
from PIL import Image
from typer.testing import CliRunner

from vlrl.cli import app
from vlrl.data import generate
from vlrl.models.config_only import config_file, is_config_only, stand_in_policy

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "model_configs"
REPO = Path(__file__).resolve().parents[2]

# The parameter counts the model cards publish (Qwen2.5-VL: "3.75B" / "8.29B"; Qwen3-VL-8B: 8.77B;
# Qwen3-VL-30B-A3B: 31.1B), and the vision tokens of a 448 × 448 image: (448 / patch)² / merge² —
# 14-px patches: 32² / 4 = 256; 16-px patches: 28² / 4 = 196.
PUBLISHED = {"qwen2_5_vl_3b": (3.75e9, 256), "qwen2_5_vl_7b": (8.29e9, 256), "qwen3_vl_8b": (8.77e9, 196),
             "qwen3_vl_30b_a3b": (31.07e9, 196)}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_a_fixture_builds_on_meta_with_its_published_size_and_vision_tokens(name):
    params, vision_tokens = PUBLISHED[name]
    policy = stand_in_policy(FIXTURES / f"{name}.json")  # meta: no memory
    assert policy.num_parameters() == pytest.approx(params, rel=2e-3)
    assert next(policy.model.parameters()).is_meta
    sample = generate("shapes", 1)[0]
    encoded = policy.adapter.encode_prompt(sample.messages, [Image.new("RGB", (448, 448))])
    image_pad = policy.model.config.image_token_id  # re-pointed at the stand-in tokenizer's <|image_pad|>
    assert encoded.input_ids.count(image_pad) == vision_tokens
    assert policy.tokenizer.convert_ids_to_tokens(image_pad) == "<|image_pad|>"
    assert policy.model.config.get_text_config().vocab_size == json.loads(
        (FIXTURES / f"{name}.json").read_text()).get("vocab_size", 151936)  # the real vocabulary's logits


def test_what_counts_as_a_config_alone(tmp_path, tiny_vlm_dir):
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(FIXTURES / "qwen2_5_vl_3b.json", bare / "config.json")
    assert config_file(FIXTURES / "qwen2_5_vl_3b.json") == FIXTURES / "qwen2_5_vl_3b.json"
    assert config_file(bare) == bare / "config.json"
    assert not is_config_only(tiny_vlm_dir)  # a model directory with its tokenizer is loaded as it is
    assert not is_config_only("tiny-qwen2-vl") and not is_config_only("Qwen/Qwen2.5-VL-3B-Instruct")


def test_a_family_without_a_stand_in_tokenizer_is_named(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                                  "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100}))
    with pytest.raises(ValueError, match="'llama': no stand-in tokenizer"):
        stand_in_policy(config)


@pytest.mark.parametrize("as_directory", [False, True])
def test_vlrl_plan_plans_a_real_model_from_its_config_json_alone(tmp_path, as_directory):
    path = FIXTURES / "qwen2_5_vl_7b.json"
    if as_directory:  # a directory holding config.json and nothing else (no weights, no tokenizer)
        path = tmp_path / "Qwen2.5-VL-7B-Instruct"
        path.mkdir()
        shutil.copy(FIXTURES / "qwen2_5_vl_7b.json", path / "config.json")
    result = CliRunner().invoke(app, ["plan", str(REPO / "configs" / "shapes_lora_grpo.yaml"), "--gpus", "1",
                                      "--gpu-mem", "80", f"model.path={path}", "model.dtype=bfloat16",
                                      "rollout.max_new_tokens=1024", "rollout.engine.max_batch_size=16",
                                      "train.micro_batch_size=16"])
    assert result.exit_code == 0, result.output
    # the README's worked case: Qwen2.5-VL-7B, LoRA r=16, bf16, checkpointing on one 80 GiB GPU
    assert "Ψ = 8.29e+03M parameters (vision Ψ_v = 677M), 28 layers, h = 3584" in result.output
    assert "V = 152064" in result.output
    assert "#1 colocated fsdp×1" in result.output and "23.95 GiB of 80 GiB" in result.output


def test_plan_measure_refuses_a_config_alone_and_says_why():
    result = CliRunner().invoke(app, ["plan", str(REPO / "configs" / "shapes_grpo.yaml"), "--measure",
                                      f"model.path={FIXTURES / 'qwen2_5_vl_3b.json'}"])
    assert result.exit_code == 2 and "needs the model's tokenizer and weights" in result.output
