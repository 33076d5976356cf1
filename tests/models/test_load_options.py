"""The options users set on real checkpoints (`vlrl.models.policy.LoadOptions`): each reaches transformers, and every
command that loads a model passes them (sft, rl, eval, serve, data select, data pack; `vlrl launch`'s servers)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import forked_runs  # tests/ is on sys.path
from vlrl.models import load_policy
from vlrl.models.policy import LoadOptions, load_processor

REPO = Path(__file__).resolve().parents[2]
MESSAGES = [{"role": "user", "content": [{"type": "text", "text": "How many?"}]}]


def _attention(model) -> set[str]:
    config = model.config
    subs = [config, *(getattr(config, name) for name in ("text_config", "vision_config") if hasattr(config, name))]
    return {c._attn_implementation for c in subs}


# ----------------------------------------------------------------------------------------------- attn_implementation
def test_attn_implementation_reaches_the_model(tiny_vlm_dir):
    """The implementation the model reports (every sub-config) — a preset and a checkpoint loaded by from_pretrained."""
    assert _attention(load_policy("tiny-qwen2-vl").model) == {"sdpa"}  # transformers' default
    assert _attention(load_policy("tiny-qwen2-vl", options=LoadOptions(attn_implementation="eager")).model) == {"eager"}
    assert _attention(load_policy(str(tiny_vlm_dir), options=LoadOptions(attn_implementation="eager")).model) == {"eager"}


def test_an_attention_kernel_that_is_not_installed_is_refused_naming_the_field(tiny_vlm_dir):
    with pytest.raises(ValueError, match=r"model.attn_implementation=flash_attention_2: .*flash-attn"):
        load_policy(str(tiny_vlm_dir), options=LoadOptions(attn_implementation="flash_attention_2"))
    with pytest.raises(ValueError, match=r"model.attn_implementation=nonsense: "):
        load_policy("tiny-qwen2-vl", options=LoadOptions(attn_implementation="nonsense"))


# ----------------------------------------------------------------------------------------------- revision
def test_revision_reaches_every_file_transformers_reads(tiny_vlm_dir, monkeypatch):
    """No hub here: each ``from_pretrained`` is wrapped to record its keyword arguments (a local directory ignores
    the revision, so the load itself goes on)."""
    import transformers

    seen: dict[str, dict] = {}
    # a saved preset's tokenizer is read as the backend it was saved as (vlrl.models.policy._saved_tokenizer), a
    # hub checkpoint's by AutoTokenizer
    for name in ("AutoConfig", "AutoTokenizer", "TokenizersBackend", "AutoImageProcessor", "AutoModelForImageTextToText"):
        cls = getattr(transformers, name)
        real = cls.from_pretrained.__func__

        def spy(klass, path, *args, _name=name, _real=real, **kwargs):
            seen[_name] = kwargs
            return _real(klass, path, *args, **kwargs)

        monkeypatch.setattr(cls, "from_pretrained", classmethod(spy))
    load_policy(str(tiny_vlm_dir), options=LoadOptions(revision="v2"))
    assert {name: kwargs.get("revision") for name, kwargs in seen.items()} == {
        "AutoConfig": "v2", "TokenizersBackend": "v2", "AutoImageProcessor": "v2", "AutoModelForImageTextToText": "v2"}
    assert all(kwargs.get("trust_remote_code") is False for kwargs in seen.values())


# ----------------------------------------------------------------------------------------------- trust_remote_code
@pytest.fixture(scope="module")
def custom_code_dir(tmp_path_factory) -> Path:
    """A checkpoint that ships its own modelling code: tiny-qwen2's weights under a model type transformers does not
    know, its classes mapped by config.json's ``auto_map`` to the .py files beside it."""
    path = tmp_path_factory.mktemp("custom-code")
    load_policy("tiny-qwen2").save(path)
    config = json.loads((path / "config.json").read_text())
    config.update(model_type="vlrl_custom_lm", architectures=["CustomForCausalLM"],
                  auto_map={"AutoConfig": "configuration_custom.CustomConfig",
                            "AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"})
    (path / "config.json").write_text(json.dumps(config))
    (path / "configuration_custom.py").write_text(
        "from transformers import Qwen2Config\n\n\nclass CustomConfig(Qwen2Config):\n    model_type = 'vlrl_custom_lm'\n")
    (path / "modeling_custom.py").write_text(
        "from transformers import Qwen2ForCausalLM\n\nfrom .configuration_custom import CustomConfig\n\n\n"
        "class CustomForCausalLM(Qwen2ForCausalLM):\n    config_class = CustomConfig\n")
    return path


def test_remote_code_is_refused_unless_trusted(custom_code_dir):
    with pytest.raises(ValueError, match=r"ships its own modelling code \(configuration_custom.py, modeling_custom.py\).*"
                                         r"model.trust_remote_code=true"):
        load_policy(str(custom_code_dir))
    policy = load_policy(str(custom_code_dir), options=LoadOptions(trust_remote_code=True))
    assert type(policy.model).__name__ == "CustomForCausalLM"  # the shipped class ran
    assert policy.model.config.model_type == "vlrl_custom_lm"


