"""Rollout: the `Engine` protocol, the in-process transformers engine, and the records they produce."""

from vlrl.rollout.hf_engine import HFEngine
from vlrl.rollout.types import Engine, Request, SamplingParams, Status, Trajectory

__all__ = ["Engine", "HFEngine", "Request", "SamplingParams", "Status", "Trajectory"]
