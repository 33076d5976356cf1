"""The settings of `vlrl.rollout.http_engine.HTTPEngine`, grouped: how it talks to its servers (`ClientSettings`) and
how it gives them the trainer's weights (`SyncSettings`). `vlrl.rollout.build_engine` builds both from the ``rollout``
config section; tests and benchmarks build them directly."""

from __future__ import annotations

import dataclasses
from pathlib import Path

PROMPT_CHECKS = ("error", "warn", "off")
ENGINES = ("auto", "vlrl", "sglang", "vllm")
PAUSE_MODES = {"finish": "retract", "abort": "abort", "retract": "retract", "in_place": "in_place", "partial": "retract"}
"""`rollout.servers.on_weight_update` → the ``/pause_generation`` mode sent before each update (``finish``: none before a disk
update; before a distributed one, once this client's requests in flight ended — nothing of its own is retracted).
``partial`` is SGLang's ``retract`` (its retracted requests keep their tokens and go on after the update); vlrl serve
is sent its own ``partial`` (`pause_mode`), its ``retract`` decoding again from the prompt."""


def pause_mode(on_weight_update: str, engines: set[str | None]) -> str:
    """The ``/pause_generation`` mode for ``on_weight_update`` on servers of ``engines`` (`PAUSE_MODES`; vlrl serve
    alone gets ``partial`` as itself)."""
    if on_weight_update == "partial" and engines == {"vlrl"}:
        return "partial"
    return PAUSE_MODES[on_weight_update]


@dataclasses.dataclass(frozen=True)
class ClientSettings:
    """How an `HTTPEngine` talks to its servers (the ``rollout.servers.*`` fields `vlrl.rollout.build_engine` binds)."""

    api_key: str | None = None
    """The servers' key (``Authorization: Bearer``); None: ``$VLRL_API_KEY``, if set."""
    admin_api_key: str | None = None
    """The key of the weight and pause calls (``vlrl serve --admin-api-key``); None: ``$VLRL_ADMIN_API_KEY``, else
    ``api_key``."""
    request_timeout: float = 300.0
    """Seconds one ``/generate`` may take before it counts as a failure of its server."""
    connect_timeout: float = 10.0
    """Seconds to open a connection."""
    startup_timeout: float = 60.0
    """Seconds every server has to answer ``/server_info`` when the engine starts."""
    max_retries: int = 3
    """Times a failed request is retried on another server."""
    max_server_failures: int = 2
    """Consecutive failures after which a server is dropped from the pool."""
    prompt_check: str = "error"
    """``rollout.servers.prompt_check``: a server's ``meta_info.prompt_tokens`` against the trainer's prompt (error, warn,
    off)."""
    engine: str = "auto"
    """``rollout.servers.engine``: vlrl, sglang (SGLang's API), vllm (vLLM's), or auto (read from ``/server_info``)."""
    checksum: str = "every_update"
    """``rollout.servers.checksum`` (vLLM): when its ``/weight_checker`` checksums are compared with the trainer's."""

    def __post_init__(self) -> None:
        if self.prompt_check not in PROMPT_CHECKS:
            raise ValueError(f"rollout.servers.prompt_check: error, warn or off, got {self.prompt_check!r}")
        if self.engine not in ENGINES:
            raise ValueError(f"rollout.servers.engine: one of {ENGINES}, got {self.engine!r}")


@dataclasses.dataclass(frozen=True)
class SyncSettings:
    """How an `HTTPEngine` gives its servers the trainer's weights (`vlrl.rollout.publish`)."""

    weights_dir: str | Path
    """Where each version is saved for ``/update_weights_from_disk`` (a RAM disk when servers share the host)."""
    method: str = "disk"
    """``rollout.weight_sync.method``: ``disk`` or ``distributed`` (a process group: `vlrl.rollout.weight_group`)."""
    on_weight_update: str = "finish"
    """``rollout.servers.on_weight_update``: what the servers do with requests in flight during an update (`PAUSE_MODES`)."""
    update_timeout: float = 600.0
    """``rollout.weight_sync.update_timeout``: seconds one weight or pause call may take."""
    keep_checkpoints: int = 2
    """Saved versions kept under ``weights_dir`` (older ones are deleted)."""
    address: str = "127.0.0.1"
    """``rollout.weight_sync.address``: the trainer's address as the servers reach it (distributed)."""
    port: int = 0
    """``rollout.weight_sync.port``: the rendezvous port (distributed); 0: a free port."""
    bucket_mb: float = 256.0
    """``rollout.weight_sync.bucket_mb``: megabytes of parameters per broadcast bucket (distributed)."""
    timeout: float = 120.0
    """``rollout.weight_sync.timeout``: seconds to form a group or to see a bucket through (distributed)."""
    backend: str | None = None
    """The weight-update group's backend; None: NCCL for a CUDA policy, else gloo."""
    deadline: float = 900.0
    """``rollout.weight_sync.deadline``: seconds one whole distributed update may take (the session, the group's
    formation, every bucket and its answers); past it the update is abandoned and goes by disk (distributed)."""
    on_failure: str = "disk"
    """``rollout.weight_sync.on_failure``: after a distributed update failed and went by disk, ``disk`` (go on; the next
    update forms a new group) or ``stop`` (raise `WeightSyncError` naming the failure)."""
    verify_checksum: bool = True
    """``rollout.weight_sync.verify_checksum``: compare each server's reported weight checksum with the trainer's —
    computed only for servers that report one (vlrl serve does; SGLang does not)."""

    def __post_init__(self) -> None:
        if self.method not in ("disk", "distributed"):
            raise ValueError(f"rollout.weight_sync.method: 'disk' or 'distributed', got {self.method!r}")
        if self.on_failure not in ("disk", "stop"):
            raise ValueError(f"rollout.weight_sync.on_failure: 'disk' or 'stop', got {self.on_failure!r}")
        if self.on_weight_update not in PAUSE_MODES:
            raise ValueError(f"rollout.servers.on_weight_update: one of {sorted(PAUSE_MODES)}, got {self.on_weight_update!r}")
