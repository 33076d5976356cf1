"""`vlrl launch --ray ADDRESS|local CONFIG [overrides]`: the trainer ranks as Ray actors.

    1. ray.init(ADDRESS)            ``local``: a single-node Ray started here (CPUs: launch.nproc × cpus_per_rank
                                    + launch.rollout_servers × server_cpus)
    2. placement group              launch.nproc bundles {CPU: cpus_per_rank, GPU: gpus_per_rank} (+ one per
                                    rollout server, below), strategy launch.placement
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

Rollout servers (``launch.rollout_servers: K``, `RolloutServers`): the placement group gets K more bundles
{CPU: launch.server_cpus, GPU: launch.gpus_per_server}, one server actor each (verl's resource pools, AReaL's
launcher). Each actor starts `vlrl serve` on its node, bound to the node's IP (not loopback: the ranks may run on
other nodes) on a free port, with a generated bearer key in its environment, and reports the URL the server
prints; once every server answers /health (asked by its actor, on its node), the ranks get
``rollout.servers.urls=[URLs]`` and the key in ``rollout.servers.api_key_env`` (and, for rollout.weight_sync.method=distributed left at
its loopback default while a server runs on another node, rank 0's IP as ``rollout.weight_sync.address``). While
the ranks run, a server that exits — or whose actor dies — stops them (the error names the server); when the ranks
end, ok or not, the servers are stopped (SIGTERM, then SIGKILL; a server also gets SIGKILL when its actor dies).
``--ray local`` takes the same path: one code path, the one a cluster runs, is the one the CPU tests cover; the
actor costs one process per server.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
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
    from vlrl.check.options import load_run_config
    from vlrl.config import RLConfig, SFTConfig
    from vlrl.recipes import RECIPES

    config_cls = SFTConfig if spec.recipe == "sft" else RLConfig
    return RECIPES[spec.recipe](load_run_config(config_cls, spec.config, list(spec.overrides)))


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
    With ``servers``, its `vlrl serve` actors are started first and wired into the ranks (module docstring).
    Raises `LaunchError` when a rank or a server fails (after stopping all of them)."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    n = launch_cfg.nproc
    pool = RolloutServers(servers) if servers is not None else None
    started_here = not ray.is_initialized()
    group, actors = None, []
    try:
        if started_here:
            if address == "local":
                cpus = n * launch_cfg.cpus_per_rank + (servers.count * servers.cpus if servers is not None else 0)
                ray.init(num_cpus=max(1, math.ceil(cpus)), include_dashboard=False, log_to_driver=True)
            else:
                ray.init(address=address, log_to_driver=True)
        bundles = [_bundle(launch_cfg.cpus_per_rank, launch_cfg.gpus_per_rank) for _ in range(n)]
        if servers is not None:
            bundles += [_bundle(servers.cpus, servers.gpus) for _ in range(servers.count)]
        group = placement_group(bundles, strategy=launch_cfg.placement)
        ray.get(group.ready(), timeout=600)
        if pool is not None:
            pool.start(group, first_bundle=n)  # they load their weights while the ranks are placed
        actors = _rank_actors(group, launch_cfg)
        where = ray.get([a.node.remote() for a in actors])
        extra_env = dict(launch_cfg.env)
        if pool is not None:
            spec = replace(spec, overrides=(*spec.overrides, *_server_overrides(pool, where[0][0])))
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
        if pool is not None and ray.is_initialized():
            pool.stop()
        if group is not None:
            remove_placement_group(group)
        if started_here and ray.is_initialized():
            ray.shutdown()


def _bundle(cpus: float, gpus: float) -> dict[str, float]:
    return {"CPU": cpus, **({"GPU": gpus} if gpus else {})}


def _rank_actors(group, launch_cfg) -> list[Any]:
    """Rank k's actor in bundle k."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    actor_cls = _rank_actor_class()
    return [actor_cls.options(
        num_cpus=launch_cfg.cpus_per_rank, num_gpus=launch_cfg.gpus_per_rank, name=f"vlrl-rank-{rank}",
        scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=rank),
    ).remote() for rank in range(launch_cfg.nproc)]


