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
verl's single controller starts its FSDP workers.

Rollout servers (``launch.rollout_servers: K``, `RolloutServers`): before the ranks start, K `vlrl serve`
processes are started as children of the launcher on loopback (port 0; each prints the port it bound) with a
generated bearer key in their environment; once every one answers /health, the ranks get
``rollout.servers=[URLs]`` and the key in ``rollout.api_key_env``. While the ranks run, a server that exits stops
them (the error names the server); when the ranks end, ok or not, the servers are stopped (SIGTERM, then SIGKILL;
they also get SIGKILL if the launcher itself dies). Local children, not Ray actors: with ``--ray local`` this
node is the whole cluster, so a bundle would add nothing but a process between the launcher and the server. On a
multi-node cluster the servers belong on devices of their own in the placement group, as verl's resource pools and
AReaL's launcher place them; that is not built, so there ``launch.rollout_servers`` is refused (start `vlrl serve`
on the nodes and set ``rollout.servers``).
"""

from __future__ import annotations

import collections
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class LaunchError(RuntimeError):
    """A rank or a rollout server failed (the message names it and carries its error); everything was stopped."""


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


def launch(spec: RankSpec, launch_cfg, *, address: str = "local", poll_seconds: float = 0.5,
           servers: ServerPlan | None = None) -> list[Any]:
    """Run ``spec`` on ``launch_cfg.nproc`` Ray actors; returns every rank's result (rank 0's summary first).
    With ``servers``, its `vlrl serve` processes are started first and wired into the ranks (module docstring).
    Raises `LaunchError` when a rank or a server fails (after stopping all of them)."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    n = launch_cfg.nproc
    pool = RolloutServers(servers) if servers is not None else None
    started_here = not ray.is_initialized()
    group, actors = None, []
    try:
        if pool is not None:
            pool.start()  # they load their weights while Ray starts
        if started_here:
            if address == "local":
                ray.init(num_cpus=max(1, int(round(n * launch_cfg.cpus_per_rank))), include_dashboard=False,
                         log_to_driver=True)
            else:
                ray.init(address=address, log_to_driver=True)
        bundle = {"CPU": launch_cfg.cpus_per_rank, **({"GPU": launch_cfg.gpus_per_rank} if launch_cfg.gpus_per_rank else {})}
        group = placement_group([dict(bundle) for _ in range(n)], strategy=launch_cfg.placement)
        ray.get(group.ready(), timeout=600)
        actor_cls = _rank_actor_class()
        actors = [actor_cls.options(
            num_cpus=launch_cfg.cpus_per_rank, num_gpus=launch_cfg.gpus_per_rank, name=f"vlrl-rank-{rank}",
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=rank),
        ).remote() for rank in range(n)]
        where = ray.get([a.node.remote() for a in actors])
        extra_env = dict(launch_cfg.env)
        if pool is not None:
            urls = pool.wait_ready()
            spec = replace(spec, overrides=(*spec.overrides, f"rollout.servers=[{','.join(urls)}]"))
            extra_env[servers.api_key_env] = pool.api_key
        envs = rendezvous_env(where, launch_cfg.master_port or where[0][1], extra=extra_env)
        log.info("vlrl launch: %d rank(s) on %s; rendezvous %s:%s", n, sorted({ip for ip, _ in where}),
                 envs[0]["MASTER_ADDR"], envs[0]["MASTER_PORT"])
        refs = [a.run.remote(spec, env) for a, env in zip(actors, envs, strict=True)]
        results = _wait_all(refs, poll_seconds, check=pool.check if pool is not None else None)
        if pool is not None:
            pool.report_weights()
        return results
    finally:
        for actor in actors:  # finished ranks exit quietly; a failure or Ctrl-C stops the rest here
            ray.kill(actor, no_restart=True)
        if group is not None:
            remove_placement_group(group)
        if started_here and ray.is_initialized():
            ray.shutdown()
        if pool is not None:
            pool.stop()


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


