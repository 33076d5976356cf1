"""Delta encoding of observations (slime's dummy-conversation trick): the tokens an observation adds to a
running conversation are exactly what the chat template renders for it there — never the system prompt or
the tool preamble again — for the tiny presets' template and for real Qwen templates."""

import pytest
from PIL import Image

from vlrl.models import load_policy
from vlrl.models.adapters import Qwen2VLAdapter, TextAdapter

# Qwen2.5-Instruct's chat template (tools in the system prompt, tool replies as <tool_response> user turns).
QWEN25_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if messages[0]['role'] == 'system' %}"
    "{{- messages[0]['content'] }}{%- else %}{{- 'You are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.' }}{%- endif %}{{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user "
    "query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}"
    "{%- for tool in tools %}{{- \"\\n\" }}{{- tool | tojson }}{%- endfor %}{{- \"\\n</tools>\\n\\nFor each function "
    "call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n"
    "<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\" }}"
    "{%- else %}{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + "
    "'<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a "
    "helpful assistant.<|im_end|>\\n' }}{%- endif %}{%- endif %}"
    "{%- for message in messages %}{%- if (message.role == \"user\") or (message.role == \"system\" and not "
    "loop.first) or (message.role == \"assistant\" and not message.tool_calls) %}{{- '<|im_start|>' + message.role "
    "+ '\\n' + message.content + '<|im_end|>' + '\\n' }}{%- elif message.role == \"assistant\" %}"
    "{{- '<|im_start|>' + message.role }}{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}{%- elif message.role == \"tool\" %}{%- if (loop.index0 == 0) or "
    "(messages[loop.index0 - 1].role != \"tool\") %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}{%- if loop.last or "
    "(messages[loop.index0 + 1].role != \"tool\") %}{{- '<|im_end|>\\n' }}{%- endif %}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Qwen2-VL-Instruct's chat template (image counting, optional "Picture k:" ids).
QWEN2VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% for message in messages %}{% if loop.first and message['role'] "
    "!= 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}<|im_start|>"
    "{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n{% else %}"
    "{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in content or 'image_url' "
    "in content %}{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture "
    "{{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif 'text' in content %}"
    "{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "zoom", "description": "Enlarge a region",
                                           "parameters": {"type": "object", "properties": {}}}}]
FEEDBACK = {"role": "user", "content": [{"type": "text", "text": "Incorrect, try again."}]}


@pytest.fixture(scope="module")
def vlm():
    return load_policy("tiny-qwen2-vl")


@pytest.fixture(scope="module")
def lm():
    return load_policy("tiny-qwen2")


def _image(color=(200, 30, 30)):
    return Image.new("RGB", (56, 56), color)


@pytest.mark.parametrize("which", ["vlm", "lm"])
def test_delta_of_the_preset_template_never_repeats_the_system_prompt(which, request):
    adapter = request.getfixturevalue(which).adapter
    expected = "\n<|im_start|>user\nIncorrect, try again.<|im_end|>\n<|im_start|>assistant\n"
    assert adapter.observation_text([FEEDBACK]) == expected
    # a turn the model did not end itself is closed by the template's end-of-turn marker first
    assert adapter.observation_text([FEEDBACK], close_turn=True) == "<|im_end|>" + expected
    ids = adapter.encode_observation([FEEDBACK]).input_ids
    assert "system" not in adapter.tokenizer.decode(ids) and "helpful" not in adapter.tokenizer.decode(ids)


@pytest.mark.parametrize("which", ["vlm", "lm"])
def test_prompt_plus_turns_plus_deltas_equal_the_whole_conversation_rendered(which, request):
    """Context before turn 3 = the template's rendering of the whole conversation, token for token."""
    policy = request.getfixturevalue(which)
    adapter, eos = policy.adapter, policy.eos_token_ids[0]
    question = {"role": "user", "content": [{"type": "text", "text": "What color is the circle?"}]}
    answer_1, answer_2 = "<answer>B</answer>", "<answer>C</answer>"
    context = adapter.encode_prompt([question], []).input_ids
    context += adapter.encode_text(answer_1) + [eos] + adapter.encode_observation([FEEDBACK]).input_ids
    context += adapter.encode_text(answer_2) + [eos] + adapter.encode_observation([FEEDBACK]).input_ids
    conversation = [question, {"role": "assistant", "content": answer_1}, FEEDBACK,
                    {"role": "assistant", "content": answer_2}, FEEDBACK]
    assert context == adapter.encode_prompt(conversation, []).input_ids


