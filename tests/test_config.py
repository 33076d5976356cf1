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