def _server_overrides(pool: RolloutServers, rank0_ip: str) -> list[str]:
    """The healthy servers' URLs as rollout.servers.urls; with distributed weight sync at its loopback default and a
    server on another node than rank 0, rank 0's IP as rollout.weight_sync.address (where the servers join the
    trainer's broadcast group)."""
    urls = pool.wait_ready()
    overrides = [f"rollout.servers.urls=[{','.join(urls)}]"]
    if pool.plan.wire_sync_address and any(s.ip != rank0_ip for s in pool.servers):
        overrides.append(f"rollout.weight_sync.address={rank0_ip}")
    return overrides


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
    from vlrl.check import detect_recipe
    from vlrl.safe_yaml import YamlRefused, load_file

    try:
        raw = load_file(config) if config is not None and config.is_file() else {}
    except YamlRefused:
        raw = {}  # the full load reports it with the file name
    return detect_recipe(raw if isinstance(raw, dict) else {}, config)


# ----------------------------------------------------------------------------------------------- before anything starts
class LaunchRefused(ValueError):
    """A launch that cannot be honoured, refused before anything starts (the message names the field)."""


@dataclass(frozen=True)
class Prepared:
    """What `vlrl launch` starts: the loaded config (rollout servers' URLs stood in for), the ranks' spec and the
    servers."""

    cfg: Any
    spec: RankSpec
    servers: ServerPlan | None


def prepare(kind: str, config: Path | None, overrides: list[str]) -> Prepared:
    """Every check `vlrl launch` makes before it starts Ray — also what `vlrl plan` runs on each placement it prints,
    so the planner never shows a placement the runtime refuses. Raises `vlrl.config.ConfigError` (the config does
    not load) or `LaunchRefused`."""
    from vlrl.check.options import load_run_config
    from vlrl.config import RLConfig, SFTConfig
    from vlrl.train.distributed import check_scalable

    if kind not in ("sft", "rl"):
        raise LaunchRefused(f"launches sft and rl runs (got recipe {kind!r}; pass --recipe)")
    placeholder = starts_servers(config, overrides) if kind == "rl" else None
    cfg = load_run_config(SFTConfig if kind == "sft" else RLConfig, config, [*overrides, *([placeholder] if placeholder else [])])
    try:
        check_scalable(cfg, cfg.launch.nproc)  # what every rank would refuse, refused before anything starts
    except ValueError as err:
        raise LaunchRefused(str(err)) from None
    batch, size = ("train.batch_size", cfg.train.batch_size) if kind == "sft" else \
        ("train.prompts_per_step", cfg.train.prompts_per_step)
    if size % cfg.launch.nproc:  # the ranks' first step would stop on it (`DistContext.shard`)
        raise LaunchRefused(f"{batch}: {size} does not split evenly over launch.nproc={cfg.launch.nproc} ranks; use "
                            f"a multiple of {cfg.launch.nproc}")
    return Prepared(cfg, RankSpec(kind, str(config) if config is not None else None, tuple(overrides)),
                    server_plan(cfg, kind))


# ----------------------------------------------------------------------------------------------- rollout servers
@dataclass(frozen=True)
class ServerPlan:
    """The `vlrl serve` processes `vlrl launch` starts (from the launch section; `server_plan`)."""

    count: int
    model: str
    threads: int = 1
    args: tuple[str, ...] = ()
    timeout: float = 300.0
    api_key_env: str = "VLRL_API_KEY"  # where the ranks' HTTP engines read the key (rollout.servers.api_key_env)
    cpus: float = 1.0  # each server's bundle
    gpus: float = 0.0
    device: str = "cpu"
    dtype: str = "float32"
    wire_sync_address: bool = False  # rollout.weight_sync.method=distributed at its loopback default: set rank 0's IP
    engine: str = "vlrl"  # rollout.servers.engine: vlrl serve, or vLLM (`vlrl.rollout.engine_launch`)
    python: str | None = None  # vLLM's interpreter (rollout.servers.launch.python; default .venv-vllm/bin/python)
    env: tuple[tuple[str, str], ...] = ()  # extra environment of each server (vLLM: rollout.servers.launch.env)

    def command(self, index: int) -> list[str]:
        """`vlrl serve` without --host / --port (the actor adds its node's IP and port 0); vLLM with ``{host}``,
        ``{port}`` and ``{api_key}`` for the actor to fill (it picks a free port: vLLM takes no port 0)."""
        extra = [arg.replace("{i}", str(index)) for arg in self.args]
        if self.engine == "vllm":
            from vlrl.rollout.engine_launch import engine_command, engine_python

            return [*engine_command("vllm", engine_python("vllm", self.python), model=self.model, host="{host}",
                                    port="{port}", dtype=self.dtype, api_key="{api_key}"), *extra]  # type: ignore[arg-type]
        return [sys.executable, "-m", "vlrl.cli", "serve", "--model", self.model, "--threads", str(self.threads),
                "--device", self.device, "--dtype", self.dtype, *extra]


