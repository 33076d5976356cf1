"""Metric sinks: where `MetricsLogger` records go. One interface, one registry.

A sink receives every record the recipes log — ``{"stage": "rl", "step": 12, "time": 83.1, "reward/mean": 0.6,
...}`` — through ``write(record)`` and is closed at the end of the run. ``metrics.jsonl`` is always written
(`JsonlSink`); the others are opt-in with ``report.sinks=[tensorboard, wandb, mlflow]`` or a dotted path
``pkg.mod:factory`` to your own.

Names stay the same everywhere (``reward/mean``, ``policy/entropy``, ...). A run has several stages whose
steps restart at 1 (``sft``, ``rl``, ``sft_control``, ``eval/…``), so:

- TensorBoard: one sub-run per stage (``RUN_DIR/tensorboard/<stage>``), tags unchanged;
- W&B and MLflow: one run, keys ``<stage>/<name>``; W&B plots each stage against its own ``<stage>/step``;
  MLflow forbids ``@`` in names, so ``pass@4/mean`` is logged as ``pass_4/mean`` there.

A sink whose package is missing raises `SinkUnavailable` naming the package to install; the preflight
check reports it before any weights load.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from vlrl.registry import Registry

RESERVED = ("stage", "step", "time")  # record keys that are not metrics


@runtime_checkable
class Sink(Protocol):
    """Receives every logged record; ``close`` flushes and releases it."""

    def write(self, record: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


SinkFactory = Callable[..., Sink]
SINKS: Registry[SinkFactory] = Registry(
    "metric sink", signature="make(run_dir: Path, *, run_name: str, config: dict, **options) -> Sink"
)


class SinkUnavailable(RuntimeError):
    """A configured sink whose package is not installed (the message says what to install)."""


def numeric_metrics(record: Mapping[str, Any]) -> Iterator[tuple[str, float]]:
    """The finite numeric metrics of a record (not stage/step/time, not strings or NaN)."""
    for name, value in record.items():
        if name in RESERVED or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if math.isfinite(value):
            yield name, float(value)


def make_sink(name: str, run_dir: str | Path, *, run_name: str, config: dict[str, Any] | None = None,
              options: Mapping[str, Any] | None = None) -> Sink:
    """Build the sink registered as ``name`` (or a dotted path) for ``run_dir``."""
    return SINKS.get(name)(Path(run_dir), run_name=run_name, config=config or {}, **dict(options or {}))


_REQUIREMENTS = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


def sink_requirement(name: str) -> str | None:
    """The package a built-in sink needs (None for jsonl and for dotted-path sinks)."""
    return _REQUIREMENTS.get(name)


def _require(module: str, extra: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise SinkUnavailable(
            f"the {extra} sink needs the '{module.split('.')[0]}' package: pip install 'vlrl[{extra}]' ({err})"
        ) from err


def _pretty(value: Any) -> Any:
    if hasattr(value, "item") and getattr(value, "numel", lambda: 1)() == 1:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; the report reads these strings back as NaN
    return value


# ----------------------------------------------------------------------------------------------- jsonl
class JsonlSink:
    """One JSON object per record, appended to ``path`` (flushed at every write: a crash loses nothing)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: Mapping[str, Any]) -> None:
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps({k: _pretty(v) for k, v in record.items()}) + "\n")

    def close(self) -> None:
        pass


@SINKS.register("jsonl")
def jsonl_sink(run_dir: Path, *, run_name: str, config: dict, path: str = "metrics.jsonl") -> JsonlSink:
    return JsonlSink(run_dir / path)


# ----------------------------------------------------------------------------------------------- TensorBoard
class TensorBoardSink:
    """Scalars in TensorBoard event files, one sub-run per stage: ``tensorboard --logdir RUN_DIR/tensorboard``."""

    def __init__(self, log_dir: Path) -> None:
        self._writer_cls = _require("torch.utils.tensorboard", "tensorboard").SummaryWriter
        self.log_dir = log_dir
        self._writers: dict[str, Any] = {}

    def write(self, record: Mapping[str, Any]) -> None:
        stage = str(record.get("stage", "run"))
        if stage not in self._writers:
            self._writers[stage] = self._writer_cls(log_dir=str(self.log_dir / stage))
        writer, step = self._writers[stage], int(record.get("step", 0))
        for name, value in numeric_metrics(record):
            writer.add_scalar(name, value, step)
        writer.flush()

    def write_table(self, stage: str, step: int, columns: list[str], rows: list[dict[str, Any]]) -> None:
        """``eval.samples_table``: a markdown table under the text tag ``samples`` of the stage's sub-run."""
        if stage not in self._writers:
            self._writers[stage] = self._writer_cls(log_dir=str(self.log_dir / stage))
        self._writers[stage].add_text("samples", markdown_table(columns, rows), step)
        self._writers[stage].flush()

    def close(self) -> None:
        for writer in self._writers.values():
            writer.close()
        self._writers.clear()


