"""The preflight check: each failure mode is caught, naming the field or the file; good configs pass; the
recipes stop before any model weights load."""

import json
import re
from pathlib import Path

import pytest

from vlrl.check import PreflightError, detect_recipe, preflight
from vlrl.config import DemoConfig, RLConfig, SFTConfig, load_config

SMALL = ["data.n_train=16", "data.n_test=8", "check.samples_per_task=2"]


def _rl(*overrides):
    return load_config(RLConfig, None, [*SMALL, *overrides])


def _where(report):
    return {p.where for p in report.problems}


def _write_jsonl(path, records):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n")
    return path


def _record(k, **fields):
    return {"id": f"q{k}", "task": "t", "prompt": "What is 2+2?", "answer": "4", "reward": "number",
            "response": "<answer>4</answer>", **fields}


@pytest.mark.parametrize("path", sorted((Path(__file__).parents[2] / "configs").glob("*.yaml")), ids=lambda p: p.stem)
def test_shipped_configs_pass(path):
    cls = {"demo": DemoConfig, "sft": SFTConfig, "rl": RLConfig}[detect_recipe(__import__("yaml").safe_load(path.read_text()), path)]
    report = preflight(load_config(cls, path, ["check.samples_per_task=2"]))
    assert report.ok, report.format()
    assert any("context 2048 tokens" in fact for fact in report.facts)


def test_detect_recipe():
    assert detect_recipe({"sft": {}, "rl": {}}) == "demo"
    assert detect_recipe({"rollout": {"n": 4}}) == "rl"
    assert detect_recipe({"train": {"batch_size": 8}}) == "sft"
    assert detect_recipe({"model": {}}, "configs/my_sft.yaml") == "sft"
    assert detect_recipe({"stages": [{"name": "a", "prompt_template": "answer"}]}, "x.yaml") == "rl"
    assert detect_recipe({"stages": [{"name": "a", "train": {"batch_size": 8}}]}, "x.yaml") == "sft"


def test_vision_tokens_must_match_the_models_features(tmp_path):
    """A processor whose merge size differs from the model's: 112×112 → 8×8 patches; merge 1 gives 64 image
    tokens per prompt, while the model (spatial_merge_size 2) outputs 64 / 2² = 16 features."""
    from vlrl.models import load_policy

    load_policy("tiny-qwen2-vl").save(tmp_path / "model")
    processor = tmp_path / "model" / "preprocessor_config.json"
    settings = json.loads(processor.read_text())
    settings["merge_size"] = 1
    processor.write_text(json.dumps(settings))
    report = preflight(_rl(f"model.path={tmp_path / 'model'}", "data.tasks=[count]"))
    mismatches = [p for p in report.problems if "64 image tokens in the prompt" in p.message]
    assert mismatches and "outputs 16 features" in mismatches[0].message
    assert "spatial_merge_size 2" in mismatches[0].message
    assert all(p.where.startswith(("train sample", "test sample")) for p in mismatches)


def test_a_stray_image_token_in_the_text_names_the_line(tmp_path):
    data = _write_jsonl(tmp_path / "train.jsonl", [
        {"id": "a", "task": "t", "prompt": "<image>How many?", "images": [_image(tmp_path)], "answer": "1", "reward": "number"},
        {"id": "b", "task": "t", "prompt": "<image>How many <|image_pad|> here?", "images": [_image(tmp_path)],
         "answer": "1", "reward": "number"},
    ])
    report = preflight(_rl(f"data.train={data}"))
    assert _where(report) == {f"{data}:2"}
    assert "2 image placeholder(s) but 1 image(s)" in report.problems[0].message


def _image(tmp_path):
    from PIL import Image

    path = tmp_path / "img.png"
    if not path.exists():
        Image.new("RGB", (112, 112), "white").save(path)
    return str(path)


