"""`vlrl launch --ray ADDRESS|local CONFIG [overrides]`: the trainer ranks as Ray actors.

    1. ray.init(ADDRESS)            ``local``: a single-node Ray started here (CPUs: launch.nproc × cpus_per_rank)
    2. placement group              launch.nproc bundles {CPU: cpus_per_rank, GPU: gpus_per_rank}, launch.placement
    3. one `RankActor` per bundle   bundle k hosts rank k
    4. rendezvous                   rank 0's node IP and a free port; every actor gets torchrun's contract —
                                    RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT
                                    (+ launch.env) — and runs the recipe (`run_sft` / `run_rl`) in-process
    5. logs                         the actors' stdout/stderr stream to this terminal (Ray prefixes each line
                                    with the actor and its pid)
    6. stop                         Ctrl-C, or any rank raising or dying: every actor is killed (the others
                                    would wait in a collective until the timeout), the placement group removed,
                                    and the launcher exits non-zero

The recipes are the ones torchrun runs: Ray only places the processes and wires the rendezvous, which is how
verl's single controller starts its FSDP workers. Rollout servers get bundles of their own once the trainer
talks to servers under several ranks (see README, "Scaling out").
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class LaunchError(RuntimeError):
    """A rank failed (the message names it and carries its error); every rank was stopped."""


@dataclass(frozen=True)
class RankSpec:
    recipe: str  # sft | rl
    config: str | None  # YAML path (read by every rank)
    overrides: tuple[str, ...]


def _run_recipe(spec: RankSpec, env: dict[str, str]) -> dict:
    """What each actor runs: the recipe, as `vlrl sft|rl CONFIG OVERRIDES` would, with torchrun's variables."""
    os.environ.update(env)
    from vlrl.config import RLConfig, SFTConfig, load_config
    from vlrl.train.recipes import run_rl, run_sft

    config_cls, recipe = (SFTConfig, run_sft) if spec.recipe == "sft" else (RLConfig, run_rl)
    return recipe(load_config(config_cls, spec.config, list(spec.overrides)))


def _rank_actor_class():
    import ray

    @ray.remote
    class RankActor:
        """One trainer rank: reports where it runs, then runs the recipe."""

        def node(self) -> tuple[str, int]:
            """(node IP, a free TCP port on it) — the port is used only by rank 0's actor."""
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind(("", 0))
                port = sock.getsockname()[1]
            return ray.util.get_node_ip_address(), port

        def run(self, spec: RankSpec, env: dict[str, str]) -> dict:
            return _run_recipe(spec, env)

    return RankActor


def launch(spec: RankSpec, launch_cfg, *, address: str = "local", poll_seconds: float = 0.5) -> list[Any]:
    """Run ``spec`` on ``launch_cfg.nproc`` Ray actors; returns every rank's result (rank 0's summary first).
    Raises `LaunchError` when a rank fails (after stopping all of them)."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    n = launch_cfg.nproc
    started_here = not ray.is_initialized()
    if started_here:
        if address == "local":
            ray.init(num_cpus=max(1, int(round(n * launch_cfg.cpus_per_rank))), include_dashboard=False,
                     log_to_driver=True)
        else:
            ray.init(address=address, log_to_driver=True)
    bundle = {"CPU": launch_cfg.cpus_per_rank, **({"GPU": launch_cfg.gpus_per_rank} if launch_cfg.gpus_per_rank else {})}
    group = placement_group([dict(bundle) for _ in range(n)], strategy=launch_cfg.placement)
    actors: list[Any] = []
    try:
        ray.get(group.ready(), timeout=600)
        actor_cls = _rank_actor_class()
        actors = [actor_cls.options(
            num_cpus=launch_cfg.cpus_per_rank, num_gpus=launch_cfg.gpus_per_rank, name=f"vlrl-rank-{rank}",
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=rank),
        ).remote() for rank in range(n)]
        where = ray.get([a.node.remote() for a in actors])
        envs = rendezvous_env(where, launch_cfg.master_port or where[0][1], extra=launch_cfg.env)
        log.info("vlrl launch: %d rank(s) on %s; rendezvous %s:%s", n, sorted({ip for ip, _ in where}),
                 envs[0]["MASTER_ADDR"], envs[0]["MASTER_PORT"])
        refs = [a.run.remote(spec, env) for a, env in zip(actors, envs, strict=True)]
        return _wait_all(refs, poll_seconds)
    finally:
        for actor in actors:  # finished ranks exit quietly; a failure or Ctrl-C stops the rest here
            ray.kill(actor, no_restart=True)
        remove_placement_group(group)
        if started_here:
            ray.shutdown()


def rendezvous_env(where: list[tuple[str, int]], port: int, *, extra: dict[str, str] | None = None) -> list[dict[str, str]]:
    """torchrun's environment for each rank: ranks in bundle order, local ranks numbered per node IP."""
    per_node: dict[str, int] = {}
    local_ranks = []
    for ip, _ in where:
        local_ranks.append(per_node.get(ip, 0))
        per_node[ip] = per_node.get(ip, 0) + 1
    return [{**(extra or {}), "RANK": str(rank), "LOCAL_RANK": str(local_ranks[rank]), "WORLD_SIZE": str(len(where)),
             "LOCAL_WORLD_SIZE": str(per_node[ip]), "MASTER_ADDR": where[0][0], "MASTER_PORT": str(port)}
            for rank, (ip, _) in enumerate(where)]


def _wait_all(refs: list[Any], poll_seconds: float) -> list[Any]:
    """Every rank's result in rank order; the first failure raises `LaunchError` naming its rank."""
    import ray

    pending = dict(enumerate(refs))
    results: dict[int, Any] = {}
    while pending:
        done, _ = ray.wait(list(pending.values()), num_returns=1, timeout=poll_seconds)
        for ref in done:
            rank = next(r for r, x in pending.items() if x == ref)
            del pending[rank]
            try:
                results[rank] = ray.get(ref)
            except Exception as err:  # RayTaskError (the recipe raised) or RayActorError (the process died)
                cause = getattr(err, "cause", None) or err  # the recipe's own exception, without Ray's wrapping
                raise LaunchError(f"rank {rank} failed, all ranks stopped: {type(cause).__name__}: {cause}") from err
        time.sleep(0 if done else 0.01)
    return [results[r] for r in range(len(refs))]


def detect(config: Path | None, recipe: str) -> str:
    """``sft`` or ``rl`` for ``vlrl launch`` (``auto``: from the config file's sections)."""
    if recipe != "auto":
        return recipe
    import yaml

    from vlrl.check import detect_recipe

    raw = yaml.safe_load(config.read_text()) if config is not None and config.is_file() else {}
    return detect_recipe(raw if isinstance(raw, dict) else {}, config)
