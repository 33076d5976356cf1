"""The run-wide sections (report, check, sandbox, dist, checkpoint, launch) and the whole runs: `RunConfig`,
`SFTConfig`, `RLConfig`, `DemoConfig`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from vlrl.config.base import SEED_MAX, Section
from vlrl.config.model import DataConfig, EvalConfig, ModelConfig
from vlrl.config.train import RLStage, SFTStage
from vlrl.numerics import Numerics


def _check_stages(cfg, per_stage: tuple[str, ...], described: str) -> None:
    """With ``stages`` set, the per-stage sections may not also be set at the top, and names are unique."""
    if not cfg.stages:
        return
    top = sorted(set(per_stage) & cfg.model_fields_set)
    if top:
        raise ValueError(f"{', '.join(top)}: with `stages` set, every stage has its own {described} "
                         "sections; move these settings into the stages")
    names = [s.name for s in cfg.stages]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"stages: duplicate stage name(s) {duplicates}")


# ----------------------------------------------------------------------------------------------- report + check
class WandbOptions(Section):
    project: str = Field("vlrl", description="Weights & Biases project name.")
    entity: str | None = Field(None, description="Weights & Biases entity (user or team); unset: your default.")
    mode: Literal["offline", "online"] = Field(
        "offline", description="offline (default) writes under RUN_DIR/wandb for a later `wandb sync`; online needs a login."
    )


class MlflowOptions(Section):
    tracking_uri: str | None = Field(
        None, description="MLflow tracking URI; unset: a local store in the run directory (RUN_DIR/mlflow.db, or RUN_DIR/mlruns without SQLAlchemy)."
    )
    experiment: str = Field("vlrl", description="MLflow experiment name.")


class ReportConfig(Section):
    sinks: list[str] = Field(
        default_factory=list,
        description="Metric sinks besides metrics.jsonl (always written): tensorboard, wandb, mlflow, or 'pkg.mod:factory'.",
    )
    wandb: WandbOptions = Field(default_factory=WandbOptions, description="Options of the wandb sink.")
    mlflow: MlflowOptions = Field(default_factory=MlflowOptions, description="Options of the mlflow sink.")
    sink_options: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="Keyword options of custom (dotted-path) sinks, keyed by the sink's name."
    )
    html: bool = Field(True, description="Write RUN_DIR/report.html (curves, sampled responses, eval) when the run ends.")
    samples_per_task: int = Field(
        2, ge=0, description="Prompts per task whose responses (with rewards and images) go to samples.jsonl per snapshot."
    )
    rl_snapshots: int = Field(4, ge=0, description="Training batches of the RL stage recorded to samples.jsonl over the run.")
    progress: Literal["auto", "on", "off"] = Field(
        "auto", description="Live progress bars: auto shows them only when stderr is a terminal (CI logs stay plain)."
    )


class CheckConfig(Section):
    enabled: bool = Field(True, description="Run the preflight check (`vlrl check`) before any model weights are loaded.")
    samples_per_task: int = Field(
        4, ge=1, description="Samples per task (per split) encoded by the preflight check, plus the longest prompts."
    )


class SandboxConfig(Section):
    """The sandbox of the ``code`` reward, which runs model-written programs (`vlrl.rewards.sandbox`)."""

    isolation: Literal["namespaces", "root", "user", "none"] = Field(
        "namespaces", description="What isolates the programs. namespaces: root where it works, else user. root: "
        "`unshare` as root — network, PID, mount, IPC and UTS namespaces, a private read-only root filesystem, "
        "programs run as nobody. user: the same inside a user namespace, programs run as this user. none: rlimits "
        "and a disabled socket module only (programs can read this machine's files and reach its network). A "
        "setting this machine cannot give stops the run at preflight with the cause; the sandbox never falls back "
        "to less. The mode obtained is logged and recorded in summary.json (`sandbox`).",
    )
    max_memory_mb: int = Field(
        512, ge=16, description="Most memory of one sandboxed run's whole process tree — the runner, every process a "
        "test forks and the files it writes to its tmpfs — not per process: a cgroup per run (memory.max, or cgroup "
        "v1's memory.limit_in_bytes) where the host allows one; see tree_bound. A verifier's own memory_mb (e.g. "
        "from a sample's metadata) may lower it, never raise it.",
    )
    max_processes: int = Field(
        64, ge=1, description="Most processes of one sandboxed program at once (the cgroup's pids.max, plus the "
        "runner's two); as root every run has a user of its own, so runs never share RLIMIT_NPROC's count.",
    )
    tree_bound: Literal["auto", "cgroup", "rlimits"] = Field(
        "auto", description="How max_memory_mb and max_processes bound the whole process tree. auto: a cgroup per "
        "run (v2, else v1) where one can be made, else the documented fallback, logged as a warning and recorded "
        "in summary.json — each test is one process (RLIMIT_NPROC 1: it cannot fork) of at most max_memory_mb "
        "(RLIMIT_AS). cgroup: stop at preflight where no cgroup can be made. rlimits: the fallback everywhere.",
    )


# ----------------------------------------------------------------------------------------------- scale-out
class DistConfig(Section):
    strategy: Literal["fsdp", "ddp"] = Field(
        "fsdp", description="Data parallelism across the ranks torchrun (or `vlrl launch`) starts: fsdp = FSDP2 "
        "fully_shard (vision tower, each decoder/vision block and the root are units; ZeRO-3 memory), ddp = "
        "DistributedDataParallel (full replica per rank, all-reduced gradients). Ignored with one process.",
    )
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="torch.distributed backend; auto = nccl when model.device is cuda, else gloo."
    )
    mixed_precision: Literal["none", "bf16", "fp16"] = Field(
        "none", description="Mixed precision: FSDP2 MixedPrecisionPolicy (parameters gathered in bf16/fp16, "
        "gradients reduced in fp32) or torch.autocast for DDP and single-process runs; fp32 master weights either way.",
    )
    reshard_after_forward: bool = Field(
        True, description="FSDP2: free the gathered parameters after forward (ZeRO-3); false keeps them until backward "
        "(ZeRO-2-like: more memory, one all-gather fewer).",
    )
    find_unused_parameters: bool = Field(
        False, description="DDP: allow parameters that get no gradient in a step (e.g. the vision tower on text-only data)."
    )
    timeout_minutes: float = Field(30.0, gt=0, description="Collective timeout: a rank waiting longer than this fails the run.")
    deterministic: bool = Field(
        False, description="torch.use_deterministic_algorithms(True) (and CUBLAS_WORKSPACE_CONFIG on GPUs): bitwise "
        "reproducible steps on GPUs at some speed cost. CPU kernels are deterministic already.",
    )
    rank0_load: bool = Field(
        True, description="FSDP2 start-up: only rank 0 reads the weights (or builds the preset); the other ranks build "
        "the model on the meta device (no memory) and get each unit's tensors broadcast from rank 0 just before it is "
        "sharded — they never hold more than their shards and one unit, instead of a whole copy each (the broadcast "
        "set_model_state_dict(broadcast_from_rank0=True) does, unit by unit). false: every rank loads the whole model, "
        "then shards it. DDP needs the whole model on every rank either way, and so does rollout.mode=async without "
        "rollout servers (each rank's in-process rollout engine holds a whole copy).",
    )
    cpu_offload: bool = Field(
        False, description="FSDP2 CPUOffloadPolicy: the sharded parameters, their gradients and the AdamW moments live "
        "in host memory (pinned on GPUs) and the optimizer steps on the CPU; each unit's shard is copied to the device "
        "for its all-gather. Frees ~16 bytes per parameter / d of device memory (fp32) for PCIe traffic every step; "
        "`vlrl plan` counts it. No effect on DDP or one process.",
    )


class CheckpointConfig(Section):
    every: int = Field(
        0, ge=0, description="Save a resumable checkpoint (DCP shards + trainer_state.json) every N steps; 0 = none "
        "(the final weights are exported to checkpoints/final either way).",
    )
    keep: int = Field(2, ge=1, description="Resumable checkpoints kept (the oldest are deleted after a successful save).")
    resume: str | None = Field(
        None, description="'auto': continue from the latest complete checkpoint under OUT/checkpoints (start fresh if "
        "there is none); a checkpoint directory: continue from it; unset: start fresh.",
    )
    export_hf: bool = Field(
        False, description="Also write each checkpoint's weights in the transformers layout (CKPT/hf, safetensors) "
        "that transformers, vLLM and SGLang load.",
    )


class LaunchConfig(Section):
    nproc: int = Field(2, ge=1, description="`vlrl launch`: trainer ranks (one Ray actor each, one placement-group bundle each).")
    cpus_per_rank: float = Field(1.0, ge=0, description="`vlrl launch`: CPUs reserved in each rank's bundle.")
    gpus_per_rank: float = Field(0.0, ge=0, description="`vlrl launch`: GPUs reserved in each rank's bundle (1 on GPU machines).")
    placement: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="`vlrl launch`: Ray placement-group strategy of the rank bundles (PACK: as few nodes as possible)."
    )
    master_port: int = Field(0, ge=0, le=65535, description="`vlrl launch`: rendezvous port on rank 0's node; 0 picks a free one.")
    env: dict[str, str] = Field(
        default_factory=dict, description="`vlrl launch`: extra environment variables for every rank (e.g. NCCL settings)."
    )
    rollout_servers: int = Field(
        0, ge=0, description="`vlrl launch` (rl): start this many `vlrl serve` processes, each in a Ray actor of its own "
        "placement-group bundle ({CPU: server_cpus, GPU: gpus_per_server}) bound to its node's IP on a free port; wait "
        "for their /health, pass their URLs as rollout.servers.urls and a generated key in rollout.servers.api_key_env, stop them "
        "when the run ends; a server that dies stops the ranks. 0: none (rollout.servers.urls as configured). "
        "`vlrl plan --apply` writes it."
    )
    server_cpus: float = Field(1.0, ge=0, description="`vlrl launch`: CPUs reserved in each rollout server's bundle.")
    gpus_per_server: float = Field(
        0.0, ge=0, description="`vlrl launch`: GPUs reserved in each rollout server's bundle (1 on GPU machines: one "
        "full replica per device, as `vlrl plan`'s separate placements assume); Ray sets the server's CUDA_VISIBLE_DEVICES."
    )
    server_device: str | None = Field(
        None, description="`vlrl launch`: the rollout servers' torch device (`vlrl serve --device`). Unset: model.device."
    )
    server_dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None, description="`vlrl launch`: the rollout servers' weight dtype (`vlrl serve --dtype`). Unset: the trainer's "
        "compute dtype — dist.mixed_precision's (bf16 → bfloat16, fp16 → float16) or else model.dtype, what `vlrl plan` "
        "counts for a server."
    )
    server_model: str | None = Field(
        None, description="`vlrl launch`: the model the rollout servers load (`vlrl serve --model`). Unset: model.path."
    )
    server_threads: int = Field(1, ge=1, description="`vlrl launch`: torch CPU threads of each rollout server (`--threads`).")
    server_args: list[str] = Field(
        default_factory=list, description="`vlrl launch`: extra `vlrl serve` flags for every server (after the launch's own, so "
        "they win); {i} in a flag is the server's index, e.g. [--batch-window-ms, '5']."
    )
    server_timeout: float = Field(
        300.0, gt=0, description="`vlrl launch`: seconds each rollout server may take to load and answer /health."
    )


# ----------------------------------------------------------------------------------------------- whole runs
class RunConfig(Section):
    model: ModelConfig = Field(default_factory=ModelConfig, description="The policy to train.")
    data: DataConfig = Field(default_factory=DataConfig, description="Training and held-out data.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Held-out evaluation.")
    out: str = Field("runs/latest", description="Run directory: config.yaml, metrics.jsonl, checkpoints/, summary.json.")
    seed: int = Field(0, ge=0, lt=SEED_MAX, description="Seed of sampling, shuffling and dropout (0 ≤ seed < 2**32: "
                      "numpy's range; with several ranks, rank r uses seed + r).")
    numerics: Numerics = Field(
        "native", description="CPU kernels. native: each library's fastest for this CPU (AVX-512 where present). "
        "portable: ATen, MKL and oneDNN capped at AVX2 (MKL in strict reproducible mode), so the run gives the same "
        "bits on any Intel CPU with AVX2 at a given torch thread count — refused on other CPUs (AMD, ARM, no AVX2), "
        "whose kernels no Intel machine reproduces; ~1.1-1.3x slower per step where AVX-512 is present. auto: "
        "portable where it can be honoured, native elsewhere, the choice and its reason in the run's first line and "
        "summary.json (the demo uses it). Applied before the run's first tensor operation (`vlrl.numerics`); GPUs "
        "unaffected.",
    )
    report: ReportConfig = Field(default_factory=ReportConfig, description="Metric sinks, progress and the HTML report.")
    check: CheckConfig = Field(default_factory=CheckConfig, description="The preflight check run before loading weights.")
    sandbox: SandboxConfig = Field(
        default_factory=SandboxConfig, description="Isolation of the `code` reward's sandbox (model-written programs)."
    )
    dist: DistConfig = Field(default_factory=DistConfig, description="Data-parallel training under torchrun / `vlrl launch`.")
    checkpoint: CheckpointConfig = Field(
        default_factory=CheckpointConfig, description="Resumable checkpoints (sharded, atomic) and `--resume auto`."
    )
    launch: LaunchConfig = Field(default_factory=LaunchConfig, description="`vlrl launch`: trainer ranks as Ray actors.")


class SFTStageSpec(SFTStage):
    """One named stage of a staged SFT run (LLaVA-OV-1.5: align → midtrain → instruct)."""

    name: str = Field(..., min_length=1, description="Stage name: metrics stage, checkpoint directory checkpoints/<name>.")
    data: DataConfig | None = Field(
        None, description="Training data of this stage (train file, packing plan, ...). Unset: the run's `data` section.",
    )


class SFTConfig(RunConfig, SFTStage):
    """`vlrl sft`: supervised fine-tuning on the reference responses (assistant tokens only)."""

    stages: list[SFTStageSpec] = Field(
        default_factory=list, description="Staged SFT: stages run in order, each starting from the previous stage's "
        "checkpoint with its own optimizer, trainable modules and data. Empty: one stage from `optim` and `train`. "
        "See configs/three_stage_sft.yaml.",
    )

    @model_validator(mode="after")
    def _check_stages(self) -> SFTConfig:
        _check_stages(self, ("optim", "train"), "optim and train")
        return self


class RLStageSpec(RLStage):
    """One stage of an RL curriculum (LLaVA-OV-1.5-RL: answer-only, then chain-of-thought)."""

    name: str = Field(..., min_length=1, description="Stage name: metrics stage, checkpoint directory checkpoints/<name>.")
    data: DataConfig | None = Field(
        None, description="Prompts of this stage (train file or procedural suite). Unset: the run's `data` section.",
    )
    prompt_template: str | None = Field(
        None, description="Instruction put at the end of every prompt's last user turn, replacing a known one: "
        "'answer' (Put ONLY your final answer within <answer></answer>.), 'think' (step by step in <think></think>, "
        "then <answer></answer>), 'none', or literal text. Unset: prompts as they are.",
    )


class RLConfig(RunConfig, RLStage):
    """`vlrl rl`: GRPO-family RL with verifiable rewards, synchronous or asynchronous (``rollout.mode``)."""

    stages: list[RLStageSpec] = Field(
        default_factory=list, description="RL curriculum: stages run in order, each starting from the previous "
        "stage's checkpoint with its own data, prompt template, rollout, algo, optim and train sections. Empty: one "
        "stage from the top-level sections. See configs/curriculum_grpo.yaml.",
    )

    @model_validator(mode="after")
    def _check_stages(self) -> RLConfig:
        _check_stages(self, ("rollout", "algo", "optim", "train", "staleness", "select"),
                      "rollout, algo, optim, train, staleness and select")
        return self


class DemoConfig(RunConfig):
    """`vlrl demo`: SFT warm start → eval → RL → eval, plus an SFT control with the RL stage's budget."""

    sft: SFTStage = Field(default_factory=SFTStage, description="The SFT warm-start stage.")
    rl: RLStage = Field(default_factory=RLStage, description="The RL stage, started from the SFT checkpoint.")
    control: bool = Field(
        True, description="Also train the SFT checkpoint by more SFT on the same labelled samples with the RL stage's "
        "budget (the control), and evaluate it the same way.",
    )
    control_budget: Literal["flops", "wall"] = Field(
        "flops", description="The control's budget. flops: the RL stage's training + generation FLOPs (counted as run, "
        "vlrl.train.budget) converted to SFT steps at the SFT stage's FLOPs per step — the same for every run of a "
        "config, seed and thread count, whatever the machine's load; it counts a decode FLOP like a training FLOP, "
        "which on CPUs gives the control fewer steps than equal time would. wall: the RL stage's wall time (moves "
        "with load). summary.json's `budget` records the step counts of both.",
    )

    @model_validator(mode="after")
    def _check_in_process(self) -> DemoConfig:
        if self.eval.every:
            raise ValueError("eval.every: the demo evaluates at its own points (base, sft, rl, control); validation "
                             "during training is for `vlrl sft` and `vlrl rl`")
        if self.rl.rollout.mode != "sync" or self.rl.rollout.servers.urls:
            raise ValueError("rl.rollout.mode / rl.rollout.servers.urls: the demo runs the synchronous in-process recipe; "
                             "use `vlrl rl` for asynchronous training or rollout servers")
        if self.control and self.control_budget == "wall" and self.sft.optim.schedule != "constant":
            raise ValueError(f"sft.optim.schedule={self.sft.optim.schedule} with control_budget=wall: the control's "
                             "step count is known only when its time runs out, so its learning rate has nothing to "
                             "decay over — use control_budget=flops or sft.optim.schedule=constant")
        return self

