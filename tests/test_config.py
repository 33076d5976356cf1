import pytest
from pydantic import BaseModel

from vlrl.config import ConfigError, DemoConfig, RLConfig, SFTConfig, load_config


def _models(cls, seen=None):
    seen = seen if seen is not None else set()
    if cls in seen:
        return seen
    seen.add(cls)
    for field in cls.model_fields.values():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            _models(annotation, seen)
    return seen


@pytest.mark.parametrize("root", [DemoConfig, RLConfig, SFTConfig])
def test_every_field_has_a_description(root):
    missing = [f"{cls.__name__}.{name}" for cls in _models(root) for name, f in cls.model_fields.items()
               if not (f.description and len(f.description) > 10)]
    assert not missing, missing


def test_overrides_and_yaml(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("algo:\n  clip_high: 0.3\ntrain:\n  steps: 7\n")
    cfg = load_config(RLConfig, path, ["algo.clip_high=0.28", "rollout.stop=['</answer>']", "data.tasks=[count]"])
    assert cfg.algo.clip_high == 0.28 and cfg.train.steps == 7
    assert cfg.rollout.stop == ["</answer>"] and cfg.data.tasks == ["count"]


def test_wrong_key_and_type_name_the_field(tmp_path):
    with pytest.raises(ConfigError, match=r"config field 'algo.clip_hgh': unknown field"):
        load_config(RLConfig, None, ["algo.clip_hgh=0.3"])
    with pytest.raises(ConfigError, match=r"config field 'train.steps'"):
        load_config(RLConfig, None, ["train.steps=many"])
    with pytest.raises(ConfigError, match="expected key=value"):
        load_config(RLConfig, None, ["algo.clip_high"])
    with pytest.raises(ConfigError, match="not found"):
        load_config(RLConfig, tmp_path / "missing.yaml")


def test_batch_sizes_must_divide():
    with pytest.raises(ConfigError, match="do not split into"):
        load_config(RLConfig, None, ["train.prompts_per_step=3", "rollout.n=3", "train.minibatches=2"])


def test_shipped_configs_load():
    from pathlib import Path

    root = Path(__file__).parents[1] / "configs"
    files = sorted(root.glob("*.yaml"))
    assert files
    for path in files:
        cls = DemoConfig if path.stem.startswith("demo") else SFTConfig if "sft" in path.stem else RLConfig
        load_config(cls, path)


def test_relative_paths_in_a_config_file_resolve_beside_it(tmp_path, monkeypatch):
    """data.train in configs/x.yaml is found beside the file; the same path as an override (or --data) is taken
    from the current directory; `out` stays relative to the current directory; a preset or hub id is kept."""
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "model").mkdir()
    (tmp_path / "cfg" / "model" / "config.json").write_text("{}")
    (tmp_path / "cfg" / "x.yaml").write_text(
        "data: {train: mine.jsonl, test: ../held/test.jsonl}\nmodel: {path: model}\nout: runs/x\n"
        "stages: [{name: a, data: {train: a.jsonl}}]\n")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    cfg = load_config(SFTConfig, "../cfg/x.yaml")
    assert cfg.data.train == str(tmp_path / "cfg" / "mine.jsonl")
    assert cfg.data.test == str(tmp_path / "held" / "test.jsonl")
    assert cfg.model.path == str(tmp_path / "cfg" / "model")  # exists beside the file: a directory
    assert cfg.stages[0].data.train == str(tmp_path / "cfg" / "a.jsonl")
    assert cfg.out == "runs/x"  # an output: where you run
    cfg = load_config(SFTConfig, "../cfg/x.yaml", ["data.train=mine.jsonl", "stages.0.data.train=b.jsonl",
                                                  "model.path=Qwen/Qwen2-VL-2B-Instruct"])
    assert cfg.data.train == str(tmp_path / "elsewhere" / "mine.jsonl")  # the command line: the cwd
    assert cfg.stages[0].data.train == str(tmp_path / "elsewhere" / "b.jsonl")
    assert cfg.model.path == "Qwen/Qwen2-VL-2B-Instruct"  # no such directory: a hub id, kept
    assert load_config(RLConfig, None, ["model.path=tiny-qwen2"]).model.path == "tiny-qwen2"
    assert load_config(RLConfig, None, ["model.path=./ckpt"]).model.path == str(tmp_path / "elsewhere" / "ckpt")


