"""The RL stage's rollout sections: how responses are sampled (`RolloutConfig`, with its sub-sections `EngineConfig`,
`AgentConfig`, `ServersConfig` and `WeightSyncConfig`, and `MOVED_KEYS`: the old flat keys → their new places), the
asynchronous staleness bound (`StalenessConfig`) and the DAPO dynamic sampling (`DynamicSamplingConfig`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from vlrl.config.base import Section


# ----------------------------------------------------------------------------------------------- RL stage
class EngineConfig(Section):
    """The in-process engine (`rollout.engine`): used when no rollout servers are set (``rollout.servers.urls``
    empty) — rollout.mode=sync generates with the trainer's own model, async with a private copy of it."""

    max_batch_size: int = Field(
        256, ge=1, description="Sequences generated at once by the in-process engine (`vlrl plan` also sizes a rollout "
        "server's generation batch with it).")
    compile: bool = Field(
        False, description="In-process engine (rollout.mode=sync, no servers): decode against a static KV cache with one "
        "decode step compiled by torch.compile (CUDA graphs on GPUs, mode reduce-overhead; inductor on CPU) instead of "
        "the eager per-token loop. Same greedy ids and log-probs; the first batch of each shape pays the compile "
        "(seconds on a GPU, ~a minute for a tiny model on 2 CPU cores). Layers other than full attention and FSDP2 "
        "shards decode eagerly.",
    )


class AgentConfig(Section):
    """The rollout function and the multi-turn agent loop (`rollout.agent`, `vlrl.rollout.agent`; docs: "Multi-turn
    agents"): ``function`` applies to every run (single_turn, the default, is one ``engine.generate``); the
    environment and episode fields apply when ``function`` is multi_turn, per_sample or a custom one."""

    function: str = Field(
        "single_turn", description="Rollout function: single_turn (= engine.generate), multi_turn (the batched agent "
        "loop over rollout.agent.env), per_sample (rollout.agent.generate per sample), or 'pkg.mod:fn' with the same "
        "signature.",
    )
    generate: str = Field(
        "agent", description="Per-sample generate used by rollout.agent.function=per_sample: agent (one episode of the "
        "agent loop) or 'pkg.mod:fn' — slime's second plug-in level.",
    )
    options: dict[str, Any] = Field(
        default_factory=dict, description="Free-form options handed to a custom rollout function (AgentSettings.options).",
    )
    env: str | None = Field(
        None, description="Environment of multi-turn rollouts: shapes_feedback, tool_zoom, judge, or 'pkg.mod:Class'.",
    )
    env_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Typed keyword options of the environment's constructor (checked at start-up), "
        "e.g. {zoom: true} for shapes_feedback.",
    )
    max_turns: int = Field(1, ge=1, description="Model turns per episode at most (slime's geo3k: 3).")
    max_total_tokens: int | None = Field(
        None, ge=1, description="Token budget of a whole episode (prompt + turns + observations); hitting it marks "
        "the trajectory TRUNCATED. Unset: only max_turns × max_new_tokens bound it.",
    )
    max_env_retries_per_turn: int = Field(
        2, ge=0, description="Failed environment calls (raised or timed out) retried per turn; one more marks the "
        "trajectory FAILED (excluded from the loss, counted in agent/failed).",
    )
    env_timeout_seconds: float = Field(
        30.0, gt=0, description="An environment reset/step taking longer counts as failed (and is retried on a fresh instance).",
    )


