"""Metric sinks: TensorBoard event files (one sub-run per stage), W&B and MLflow calls (against stand-in
modules: the real packages are optional), clear errors for missing packages and unknown names."""

import sys
import types

import pytest

from vlrl.registry import RegistryError
from vlrl.report import SinkUnavailable, make_sink
from vlrl.report.sinks import flatten, mlflow_name, numeric_metrics

RECORDS = [{"stage": "rl", "step": 1, "time": 0.1, "reward/mean": 0.5, "pass@4/mean": 0.25, "note": "text"},
           {"stage": "rl", "step": 2, "time": 0.2, "reward/mean": 0.75, "pass@4/mean": 0.5, "policy/kl": "nan"},
           {"stage": "eval/final", "step": 0, "time": 0.3, "accuracy/mean": 0.9}]


def test_numeric_metrics_skip_reserved_strings_and_nan():
    assert dict(numeric_metrics(RECORDS[1])) == {"reward/mean": 0.75, "pass@4/mean": 0.5}
    assert dict(numeric_metrics({"a": True, "b": float("inf"), "c": 2})) == {"c": 2.0}


def test_tensorboard_writes_one_run_per_stage(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sink = make_sink("tensorboard", tmp_path, run_name="r")
    for record in RECORDS:
        sink.write(record)
    sink.close()
    rl = EventAccumulator(str(tmp_path / "tensorboard" / "rl"))
    rl.Reload()
    assert sorted(rl.Tags()["scalars"]) == ["pass@4/mean", "reward/mean"]  # names unchanged
    assert [(e.step, e.value) for e in rl.Scalars("reward/mean")] == [(1, 0.5), (2, 0.75)]
    final = EventAccumulator(str(tmp_path / "tensorboard" / "eval" / "final"))
    final.Reload()
    assert [e.value for e in final.Scalars("accuracy/mean")] == [pytest.approx(0.9)]


def test_wandb_runs_offline_with_a_step_axis_per_stage(tmp_path, monkeypatch):
    calls = []

    class Run:
        def define_metric(self, name, **kwargs):
            calls.append(("define", name, kwargs))

        def log(self, payload):
            calls.append(("log", payload))

        def finish(self):
            calls.append(("finish",))

    fake = types.ModuleType("wandb")
    fake.init = lambda **kwargs: calls.append(("init", kwargs)) or Run()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    sink = make_sink("wandb", tmp_path, run_name="r", config={"a": 1}, options={"project": "p", "mode": "offline"})
    sink.write(RECORDS[0])
    sink.write(RECORDS[1])
    sink.close()
    init = calls[0][1]
    assert init["mode"] == "offline" and init["dir"] == str(tmp_path) and init["config"] == {"a": 1}
    assert ("define", "rl/*", {"step_metric": "rl/step"}) in calls
    logs = [c[1] for c in calls if c[0] == "log"]
    assert logs[1] == {"rl/reward/mean": 0.75, "rl/pass@4/mean": 0.5, "rl/step": 2}
    assert calls[-1] == ("finish",) and sum(c[0] == "define" for c in calls) == 2  # defined once per stage


def test_mlflow_uses_a_local_store_and_legal_names(tmp_path, monkeypatch):
    calls = []
    fake = types.ModuleType("mlflow")
    for name in ("set_tracking_uri", "set_experiment", "start_run", "log_params", "end_run"):
        setattr(fake, name, (lambda n: lambda *a, **k: calls.append((n, a, k)))(name))
    fake.log_metrics = lambda metrics, step: calls.append(("log_metrics", metrics, step))
    monkeypatch.setitem(sys.modules, "mlflow", fake)
    sink = make_sink("mlflow", tmp_path, run_name="r", config={"algo": {"clip_high": 0.28}})
    sink.write(RECORDS[0])
    sink.close()
    from vlrl.report.sinks import local_mlflow_uri

    assert calls[0] == ("set_tracking_uri", (local_mlflow_uri(tmp_path),), {})
    assert str(tmp_path.resolve()) in calls[0][1][0]  # the store lives in the run directory
    assert ("log_params", ({"algo.clip_high": "0.28"},), {}) in calls
    assert ("log_metrics", {"rl/reward/mean": 0.5, "rl/pass_4/mean": 0.25}, 1) in calls
    assert mlflow_name("pass@4/shapes/count") == "pass_4/shapes/count"
    assert flatten({"a": {"b": {"c": 1}}, "d": {}}) == {"a.b.c": 1, "d": {}}


def test_missing_package_and_unknown_name_are_clear(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb → ImportError
    with pytest.raises(SinkUnavailable, match=r"needs the 'wandb' package: pip install 'vlrl\[wandb\]'"):
        make_sink("wandb", tmp_path, run_name="r")
    with pytest.raises(RegistryError, match="unknown metric sink 'tensorbored'"):
        make_sink("tensorbored", tmp_path, run_name="r")


def test_a_dotted_path_sink_gets_its_options(tmp_path):
    sink = make_sink(f"{__name__}:ListFactory", tmp_path, run_name="r", options={"tag": "x"})
    assert sink.tag == "x" and sink.run_dir == tmp_path


class ListFactory:
    def __init__(self, run_dir, *, run_name, config, tag):
        self.run_dir, self.tag = run_dir, tag

    def write(self, record):
        pass

    def close(self):
        pass
