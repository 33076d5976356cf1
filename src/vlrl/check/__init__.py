"""Checks before anything loads: the preflight of a run's config, data and model (`vlrl check`, and at the start of
every recipe) and every plug-in option against its plug-in (`vlrl.check.options`, also when a config loads)."""

from vlrl.check.preflight import (
    detect_recipe,
    memory_bytes,
    preflight,
    read_data,
    sandbox_isolation,
)
from vlrl.check.report import CheckReport, PreflightError, Problem
from vlrl.check.samples import model_path_problem

__all__ = [
    "CheckReport", "PreflightError", "Problem", "detect_recipe", "memory_bytes", "model_path_problem", "preflight",
    "read_data", "sandbox_isolation",
]