def _wait_all(refs: list[Any], poll_seconds: float, check=None) -> list[Any]:
    """Every rank's result in rank order; the first failure raises `LaunchError` naming its rank. ``check()``
    (the rollout servers' liveness) runs at every poll and before a rank's failure is reported: a rank that
    failed because its server died is reported as the server's failure."""
    import ray

    pending = dict(enumerate(refs))
    results: dict[int, Any] = {}
    while pending:
        if check is not None:
            check()
        done, _ = ray.wait(list(pending.values()), num_returns=1, timeout=poll_seconds)
        for ref in done:
            rank = next(r for r, x in pending.items() if x == ref)
            del pending[rank]
            try:
                results[rank] = ray.get(ref)
            except Exception as err:  # RayTaskError (the recipe raised) or RayActorError (the process died)
                if check is not None:
                    check()
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


# ----------------------------------------------------------------------------------------------- rollout servers
@dataclass(frozen=True)
class ServerPlan:
    """The `vlrl serve` processes `vlrl launch` starts (from the launch section; `server_plan`)."""

    count: int
    model: str
    threads: int = 1
    args: tuple[str, ...] = ()
    timeout: float = 300.0
    api_key_env: str = "VLRL_API_KEY"  # where the ranks' HTTP engines read the key (rollout.api_key_env)


def starts_servers(config: Path | None, overrides: list[str]) -> str | None:
    """``rollout.servers=[…]``, a stand-in for the URLs of the servers ``launch.rollout_servers`` will start, so
    the config validates (rollout.weight_sync=distributed needs servers); None when the launch starts none.
    `LaunchError` when rollout.servers is set as well (one or the other)."""
    import yaml

    from vlrl.config import apply_overrides

    raw = yaml.safe_load(config.read_text()) if config is not None and config.is_file() else {}
    try:
        raw = apply_overrides(raw if isinstance(raw, dict) else {}, list(overrides))
        count, servers = (raw.get("launch") or {}).get("rollout_servers"), (raw.get("rollout") or {}).get("servers")
    except Exception:  # noqa: BLE001 - malformed input: the full load reports it with its own message
        return None
    if not isinstance(count, int) or count <= 0:
        return None
    if servers:
        raise LaunchError(f"launch.rollout_servers={count} starts the rollout servers and passes their URLs; "
                          f"rollout.servers is set too ({servers}): set one or the other")
    return "rollout.servers=[http://127.0.0.1:1]"


def server_plan(cfg, recipe: str, address: str) -> ServerPlan | None:
    """``launch.rollout_servers`` as a `ServerPlan` (None for 0); a setting it cannot honour raises `LaunchError`
    naming the field."""
    launch_cfg = cfg.launch
    if not launch_cfg.rollout_servers:
        return None
    if recipe != "rl":
        raise LaunchError(f"launch.rollout_servers={launch_cfg.rollout_servers}: rollout servers serve RL runs "
                          f"(this is a {recipe} run); set launch.rollout_servers=0")
    if address != "local":
        raise LaunchError(f"launch.rollout_servers={launch_cfg.rollout_servers} with --ray {address}: servers are "
                          "started on this machine's loopback, which the ranks of a cluster cannot reach; start "
                          "`vlrl serve` on the nodes and set rollout.servers (servers in the placement group are "
                          "not built yet)")
    return ServerPlan(launch_cfg.rollout_servers, launch_cfg.server_model or cfg.model.path,
                      threads=launch_cfg.server_threads, args=tuple(launch_cfg.server_args),
                      timeout=launch_cfg.server_timeout, api_key_env=cfg.rollout.api_key_env)


def _death_signal():
    """Linux: a ``preexec_fn`` giving the server SIGKILL when the launcher dies, however it dies (no orphaned
    servers); None elsewhere. libc is looked up here, in the parent: the forked child only makes the call."""
    try:
        import ctypes

        prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@dataclass
class _Server:
    index: int
    process: subprocess.Popen
    url: str | None = None
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=20))  # its last lines printed

    def name(self) -> str:
        return f"rollout server {self.index} ({self.url or 'not listening yet'}, pid {self.process.pid})"