class LaunchServersConfig(Section):
    """Rollout servers vlrl starts itself (`rollout.servers.launch`, `vlrl.rollout.engine_launch`): ``count`` servers of
    ``rollout.servers.engine`` on loopback, each on a free port with a generated key, waited for, stopped with the run.
    Docs: "Rollout servers"."""

    count: int = Field(
        0, ge=0, description="Servers to start (0: none; rollout.servers.urls then names servers started by hand). One "
        "process runs the trainer: under torchrun or `vlrl launch`, start them there instead (launch.rollout_servers)."
    )
    python: str | None = Field(
        None, description="The interpreter of the environment that has the engine, e.g. .venv-vllm/bin/python (vLLM "
        "needs transformers < 5.20: its own venv, `make .venv-vllm`). Unset: for vllm .venv-vllm/bin/python where it "
        "exists, else this interpreter."
    )
    command: list[str] | None = Field(
        None, description="The whole server command instead of the engine's own, with {python}, {model}, {host}, "
        "{port}, {dtype} and {i} (the server's index) filled in; the key is in $VLRL_API_KEY."
    )
    model: str | None = Field(
        None, description="What the servers load. Unset: model.path when it is a directory, else the trainer's policy "
        "saved under <out>/rollout_model (vLLM and SGLang load a directory, not a vlrl preset)."
    )
    args: list[str] = Field(
        default_factory=list, description="Extra arguments after the engine's own (e.g. [--enforce-eager, "
        "--max-model-len, '1024'] for vLLM on a CPU); {i} is the server's index."
    )
    env: dict[str, str] = Field(
        default_factory=dict, description="Extra environment variables of the servers (e.g. {VLLM_CPU_KVCACHE_SPACE: "
        "'1'}); vLLM always gets VLLM_SERVER_DEV_MODE=1 (its pause and weight routes)."
    )
    host: str = Field(
        "127.0.0.1", description="Bind address. Loopback: vLLM's RL routes (pause, weights) are not behind its --api-key."
    )
    timeout: float = Field(
        600.0, gt=0, description="Seconds each server may take to answer /health (vLLM on 2 CPU cores: 1-4 minutes)."
    )


class ServersConfig(Section):
    """Rollout servers (`rollout.servers`; docs: "Rollout servers"): used when ``urls`` names servers (`vlrl serve`,
    SGLang or vLLM) or ``launch`` starts them; they then generate instead of an in-process engine. ``on_weight_update``
    and ``max_concurrent_rollouts`` also apply to rollout.mode=async without servers (its threaded engine)."""

    urls: list[str] = Field(
        default_factory=list, description="Rollout server base URLs (`vlrl serve`, SGLang or vLLM, e.g. "
        "http://127.0.0.1:30000). Empty: generate in this process (async mode uses a private copy of the policy), "
        "unless rollout.servers.launch starts servers."
    )
    engine: Literal["auto", "vlrl", "sglang", "vllm"] = Field(
        "auto", description="What the servers are, and so which API vlrl speaks: vlrl (`vlrl serve`) and sglang "
        "(SGLang's native /generate and weight routes), vllm (vLLM's /inference/v1/generate, /pause, /collective_rpc "
        "reload_weights, /update_weight_version, /weight_checker; needs VLLM_SERVER_DEV_MODE=1 and --enable-scale-out). "
        "auto: read from each server's /server_info (vLLM's carries vllm_config, vlrl serve's version is 'vlrl'); with "
        "rollout.servers.launch, auto starts vlrl serve."
    )
    launch: LaunchServersConfig = Field(
        default_factory=LaunchServersConfig, description="Rollout servers vlrl starts and stops itself.")
    checksum: Literal["every_update", "first_update", "off"] = Field(
        "every_update", description="vLLM: compare the server's /weight_checker checksums (sha256 of every parameter "
        "as it holds it) with the trainer's weights after every disk update, after the first only, or never — a "
        "pass over the weights on the server each time. vlrl serve reports its checksum with every load; SGLang none."
    )
    api_key_env: str = Field(
        "VLRL_API_KEY", description="Environment variable holding the servers' bearer token (never put the key itself in a config)."
    )
    admin_api_key_env: str = Field(
        "VLRL_ADMIN_API_KEY", description="Environment variable holding the servers' admin key (SGLang's / vlrl "
        "serve's --admin-api-key), sent on the weight and pause calls; unset: they carry the api_key_env key."
    )
    max_concurrent_rollouts: int | None = Field(
        None, ge=1, description="Async mode (with or without servers): prompts (each with n samples) in flight at once. "
        "Unset: 2 × train.prompts_per_step."
    )
    on_weight_update: Literal["finish", "abort", "retract", "in_place", "partial"] = Field(
        "finish", description="Requests in flight during a weight update (async mode; servers are sent SGLang's "
        "/pause_generation with this mode before each update and /continue_generation after, and this client holds "
        "new requests meanwhile): 'finish' them on the old weights, tagged with the old version (a disk update waits "
        "for them; a distributed one first lets them end, then pauses); 'abort' them and re-queue their prompts; "
        "'retract' them (SGLang: re-queued inside the server and continued on the new weights after the update — "
        "their tokens span two versions and the answer is tagged with the older; vlrl serve decodes them again from "
        "the prompt on the new weights); 'in_place' (SGLang: held with their KV cache and continued on the new "
        "weights, the prefix cache not flushed — prompts cached before the update are reused; vlrl serve finishes "
        "them on the old weights); 'partial' (partial rollout: each unfinished generation is interrupted at the update, "
        "keeps its tokens and goes on from where it stopped on the new weights — no token sampled again; every token "
        "carries the version that sampled it (Trajectory.token_versions), the answer is tagged with its oldest, which "
        "staleness.eta bounds; vlrl serve and the in-process engine continue from the kept tokens, SGLang is sent "
        "'retract', vLLM 'keep'). The in-process async engine (no servers) honours it too. Docs: \"Rollout servers\"."
    )
    prompt_check: Literal["error", "warn", "off"] = Field(
        "error", description="Compare each answer's meta_info.prompt_tokens with the prompt the "
        "trainer scores; a mismatch (SGLang re-processed the images with other pixel bounds, or a context did not "
        "survive decode → encode) is an error naming the sample and both counts, a logged warning, or not checked."
    )
    request_timeout: float = Field(300.0, gt=0, description="Seconds a server may take for one /generate before it counts as stalled.")
    max_retries: int = Field(3, ge=0, description="Times a failed request is retried on another server before the run stops.")
    max_server_failures: int = Field(
        2, ge=1, description="Consecutive failures (errors or timeouts) after which a server is dropped from the pool."
    )