def test_prompt_plus_new_tokens_must_fit_the_context():
    report = preflight(_rl("rollout.max_new_tokens=2040", "eval.max_new_tokens=4000"))
    assert _where(report) == {"rollout.max_new_tokens", "eval.max_new_tokens"}
    message = next(p.message for p in report.problems if p.where == "eval.max_new_tokens")
    assert "+ 4000 new tokens" in message and "context of 2048 tokens" in message


def test_sft_response_must_fit_the_context(tmp_path):
    data = _write_jsonl(tmp_path / "train.jsonl", [_record(0), _record(1, response="<answer>" + "4 " * 3000 + "</answer>")])
    report = preflight(load_config(SFTConfig, None, [*SMALL, f"data.train={data}", "data.suite=arith", "data.tasks=[add]"]))
    assert _where(report) == {f"{data}:2"}
    assert "exceeds the model context of 2048 tokens (SFT)" in report.problems[0].message


def test_batch_sizes_must_divide():
    report = preflight(_rl("train.prompts_per_step=4", "rollout.n=4", "train.micro_batch_size=6"))
    assert _where(report) == {"train.micro_batch_size"}
    assert "6 does not divide the minibatch of 16 responses" in report.problems[0].message
    report = preflight(load_config(SFTConfig, None, [*SMALL, "train.batch_size=32", "train.micro_batch_size=12"]))
    assert _where(report) == {"train.micro_batch_size"}
    demo = preflight(load_config(DemoConfig, None, [*SMALL, "rl.rollout.n=1", "rl.train.micro_batch_size=3"]))
    assert _where(demo) == {"rl.train.micro_batch_size"}  # demo fields carry their section
    # a group of one: advantages all 0; SFT batches of 32 from 16 samples repeat them (issue 38: said with numbers)
    assert {w.where for w in demo.warnings} == {"rl.rollout.n", "sft.train.batch_size"}


def test_names_and_dotted_paths_must_resolve():
    report = preflight(_rl("algo.advantage=grpoo", "algo.policy_loss=no_such_module:loss",
                           "data.suite_options={env: 'vlrl.rewards:no_such_env'}", "data.suite=shapes"))
    problems = {p.where: p.message for p in report.problems}
    assert "unknown advantage 'grpoo'" in problems["algo.advantage"]
    assert "cannot import module 'no_such_module'" in problems["algo.policy_loss"]
    assert "has no 'no_such_env'" in problems["data.suite_options.env"]
    report = preflight(_rl("algo.reward_shaping=[{name: reward_scale}, {name: overlong_penaltyy}]",
                           "algo.advantage_shaping=[{name: 'vlrl.algos:no_such_shaper'}]"))
    problems = {p.where: p.message for p in report.problems}
    assert set(problems) == {"algo.reward_shaping.1.name", "algo.advantage_shaping.0.name"}
    assert "unknown reward shaping 'overlong_penaltyy'" in problems["algo.reward_shaping.1.name"]


def test_unknown_suite_and_task():
    assert _where(preflight(_rl("data.suite=juggling"))) == {"data.suite"}
    report = preflight(_rl("data.tasks=[count, juggle]"))
    assert _where(report) == {"data.tasks"} and "juggle" in report.problems[0].message


def test_data_files_must_exist_and_parse(tmp_path):
    report = preflight(_rl(f"data.train={tmp_path / 'missing.jsonl'}"))
    assert _where(report) == {"data.train"} and "no such file" in report.problems[0].message
    data = _write_jsonl(tmp_path / "train.jsonl", [_record(0), "{broken", _record(2, reward="no_such_reward"),
                                                   _record(3, images=["missing.png"], prompt="<image>x")])
    test = _write_jsonl(tmp_path / "test.jsonl", [_record(9)])
    report = preflight(_rl(f"data.train={data}", f"data.test={test}", "model.path=tiny-qwen2"))
    problems = {p.where: p.message for p in report.problems}
    assert set(problems) == {f"{data}:2", f"{data}:3", f"{data}:4"}
    assert "malformed JSON" in problems[f"{data}:2"]
    assert "unknown reward 'no_such_reward'" in problems[f"{data}:3"]
    assert "image file not found" in problems[f"{data}:4"]
    skipping = preflight(_rl(f"data.train={data}", f"data.test={test}", "model.path=tiny-qwen2", "data.on_error=skip"))
    skipped = [w for w in skipping.warnings if w.where.startswith(f"{data}:")]
    assert skipping.ok and len(skipped) == 3  # skipped and counted, not fatal