def test_overrides_index_lists_of_stages(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("stages: [{name: a}, {name: b, train: {steps: 5}}]\n")
    cfg = load_config(SFTConfig, path, ["stages.1.train.steps=2", "stages.0.train.batch_size=4"])
    assert [s.train.steps for s in cfg.stages] == [500, 2] and cfg.stages[0].train.batch_size == 4
    with pytest.raises(ConfigError, match="'2' is not an index of the 2 item"):
        load_config(SFTConfig, path, ["stages.2.train.steps=1"])
    with pytest.raises(ConfigError, match="would replace one item of a list"):
        load_config(SFTConfig, path, ["stages.0=x"])


def test_test_fraction_is_a_share():
    assert load_config(RLConfig, None, []).data.test_fraction == 0.1
    with pytest.raises(ConfigError, match="config field 'data.test_fraction'"):
        load_config(RLConfig, None, ["data.test_fraction=1.5"])


def test_every_float_field_of_every_section_refuses_nan_and_inf():
    """One pydantic rule (`Section.model_config`, allow_inf_nan=False) covers every float field, present and
    future, also inside tuples and dicts: each refuses nan and ±inf, naming the field."""
    import math
    import typing

    from pydantic import ValidationError

    import vlrl.config as config

    def sections(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from sections(sub)

    checked = 0
    for section in set(sections(config.Section)):
        for name, info in section.model_fields.items():
            if info.annotation is float or set(typing.get_args(info.annotation)) == {float, type(None)}:
                for bad in (math.nan, math.inf, -math.inf):
                    with pytest.raises(ValidationError) as err:
                        section.model_validate({name: bad})
                    assert any(e["loc"] == (name,) and e["type"] == "finite_number" for e in err.value.errors()), \
                        f"{section.__name__}.{name} accepted {bad}"
                checked += 1
    assert checked >= 25  # 27 today: lr, temperatures, clip ranges, KL and loss coefficients, timeouts, ...
    with pytest.raises(ConfigError, match=r"config field 'optim.betas.0': Input should be a finite number"):
        load_config(SFTConfig, None, ["optim.betas=[.nan,0.99]"])  # inside a tuple
    with pytest.raises(ConfigError, match=r"config field 'optim.module_lr.visual': Input should be a finite number"):
        load_config(SFTConfig, None, ["optim.module_lr={visual: .inf}"])  # inside a dict


def test_seeds_are_bounded_to_numpy_range():
    for field in ("seed", "data.seed", "model.init_seed"):
        assert load_config(RLConfig, None, [f"{field}={2**32 - 1}"]) is not None
        with pytest.raises(ConfigError, match=rf"config field '{field}': Input should be less than 4294967296"):
            load_config(RLConfig, None, [f"{field}={2**32}"])


def test_an_override_of_a_string_field_is_the_text_as_typed_through_the_cli(tmp_path):
    """Issue 50, item 4: ``'data.prompt_template={{ content }} Answer.'`` is not YAML (a flow mapping left open);
    for a field typed as a string it is the string the user meant — `vlrl check` renders the template on every row
    (an undefined name in it is reported, so the text reached the renderer as typed), and text YAML reads as a
    mapping (``Q: {content}``) is the string too. Any other field refuses text that is not YAML as before."""
    import json

    from typer.testing import CliRunner

    from vlrl.cli import app

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"id": f"q{k}", "task": "t", "prompt": "What is 2+2?", "answer": "4",
                                        "reward": "number", "response": "<answer>4</answer>"}) + "\n" for k in range(2)))
    config = tmp_path / "sft.yaml"
    config.write_text(f"model: {{path: tiny-qwen2}}\ndata: {{train: {data}, test: {data}}}\n"
                      "train: {batch_size: 2, micro_batch_size: 2}\ncheck: {samples_per_task: 1}\n")

    def check(override):
        return CliRunner().invoke(app, ["check", str(config), override])

    for template in ("{{ content }} Answer.", "Q: {{ content }}"):
        result = check(f"data.prompt_template={template}")
        assert result.exit_code == 0 and "does not load" not in result.output, (template, result.output)
    result = check("data.prompt_template={{ nope }} {{ content }}")  # the template as typed, rendered per row
    assert result.exit_code == 1 and "data.prompt_template: 'nope' is undefined" in result.output, result.output
    result = check("train.steps={{ content }} Answer.")
    assert result.exit_code == 1 and "override 'train.steps={{ content }} Answer.': the value is not valid YAML" \
        in result.output, result.output
    # null still unsets an optional string; a field that takes a string or a mapping keeps YAML's mapping
    assert load_config(SFTConfig, config, ["data.prompt_template=null"]).data.prompt_template is None
    assert load_config(SFTConfig, config, ["data.reward={math: 0.9, format: 0.1}"]).data.reward == \
        {"math": 0.9, "format": 0.1}
