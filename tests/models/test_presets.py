import pytest
import torch

from vlrl.data import generate
from vlrl.models import PRESETS, collate, load_policy
from vlrl.models.presets import FAMILY_PRESETS
from vlrl.rollout import HFEngine


@pytest.mark.parametrize("name", sorted(set(PRESETS) - set(FAMILY_PRESETS)))  # the families: test_families.py
def test_preset_round_trips_through_plain_transformers(name, tmp_path):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    policy = load_policy(name)
    policy.save(tmp_path)
    auto = AutoModelForImageTextToText if policy.is_vision else AutoModelForCausalLM
    reloaded = auto.from_pretrained(tmp_path).eval()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert tokenizer("<answer>3</answer>")["input_ids"] == policy.tokenizer("<answer>3</answer>")["input_ids"]
    suite = "shapes" if policy.is_vision else "arith"
    engine = HFEngine(policy)
    requests = [engine.encode(s) for s in generate(suite, 3)]
    tokens = collate([r.prompt_ids for r in requests], [[100, 101]] * 3, [r.vision for r in requests],
                     pad_token_id=policy.pad_token_id)
    kwargs = policy.adapter.forward_inputs(policy.model, tokens.input_ids, tokens.attention_mask, tokens.vision)
    policy.model.eval()
    with torch.no_grad():
        assert torch.equal(policy.model(**kwargs).logits, reloaded(**kwargs).logits)
    # and vlrl's own loader gives the same policy back — its tokenizer too, numbers included: transformers'
    # AutoTokenizer reads a tiny-qwen2 checkpoint with Qwen2Tokenizer, which splits "17" into digits the preset's
    # tokenizer never made (a saved arith checkpoint fell from 0.486 to 0.127 strict); vlrl loads the saved backend
    back = load_policy(str(tmp_path))
    assert back.adapter.family == policy.adapter.family
    text = "17+25=42 <answer>120</answer>"
    assert back.tokenizer(text)["input_ids"] == policy.tokenizer(text)["input_ids"]


def test_parameter_counts_match_the_preset_table():
    assert 0.8e6 < load_policy("tiny-qwen2-vl").num_parameters() < 1.5e6
    assert 10e6 < load_policy("tiny-qwen2-vl-20m").num_parameters() < 25e6


def test_chat_template_and_image_expansion(tiny_vlm):
    sample = generate("shapes", 1)[0]
    request = HFEngine(tiny_vlm).encode(sample)
    text = tiny_vlm.tokenizer.decode(request.prompt_ids)
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n<|vision_start|>")
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    n_image_tokens = request.prompt_ids.count(tiny_vlm.model.config.image_token_id)
    assert n_image_tokens == int(request.vision.image_grid_thw.prod()) // 4 == 16  # 112px / 14 = 8x8 patches, 2x2 merge


def test_unknown_preset_or_path_is_clear(tmp_path):
    with pytest.raises((OSError, ValueError)):
        load_policy(str(tmp_path / "nothing-here"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_policy(str(tmp_path / "empty"))