def test_sft_needs_reference_responses(tmp_path):
    data = _write_jsonl(tmp_path / "train.jsonl", [_record(0), _record(1, response=None)])
    test = _write_jsonl(tmp_path / "test.jsonl", [_record(9)])
    report = preflight(load_config(SFTConfig, None, [*SMALL, f"data.train={data}", f"data.test={test}", "model.path=tiny-qwen2"]))
    assert _where(report) == {"data.train"}
    assert "1 of 2 samples have no reference 'response'" in report.problems[0].message
    assert f"{data}:2" in report.problems[0].message


def test_model_path_must_be_a_model(tmp_path):
    report = preflight(_rl(f"model.path={tmp_path}"))
    assert _where(report) == {"model.path"} and "no config.json" in report.problems[0].message


def test_text_model_with_images_is_caught():
    report = preflight(_rl("model.path=tiny-qwen2"))  # shapes prompts carry images
    assert report.problems and all(p.where.startswith(("train sample", "test sample")) for p in report.problems)
    assert "a text-only model cannot take images" in report.problems[0].message


def test_missing_sink_package_is_named(monkeypatch):
    import vlrl.report.sinks as sinks

    monkeypatch.setitem(sinks._REQUIREMENTS, "wandb", "vlrl_no_such_package")
    report = preflight(_rl("report.sinks=[wandb, nope]"))
    messages = [p.message for p in report.problems if p.where == "report.sinks"]
    assert any("unknown metric sink 'nope'" in m for m in messages)
    assert any("needs the 'vlrl_no_such_package' package: pip install 'vlrl[wandb]'" in m for m in messages)


def test_recipes_stop_before_loading_weights(tmp_path, monkeypatch):
    import vlrl.recipes as recipes
    import vlrl.recipes.run as run

    def no_weights(*args, **kwargs):
        raise AssertionError("weights were loaded despite a failed preflight")

    monkeypatch.setattr(run, "load_policy", no_weights)
    cfg = load_config(RLConfig, None, [*SMALL, f"out={tmp_path}", "rollout.max_new_tokens=4000"])
    with pytest.raises(PreflightError, match=r"rollout.max_new_tokens: .* exceeds the model context"):
        recipes.run_rl(cfg)
    assert not (tmp_path / "report.html").exists()  # nothing was logged, so no report either


def test_syn_grpo_settings_are_checked(tmp_path):
    report = preflight(_rl("synth.enabled=true", "synth.backend=diffusers", "synth.segmenter=segment_anything",
                           "data.suite=shapes"))
    problems = {p.where: p.message for p in report.problems}
    assert "needs a local model directory" in problems["synth.backend_options.model_path"]
    assert "unknown segmenter 'segment_anything'" in problems["synth.segmenter"]
    assert any(w.where == "algo.reward_shaping" and "syn_diversity" in w.message for w in report.warnings)
    ok = preflight(_rl("synth.enabled=true", "synth.segmenter=model", f"synth.segmenter_options={{path: {tmp_path}}}",
                       "algo.reward_shaping=[{name: syn_diversity}]", "data.suite=shapes"))
    assert not [p for p in ok.problems if p.where.startswith(("synth", "algo"))], ok.format()


def _photo(tmp_path, name, size):
    from PIL import Image

    path = tmp_path / name
    Image.new("RGB", size, (120, 60, 30)).save(path)
    return str(path)


