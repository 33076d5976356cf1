"""Typed configuration: one documented field per setting, validated at load time.

Configs are pydantic models; every field carries a description (a test enforces it). A YAML file and
dotted command-line overrides (``algo.clip_high=0.28``) are merged into one dict and validated once; a
wrong key or type raises `ConfigError` naming the field.

Shape: `SFTConfig` and `RLConfig` share the run sections (`model`, `data`, `eval`, `out`, `seed`) and add
their stage sections; `DemoConfig` holds both stages under ``sft`` and ``rl``.

The package, by topic (every name is importable from ``vlrl.config`` itself):

- `vlrl.config.base`: `Section`, `ConfigError`, `SEED_MAX`;
- `vlrl.config.model`: the policy and its data (`ModelConfig`, `LoraConfig`, `DataConfig`, `EvalConfig`);
- `vlrl.config.rollout`: how the RL stage samples (`RolloutConfig` and its sub-sections `EngineConfig`, `AgentConfig`,
  `ServersConfig` (with `LaunchServersConfig`), `WeightSyncConfig`; `StalenessConfig`, `DynamicSamplingConfig`);
- `vlrl.config.train`: the optimizer, the SFT stage and the RL stage's algorithm and loop (`SFTStage`, `RLStage`);
- `vlrl.config.runs`: the run-wide sections and the whole runs (`RunConfig`, `SFTConfig`, `RLConfig`, `DemoConfig`);
- `vlrl.config.loading`: `load_config`, `apply_overrides`, `resolve_paths`, `dump_config`.
"""

from vlrl.config.base import SEED_MAX, ConfigError, Section
from vlrl.config.loading import (
    apply_overrides,
    dump_config,
    load_config,
    resolve_paths,
)
from vlrl.config.model import DataConfig, EvalConfig, LoraConfig, ModelConfig
from vlrl.config.rollout import (
    MOVED_KEYS,
    AgentConfig,
    DynamicSamplingConfig,
    EngineConfig,
    LaunchServersConfig,
    RolloutConfig,
    ServersConfig,
    StalenessConfig,
    WeightSyncConfig,
)
from vlrl.config.runs import (
    CheckConfig,
    CheckpointConfig,
    DemoConfig,
    DistConfig,
    LaunchConfig,
    MlflowOptions,
    ReportConfig,
    RLConfig,
    RLStageSpec,
    RunConfig,
    SandboxConfig,
    SFTConfig,
    SFTStageSpec,
    WandbOptions,
)
from vlrl.config.train import (
    AlgoConfig,
    CriticConfig,
    DistillConfig,
    OptimConfig,
    RLStage,
    RLTrainConfig,
    RolloutCorrectionConfig,
    SelectConfig,
    SFTStage,
    SFTTrainConfig,
    ShapingSpec,
    SynthConfig,
)

__all__ = [
    "MOVED_KEYS", "SEED_MAX", "AgentConfig", "AlgoConfig", "DistillConfig", "CheckConfig", "CheckpointConfig", "ConfigError",
    "CriticConfig", "DataConfig", "DemoConfig", "DistConfig", "DynamicSamplingConfig", "EngineConfig", "EvalConfig",
    "LaunchConfig", "LaunchServersConfig", "LoraConfig", "MlflowOptions", "ModelConfig", "OptimConfig", "RLConfig", "RLStage", "RLStageSpec",
    "RLTrainConfig", "ReportConfig", "RolloutConfig", "RolloutCorrectionConfig", "RunConfig", "SFTConfig", "SFTStage",
    "SFTStageSpec", "SFTTrainConfig", "SandboxConfig", "Section", "SelectConfig", "ServersConfig", "ShapingSpec",
    "StalenessConfig", "SynthConfig", "WandbOptions", "WeightSyncConfig", "apply_overrides", "dump_config",
    "load_config", "resolve_paths",
]