class WeightSyncConfig(Section):
    """How rollout servers get each weight version (`rollout.weight_sync`): used only with servers
    (``rollout.servers.urls``); in-process engines share the trainer's weights. Docs: "Scaling out"."""

    method: Literal["disk", "distributed"] = Field(
        "disk", description="'disk' (save_pretrained under rollout.weight_sync.dir, then SGLang's "
        "/update_weights_from_disk; works with any server pool) or 'distributed' (SGLang's "
        "/init_weights_update_group + /update_weights_from_distributed: the servers join a process group hosted by "
        "the trainer, which broadcasts the weights bucket by bucket — gloo on CPU, NCCL on GPUs; no disk; falls back "
        "to disk for an update when a server dies mid-broadcast)."
    )
    dir: str | None = Field(
        None, description="Where weights are saved for the servers to load (must be visible to them). Unset: <out>/rollout_weights."
    )
    update_timeout: float = Field(
        600.0, gt=0, description="Seconds each weight call (/update_weights_from_disk, "
        "/pause_generation, /continue_generation, /destroy_weights_update_group) may take before its server counts "
        "as failed — apart from rollout.servers.request_timeout, so a long load is never taken for a stalled generation."
    )
    address: str = Field(
        "127.0.0.1", description="method=distributed: the trainer's address as the servers reach it (its rendezvous "
        "store listens there); set the trainer node's IP when servers run on other machines."
    )
    port: int = Field(
        0, ge=0, le=65535, description="method=distributed: the rendezvous port on `address`; 0 = a free port."
    )
    bucket_mb: float = Field(
        256.0, gt=0, description="method=distributed: megabytes of parameters per broadcast bucket (one HTTP call "
        "per bucket; an FSDP2 trainer gathers one bucket of full tensors at a time)."
    )
    timeout: float = Field(
        120.0, gt=0, description="method=distributed: seconds the trainer waits for the servers to join a group, "
        "for a bucket's broadcast and for its answers; past it (or as soon as a server's call fails) the group is "
        "closed, that update goes by disk to the servers left and the next one forms a new group."
    )
    deadline: float = Field(
        900.0, gt=0, description="method=distributed: seconds one whole update may take (opening SGLang's weight-update "
        "session, forming the group, every bucket's broadcast and answers); past it the update is abandoned — the "
        "group torn down, that update by disk — even where a collective would block (NCCL creates its communicator at "
        "the first broadcast, and waits there for every rank)."
    )
    on_failure: Literal["disk", "stop"] = Field(
        "disk", description="method=distributed: when an update could not go over the group (a server refused it, "
        "died, or the deadline passed), it goes by disk (a warning names why) and then 'disk': the run goes on, the "
        "next update forms a new group; 'stop': the run stops with an error naming the failure."
    )
    verify_checksum: bool = Field(
        True, description="Compare the weight checksum each server reports after an update with the trainer's (a "
        "mismatch stops the run). The trainer computes it only for servers that report one (vlrl serve does; SGLang "
        "does not: on a GPU that spares copying every weight to the host each update); false: never."
    )