class RolloutServers:
    """``plan.count`` `vlrl serve` processes on loopback, children of the launcher; their output is streamed
    here, prefixed ``(vlrl serve i)``."""

    def __init__(self, plan: ServerPlan) -> None:
        self.plan, self.api_key, self.servers = plan, secrets.token_urlsafe(24), []
        self._readers: list[threading.Thread] = []

    def start(self) -> None:
        base = [sys.executable, "-m", "vlrl.cli", "serve", "--model", self.plan.model, "--host", "127.0.0.1",
                "--port", "0", "--threads", str(self.plan.threads)]
        env = {**os.environ, "VLRL_API_KEY": self.api_key}  # `vlrl serve --api-key`'s variable
        on_fork = _death_signal()
        for i in range(self.plan.count):
            cmd = [*base, *(arg.replace("{i}", str(i)) for arg in self.plan.args)]
            print(f"vlrl launch: starting rollout server {i}: {' '.join(cmd)}", flush=True)
            process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       env=env, text=True, bufsize=1, preexec_fn=on_fork)
            self.servers.append(_Server(i, process))
        for server in self.servers:
            reader = threading.Thread(target=self._read, args=(server,), daemon=True, name=f"vlrl-serve-{server.index}")
            reader.start()
            self._readers.append(reader)

    def _read(self, server: _Server) -> None:
        for line in server.process.stdout:
            line = line.rstrip("\n")
            server.tail.append(line)
            if server.url is None and "listening on " in line:
                server.url = line.split("listening on ")[1].split()[0]
            print(f"(vlrl serve {server.index}) {line}", flush=True)

    def wait_ready(self) -> list[str]:
        """Every server's URL once it answers /health; `LaunchError` if one exits or takes longer than the timeout."""
        import httpx

        deadline = time.monotonic() + self.plan.timeout
        for server in self.servers:
            while True:
                self.check(starting=True)
                if server.url is not None:
                    try:
                        if httpx.get(f"{server.url}/health", timeout=5).status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                if time.monotonic() > deadline:
                    raise LaunchError(f"{server.name()} did not answer /health within launch.server_timeout="
                                      f"{self.plan.timeout:g} s; everything was stopped")
                time.sleep(0.2)
        urls = [s.url for s in self.servers]
        for server in self.servers:
            print(f"vlrl launch: {server.name()} is healthy", flush=True)
        return urls

    def check(self, starting: bool = False) -> None:
        """`LaunchError` naming the first server that has exited."""
        for server in self.servers:
            code = server.process.poll()
            if code is None:
                continue
            if self._readers:
                self._readers[server.index].join(timeout=2)  # its last words
            how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
            what = "could not start" if starting else "stopped during the run; all ranks stopped"
            last = next((line.strip() for line in reversed(server.tail) if line.strip()), "no output")
            said = f" (its last line: {last})" if starting or code > 0 else ""  # a killed server said nothing
            raise LaunchError(f"{server.name()} {how}: {what}{said}")

    def report_weights(self) -> None:
        """Print each server's final weight version and checksum (they equal the trainer's after its last update)."""
        import httpx

        for server in self.servers:
            try:
                info = httpx.get(f"{server.url}/get_model_info", timeout=30,
                                 headers={"Authorization": f"Bearer {self.api_key}"}).json()
                print(f"vlrl launch: {server.name()} ends with weight_version {info.get('weight_version')} "
                      f"weight_checksum {info.get('weight_checksum')}", flush=True)
            except (httpx.HTTPError, ValueError) as err:
                print(f"vlrl launch: {server.name()}: /get_model_info failed ({err})", flush=True)

    def stop(self, grace: float = 30.0) -> None:
        """SIGTERM every server (they drain), SIGKILL what is left after ``grace`` seconds."""
        for server in self.servers:
            if server.process.poll() is None:
                server.process.terminate()
        deadline = time.monotonic() + grace
        for server in self.servers:
            try:
                server.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                server.process.kill()
                server.process.wait()
        for reader in self._readers:
            reader.join(timeout=2)
