"""`build_engine`: the one place an engine is built, from a ``rollout`` config section.

    generation      HTTPEngine over rollout.servers   (any mode; the servers get the trainer's weights as version 0)
                    ThreadedEngine                     (rollout.mode=async, no servers: a private copy of the policy)
                    HFEngine                           (rollout.mode=sync, no servers: the trainer's own model)
    rollout         RolloutEngine(build_rollout(cfg))  (rollout.function other than single_turn: multi_turn,
                                                        per_sample, or a dotted path — episodes behind ``generate``
                                                        and, over an asynchronous engine, ``agenerate``)
    report          WatchedEngine                      (given a logger: progress, rollout metrics, samples.jsonl)

Every recipe (``vlrl rl`` sync and async, ``vlrl demo``, the curriculum stages, the evaluations, ``vlrl eval``,
``vlrl data select``) builds its engine here, so a configured capability cannot be wired in one of them and
forgotten in another. ``single_turn`` is ``engine.generate`` itself: no wrapper, so the asynchronous recipe keeps
the inner engine's own batched ``agenerate``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from vlrl.rollout.agent import RolloutEngine, build_rollout
from vlrl.rollout.hf_engine import HFEngine
from vlrl.rollout.types import Engine


def build_engine(cfg: Any, policy: Any, *, run_dir: str | Path | None = None, logger: Any = None, samples: Any = None,
                 sync_weights: bool = True, max_batch_size: int | None = None) -> Engine:
    """The engine of a `vlrl.config.RolloutConfig` ``cfg`` over ``policy`` (see the module docstring).

    ``run_dir``: where weights for the servers go when ``rollout.weights_dir`` is unset (``RUN_DIR/rollout_weights``).
    ``logger`` / ``samples``: a `MetricsLogger` and `SampleLog` to wrap the engine in the report's `WatchedEngine`.
    ``sync_weights``: set the servers' weights to the policy's (version 0) — False when they already serve it
    and ``policy`` holds no weights (`vlrl data select --servers`). ``max_batch_size``: overrides
    ``rollout.max_batch_size`` (evaluation's own batch size)."""
    engine = _generation_engine(cfg, policy, run_dir=run_dir, sync_weights=sync_weights,
                                max_batch_size=max_batch_size or cfg.max_batch_size)
    if cfg.function != "single_turn":
        codec = engine if isinstance(engine, HFEngine) else HFEngine(policy)  # encodes observations for the others
        engine = RolloutEngine.wrap(engine, build_rollout(cfg), codec=codec)
    if logger is not None:
        from vlrl.report.watch import WatchedEngine

        engine = WatchedEngine(engine, logger, samples)
    return engine


def _generation_engine(cfg: Any, policy: Any, *, run_dir: str | Path | None, sync_weights: bool,
                       max_batch_size: int) -> Engine:
    if cfg.servers:
        from vlrl.rollout.http_engine import HTTPEngine

        if cfg.weights_dir is None and run_dir is None:
            raise ValueError("rollout.weights_dir: set it (or give the run directory) so the servers can load weights")
        engine = HTTPEngine(policy, cfg.servers, weights_dir=cfg.weights_dir or Path(run_dir) / "rollout_weights",
                            api_key=os.environ.get(cfg.api_key_env), request_timeout=cfg.request_timeout,
                            max_retries=cfg.max_retries, max_server_failures=cfg.max_server_failures,
                            on_weight_update=cfg.on_weight_update, weight_sync=cfg.weight_sync,
                            sync_address=cfg.weight_sync_address, sync_port=cfg.weight_sync_port,
                            bucket_mb=cfg.weight_sync_bucket_mb, sync_timeout=cfg.weight_sync_timeout,
                            weight_update_timeout=cfg.weight_update_timeout, prompt_check=cfg.prompt_check,
                            admin_api_key=os.environ.get(cfg.admin_api_key_env) or None)
        if sync_weights:
            engine.update_weights(version=0)
        return engine
    if cfg.mode == "async":
        from vlrl.rollout.server import ThreadedEngine

        return ThreadedEngine(policy, max_batch_size=max_batch_size, on_weight_update=cfg.on_weight_update)
    return HFEngine(policy, max_batch_size=max_batch_size, compile=cfg.compile)


def close_engine(engine: Any) -> None:
    """Close an engine built by `build_engine` (servers' connections, threads), whatever wraps it."""
    close = getattr(engine, "close", None)
    if callable(close):
        close()