def starts_servers(config: Path | None, overrides: list[str]) -> str | None:
    """``rollout.servers.urls=[…]``, a stand-in for the URLs of the servers ``launch.rollout_servers`` will start, so
    the config validates (rollout.weight_sync.method=distributed needs servers); None when the launch starts none.
    `LaunchRefused` when rollout.servers.urls is set as well (one or the other)."""
    from vlrl.config import RLConfig, apply_overrides
    from vlrl.safe_yaml import load_file

    try:
        raw = load_file(config) if config is not None and config.is_file() else {}
        raw = apply_overrides(raw if isinstance(raw, dict) else {}, list(overrides), cls=RLConfig)
        count, servers = (raw.get("launch") or {}).get("rollout_servers"), (raw.get("rollout") or {}).get("servers")
        servers = servers.get("urls") if isinstance(servers, dict) else None  # a list: an old key, reported at load
    except Exception:  # noqa: BLE001 - malformed input: the full load reports it with its own message
        return None
    if not isinstance(count, int) or count <= 0:
        return None
    if servers:
        raise LaunchRefused(f"launch.rollout_servers={count} starts the rollout servers and passes their URLs; "
                            f"rollout.servers.urls is set too ({servers}): set one or the other")
    return "rollout.servers.urls=[http://127.0.0.1:1]"


COMPUTE_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


def server_plan(cfg, recipe: str) -> ServerPlan | None:
    """``launch.rollout_servers`` as a `ServerPlan` (None for 0); `LaunchRefused` naming the field for a setting it
    cannot honour."""
    launch_cfg = cfg.launch
    if not launch_cfg.rollout_servers:
        return None
    if recipe != "rl":
        raise LaunchRefused(f"launch.rollout_servers={launch_cfg.rollout_servers}: rollout servers serve RL runs "
                            f"(this is a {recipe} run); set launch.rollout_servers=0")
    rollout = cfg.rollout
    model = cfg.model  # the servers load the checkpoint as the trainer does (the launch's server_args come after)
    model_flags = [*(["--attn-implementation", model.attn_implementation] if model.attn_implementation else []),
                   *(["--revision", model.revision] if model.revision else []),
                   *(["--trust-remote-code"] if model.trust_remote_code else [])]
    engine = "vllm" if rollout.servers.engine == "vllm" else "vlrl"
    if rollout.servers.engine == "sglang":
        raise LaunchRefused("launch.rollout_servers starts vlrl serve or vLLM (rollout.servers.engine=vllm); start SGLang "
                            "servers yourself and give their URLs (rollout.servers.urls)")
    if engine == "vllm":
        model_flags = ["--weight-transfer-config", '{"backend": "nccl"}'] \
            if rollout.weight_sync.method == "distributed" else []
    return ServerPlan(
        launch_cfg.rollout_servers, launch_cfg.server_model or cfg.model.path, threads=launch_cfg.server_threads,
        engine=engine, python=rollout.servers.launch.python, env=tuple(sorted(rollout.servers.launch.env.items())),
        args=(*model_flags, *launch_cfg.server_args), timeout=launch_cfg.server_timeout, api_key_env=rollout.servers.api_key_env,
        cpus=launch_cfg.server_cpus, gpus=launch_cfg.gpus_per_server, device=launch_cfg.server_device or cfg.model.device,
        dtype=launch_cfg.server_dtype or COMPUTE_DTYPES.get(cfg.dist.mixed_precision, cfg.model.dtype),
        wire_sync_address=rollout.weight_sync.method == "distributed" and rollout.weight_sync.address == "127.0.0.1")


