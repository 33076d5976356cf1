"""Evaluation: greedy and sampled accuracy, pass@k, per task."""

from vlrl.eval.evaluate import evaluate, pass_at_k

__all__ = ["evaluate", "pass_at_k"]
