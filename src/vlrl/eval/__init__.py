"""Evaluation: greedy and sampled accuracy, pass@k, per task."""

from vlrl.eval.evaluate import EvalResult, evaluate, pass_at_k

__all__ = ["EvalResult", "evaluate", "pass_at_k"]