def test_check_names_the_field_for_remote_code(custom_code_dir, tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(f"model: {{path: {custom_code_dir}}}\ndata: {{suite: arith, tasks: [add], n_train: 4, n_test: 2}}\n"
                      "rollout: {n: 2}\ntrain: {prompts_per_step: 2}\n")
    done = _cli("check", str(config), ok=False)
    assert done.returncode == 1 and "✗ model.trust_remote_code: model.path" in done.stdout
    assert _cli("check", str(config), "model.trust_remote_code=true").returncode == 0


# ----------------------------------------------------------------------------------------------- chat_template_kwargs
def test_chat_template_kwargs_switch_a_thinking_template_off():
    """Qwen3.5's template (the tiny preset's) thinks by default; ``{enable_thinking: false}`` renders the closed empty
    think block that switches it off, in every prompt the adapter renders and in the preflight's token count."""
    plain = load_policy("tiny-qwen3.5").adapter.render(MESSAGES)
    off = load_policy("tiny-qwen3.5", options=LoadOptions(chat_template_kwargs={"enable_thinking": False}))
    assert plain.endswith("<|im_start|>assistant\n")
    assert off.adapter.render(MESSAGES) == plain + "<think>\n\n</think>\n\n"
    counted = load_processor("tiny-qwen3.5", options=LoadOptions(chat_template_kwargs={"enable_thinking": False}))
    assert counted.adapter.render(MESSAGES) == off.adapter.render(MESSAGES)


def test_the_recipes_load_the_model_with_its_section(tmp_path):
    """`vlrl sft` / `vlrl rl` load the policy through one function that takes every option of ``model``."""
    from vlrl.config import RLConfig, load_config
    from vlrl.recipes.run import load_run_policy
    from vlrl.report import MetricsLogger

    cfg = load_config(RLConfig, None, ["model.path=tiny-qwen3.5", "model.attn_implementation=eager",
                                       "model.chat_template_kwargs={enable_thinking: false}"])
    logger = MetricsLogger(None, quiet=True)
    policy = load_run_policy(cfg, logger)
    assert _attention(policy.model) == {"eager"}
    assert policy.adapter.render(MESSAGES).endswith("<think>\n\n</think>\n\n")


def test_check_counts_prompts_with_the_template_variables(tmp_path):
    """Through the CLI: the preflight encodes prompts with ``model.chat_template_kwargs`` (the closed think block:
    a few more tokens)."""
    config = tmp_path / "c.yaml"
    config.write_text("model: {path: tiny-qwen3.5}\ndata: {suite: arith, tasks: [add], n_train: 4, n_test: 2}\n"
                      "rollout: {n: 2}\ntrain: {prompts_per_step: 2}\n")

    def longest(*overrides: str) -> int:
        out = _cli("check", str(config), *overrides).stdout
        return int(out.split("longest prompt: train ")[1].split(" tokens")[0])

    assert longest("model.chat_template_kwargs={enable_thinking: false}") > longest()


# ----------------------------------------------------------------------------------------------- the other commands
@pytest.fixture
def captured(monkeypatch):
    """`load_policy` / `load_processor` as the CLI imports them, recording the options and stopping the command."""
    import vlrl.models
    import vlrl.models.policy

    calls: list[LoadOptions] = []

    class Stop(Exception):
        pass

    def record(*args, options=None, **kwargs):
        calls.append(options)
        raise Stop

    monkeypatch.setattr(vlrl.models, "load_policy", record)
    monkeypatch.setattr(vlrl.models.policy, "load_processor", record)
    monkeypatch.setattr("vlrl.models.load_policy", record)
    return calls


def test_eval_serve_select_and_pack_pass_the_options(captured, tmp_path, monkeypatch):
    from vlrl.cli import app
    from vlrl.data import generate, write_samples

    data = write_samples(generate("arith", 4, tasks=["add"]), tmp_path / "d.jsonl")
    runner = CliRunner()
    flags = ["--attn-implementation", "eager", "--revision", "v2", "--trust-remote-code",
             "--chat-template-kwargs", '{"enable_thinking": false}']
    want = LoadOptions("eager", "v2", True, {"enable_thinking": False})
    runner.invoke(app, ["eval", "--model", "tiny-qwen2", "--data", str(data), *flags])
    runner.invoke(app, ["data", "select", "--data", str(data), "--model", "tiny-qwen2", "--out", str(tmp_path / "s"),
                        *flags])
    assert captured == [want, want]
    import vlrl.rollout.server as server

    monkeypatch.setattr(server, "serve", lambda model, **kwargs: captured.append(kwargs["options"]))
    runner.invoke(app, ["serve", "--model", "tiny-qwen2", "--no-auth", *flags[:5]])
    assert captured[-1] == LoadOptions("eager", "v2", True, {})
    runner.invoke(app, ["data", "pack", "--data", str(data), "--out", str(tmp_path / "p.npz"), "--capacity", "64",
                        "--model", "tiny-qwen2", *flags[2:]])
    assert captured[-1] == LoadOptions(None, "v2", True, {"enable_thinking": False})


def test_launch_gives_the_servers_the_model_options():
    from vlrl.config import RLConfig, load_config
    from vlrl.launch.launcher import server_plan

    cfg = load_config(RLConfig, None, ["launch.rollout_servers=1", "model.attn_implementation=sdpa",
                                       "model.revision=v2", "model.trust_remote_code=true",
                                       "launch.server_args=[--batch-window-ms, '5']"])
    command = server_plan(cfg, "rl").command(0)
    assert command[command.index("--attn-implementation") + 1] == "sdpa"
    assert command[command.index("--revision") + 1] == "v2" and "--trust-remote-code" in command
    assert command.index("--batch-window-ms") > command.index("--trust-remote-code")  # the launch's own args last


def _cli(*args: str, ok: bool = True) -> subprocess.CompletedProcess:
    done = forked_runs.run([sys.executable, "-m", "vlrl.cli", *args], timeout=600,
                           env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}, cwd=REPO)
    if ok:
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done