def test_an_answer_its_verifier_cannot_score_is_a_problem(tmp_path):
    data = _write_jsonl(tmp_path / "train.jsonl", [_record(0), _record(1, answer="seven"), _record(2)])
    test = _write_jsonl(tmp_path / "test.jsonl", [_record(9)])
    report = preflight(_rl(f"data.train={data}", f"data.test={test}", "model.path=tiny-qwen2"))
    assert _where(report) == {f"{data}:2"}
    assert "answer \"seven\" can never score on verifier 'number'" in report.problems[0].message


def test_resized_images_are_a_warning_from_what_to_what(tmp_path):
    """tiny-qwen2-vl's processor (Qwen2-VL smart_resize, factor 28, max_pixels 112² = 12,544): 448×224 has
    100,352 pixels > max, so β = √(448·224 / 12,544) = √8 ≈ 2.83; width ⌊448 / β / 28⌋·28 = ⌊5.66⌋·28 = 140,
    height ⌊224 / β / 28⌋·28 = ⌊2.83⌋·28 = 56: the model sees 140×56. A 112×112 image is kept as it is."""
    big = _photo(tmp_path, "big.png", (448, 224))
    exact = _photo(tmp_path, "exact.png", (112, 112))
    rows = [_record(0, prompt="<image>How many?", images=[big]), _record(1, prompt="<image>How many?", images=[exact])]
    data = _write_jsonl(tmp_path / "train.jsonl", rows)
    test = _write_jsonl(tmp_path / "test.jsonl", [_record(9)])  # text only
    report = preflight(_rl(f"data.train={data}", f"data.test={test}"))
    assert report.ok, report.format()
    warnings = [w for w in report.warnings if w.where == "model.max_pixels"]
    assert len(warnings) == 1 and "1 of 2 checked image(s) will be resized" in warnings[0].message
    assert "448×224 → 140×56" in warnings[0].message and "112×112 →" not in warnings[0].message
    assert f"(first: {data}:1)" in warnings[0].message


def test_a_missing_model_path_says_so():
    report = preflight(_rl("model.path=runs/nope/checkpoints/final"))
    assert _where(report) == {"model.path"}
    assert "runs/nope/checkpoints/final: no such directory (and not a preset: tiny-qwen2-vl" in report.problems[0].message
    assert "Repo id" not in report.format()


def test_a_prompt_longer_than_the_context_names_its_line(tmp_path):
    """Checked before anything is generated (`vlrl eval` once tried to allocate 8.6 GB for an 840k-token
    prompt): the longest-text prompt is among the encoded ones even when shorter prompts carry more images."""
    image = _image(tmp_path)
    rows = [_record(k, prompt="<image>How many?", images=[image]) for k in range(6)]
    rows.append(_record(6, prompt="word " * 3000 + "How many?"))  # no image, ~3000 tokens
    data = _write_jsonl(tmp_path / "test.jsonl", rows)
    report = preflight(_rl(f"data.test={data}", "check.samples_per_task=1"))
    assert _where(report) == {f"{data}:7"}
    assert "longer than the model context of 2048 tokens" in report.problems[0].message


def test_held_out_split_is_stated_and_user_stages_need_a_test_file(tmp_path):
    data = _write_jsonl(tmp_path / "train.jsonl", [_record(k) for k in range(20)])
    report = preflight(_rl(f"data.train={data}", "model.path=tiny-qwen2"))
    assert report.ok, report.format()
    assert any("2 of 20 samples of data.train held out for evaluation" in fact for fact in report.facts)
    report = preflight(_rl(f"data.train={data}", "model.path=tiny-qwen2", "data.test_fraction=0"))
    assert _where(report) == {"data.test"} and "data.test_fraction is 0" in report.problems[0].message
    staged = preflight(load_config(SFTConfig, None, [*SMALL, "model.path=tiny-qwen2", "data.suite=arith",
                                                     f"stages=[{{name: a, data: {{train: {data}}}}}]"]))
    assert "data.test" in _where(staged) and "stages.0.data.train" in staged.problems[0].message


