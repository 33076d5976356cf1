"""`build_engine`: the one place an engine is built, from a ``rollout`` config section.

    generation      HTTPEngine over rollout.servers.urls (any mode; the servers get the trainer's weights as version 0)
                    ThreadedEngine                     (rollout.mode=async, no servers: a private copy of the policy)
                    HFEngine                           (rollout.mode=sync, no servers: the trainer's own model)
    rollout         RolloutEngine(build_rollout(cfg))  (rollout.agent.function other than single_turn:
                                                        multi_turn, per_sample, or a dotted path — episodes behind
                                                        ``generate``
                                                        and, over an asynchronous engine, ``agenerate``)

The report's watcher (progress, rollout metrics, samples.jsonl) is the recipe's to add (`vlrl.report.watch.watch`):
the rollout room knows nothing of the report. A recipe asks the engine for what else it can do through the protocols
of `vlrl.rollout.types` (`capability(engine, AsyncEngine)`, `capability(engine, WeightPublisher)`).

Every recipe (``vlrl rl`` sync and async, ``vlrl demo``, the curriculum stages, the evaluations, ``vlrl eval``,
``vlrl data select``) builds its engine here, so a configured capability cannot be wired in one of them and
forgotten in another. ``single_turn`` is ``engine.generate`` itself: no wrapper, so the asynchronous recipe keeps
the inner engine's own batched ``agenerate``.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from vlrl.rollout.agent import RolloutEngine, build_rollout
from vlrl.rollout.hf_engine import HFEngine
from vlrl.rollout.http_settings import ClientSettings, SyncSettings
from vlrl.rollout.types import Closable, Engine


def build_engine(cfg: Any, policy: Any, *, run_dir: str | Path | None = None, sync_weights: bool = True,
                 max_batch_size: int | None = None) -> Engine:
    """The engine of a `vlrl.config.RolloutConfig` ``cfg`` over ``policy`` (see the module docstring).

    ``run_dir``: where weights for the servers go when ``rollout.weight_sync.dir`` is unset (``RUN_DIR/rollout_weights``).
    ``sync_weights``: set the servers' weights to the policy's (version 0) — False when they already serve it
    and ``policy`` holds no weights (`vlrl data select --servers`). ``max_batch_size``: overrides
    ``rollout.engine.max_batch_size`` (evaluation's own batch size)."""
    engine = _generation_engine(cfg, policy, run_dir=run_dir, sync_weights=sync_weights,
                                max_batch_size=max_batch_size or cfg.engine.max_batch_size)
    if cfg.agent.function != "single_turn":
        codec = engine if isinstance(engine, HFEngine) else HFEngine(policy)  # encodes observations for the others
        engine = RolloutEngine.wrap(engine, build_rollout(cfg), codec=codec)
    return engine


def http_settings(cfg: Any, run_dir: str | Path | None) -> tuple[SyncSettings, ClientSettings]:
    """The `HTTPEngine`'s settings of a `vlrl.config.RolloutConfig` ``cfg``: how the servers get the weights, how the
    engine talks to them (the keys read from the environment variables ``cfg`` names)."""
    weights, servers = cfg.weight_sync, cfg.servers
    if weights.dir is None and run_dir is None:
        raise ValueError("rollout.weight_sync.dir: set it (or give the run directory) so the servers can load weights")
    sync = SyncSettings(weights_dir=weights.dir or Path(run_dir) / "rollout_weights", method=weights.method,
                        on_weight_update=servers.on_weight_update, update_timeout=weights.update_timeout,
                        address=weights.address, port=weights.port, bucket_mb=weights.bucket_mb,
                        timeout=weights.timeout, deadline=weights.deadline, on_failure=weights.on_failure,
                        verify_checksum=weights.verify_checksum)
    client = ClientSettings(api_key=os.environ.get(servers.api_key_env),
                            admin_api_key=os.environ.get(servers.admin_api_key_env) or None,
                            request_timeout=servers.request_timeout, max_retries=servers.max_retries,
                            max_server_failures=servers.max_server_failures, prompt_check=servers.prompt_check,
                            engine=servers.engine, checksum=servers.checksum)
    return sync, client


def _generation_engine(cfg: Any, policy: Any, *, run_dir: str | Path | None, sync_weights: bool,
                       max_batch_size: int) -> Engine:
    if cfg.servers.urls or cfg.servers.launch.count:
        from vlrl.rollout.http_engine import HTTPEngine

        sync, client = http_settings(cfg, run_dir)
        urls, owned = cfg.servers.urls, None
        if cfg.servers.launch.count:
            owned = launch(cfg, policy, run_dir=run_dir)
            urls = owned.urls
            client = dataclasses.replace(client, api_key=owned.api_key, admin_api_key=owned.api_key,
                                         engine=owned.engine, startup_timeout=max(client.startup_timeout, 60.0))
        try:
            engine = HTTPEngine(policy, urls, sync, client, owned=owned)
        except BaseException:
            if owned is not None:
                owned.stop()
            raise
        if sync_weights:
            engine.update_weights(version=0)
        return engine
    if cfg.mode == "async":
        from vlrl.rollout.threaded_engine import ThreadedEngine

        return ThreadedEngine(policy, max_batch_size=max_batch_size, on_weight_update=cfg.servers.on_weight_update)
    return HFEngine(policy, max_batch_size=max_batch_size, compile=cfg.engine.compile)


def launch(cfg: Any, policy: Any, *, run_dir: str | Path | None) -> Any:
    """``rollout.servers.launch``: start the servers (`vlrl.rollout.engine_launch`) on what the trainer holds — the
    launch's model, else ``model.path`` when it is a directory, else the policy saved under ``RUN_DIR/rollout_model``
    — in the policy's dtype; auto starts vlrl serve."""
    import torch.distributed as dist

    from vlrl.rollout.engine_launch import launch_servers

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError("rollout.servers.launch starts servers from one trainer process; with several ranks let `vlrl "
                         "launch` start them (launch.rollout_servers) or give their URLs (rollout.servers.urls)")
    spec = cfg.servers.launch
    base = Path(run_dir) if run_dir is not None else Path(cfg.weight_sync.dir or ".")
    model = spec.model or (policy.source if policy.source and Path(policy.source).is_dir() else None)
    if model is None:
        model = str(base / "rollout_model")
        policy.save(model)
    engine = "vlrl" if cfg.servers.engine == "auto" else cfg.servers.engine
    param = next(policy.model.parameters())
    args = list(spec.args)
    if engine == "vllm" and cfg.weight_sync.method == "distributed":
        args += ["--weight-transfer-config", '{"backend": "nccl"}']
    return launch_servers(engine, spec.count, model=str(model), dtype=str(param.dtype).removeprefix("torch."),
                          log_dir=base / "rollout_servers", python=spec.python, command=spec.command, args=args,
                          env=spec.env, host=spec.host, device=param.device.type, timeout=spec.timeout)


def close_engine(engine: Any) -> None:
    """Close an engine built by `build_engine` (servers' connections, threads), whatever wraps it (a wrapper closes
    the engine it wraps)."""
    if isinstance(engine, Closable):
        engine.close()