def markdown_table(columns: list[str], rows: list[dict[str, Any]], *, limit: int = 400) -> str:
    """Rows as a markdown table (TensorBoard renders markdown in its text tab); cells cut at ``limit`` characters,
    pipes and newlines escaped."""
    def cell(value: Any) -> str:
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
        text = text if len(text) <= limit else text[:limit] + "…"
        return text.replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


@SINKS.register("tensorboard")
def tensorboard_sink(run_dir: Path, *, run_name: str, config: dict, subdir: str = "tensorboard") -> TensorBoardSink:
    return TensorBoardSink(run_dir / subdir)


# ----------------------------------------------------------------------------------------------- W&B
class WandbSink:
    """A Weights & Biases run (offline by default: ``wandb sync RUN_DIR/wandb/offline-run-*`` uploads it later)."""

    def __init__(self, run_dir: Path, *, run_name: str, config: dict, project: str = "vlrl",
                 entity: str | None = None, mode: str = "offline") -> None:
        self._wandb = wandb = _require("wandb", "wandb")
        self.run = wandb.init(project=project, entity=entity, name=run_name, dir=str(run_dir), mode=mode,
                              config=config)
        self._stages: set[str] = set()

    def write(self, record: Mapping[str, Any]) -> None:
        stage = str(record.get("stage", "run"))
        if stage not in self._stages:
            self.run.define_metric(f"{stage}/step")
            self.run.define_metric(f"{stage}/*", step_metric=f"{stage}/step")
            self._stages.add(stage)
        payload = {f"{stage}/{name}": value for name, value in numeric_metrics(record)}
        payload[f"{stage}/step"] = int(record.get("step", 0))
        self.run.log(payload)

    def write_table(self, stage: str, step: int, columns: list[str], rows: list[dict[str, Any]]) -> None:
        """``eval.samples_table``: a ``wandb.Table`` logged as ``<stage>/samples`` at the stage's step."""
        data = [[row.get(c) if isinstance(row.get(c), (int, float)) else str(row.get(c)) for c in columns] for row in rows]
        self.run.log({f"{stage}/samples": self._wandb.Table(columns=list(columns), data=data),
                      f"{stage}/step": int(step)})

    def close(self) -> None:
        self.run.finish()


@SINKS.register("wandb")
def wandb_sink(run_dir: Path, *, run_name: str, config: dict, **options) -> WandbSink:
    return WandbSink(run_dir, run_name=run_name, config=config, **options)


# ----------------------------------------------------------------------------------------------- MLflow
_MLFLOW_BAD = re.compile(r"[^\w\-. /:]")


def mlflow_name(name: str) -> str:
    """MLflow accepts letters, digits, ``_ - . / : space``; anything else becomes ``_`` (``pass@4`` → ``pass_4``)."""
    return _MLFLOW_BAD.sub("_", name)


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"algo": {"clip_high": 0.28}}`` → ``{"algo.clip_high": 0.28}``."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def local_mlflow_uri(run_dir: Path) -> str:
    """A store inside the run directory: ``sqlite:///RUN_DIR/mlflow.db`` when SQLAlchemy is installed (MLflow 3
    puts its file store in maintenance mode), else the file store ``RUN_DIR/mlruns`` (mlflow-skinny)."""
    import importlib.util
    import os

    if importlib.util.find_spec("sqlalchemy") is not None:
        return f"sqlite:///{run_dir.resolve() / 'mlflow.db'}"
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow ≥ 3.x refuses the file store without it
    return (run_dir.resolve() / "mlruns").as_uri()


class MlflowSink:
    """An MLflow run; without ``tracking_uri`` a local store inside the run directory (see `local_mlflow_uri`)."""

    def __init__(self, run_dir: Path, *, run_name: str, config: dict, tracking_uri: str | None = None,
                 experiment: str = "vlrl") -> None:
        self.mlflow = _require("mlflow", "mlflow")
        self.mlflow.set_tracking_uri(tracking_uri or local_mlflow_uri(run_dir))
        self.mlflow.set_experiment(experiment)
        self.run = self.mlflow.start_run(run_name=run_name)
        params = {mlflow_name(k): str(v)[:500] for k, v in flatten(config).items()}
        if params:
            self.mlflow.log_params(params)

    def write(self, record: Mapping[str, Any]) -> None:
        stage = str(record.get("stage", "run"))
        metrics = {mlflow_name(f"{stage}/{name}"): value for name, value in numeric_metrics(record)}
        if metrics:
            self.mlflow.log_metrics(metrics, step=int(record.get("step", 0)))

    def close(self) -> None:
        self.mlflow.end_run()


@SINKS.register("mlflow")
def mlflow_sink(run_dir: Path, *, run_name: str, config: dict, **options) -> MlflowSink:
    return MlflowSink(run_dir, run_name=run_name, config=config, **options)