def test_media_budgets_name_the_line_or_the_sample(tmp_path):
    from PIL import Image

    for k in range(4):
        Image.new("RGB", (32, 32), (60 * k, 0, 0)).save(tmp_path / f"f{k}.png")
    clip = {"messages": [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "How many?"}]}],
            "videos": [[f"f{k}.png" for k in range(4)]]}
    video = {k: v for k, v in _record(1).items() if k != "prompt"}
    data = _write_jsonl(tmp_path / "train.jsonl", [_record(0), {**video, **clip}])
    test = _write_jsonl(tmp_path / "test.jsonl", [_record(9)])
    report = preflight(_rl(f"data.train={data}", f"data.test={test}", "data.max_images=3"))
    assert _where(report) == {f"{data}:2"} and "4 images (video frames included) exceed data.max_images = 3" in report.problems[0].message
    assert preflight(_rl(f"data.train={data}", f"data.test={test}", "data.max_images=3", "data.max_frames=3")).ok
    # the procedural suite: every generated clip over the budget is a problem of the data section
    report = preflight(_rl("data.tasks=[video_count]", "data.suite_options={frames: 4, image_size: 32}", "data.max_images=3"))
    assert _where(report) == {"data"} and "data.max_images = 3" in report.problems[0].message


# ----------------------------------------------------------------------------------------------- issue 38
def _code_records(n):
    return [{"id": f"c{k}", "task": "code/echo", "prompt": f"Print {k}.", "answer": [{"input": "", "output": str(k)}],
             "reward": "code", "response": f"```python\nprint({k})\n```"} for k in range(n)]