# The flat ``rollout.*`` keys of before the sections (issue 37) → where each lives now, under ``rollout.``; a config
# still using one gets an error naming its new place (`RolloutConfig._moved_keys`).
MOVED_KEYS: dict[str, str] = {
    "max_batch_size": "engine.max_batch_size",
    "compile": "engine.compile",
    "function": "agent.function",
    "generate": "agent.generate",
    "function_options": "agent.options",
    "env": "agent.env",
    "env_kwargs": "agent.env_kwargs",
    "max_turns": "agent.max_turns",
    "max_total_tokens": "agent.max_total_tokens",
    "max_env_retries_per_turn": "agent.max_env_retries_per_turn",
    "env_timeout_seconds": "agent.env_timeout_seconds",
    "api_key_env": "servers.api_key_env",
    "admin_api_key_env": "servers.admin_api_key_env",
    "max_concurrent_rollouts": "servers.max_concurrent_rollouts",
    "on_weight_update": "servers.on_weight_update",
    "prompt_check": "servers.prompt_check",
    "request_timeout": "servers.request_timeout",
    "max_retries": "servers.max_retries",
    "max_server_failures": "servers.max_server_failures",
    "weights_dir": "weight_sync.dir",
    "weight_sync_address": "weight_sync.address",
    "weight_sync_port": "weight_sync.port",
    "weight_sync_bucket_mb": "weight_sync.bucket_mb",
    "weight_sync_timeout": "weight_sync.timeout",
    "weight_update_timeout": "weight_sync.update_timeout",
    # keys that became sections: a plain value given there is the field named here
    "servers": "servers.urls",
    "weight_sync": "weight_sync.method",
}