def test_images_in_later_turns_expand_to_their_vision_tokens(vlm):
    adapter = vlm.adapter
    prompt_image, later = Image.new("RGB", (112, 112), (255, 255, 255)), _image()
    question = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many shapes?"}]}
    observation = {"role": "user", "content": [{"type": "image", "image": later}, {"type": "text", "text": "Look."}]}
    encoded = adapter.encode_observation([observation])
    n_tokens = int(encoded.vision.image_grid_thw[0].prod()) // adapter.merge_size**2  # 56×56 → 4×4 patches → 4
    assert encoded.input_ids.count(adapter.image_token_id) == n_tokens == 4
    prompt = adapter.encode_prompt([question], [prompt_image])
    eos = vlm.eos_token_ids[0]
    context = prompt.input_ids + adapter.encode_text("2") + [eos] + encoded.input_ids
    whole = adapter.encode_prompt([question, {"role": "assistant", "content": "2"},
                                   {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Look."}]}],
                                  [prompt_image, later])
    assert context == whole.input_ids


def test_image_parts_need_their_image_and_text_models_refuse_images(vlm, lm):
    with pytest.raises(ValueError, match="part 0: an image part needs a PIL image"):
        vlm.adapter.encode_observation([{"role": "user", "content": [{"type": "image"}]}])
    with pytest.raises(ValueError, match="text-only model cannot take images"):
        lm.adapter.encode_observation([{"role": "user", "content": [{"type": "image", "image": _image()}]}])


def _with_template(policy, template, cls):
    import copy

    tokenizer = copy.deepcopy(policy.tokenizer)
    tokenizer.chat_template = template
    if cls is TextAdapter:
        return TextAdapter(tokenizer)
    return Qwen2VLAdapter(tokenizer, policy.image_processor, policy.model.config)


def test_real_qwen25_template_with_tools_keeps_the_tool_preamble_once(lm):
    adapter = _with_template(lm, QWEN25_TEMPLATE, TextAdapter)
    tool_reply = {"role": "tool", "content": '{"result": 42}'}
    delta = adapter.observation_text([tool_reply], tools=TOOLS)
    assert delta == "\n<|im_start|>user\n<tool_response>\n{\"result\": 42}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert "# Tools" not in delta and "Alibaba" not in delta
    question = {"role": "user", "content": "Zoom in."}
    render = adapter.tokenizer.apply_chat_template
    prompt = render([question], tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert prompt.count("# Tools") == 1
    whole = render([question, {"role": "assistant", "content": "call"}, tool_reply], tools=TOOLS, tokenize=False,
                   add_generation_prompt=True)
    assert prompt + "call<|im_end|>" + delta == whole and whole.count("# Tools") == 1


def test_real_qwen2vl_template_delta_with_an_image(vlm):
    adapter = _with_template(vlm, QWEN2VL_TEMPLATE, Qwen2VLAdapter)
    observation = {"role": "user", "content": [{"type": "image", "image": _image()}, {"type": "text", "text": "Look."}]}
    assert adapter.observation_text([observation]) == (
        "\n<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Look.<|im_end|>\n<|im_start|>assistant\n")
    assert adapter.encode_observation([observation]).input_ids.count(adapter.image_token_id) == 4


def test_a_template_without_the_eos_marker_is_refused(lm):
    adapter = _with_template(lm, "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}", TextAdapter)
    with pytest.raises(ValueError, match="does not end the assistant turn with the tokenizer's eos_token"):
        adapter.observation_text([{"role": "user", "content": "hi"}])