def _failing_unshare(tmp_path, monkeypatch):
    """A machine where `unshare` fails (a container without user namespaces): a fake one first on PATH."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "unshare").write_text("#!/bin/sh\necho 'unshare: unshare failed: Operation not permitted' >&2\nexit 1\n")
    (fake / "unshare").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}:{__import__('os').environ['PATH']}")
    monkeypatch.delenv("VLRL_SANDBOX_ISOLATION", raising=False)


def test_vlrl_check_refuses_code_data_where_the_sandbox_cannot_isolate(tmp_path, monkeypatch):
    """Issue 38, finding 2 through `vlrl check`: data scored by `code` on a machine where `unshare` fails is a
    preflight problem naming the cause and the setting; sandbox.isolation=none passes and says what it gives."""
    from typer.testing import CliRunner

    from vlrl.cli import app

    data = _write_jsonl(tmp_path / "code.jsonl", _code_records(8))
    config = tmp_path / "sft.yaml"
    config.write_text(f"data: {{train: {data}, test: {data}}}\ntrain: {{batch_size: 4, micro_batch_size: 4}}\n"
                      "check: {samples_per_task: 2}\n")
    _failing_unshare(tmp_path, monkeypatch)
    result = CliRunner().invoke(app, ["check", str(config)])
    assert result.exit_code == 1, result.output
    lines = [line for line in result.output.splitlines() if "sandbox.isolation" in line]
    assert len(lines) == 1 and lines[0].startswith("  ✗ sandbox.isolation: the code sandbox cannot have isolation "
                                                   "'namespaces' here (root: `unshare"), result.output
    assert "exited 1: unshare: unshare failed: Operation not permitted" in lines[0]
    assert "sandbox.isolation=none" in lines[0]
    result = CliRunner().invoke(app, ["check", str(config), "sandbox.isolation=none"])
    assert result.exit_code == 0, result.output
    assert "code sandbox: isolation none (sandbox.isolation none): rlimits and a disabled socket module only" in result.output


def _namespaces() -> bool:
    from vlrl.rewards.sandbox import SandboxUnavailable, isolation

    try:
        return isolation("namespaces") != "none"
    except SandboxUnavailable:
        return False


@pytest.mark.skipif(not _namespaces(), reason="no namespaces here: the run would (rightly) refuse code data")
def test_a_run_with_code_data_logs_and_records_the_isolation_it_got(tmp_path):
    """Issue 38: the isolation the `code` reward's programs actually get is logged once and recorded in
    summary.json (`sandbox`); data without the `code` reward records none."""
    from typer.testing import CliRunner

    from vlrl.cli import app
    from vlrl.rewards.sandbox import isolation

    data = _write_jsonl(tmp_path / "code.jsonl", _code_records(2))
    common = ["model.path=tiny-qwen2", "train.steps=1", "train.batch_size=2", "train.micro_batch_size=2",
              "eval.samples=1", "eval.max_new_tokens=2", "check.samples_per_task=1", "report.html=false"]
    result = CliRunner().invoke(app, ["sft", "--data", str(data), "--test", str(data), f"out={tmp_path / 'run'}", *common])
    assert result.exit_code == 0, result.output
    logged = [line for line in result.output.splitlines() if "code sandbox: isolation" in line]
    assert len(logged) == 1 and f"isolation {isolation()} (sandbox.isolation namespaces)" in logged[0], result.output
    sandbox = json.loads((tmp_path / "run" / "summary.json").read_text())["sandbox"]
    assert sandbox["setting"] == "namespaces" and sandbox["isolation"] == isolation() != "none"
    from vlrl.check import sandbox_isolation
    from vlrl.data import read_samples

    samples = read_samples(data).samples
    assert sandbox_isolation(SFTConfig(), {"train": samples[:1]}) == sandbox
    for s in samples:
        s.reward = "number"
    assert sandbox_isolation(SFTConfig(), {"train": samples}) is None  # no program runs: nothing to record


def test_a_record_over_data_max_record_bytes_stops_vlrl_check(tmp_path):
    """Issue 38, finding 7: a huge jsonl line passed `vlrl check` and `vlrl sft` (then 10 GB in 15 s). Now a record
    longer than data.max_record_bytes is a bad record, found while reading: one line naming file:line."""
    from typer.testing import CliRunner

    from vlrl.cli import app

    data = _write_jsonl(tmp_path / "train.jsonl", [_record(0), _record(1, prompt="x" * 300_000), _record(2)])
    result = CliRunner().invoke(app, ["check", str(_sft_config(tmp_path, data)), "data.max_record_bytes=100000"])
    assert result.exit_code == 1, result.output
    problems = [line for line in result.output.splitlines() if line.startswith("  ✗")]
    assert problems == [f"  ✗ {data}:2: a record of 300,108 bytes, more than data.max_record_bytes (100,000)"] * 2, \
        result.output  # data.train and data.test (the same file here)


def _sft_config(tmp_path, data):
    config = tmp_path / "sft.yaml"
    config.write_text(f"model: {{path: tiny-qwen2}}\ndata: {{train: {data}, test: {data}}}\n"
                      "train: {batch_size: 2, micro_batch_size: 2}\ncheck: {samples_per_task: 1}\n")
    return config


def test_a_batch_beyond_memory_stops_check_and_the_run_with_the_arithmetic(tmp_path):
    """Issue 38, finding 9: train.batch_size=1000000000 passed the preflight, then grew ~16 MB/s with no step. Now
    `vlrl check` and `vlrl sft` stop at the preflight with the arithmetic (a lower bound: token ids alone), and a
    batch larger than the data is a warning with its numbers."""
    from typer.testing import CliRunner

    from vlrl.check import memory_bytes
    from vlrl.cli import app

    data = _write_jsonl(tmp_path / "train.jsonl", [_record(k) for k in range(4)])
    config = _sft_config(tmp_path, data)
    memory, whose = memory_bytes()
    result = CliRunner().invoke(app, ["check", str(config), "train.batch_size=1000000000"])
    assert result.exit_code == 1, result.output
    problems = [line for line in result.output.splitlines() if line.startswith("  ✗")]
    assert len(problems) == 1 and re.fullmatch(
        r"  ✗ train\.batch_size: one step holds at least 1,000,000,000 samples × (\d+) tokens × 8 bytes = "
        rf"[\d,.]+ GiB of token ids, more than {re.escape(whose)} {memory / (1 << 30):,.1f} GiB of memory \(the "
        r"shortest checked prompt has \1 tokens\)", problems[0]), problems
    assert "  ! train.batch_size: 1,000,000,000 per step, more than the 4 training samples (data.train " in result.output
    result = CliRunner().invoke(app, ["sft", "--config", str(config), "train.batch_size=1000000000", f"out={tmp_path / 'run'}"])
    assert result.exit_code == 1 and problems[0] in result.output.splitlines(), result.output
    assert not (tmp_path / "run" / "checkpoints").exists()
    result = CliRunner().invoke(app, ["check", str(config), "train.batch_size=8", "train.micro_batch_size=8"])
    assert result.exit_code == 0 and "  ! train.batch_size: 8 per step, more than the 4 training samples" in result.output


@pytest.mark.parametrize(("override", "lines"), [
    ("optim.betas=[2,2]", ["config field 'optim.betas.0': Input should be less than 1",
                           "config field 'optim.betas.1': Input should be less than 1"]),
    ("optim.betas=[0.9,1.0]", ["config field 'optim.betas.1': Input should be less than 1"]),
    ("optim.betas=[-0.1,0.9]", ["config field 'optim.betas.0': Input should be greater than or equal to 0"]),
    ("optim.module_lr={vision: -1e-5}", ["config field 'optim.module_lr.vision': Input should be greater than or equal to 0"]),
    ("optim.eps=0", ["config field 'optim.eps': Input should be greater than 0"]),
    ("optim.weight_decay=-0.01", ["config field 'optim.weight_decay': Input should be greater than or equal to 0"]),
])
def test_optimizer_hyperparameters_outside_their_ranges_exit_2(override, lines, tmp_path):
    """Issue 38, finding 9: optim.betas=[2,2] passed the preflight and ended in a raw torch traceback. Each value
    outside its valid range now stops the command at load, one line per field, exit 2."""
    from typer.testing import CliRunner

    from vlrl.cli import app

    result = CliRunner().invoke(app, ["rl", override, f"out={tmp_path / 'run'}", "model.path=/nonexistent/model"])
    assert result.exit_code == 2 and result.output.strip().splitlines() == lines, result.output  # (not the preflight's 1)
    assert not (tmp_path / "run").exists()


def test_a_model_directory_with_pickle_weights_only_is_refused_in_one_line(tmp_path):
    """Issue 47: a model directory holding only pytorch_model.bin passed the preflight (then a 183-line traceback
    when the pickle would not load); `vlrl check` and `vlrl serve` now refuse it in one line naming the file."""
    import torch
    from safetensors.torch import load_file
    from typer.testing import CliRunner

    from vlrl.cli import app
    from vlrl.models import load_policy

    model = tmp_path / "model"
    load_policy("tiny-qwen2").save(model)
    for weights in model.glob("*.safetensors"):
        torch.save(load_file(weights), model / "pytorch_model.bin")
        weights.unlink()
    config = tmp_path / "rl.yaml"
    config.write_text(f"model: {{path: {model}}}\ndata: {{suite: arith, tasks: [add], n_train: 8, n_test: 4}}\n"
                      "check: {samples_per_task: 1}\n")
    result = CliRunner().invoke(app, ["check", str(config), "--recipe", "rl"])
    problems = [line for line in result.output.splitlines() if line.startswith("  ✗")]
    assert result.exit_code == 1 and problems == [
        f"  ✗ model.path: {model}: its weights are pickle files only (pytorch_model.bin); a pickle can run code when "
        "loaded, so vlrl refuses it — re-save the model where you trust it (from_pretrained, then save_pretrained "
        "writes model.safetensors)"], result.output
    served = CliRunner().invoke(app, ["serve", "--model", str(model), "--port", "0"])
    assert served.exit_code == 2 and "its weights are pickle files only" in served.output
