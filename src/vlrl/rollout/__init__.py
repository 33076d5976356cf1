"""Rollout: the `Engine` protocol, `build_engine` (the one place an engine is built and wrapped by the configured
rollout function), the in-process transformers engine, and the records they produce."""

from vlrl.rollout.build import build_engine, close_engine
from vlrl.rollout.hf_engine import HFEngine
from vlrl.rollout.types import Engine, Request, SamplingParams, Status, Trajectory

__all__ = ["Engine", "HFEngine", "Request", "SamplingParams", "Status", "Trajectory", "build_engine", "close_engine"]