def _death_signal():
    """Linux: a ``preexec_fn`` giving the server SIGKILL when the process that started it dies, however it dies
    (no orphaned servers); None elsewhere. libc is looked up here, in the parent: the forked child only makes the
    call. (The signal follows the *thread* that forked: Ray runs an actor's methods on its main thread.)"""
    try:
        import ctypes

        prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@dataclass(frozen=True)
class ServerStatus:
    """What a server actor reports: its URL once it listens, its exit code once it exited, its last line."""

    url: str | None
    code: int | None
    last_line: str


class ServerProcess:
    """One `vlrl serve` process on this node, bound to the node's IP on a free port; its output is printed here
    (under Ray, streamed to the launcher's terminal prefixed ``(vlrl serve i pid=…)``). The body of the server
    actor (`_server_actor_class`)."""

    def __init__(self, index: int, env: tuple[tuple[str, str], ...] = ()) -> None:
        self.index, self.process, self.url, self.env = index, None, None, env
        self.tail: collections.deque = collections.deque(maxlen=20)  # its last lines
        self.reader: threading.Thread | None = None

    def __repr__(self) -> str:  # Ray's prefix of this actor's lines
        return f"vlrl serve {getattr(self, 'index', '?')}"

    def start(self, command: list[str], api_key: str) -> tuple[str, int]:
        """Start ``command --host NODE_IP --port 0`` with the key in VLRL_API_KEY (`vlrl serve --api-key`'s
        variable); (node IP, pid)."""
        import ray

        host = ray.util.get_node_ip_address()  # reachable from the other nodes; loopback would not be
        env = {**os.environ, "VLRL_API_KEY": api_key, **dict(self.env)}
        if "{port}" in command:  # vLLM: a free port chosen here, its URL known at once, its RL routes switched on
            from vlrl.rollout.engine_launch import free_port

            port = free_port(host)
            self.url = f"http://{host}:{port}"
            env["VLLM_SERVER_DEV_MODE"] = "1"
            command = [a.replace("{host}", host).replace("{port}", str(port)).replace("{api_key}", api_key)
                       for a in command]  # (not str.format: an argument may be JSON)
        else:
            command = [*command, "--host", host, "--port", "0"]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, text=True,
                                        bufsize=1, preexec_fn=_death_signal())
        self.reader = threading.Thread(target=self._read, daemon=True, name=f"vlrl-serve-{self.index}")
        self.reader.start()
        return host, self.process.pid

    def _read(self) -> None:
        for line in self.process.stdout:
            line = line.rstrip("\n")
            self.tail.append(line)
            if self.url is None and "listening on " in line:
                self.url = line.split("listening on ")[1].split()[0]
            print(line, flush=True)

    def status(self) -> ServerStatus:
        code = self.process.poll()
        if code is not None and self.reader is not None:
            self.reader.join(timeout=2)  # its last words
        last = next((line.strip() for line in reversed(self.tail) if line.strip()), "no output")
        return ServerStatus(self.url, code, last)

    def healthy(self) -> bool:
        import httpx

        try:
            return self.url is not None and httpx.get(f"{self.url}/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def model_info(self, api_key: str) -> dict | str:
        """/get_model_info (weight version and checksum; vLLM: /weight_info), or why it failed."""
        import httpx

        try:
            path = "/get_model_info"
            if httpx.get(f"{self.url}{path}", timeout=30).status_code == 404:
                path = "/weight_info"  # a vLLM server
            return httpx.get(f"{self.url}{path}", timeout=30,
                             headers={"Authorization": f"Bearer {api_key}"}).json()
        except (httpx.HTTPError, ValueError) as err:
            return str(err)

    def stop(self, grace: float) -> None:
        """SIGTERM (the server drains), SIGKILL after ``grace`` seconds."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.terminate()
        try:
            self.process.wait(grace)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        if self.reader is not None:
            self.reader.join(timeout=2)


def _server_actor_class():
    import ray

    return ray.remote(ServerProcess)


@dataclass
class _Server:
    index: int
    actor: Any
    ip: str = ""
    pid: int = 0
    url: str | None = None

    def name(self) -> str:
        return f"rollout server {self.index} ({self.url or 'not listening yet'}, pid {self.pid})"


class RolloutServers:
    """``plan.count`` server actors, each in its own bundle of the run's placement group, each running `vlrl serve`
    on its node (`ServerProcess`). The launcher checks their health, liveness and final weights through the actors
    (the servers' ports need only be reachable inside the cluster)."""

    def __init__(self, plan: ServerPlan) -> None:
        self.plan, self.api_key, self.servers = plan, secrets.token_urlsafe(24), []

    def start(self, group, first_bundle: int) -> None:
        """One actor per server in bundles ``first_bundle …``; each starts its server on its node's IP."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        actor_cls = _server_actor_class()
        for i in range(self.plan.count):
            actor = actor_cls.options(
                num_cpus=self.plan.cpus, num_gpus=self.plan.gpus, name=f"vlrl-serve-{i}",
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=group,
                                                                     placement_group_bundle_index=first_bundle + i),
            ).remote(i, self.plan.env)
            self.servers.append(_Server(i, actor))
        started = ray.get([s.actor.start.remote(self.plan.command(s.index), self.api_key) for s in self.servers])
        for server, (ip, pid) in zip(self.servers, started, strict=True):
            server.ip, server.pid = ip, pid
            print(f"vlrl launch: starting rollout server {server.index} on {ip} (pid {pid}): "
                  f"{' '.join([*self.plan.command(server.index), '--host', ip, '--port', '0'])}", flush=True)

    def wait_ready(self) -> list[str]:
        """Every server's URL once it answers /health; `LaunchError` if one exits or takes longer than the timeout."""
        import ray

        deadline = time.monotonic() + self.plan.timeout
        for server in self.servers:
            while True:
                self.check(starting=True)
                if server.url is not None and ray.get(server.actor.healthy.remote(), timeout=30):
                    break
                if time.monotonic() > deadline:
                    raise LaunchError(f"{server.name()} did not answer /health within launch.server_timeout="
                                      f"{self.plan.timeout:g} s; everything was stopped")
                time.sleep(0.2)
        for server in self.servers:
            print(f"vlrl launch: {server.name()} is healthy", flush=True)
        return [s.url for s in self.servers]

    def check(self, starting: bool = False) -> None:
        """`LaunchError` naming the first server that has exited (or whose actor died)."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        what = "could not start" if starting else "stopped during the run; all ranks stopped"
        for server in self.servers:
            try:
                status = ray.get(server.actor.status.remote(), timeout=60)
            except (RayActorError, GetTimeoutError) as err:
                raise LaunchError(f"{server.name()}: its Ray actor is gone ({type(err).__name__}): {what}") from None
            server.url = server.url or status.url
            if status.code is None:
                continue
            code = status.code
            how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
            said = f" (its last line: {status.last_line})" if starting or code > 0 else ""  # a killed server said nothing
            raise LaunchError(f"{server.name()} {how}: {what}{said}")

    def report_weights(self) -> None:
        """Print each server's final weight version and checksum (they equal the trainer's after its last update)."""
        import ray

        for server in self.servers:
            info = ray.get(server.actor.model_info.remote(self.api_key), timeout=60)
            if isinstance(info, dict):
                print(f"vlrl launch: {server.name()} ends with weight_version {info.get('weight_version')} "
                      f"weight_checksum {info.get('weight_checksum')}", flush=True)
            else:
                print(f"vlrl launch: {server.name()}: /get_model_info failed ({info})", flush=True)

    def stop(self, grace: float = 30.0) -> None:
        """SIGTERM every server (they drain), SIGKILL what is left after ``grace`` seconds, then end the actors."""
        import ray

        try:
            ray.get([s.actor.stop.remote(grace) for s in self.servers], timeout=grace + 30)
        except Exception as err:  # noqa: BLE001 - an actor already gone: killing it below ends its server too
            log.debug("stopping the rollout servers: %s", err)
        for server in self.servers:
            ray.kill(server.actor, no_restart=True)  # its server dies with it (PR_SET_PDEATHSIG)
