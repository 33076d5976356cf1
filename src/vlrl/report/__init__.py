"""Reporting: metric sinks (jsonl + console)."""

from vlrl.report.metrics import MetricsLogger

__all__ = ["MetricsLogger"]
