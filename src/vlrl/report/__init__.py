"""Reporting: metric sinks (metrics.jsonl, TensorBoard, W&B, MLflow), live progress, sampled responses and the
self-contained HTML report (`vlrl report`)."""

from vlrl.report.metrics import MetricsLogger
from vlrl.report.sinks import SINKS, Sink, SinkUnavailable, make_sink

__all__ = ["MetricsLogger", "SINKS", "Sink", "SinkUnavailable", "make_sink"]