class RolloutConfig(Section):
    """How the RL stage samples (`rollout`). The fields here apply to every run; the sub-sections apply when their
    docstrings say: `engine` without servers, `agent` for multi-turn and custom rollouts, `servers` and
    `weight_sync` with rollout servers."""

    mode: Literal["sync", "async"] = Field(
        "sync", description="sync: generate a batch, then train on it (on-policy). async: rollout workers generate "
        "continuously into a buffer while the trainer trains (AReaL-style decoupled PPO; see the `staleness` section)."
    )
    n: int = Field(8, ge=1, description="Responses sampled per prompt (the GRPO group size; LLaVA-OV-1.5: 16).")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature (LLaVA-OV-1.5: 1.0).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling threshold; 1 disables.")
    top_k: int = Field(0, ge=0, description="Top-k sampling; 0 disables (the full vocabulary, as verl, TRL, SGLang "
                       "and vLLM). The shipped configs set 50: what they were tuned with (transformers' `generate` "
                       "default, which the in-process engine applied silently before it sampled with its own loop).")
    max_new_tokens: int = Field(16, ge=1, description="Response budget; longer responses are TRUNCATED.")
    stop: list[str] = Field(default_factory=list, description="Extra stop strings besides EOS.")
    engine: EngineConfig = Field(
        default_factory=EngineConfig, description="The in-process engine (used without rollout servers).")
    agent: AgentConfig = Field(
        default_factory=AgentConfig, description="The rollout function and the multi-turn agent loop.")
    servers: ServersConfig = Field(
        default_factory=ServersConfig, description="Rollout servers (used when rollout.servers.urls is set).")
    weight_sync: WeightSyncConfig = Field(
        default_factory=WeightSyncConfig, description="How rollout servers get each weight version.")

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data: Any) -> Any:
        """An old flat key (`MOVED_KEYS`), or a plain value where a sub-section goes: an error naming the new place."""
        if not isinstance(data, dict):
            return data
        problems = []
        for key, value in data.items():
            if key in ("servers", "weight_sync") and not isinstance(value, (dict, Section)):
                what = "the URL list" if key == "servers" else "the method (disk | distributed)"
                problems.append(f"rollout.{key} is a section now: {what} is rollout.{MOVED_KEYS[key]}")
            elif key in ("engine", "agent", "servers", "weight_sync") and not isinstance(value, (dict, Section)):
                field = next(new for new in MOVED_KEYS.values() if new.startswith(f"{key}."))
                problems.append(f"rollout.{key} is a section: set its fields, e.g. rollout.{field}")
            elif key in MOVED_KEYS and key not in ("servers", "weight_sync"):
                problems.append(f"rollout.{key} moved to rollout.{MOVED_KEYS[key]}")
        if problems:
            raise ValueError("; ".join(problems))
        return data

    @model_validator(mode="after")
    def _check_agent(self) -> RolloutConfig:
        agent = self.agent
        if agent.function in ("multi_turn", "per_sample") and agent.env is None:
            raise ValueError(f"rollout.agent.env must name an environment when rollout.agent.function={agent.function!r}")
        if agent.env is not None and agent.function == "single_turn":
            raise ValueError("rollout.agent.env is set but rollout.agent.function=single_turn would ignore it; "
                             "use multi_turn")
        if self.servers.urls and self.servers.launch.count:
            raise ValueError(f"rollout.servers.launch.count={self.servers.launch.count} starts the servers and uses their "
                             f"URLs; rollout.servers.urls is set too ({self.servers.urls}): set one or the other")
        if self.weight_sync.method == "distributed" and not (self.servers.urls or self.servers.launch.count):
            raise ValueError("rollout.weight_sync.method=distributed sends weights to rollout servers: set "
                             "rollout.servers.urls (in-process engines share the trainer's weights)")
        return self


class StalenessConfig(Section):
    eta: int = Field(
        4, ge=0, description="Async mode: max staleness η (AReaL max_head_offpolicyness; LLaVA-OV-1.5: 4). A sample generated "
        "by weights more than η updates older than the trainer's is discarded; 0 = on-policy."
    )
    behaviour_weight_cap: float = Field(
        5.0, gt=0, description="Cap of the behaviour importance weight min(π_prox / π_behave, cap) (LLaVA-OV-1.5: 5.0)."
    )
    apply_behaviour_weight: bool = Field(
        True, description="Async mode: multiply the per-token policy loss by the behaviour weight (the decoupled PPO "
        "objective). Set false if `algo.policy_loss` applies it itself, or to correct with "
        "algo.rollout_correction.tis_cap instead."
    )
    behaviour_weight_mode: Literal["clamp", "drop"] = Field(
        "clamp", description="What a behaviour weight above behaviour_weight_cap becomes: clamp = the cap (the "
        "LLaVA-OV-1.5 seed's BehavWeight), drop = 0, the token leaves the loss but stays in the normaliser (AReaL "
        "behav_imp_weight_cap). Used by the async recipe's weight and by policy_loss=decoupled."
    )


class DynamicSamplingConfig(Section):
    enabled: bool = Field(
        False, description="DAPO dynamic sampling (eq. 11): drop groups whose rewards are all equal (zero advantage) "
        "and back-fill with newly generated groups until the batch holds train.prompts_per_step prompts."
    )
    metric: Literal["reward", "accuracy"] = Field(
        "reward", description="What must differ within a group: the scalar reward (before shaping), or the "
        "'accuracy' sub-score (DAPO's is_equivalent; responses without it count as 0)."
    )
    oversample: float = Field(
        1.0, ge=1.0, description="Prompts generated per round = ceil(missing prompts × oversample); surplus "
        "informative groups are carried over to the next step."
    )
    max_extra_rounds: int = Field(
        4, ge=0, description="Cap on extra generation rounds per step (verl max_num_gen_batches − 1); when reached, "
        "the step trains on the informative groups it has (logged as sampling/prompts_used)."
    )

