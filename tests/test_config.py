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
