"""Typed configuration: one documented field per setting, validated at load time.

Configs are pydantic models; every field carries a description (a test enforces it). A YAML file and
dotted command-line overrides (``algo.clip_high=0.28``) are merged into one dict and validated once; a
wrong key or type raises `ConfigError` naming the field.

Shape: `SFTConfig` and `RLConfig` share the run sections (`model`, `data`, `eval`, `out`, `seed`) and add
their stage sections; `DemoConfig` holds both stages under ``sft`` and ``rl``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from vlrl import safe_yaml
from vlrl.numerics import Numerics


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the field."""



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

# numpy's legacy seeding (np.random.seed, used by seed_everything) takes 0 ≤ seed < 2**32; torch and random take
# more, so numpy's range is the one every seed field is held to.
SEED_MAX = 2**32


class Section(BaseModel):
    # allow_inf_nan=False: every float field, also inside lists, tuples and dicts (optim.betas, optim.module_lr),
    # refuses nan and ±inf at load ("Input should be a finite number", naming the field) — a non-finite learning
    # rate, temperature or coefficient would otherwise train on NaN and export NaN weights.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


# ----------------------------------------------------------------------------------------------- run sections
class LoraConfig(Section):
    """LoRA adapters through peft (the ``vlrl[peft]`` extra): the base weights stay frozen, only the adapters (and
    ``modules_to_save``) train. QLoRA (``load_in_4bit``) needs bitsandbytes on a CUDA GPU: refused on CPU."""

    r: int = Field(16, ge=1, description="LoRA rank r of every adapter (ΔW = B·A, A: r × in, B: out × r; Hu et al. 2021).")
    alpha: float = Field(32.0, gt=0, description="LoRA α: the update is scaled by α / r (common: 2·r).")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapters' input (peft lora_dropout); 0 keeps "
                           "the forward deterministic.")
    target_modules: list[str] | str = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        description="Modules that get adapters: names (peft matches the end of a module's name), a regex string, or "
        "'all-linear'. The default is the language model's attention and MLP projections (Qwen2-VL's vision blocks "
        "name theirs qkv / proj / fc1 / fc2, so they stay frozen).",
    )
    modules_to_save: list[str] = Field(
        default_factory=list, description="Modules trained in full beside the adapters and saved with them, e.g. "
        "[merger] for Qwen2-VL's projector, or [lm_head].",
    )
    load_in_4bit: bool = Field(
        False, description="QLoRA: a 4-bit NF4 base through bitsandbytes. Needs a CUDA GPU with bitsandbytes "
        "installed; refused on CPU (bitsandbytes does not run on this project's CPU machines, so this path is untested).",
    )


class ModelConfig(Section):
    path: str = Field(
        "tiny-qwen2-vl",
        description="Policy to start from: a tiny preset (tiny-qwen2-vl, tiny-qwen2-vl-20m, tiny-qwen2.5-vl, "
        "tiny-qwen2), a local directory in the transformers layout, or a hub id. A relative directory in a config "
        "file is found beside that file (or in the current directory); one given on the command line, in the "
        "current directory.",
        json_schema_extra={"path": "model"},
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Parameter dtype. bfloat16: weights, gradients and AdamW moments are all bf16 (pure bf16, "
        "half the memory of fp32; log-softmax and the losses are computed in fp32); with model.lora the adapters and "
        "their AdamW moments stay fp32. For fp32 master weights with bf16 compute keep float32 and set "
        "dist.mixed_precision=bf16. float32 on CPU.",
    )
    device: str = Field("cpu", description="Torch device for the policy, e.g. 'cpu' or 'cuda'.")
    init_seed: int = Field(0, ge=0, lt=SEED_MAX, description="Seed of the random initialisation of a tiny preset.")
    min_pixels: int | None = Field(
        None, ge=1, description="Native-resolution lower bound: images with fewer pixels are upscaled (set on the "
        "image processor; Qwen2-VL default 56·56). Unset: the processor's own setting.",
    )
    max_pixels: int | None = Field(
        None, ge=1, description="Native-resolution upper bound: larger images are downscaled to at most this many "
        "pixels, keeping the aspect ratio (LLaVA-OV-1.5 evaluation: 3,240,000). Unset: the processor's own setting.",
    )
    lora: LoraConfig | None = Field(
        None, description="Train LoRA adapters instead of all weights (peft; `pip install vlrl[peft]`): the KL reference "
        "is the base with adapters disabled (no second copy), the final export is the merged model plus adapter/. "
        "Unset: full fine-tuning. See configs/shapes_lora_grpo.yaml.",
    )
    attn_implementation: str | None = Field(
        None, description="transformers' attention implementation of the policy: eager, sdpa, flash_attention_2 (a CUDA "
        "GPU with flash-attn installed), flash_attention_3, flex_attention. Unset: transformers' default (sdpa where the "
        "family supports it). The run's log states the one in use.",
    )
    revision: str | None = Field(
        None, description="Hub revision (branch, tag or commit) of model.path's config, weights, tokenizer and "
        "processor files. Unset: the default branch.",
    )
    trust_remote_code: bool = Field(
        False, description="Run the modelling code a checkpoint ships (config.json auto_map, for a model type "
        "transformers does not know). Off: such a checkpoint is refused, naming this field. Read the code first.",
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Extra variables of every chat-template rendering (prompts, multi-turn "
        "observations, the preflight's token counts), e.g. {enable_thinking: false} for Qwen3 / Qwen3.5 templates "
        "that think by default (verl's data.apply_chat_template_kwargs).",
    )

    @model_validator(mode="after")
    def _check_pixels(self) -> ModelConfig:
        if self.min_pixels is not None and self.max_pixels is not None and self.min_pixels > self.max_pixels:
            raise ValueError(f"model.min_pixels ({self.min_pixels}) exceeds model.max_pixels ({self.max_pixels})")
        if self.lora is not None and self.lora.load_in_4bit and not self.device.startswith("cuda"):
            raise ValueError(f"model.lora.load_in_4bit: QLoRA needs bitsandbytes on a CUDA GPU, and model.device is "
                             f"{self.device!r}; bitsandbytes does not run on CPU. Use LoRA without load_in_4bit here")
        return self


class DataConfig(Section):
    train: str | None = Field(
        None, description="Training samples: a .jsonl / .json / .parquet / .arrow file, a directory of them, a glob "
        "(data/*.parquet), a `save_to_disk` folder, or a hub id (hiyouga/geometry3k; PATH@split picks a split, as "
        "EasyR1's data.train_files). Local paths in a config file are read from that file's directory; on the "
        "command line, from the current directory. In vlrl's layout or another one (`format`). "
        "Unset: generate `n_train` samples of the procedural `suite`.",
        json_schema_extra={"path": "data"},
    )
    test: str | None = Field(
        None, description="Held-out samples (same sources, layouts and path rules; `test_split` is its split). Unset "
        "with `train` set: a seeded `test_fraction` of `train` is held out (never the procedural suite). Unset with "
        "`train` unset: generate `n_test` samples of `suite`.",
        json_schema_extra={"path": "data"},
    )
    format: Literal["auto", "vlrl", "easyr1", "verl", "trl"] = Field(
        "auto", description="Layout of the data's rows: vlrl (README \"Data format\"); easyr1 (problem with <image> "
        "markers, answer, images); verl (examples/data_preprocess: prompt chat list, images, data_source, "
        "reward_model.ground_truth, extra_info); trl (prompt or problem, image or images, solution); auto: detected "
        "from the columns, and the log and `vlrl check` say which.",
    )
    columns: dict[str, str] = Field(
        default_factory=dict, description="Rename the layout's columns: vlrl field (id, task, prompt, images, answer, "
        "response, reward) → your column, e.g. {prompt: question, images: image, answer: label, task: source}. A "
        "dotted name reads inside a struct column (reward_model.ground_truth).",
    )
    prompt_template: str | None = Field(
        None, description="Jinja template of the prompt text (EasyR1's data.format_prompt): rendered with `content` = "
        "the prompt (image markers <image> kept in place) and every column by name; inline text or a .jinja file "
        "(found beside the config file). E.g. '{{ content | trim }} Put the final answer in \\boxed{}.'",
        json_schema_extra={"path": "model"},
    )
    system_prompt: str | None = Field(
        None, description="A system message put first in every prompt that has none (TRL's SYSTEM_PROMPT).")
    reward: str | dict[str, float] | None = Field(
        None, description="The verifier of rows that name none (a registered name, 'pkg.mod:fn', or weights of "
        "several: {math: 0.9, format: 0.1}). A row's own `reward` wins; unset: data.reward_by_source, then the "
        "layout's default (easyr1 and trl: math; verl: by data_source).",
    )
    reward_by_source: dict[str, str | dict[str, float]] = Field(
        default_factory=dict, description="Verifier by the row's task — verl's data_source — (verl's "
        "default_compute_score dispatch), before `reward`, e.g. {hiyouga/geometry3k: math, my/ocr-set: ocr}.",
    )
    split: str = Field("train", description="Split of `train` when it is a hub id or a `save_to_disk` DatasetDict.")
    test_split: str = Field("test", description="Split of `test` when it is a hub id or a `save_to_disk` DatasetDict.")
    subset: str | None = Field(None, description="Configuration (subset) of a hub dataset (load_dataset's `name`).")
    revision: str | None = Field(None, description="Git revision (branch, tag, commit) of a hub dataset.")
    test_fraction: float = Field(
        0.1, ge=0, lt=1, description="With `train` set and `test` unset: the share of `train` held out for evaluation "
        "(seeded by `seed`, chosen by sample id, so `vlrl sft` and `vlrl rl` on the same file hold out the same "
        "samples), at least 1 and at most `n_test` samples; the rest is trained on. 0: refuse to run without `test`.",
    )
    suite: str = Field("shapes", description="Procedural task suite used when train/test are unset: shapes, arith or embodied.")
    tasks: list[str] = Field(
        default_factory=lambda: ["count", "color"],
        description="Sub-tasks of the suite (shapes: count, color, locate, ocr, video_count; arith: add, sub, mul, two_step; embodied: pick_place, clean, cool, heat, pick_two).",
    )
    suite_options: dict[str, Any] = Field(
        default_factory=dict, description="Extra options of the suite generator, e.g. {template: think, max_shapes: 4}."
    )
    n_train: int = Field(2000, ge=1, description="Number of procedural training samples.")
    n_test: int = Field(
        200, ge=1, description="Number of procedural held-out samples; also the most samples held out of `train` "
        "(see `test_fraction`).",
    )
    seed: int = Field(
        0, ge=0, lt=SEED_MAX, description="Seed of the procedural data (train and test use separate streams) and of the held-out split of `train`."
    )
    on_error: Literal["raise", "skip"] = Field(
        "raise", description="Bad records in data files: 'raise' stops with file:line; 'skip' skips and counts them."
    )
    video_fps: float = Field(
        2.0, gt=0, description="Videos are fed as sampled frames (each an image part; native video tokens are not "
        "used: transformers' video processors need torchvision): a video file gives one frame every 1/video_fps "
        "seconds (Qwen2.5-VL/Qwen3-VL sample at 2 fps). A list of frames is taken as already sampled.",
    )
    max_frames: int = Field(
        8, ge=1, description="Most frames per video: a longer clip gives max_frames frames spread evenly over its "
        "whole duration (a list of frames is thinned evenly). Each frame costs one image's tokens.",
    )
    max_images: int | None = Field(
        32, ge=1, description="Most images per sample, video frames included; a sample with more is a bad record "
        "(data.on_error: raise names its file:line, skip counts it). With model.max_pixels bounding each image's "
        "tokens, this bounds a sample's vision tokens. None: no limit.",
    )
    max_image_pixels: int | None = Field(
        None, ge=1, description="Most pixels of one image or frame as stored (width×height from its header, before "
        "any decoding or resizing); a bigger one makes its sample a bad record. None: no limit (Pillow's own "
        "decompression-bomb check still applies).",
    )
    max_sample_pixels: int | None = Field(
        None, ge=1, description="Most pixels of all a sample's images and frames together, as stored; a sample "
        "over it is a bad record. None: no limit.",
    )
    max_record_bytes: int = Field(
        64 << 20, ge=1, description="Most bytes of one record of a data file (a jsonl line, a parquet row; images "
        "sent inline as data URLs count), checked while the file is read — a longer line is skipped through, never "
        "held — so it is a bad record (data.on_error) before it takes memory. Parquet row groups are read one at a "
        "time.",
    )
    packing_plan: str | None = Field(
        None, description="SFT: a packing plan written by `vlrl data pack` for `train` (.npz + .json sidecar). "
        "Training then reads packed sequences from the plan (no packing at run time) and train.batch_size / "
        "train.micro_batch_size count packed sequences instead of samples.",
        json_schema_extra={"path": "file"},
    )


class EvalConfig(Section):
    samples: int = Field(4, ge=1, description="Samples per prompt for sampled accuracy (pass@1) and pass@k.")
    temperature: float = Field(1.0, ge=0, description="Temperature of the sampled evaluation (the training temperature).")
    top_k: int = Field(0, ge=0, description="Top-k of the sampled evaluation; 0 disables (the full vocabulary, as "
                       "rollout.top_k). Set it to the training rollout's top_k to evaluate the distribution RL sampled.")
    max_new_tokens: int = Field(16, ge=1, description="Generation budget per evaluation response.")
    max_batch_size: int = Field(256, ge=1, description="Sequences generated at once during evaluation.")
    every: int = Field(
        0, ge=0, description="Validate during training: evaluate the held-out prompts every N steps of each SFT / RL "
        "stage (verl trainer.test_freq, EasyR1 trainer.val_freq, TRL eval_steps), logged as val/<stage> in "
        "metrics.jsonl, the report's curves and the trackers, with the initial (RL) and final evaluations at its ends. "
        "0: evaluate only before (RL) and after training. Not with rollout.mode=async or in `vlrl demo`.",
    )
    samples_table: int = Field(
        0, ge=0, description="With `every`: this many held-out prompts per validation, with their greedy responses, "
        "answers and rewards, as a table in the trackers (TensorBoard text, W&B table; verl's "
        "trainer.log_val_generations). 0: none (samples.jsonl holds responses either way).",
    )


_Beta = Annotated[float, Field(ge=0, lt=1)]  # an AdamW beta: β = 1 never forgets, β > 1 diverges
_NonNegative = Annotated[float, Field(ge=0)]


class OptimConfig(Section):
    lr: float = Field(1e-3, gt=0, description="AdamW learning rate (peak). LLaVA-OV-1.5 RL: 2e-6 for 8B; tiny presets: ~1e-3 SFT, ~5e-4 RL.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay (LLaVA-OV-1.5 RL: 0.01).")
    betas: tuple[_Beta, _Beta] = Field(
        (0.9, 0.999), description="AdamW betas (β1, β2), each in [0, 1): the decay rates of the moment estimates.")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    grad_clip: float = Field(1.0, ge=0, description="Max global gradient norm; 0 disables clipping.")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up steps, then the `schedule`.")
    schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="Learning rate after the warm-up: constant, or decayed over the stage's remaining "
        "`train.steps` to `min_lr_ratio` × lr, linearly or along a half cosine (TRL's / verl's lr_scheduler_type).",
    )
    min_lr_ratio: float = Field(
        0.0, ge=0.0, le=1.0, description="Where a linear or cosine schedule ends, as a fraction of `lr` (verl's min_lr_ratio).")
    module_lr: dict[str, _NonNegative] = Field(
        default_factory=dict, description="Per-module learning rates: module group of the model family (Qwen2-VL: "
        "projector, vision, llm) or parameter-name prefix → lr; parameters not matched use `lr`. The most specific "
        "match wins. E.g. {vision: 2e-6, projector: 1e-5, llm: 1e-5}.",
    )


# ----------------------------------------------------------------------------------------------- SFT stage
def _gradient_checkpointing_field():
    """`train.gradient_checkpointing`, the same field in the SFT and the RL train sections."""
    return Field(
        "auto", description="Recompute each decoder and vision block's activations in backward instead of keeping them "
        "(transformers' activation checkpointing, non-reentrant): activation memory of about one block per layer for "
        "one more forward. auto: on for models of 100M parameters or more, off for the tiny presets.",
    )


def _trainable_field():
    """`train.trainable`, the same field in the SFT and the RL train sections."""
    return Field(
        default_factory=lambda: ["all"], description="Parameters trained in this stage: 'all', or module groups of the "
        "model family (Qwen2-VL: projector, vision, llm) and/or parameter-name prefixes; the rest is frozen (no "
        "gradient, no AdamW moments, bit-identical after training). E.g. [llm] freezes the vision tower and projector; "
        "LLaVA-OV-1.5 stage 1 (align): [projector].",
    )


class SFTTrainConfig(Section):
    steps: int = Field(500, ge=0, description="Optimizer steps (the run may stop earlier at `max_seconds`).")
    batch_size: int = Field(32, ge=1, description="Samples per optimizer step.")
    micro_batch_size: int = Field(32, ge=1, description="Samples per forward/backward; gradients accumulate to batch_size.")
    max_samples: int | None = Field(None, ge=1, description="Train on only the first N training samples (a small labelled set).")
    max_seconds: float | None = Field(None, gt=0, description="Wall-clock budget of the stage; stops after the step that crosses it.")
    log_every: int = Field(10, ge=1, description="Log metrics every N steps.")
    on_nonfinite: Literal["stop", "skip"] = Field(
        "stop", description="A NaN or infinite loss or gradient norm at a step, found before the optimizer applies it: "
        "'stop' ends the run there with an error naming the step and which value; 'skip' drops that step's update "
        "(weights and optimizer untouched) and counts it in train/nonfinite_skipped.",
    )
    padding_free: bool = Field(
        False, description="Without a packing plan: pack each micro-batch's samples into rows at run time (no padding "
        "between samples, per-sample position ids). With data.packing_plan this is always on.",
    )
    gradient_checkpointing: bool | Literal["auto"] = _gradient_checkpointing_field()
    trainable: list[str] = _trainable_field()


class SFTStage(Section):
    optim: OptimConfig = Field(default_factory=OptimConfig, description="Optimizer of the SFT stage.")
    train: SFTTrainConfig = Field(default_factory=SFTTrainConfig, description="Loop settings of the SFT stage.")


# ----------------------------------------------------------------------------------------------- RL stage
class RolloutConfig(Section):
    n: int = Field(8, ge=1, description="Responses sampled per prompt (the GRPO group size; LLaVA-OV-1.5: 16).")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature (LLaVA-OV-1.5: 1.0).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling threshold; 1 disables.")
    top_k: int = Field(0, ge=0, description="Top-k sampling; 0 disables (the full vocabulary, as verl, TRL, SGLang "
                       "and vLLM). The shipped configs set 50: what they were tuned with (transformers' `generate` "
                       "default, which the in-process engine applied silently before it sampled with its own loop).")
    max_new_tokens: int = Field(16, ge=1, description="Response budget; longer responses are TRUNCATED.")
    stop: list[str] = Field(default_factory=list, description="Extra stop strings besides EOS.")
    max_batch_size: int = Field(256, ge=1, description="Sequences generated at once by the in-process engine.")
    compile: bool = Field(
        False, description="In-process engine (rollout.mode=sync, no servers): decode against a static KV cache with one "
        "decode step compiled by torch.compile (CUDA graphs on GPUs, mode reduce-overhead; inductor on CPU) instead of "
        "the eager per-token loop. Same greedy ids and log-probs; the first batch of each shape pays the compile "
        "(seconds on a GPU, ~a minute for a tiny model on 2 CPU cores). Layers other than full attention and FSDP2 "
        "shards decode eagerly.",
    )
    # multi-turn agents (vlrl.rollout.agent): README "Multi-turn agents"
    function: str = Field(
        "single_turn", description="Rollout function: single_turn (= engine.generate), multi_turn (the batched agent "
        "loop over rollout.env), per_sample (rollout.generate per sample), or 'pkg.mod:fn' with the same signature.",
    )
    generate: str = Field(
        "agent", description="Per-sample generate used by rollout.function=per_sample: agent (one episode of the "
        "agent loop) or 'pkg.mod:fn' — slime's second plug-in level.",
    )
    function_options: dict[str, Any] = Field(
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

    mode: Literal["sync", "async"] = Field(
        "sync", description="sync: generate a batch, then train on it (on-policy). async: rollout workers generate "
        "continuously into a buffer while the trainer trains (AReaL-style decoupled PPO; see the `staleness` section)."
    )
    servers: list[str] = Field(
        default_factory=list, description="Rollout server base URLs (`vlrl serve` or SGLang, e.g. "
        "http://127.0.0.1:30000). Empty: generate in this process (async mode uses a private copy of the policy)."
    )
    api_key_env: str = Field(
        "VLRL_API_KEY", description="Environment variable holding the servers' bearer token (never put the key itself in a config)."
    )
    max_concurrent_rollouts: int | None = Field(
        None, ge=1, description="Async mode: prompts (each with n samples) in flight at once. Unset: 2 × train.prompts_per_step."
    )
    on_weight_update: Literal["finish", "abort", "retract", "in_place"] = Field(
        "finish", description="Requests in flight during a weight update (async mode; servers are sent SGLang's "
        "/pause_generation with this mode before each update and /continue_generation after, and this client holds "
        "new requests meanwhile): 'finish' them on the old weights, tagged with the old version (a disk update waits "
        "for them; a distributed one first lets them end, then pauses); 'abort' them and re-queue their prompts; "
        "'retract' them (SGLang: re-queued inside the server and continued on the new weights after the update — "
        "their tokens span two versions and the answer is tagged with the older; vlrl serve decodes them again from "
        "the prompt on the new weights); 'in_place' (SGLang: held with their KV cache and continued on the new "
        "weights, the prefix cache not flushed — prompts cached before the update are reused; vlrl serve finishes "
        "them on the old weights). README \"Rollout servers\"."
    )
    prompt_check: Literal["error", "warn", "off"] = Field(
        "error", description="Rollout servers: compare each answer's meta_info.prompt_tokens with the prompt the "
        "trainer scores; a mismatch (SGLang re-processed the images with other pixel bounds, or a context did not "
        "survive decode → encode) is an error naming the sample and both counts, a logged warning, or not checked."
    )
    weight_update_timeout: float = Field(
        600.0, gt=0, description="Rollout servers: seconds each weight call (/update_weights_from_disk, "
        "/pause_generation, /continue_generation, /destroy_weights_update_group) may take before its server counts "
        "as failed — apart from request_timeout, so a long load is never taken for a stalled generation."
    )
    admin_api_key_env: str = Field(
        "VLRL_ADMIN_API_KEY", description="Environment variable holding the servers' admin key (SGLang's / vlrl "
        "serve's --admin-api-key), sent on the weight and pause calls; unset: they carry the api_key_env key."
    )
    request_timeout: float = Field(300.0, gt=0, description="Seconds a server may take for one /generate before it counts as stalled.")
    max_retries: int = Field(3, ge=0, description="Times a failed request is retried on another server before the run stops.")
    max_server_failures: int = Field(
        2, ge=1, description="Consecutive failures (errors or timeouts) after which a server is dropped from the pool."
    )
    weights_dir: str | None = Field(
        None, description="Where weights are saved for the servers to load (must be visible to them). Unset: <out>/rollout_weights."
    )
    weight_sync: Literal["disk", "distributed"] = Field(
        "disk", description="How the servers get each weight version: 'disk' (save_pretrained under weights_dir, then "
        "SGLang's /update_weights_from_disk; works with any server pool) or 'distributed' (SGLang's "
        "/init_weights_update_group + /update_weights_from_distributed: the servers join a process group hosted by "
        "the trainer, which broadcasts the weights bucket by bucket — gloo on CPU, NCCL on GPUs; no disk; falls back "
        "to disk for an update when a server dies mid-broadcast). README \"Scaling out\"."
    )
    weight_sync_address: str = Field(
        "127.0.0.1", description="weight_sync=distributed: the trainer's address as the servers reach it (its rendezvous "
        "store listens there); set the trainer node's IP when servers run on other machines."
    )
    weight_sync_port: int = Field(
        0, ge=0, le=65535, description="weight_sync=distributed: the rendezvous port on weight_sync_address; 0 = a free port."
    )
    weight_sync_bucket_mb: float = Field(
        256.0, gt=0, description="weight_sync=distributed: megabytes of parameters per broadcast bucket (one HTTP call "
        "per bucket; an FSDP2 trainer gathers one bucket of full tensors at a time)."
    )
    weight_sync_timeout: float = Field(
        120.0, gt=0, description="weight_sync=distributed: seconds the trainer waits for the servers to join a group, "
        "for a bucket's broadcast and for its answers; past it (or as soon as a server's call fails) the group is "
        "closed, that update goes by disk to the servers left and the next one forms a new group."
    )

    @model_validator(mode="after")
    def _check_agent(self) -> RolloutConfig:
        if self.function in ("multi_turn", "per_sample") and self.env is None:
            raise ValueError(f"rollout.env must name an environment when rollout.function={self.function!r}")
        if self.env is not None and self.function == "single_turn":
            raise ValueError("rollout.env is set but rollout.function=single_turn would ignore it; use multi_turn")
        if self.weight_sync == "distributed" and not self.servers:
            raise ValueError("rollout.weight_sync=distributed sends weights to rollout servers: set rollout.servers "
                             "(in-process engines share the trainer's weights)")
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


class ShapingSpec(Section):
    name: str = Field(description="A registered reward/advantage shaper (see README) or 'pkg.mod:fn'.")
    options: dict[str, Any] = Field(
        default_factory=dict, description="Keyword options of the shaper, e.g. {scale: 10.0, bias: -0.5} for reward_scale."
    )


class RolloutCorrectionConfig(Section):
    """Rollout–trainer mismatch correction (`vlrl.algos.rollout_correction`; README "Rollout correction").

    ρ_t = π_old(y_t) / π_sampler(y_t), with π_old the trainer's own recomputation before the update (forced on
    when this is on) and π_sampler the log-probs recorded at sampling. The async recipe's behaviour weight
    π_prox / π_behave is this same ratio: TIS together with it is refused (it would count ρ twice)."""

    tis_cap: float | None = Field(
        None, gt=1, description="Truncated importance sampling (Yao et al. 2025): multiply each token's loss by "
        "min(ρ, C) with C = tis_cap (their C = 2). Unset: no TIS. Refused together with the behaviour weight "
        "(rollout.mode=async with staleness.apply_behaviour_weight, or policy_loss=decoupled).",
    )
    tis_level: Literal["token", "sequence"] = Field(
        "token", description="TIS ratio per token (ρ_t) or per response (Π_t ρ_t on every token of it)."
    )
    mis_cap: float | None = Field(
        None, gt=1, description="Masked importance sampling: drop from the loss and its normaliser the tokens (or "
        "responses, see mis_level) whose ratio leaves [1/C, C], C = mis_cap (verl: 2). Unset: no masking.",
    )
    mis_level: Literal["token", "sequence", "geometric"] = Field(
        "token", description="MIS ratio: per token, per response (Π_t ρ_t), or the response's geometric mean "
        "(Π_t ρ_t)^(1/|y|), length-invariant (verl Geo-RS)."
    )

    @property
    def enabled(self) -> bool:
        return self.tis_cap is not None or self.mis_cap is not None


class AlgoConfig(Section):
    advantage: str = Field("grpo", description="Advantage estimator: a registered name (see README) or 'pkg.mod:fn'.")
    advantage_options: dict[str, Any] = Field(
        default_factory=dict, description="Keyword options of the estimator, e.g. {norm_by_std: false} for grpo."
    )
    policy_loss: str = Field("ppo_clip", description="Policy loss: a registered name (see README) or 'pkg.mod:fn'.")
    clip_low: float = Field(0.2, ge=0, description="PPO ε_low: ratio floor 1 − ε_low (LLaVA-OV-1.5 and DAPO: 0.2).")
    clip_high: float = Field(0.28, ge=0, description="PPO ε_high: ratio ceiling 1 + ε_high; DAPO clip-higher 0.28.")
    loss_agg: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"] = Field(
        "token_mean", description="Loss aggregation: token_mean (DAPO eq. 12), seq_mean_token_mean (GRPO), "
        "seq_mean_token_sum (Dr.GRPO), seq_mean_token_sum_norm (Dr.GRPO's code: Σ tokens / (N_seqs · L), L = "
        "loss_agg_max_length). Use seq_mean_token_mean with gspo / gmpo (their per-sequence loss, 1/G Σ_i L_i).",
    )
    loss_agg_max_length: int | None = Field(
        None, ge=1, description="The constant L of loss_agg=seq_mean_token_sum_norm (Dr.GRPO divides by the generation "
        "budget). Unset: rollout.max_new_tokens × rollout.max_turns. Ignored by the other aggregations.",
    )
    rollout_correction: RolloutCorrectionConfig = Field(
        default_factory=RolloutCorrectionConfig, description="Importance correction of the mismatch between "
        "the sampler's log-probs and the trainer's (TIS / MIS; Yao et al. 2025). Off by default.",
    )
    kl_coef: float = Field(0.0, ge=0, description="Weight of the KL-to-reference loss term; 0 removes the reference model (LLaVA-OV-1.5: 0).")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3", description="KL estimator of the KL term (k3: low variance, ≥ 0).")
    policy_loss_options: dict[str, Any] = Field(
        default_factory=dict, description="Extra keyword options of the policy loss, e.g. {clip_ratio_c: 3.0} for "
        "dual_clip or {fraction: 2e-3} for kl_cov (decoupled's cap and mode come from staleness.*).",
    )
    kl_mode: Literal["loss", "reward"] = Field(
        "loss", description="Where the KL to the reference goes when kl_coef > 0: 'loss' adds β · KL to the loss "
        "(GRPO eq. 5); 'reward' subtracts β · KL(π_old ‖ π_ref) from each token's reward before the estimator "
        "(InstructGPT / REINFORCE++; verl use_kl_in_reward).",
    )
    mask_truncated: bool = Field(
        False, description="DAPO overlong filtering: truncated responses get no loss (they still count in their "
        "group's reward statistics).",
    )
    dynamic_sampling: DynamicSamplingConfig = Field(
        default_factory=DynamicSamplingConfig, description="DAPO dynamic sampling: drop zero-advantage groups, back-fill."
    )
    reward_shaping: list[ShapingSpec] = Field(
        default_factory=list, description="Reward shapers applied in order to the scalar rewards before the advantage "
        "estimator (vlrl.algos.shaping), e.g. [{name: reward_scale, options: {scale: 10, bias: -0.5}}].",
    )
    advantage_shaping: list[ShapingSpec] = Field(
        default_factory=list, description="Advantage shapers applied in order to the (B, T) token advantages after the "
        "estimator (vlrl.algos.shaping), e.g. step-level credit of embodied plans.",
    )


class CriticConfig(Section):
    lr: float = Field(1e-3, gt=0, description="AdamW learning rate of the critic (value model), used when the "
                      "estimator needs values (gae). PPO practice: a few times the policy's.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay of the critic.")
    grad_clip: float = Field(1.0, ge=0, description="Max gradient norm of the critic; 0 disables clipping.")
    value_clip: float = Field(
        0.2, gt=0, description="ε_v of the clipped value loss ½·max((V − R)², (V_old + clip(V − V_old, ±ε_v) − R)²)."
    )


class SynthConfig(Section):
    """Syn-GRPO online data synthesis (`vlrl.synth`; README "Data synthesis (Syn-GRPO)")."""

    enabled: bool = Field(
        False, description="Syn-GRPO: the output template with a predicted diversity and a new image description, and "
        "synthesis of new training images from the selected descriptions. The diversity reward is the reward shaper "
        "syn_diversity (algo.reward_shaping: [{name: syn_diversity}]); without it descriptions are picked unranked."
    )
    synthesize: bool = Field(
        True, description="Send descriptions to the synthesis server. False keeps only the template (and the diversity "
        "reward if configured): without syn_diversity it is plain GRPO on the Syn-GRPO template, diversity still logged."
    )
    template: Literal["think", "short", "none"] = Field(
        "think", description="Rewrite the prompts to the Syn-GRPO output template and add syn_format to the reward: think "
        "(<think>, <diversity>, <description>, <answer>: the seed's), short (without <think>), none (the data already asks for it)."
    )
    format_weight: float = Field(1.0, ge=0, description="Weight of syn_format (R_format) added to each sample's reward by `template`.")
    server: str | None = Field(
        None, description="URL of a running `vlrl synth serve`. Unset: the recipe starts a synthesis server in this "
        "process group (loopback, random token) with the backend / workers settings below."
    )
    api_key_env: str = Field("VLRL_API_KEY", description="Environment variable holding the synthesis server's bearer token.")
    mode: Literal["async", "sync"] = Field(
        "async", description="async: submit and go on, swap results in when they arrive (no step waits). sync: wait for "
        "the step's jobs before the next step (the seed's slow baseline, Table 5)."
    )
    backend: str = Field("classical", description="Back-end of a server started by the recipe: classical, diffusers or 'pkg.mod:factory'.")
    backend_options: dict[str, Any] = Field(
        default_factory=dict, description="Keyword options of that back-end, e.g. {model_path: /models/sd-inpaint, steps: 25}."
    )
    segmenter: str | None = Field(None, description="Box → mask refinement of a server started by the recipe: border, model, or unset.")
    segmenter_options: dict[str, Any] = Field(default_factory=dict, description="Keyword options of the segmenter, e.g. {path: /models/seg}.")
    workers: int = Field(1, ge=1, description="Worker processes of a server started by the recipe.")
    replacement: Literal["replace", "append"] = Field(
        "replace", description="replace: a synthesised sample takes its source's place in the dataset (the seed's policy; "
        "the next synthesis starts from it); append: it is added as a new sample (seen from the next epoch on)."
    )
    max_generations: int = Field(5, ge=1, description="Synthesised generations per original sample at most.")
    preserve: Literal["auto", "objects", "answer"] = Field(
        "auto", description="Foreground kept pixel-exact: the boxes of metadata.objects (every labelled object: count, colour "
        "and locate labels stay valid), the answer's box(es), or auto (objects if present, else the answer)."
    )
    preserve_margin: int = Field(1, ge=0, description="Pixels added around every preserved box (anti-aliased edges).")
    max_in_flight: int = Field(8, ge=1, description="Jobs on the server at once; more wait in the trainer's local queue.")
    max_pending: int = Field(64, ge=1, description="Requests waiting in the trainer's local queue; more are dropped (counted).")
    deadline: float = Field(120.0, gt=0, description="Seconds after which an unfinished job is abandoned (counted as failed).")
    poll_interval: float = Field(0.5, gt=0, description="Seconds between two polls of the jobs in flight.")
    gallery: int = Field(16, ge=0, description="Original → synthesised pairs written to synth_gallery.jsonl for the report.")


class RLTrainConfig(Section):
    steps: int = Field(100, ge=0, description="RL steps (rollout + update); the run may stop earlier at `max_seconds`.")
    prompts_per_step: int = Field(16, ge=1, description="Prompts per RL step (LLaVA-OV-1.5: 32); each gets rollout.n responses.")
    minibatches: int = Field(1, ge=1, description="Optimizer steps per RL step per epoch (the rollout batch is split in this many).")
    ppo_epochs: int = Field(1, ge=1, description="Passes over each rollout batch.")
    micro_batch_size: int = Field(128, ge=1, description="Sequences per forward/backward; gradients accumulate to a minibatch.")
    max_samples: int | None = Field(None, ge=1, description="Draw prompts from only the first N training samples.")
    max_seconds: float | None = Field(None, gt=0, description="Wall-clock budget of the stage; stops after the step that crosses it.")
    log_every: int = Field(1, ge=1, description="Log metrics every N steps.")
    on_nonfinite: Literal["stop", "skip"] = Field(
        "stop", description="A NaN or infinite loss or gradient norm at a step, found before the optimizer applies it: "
        "'stop' ends the run there with an error naming the step and which value; 'skip' drops that step's update "
        "(weights and optimizer untouched) and counts it in train/nonfinite_skipped.",
    )
    padding_free: bool = Field(
        False, description="Teacher-forced passes (update, π_old, π_ref) pack each micro-batch's sequences into rows "
        "with per-sequence position ids instead of padding them (same values, fewer tokens; vlrl.models.packed).",
    )
    shared_prefix: bool = Field(
        True, description="Teacher-forced passes (π_old, π_ref, the update's forward) run each distinct prompt of a "
        "micro-batch once, vision tower included, and score its group's n responses against it: the update in one "
        "forward with the responses beside their prompt (also under DDP/FSDP2 and gradient checkpointing), π_old / "
        "π_ref against its keys/values copied to their rows (same log-probs, loss and gradients; "
        "vlrl.train.shared_prefix; logged as perf/shared_prefix_frac). Wherever that is exact; elsewhere the plain "
        "pass, said once in the log (a response holding images, a cache that cannot be expanded; for the update "
        "recurrent layers, token-type attention masks (Gemma 3), dropout). false: always the plain pass.",
    )
    logprob_chunk: int | Literal["auto"] = Field(
        "auto", description="Teacher-forced passes (update, π_old, π_ref) run the LM head and the fp32 log-softmax / "
        "entropy over this many tokens at a time, each chunk recomputed in the backward, instead of holding the full "
        "fp32 [tokens, vocab] logits (same values; vlrl.models.logprobs). auto: chunks of ⌊2^26 / vocab⌋ tokens once "
        "a pass's logits would exceed 2^26 values (256 MiB; 441 tokens at a 151,936-token vocabulary); 0: never "
        "(the full logits). SFT always uses auto.",
    )
    skip_zero_advantage: bool = Field(
        False, description="Leave sequences whose advantages are all 0 out of the update's forward/backward (one "
        "process, no KL loss term): their loss is 0, the normaliser still counts them, so the gradient is the same "
        "and the step cheaper. policy/entropy and the clip metrics then cover the trained sequences only.",
    )
    gradient_checkpointing: bool | Literal["auto"] = _gradient_checkpointing_field()
    trainable: list[str] = _trainable_field()

    @model_validator(mode="after")
    def _check_logprob_chunk(self) -> RLTrainConfig:
        if self.logprob_chunk != "auto" and self.logprob_chunk < 0:
            raise ValueError(f"train.logprob_chunk = {self.logprob_chunk}: a number of tokens ≥ 1, 0 (never chunk) or auto")
        return self


class SelectConfig(Section):
    """Discrepancy-driven selection of the RL prompts before training (LLaVA-OV-1.5-RL; `vlrl data select`)."""

    enabled: bool = Field(
        False, description="Roll out `n` responses per training prompt with the starting policy and train only on the "
        "prompts inside the band: solved sometimes but not always (pass@1 < 1, pass@N > 0 with the default band). "
        "Groups of the dropped prompts would all score alike (zero advantage). Costs n rollouts per scored prompt.",
    )
    n: int = Field(8, ge=1, description="Rollouts per prompt (N) for pass@1, pass@k and the mean reward.")
    k: int | None = Field(None, ge=1, description="pass@k of the gap; unset: k = n (pass@N).")
    min_mean_reward: float | None = Field(
        0.1, description="Drop prompts whose mean reward is lower (never solved; with n = 8 and 0/1 rewards: 0 of 8).")
    max_mean_reward: float | None = Field(
        0.9, description="Drop prompts whose mean reward is higher (always solved; with n = 8 and 0/1 rewards: 8 of 8).")
    min_gap: float | None = Field(None, description="Keep only prompts with pass@k − pass@1 ≥ this; unset: no bound.")
    max_prompts: int | None = Field(
        None, ge=1, description="Score only the first N training prompts (the rest are not trained on); unset: all.")
    cache: str | None = Field(
        None, description="Rollout cache (jsonl, `vlrl data select --store`) reused across runs, keyed by model.path: "
        "clear it when the weights at that path change. Unset: fresh rollouts, kept in RUN_DIR/select_rollouts.jsonl.",
    )

    @model_validator(mode="after")
    def _check_k(self) -> SelectConfig:
        if self.k is not None and self.k > self.n:
            raise ValueError(f"select.k = {self.k} exceeds select.n = {self.n} (pass@k needs k ≤ n rollouts)")
        return self


class RLStage(Section):
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="How responses are sampled.")
    algo: AlgoConfig = Field(default_factory=AlgoConfig, description="Advantage, loss, clipping and KL.")
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=5e-4), description="Optimizer of the RL stage.")
    train: RLTrainConfig = Field(default_factory=RLTrainConfig, description="Loop settings of the RL stage.")
    staleness: StalenessConfig = Field(
        default_factory=StalenessConfig, description="Async mode: staleness bound and off-policy correction."
    )
    critic: CriticConfig = Field(
        default_factory=CriticConfig, description="The value model trained when algo.advantage needs values (gae / PPO)."
    )
    synth: SynthConfig = Field(default_factory=SynthConfig, description="Syn-GRPO online data synthesis (off by default).")
    select: SelectConfig = Field(
        default_factory=SelectConfig, description="pass@N-vs-pass@1 selection of the training prompts (off by default)."
    )

    @model_validator(mode="after")
    def _check_sizes(self) -> RLStage:
        total = self.train.prompts_per_step * self.rollout.n
        if total % self.train.minibatches:
            raise ValueError(
                f"train.prompts_per_step × rollout.n = {total} responses per step do not split into "
                f"train.minibatches = {self.train.minibatches} equal minibatches"
            )
        return self


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
        "then shards it. DDP needs the whole model on every rank either way.",
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
        "for their /health, pass their URLs as rollout.servers and a generated key in rollout.api_key_env, stop them "
        "when the run ends; a server that dies stops the ranks. 0: none (rollout.servers as configured). "
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
        if self.eval.every and any(stage.rollout.mode == "async" for stage in [self, *self.stages]):
            raise ValueError(f"eval.every={self.eval.every} with rollout.mode=async: the background rollout shares the "
                             "engine with the evaluation; validate with rollout.mode=sync, or set eval.every=0 (the run "
                             "still evaluates before and after training)")
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
        if self.rl.rollout.mode != "sync" or self.rl.rollout.servers:
            raise ValueError("rl.rollout.mode / rl.rollout.servers: the demo runs the synchronous in-process recipe; "
                             "use `vlrl rl` for asynchronous training or rollout servers")
        if self.control and self.control_budget == "wall" and self.sft.optim.schedule != "constant":
            raise ValueError(f"sft.optim.schedule={self.sft.optim.schedule} with control_budget=wall: the control's "
                             "step count is known only when its time runs out, so its learning rate has nothing to "
                             "decay over — use control_budget=flops or sft.optim.schedule=constant")
        return self


# ----------------------------------------------------------------------------------------------- loading
def apply_overrides(raw: dict[str, Any], overrides: list[str], *, cls: type[BaseModel] | None = None,
                    base: Path | None = None) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides (values parsed as YAML) to a nested dict, in place; a number indexes a
    list already there (``stages.0.train.steps=10``). Given the config class and a ``base`` directory, input
    paths among the values are resolved against it (`resolve_paths`)."""
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r}: expected key=value, e.g. algo.clip_high=0.28")
        parts = key.strip().split(".")
        try:
            value = safe_yaml.load(text, f"override {item!r}") if text.strip() else ""
        except safe_yaml.YamlRefused as err:  # an unclosed bracket, a tag, a billion laughs: one line
            raise ConfigError(f"override {item!r}: the value is not valid YAML ({err.reason})") from None
        if cls is not None and base is not None:  # resolve the value where it sits in a config of its own
            alone: dict[str, Any] = {}
            node = alone
            for part in parts[:-1]:
                node = node.setdefault(part, {})
            node[parts[-1]] = value
            resolve_paths(cls, alone, base)
            value = node[parts[-1]]
        node = raw
        for part in parts[:-1]:
            if isinstance(node, list):  # stages.1.train.steps: an index into a list of sections
                if not part.isdigit() or int(part) >= len(node):
                    raise ConfigError(f"override {item!r}: {part!r} is not an index of the {len(node)} item(s) there")
                child = node[int(part)]
            else:
                child = node.setdefault(part, {})
            if not isinstance(child, (dict, list)):
                raise ConfigError(f"override {item!r}: {part!r} is not a section")
            node = child
        if isinstance(node, list):
            raise ConfigError(f"override {item!r}: {parts[-1]!r} would replace one item of a list; set a field inside it")
        node[parts[-1]] = value
    return raw


def load_config(cls: type[Section], path: str | Path | None = None, overrides: list[str] | None = None, *,
                prepare: Callable[[Any], None] | None = None,
                check: Callable[[Any], list[tuple[str, str]]] | None = None) -> Any:
    """Read YAML (optional), apply dotted overrides, validate into ``cls``; ``prepare(cfg)`` runs between the
    validation and ``check(cfg)`` — (field, message) problems, each a line of the `ConfigError`: the plug-in checks
    of `vlrl.check.options.load_run_config`, which run tensor operations (the CLI pins ``numerics`` in ``prepare``).

    Input paths (the fields marked ``json_schema_extra={"path": ...}``: data files, packing plans, model
    directories) are made absolute: a relative one written in the YAML file is taken from the file's own
    directory, one given as an override (or ``--data`` / ``--test``) from the current directory. Output
    locations (``out``, ``rollout.weights_dir``) stay as written, relative to the current directory.
    """
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            raw = safe_yaml.load_file(path) or {}
        except safe_yaml.YamlRefused as err:  # bounded: aliases, depth, duplicate keys, tags (`vlrl.safe_yaml`)
            raise ConfigError(str(err)) from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections")
        resolve_paths(cls, raw, path.resolve().parent)
    apply_overrides(raw, overrides or [], cls=cls, base=Path.cwd())
    try:
        cfg = cls.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_explain(err, path)) from None
    if prepare is not None:
        prepare(cfg)
    problems = check(cfg) if check is not None else []
    if problems:
        where = f"{path}: " if path else ""
        raise ConfigError("\n".join(f"{where}config field '{field}': {message}" for field, message in problems))
    return cfg


def _sections(annotation: Any) -> list[type[BaseModel]]:
    """The config classes inside a field's annotation (``DataConfig | None``, ``list[SFTStageSpec]``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [cls for arg in get_args(annotation) for cls in _sections(arg)]


def _path_fields(cls: type[BaseModel], node: Any):
    """(dict holding the field, key, kind) of every input-path field set in the raw config dict ``node``."""
    if not isinstance(node, dict):
        return
    for name, field in cls.model_fields.items():
        if name not in node:
            continue
        extra = field.json_schema_extra
        kind = extra.get("path") if isinstance(extra, dict) else None
        if kind is not None:
            if isinstance(node[name], str):
                yield node, name, kind
            continue
        children = node[name] if isinstance(node[name], list) else [node[name]]
        if isinstance(node[name], dict) and node[name] and all(str(k).isdigit() for k in node[name]):
            children = list(node[name].values())  # an override into a list item: {"0": {...}}
        for section in _sections(field.annotation):
            for child in children:
                yield from _path_fields(section, child)


def resolve_paths(cls: type[BaseModel], raw: dict[str, Any], base: Path) -> dict[str, Any]:
    """Make the input paths of a raw config dict absolute against ``base``, in place.

    A data file or packing plan (kind ``file``) is always a path. A ``model.path`` (kind ``model``) may also
    be a preset name or a hub id (``Qwen/Qwen2-VL-2B-Instruct``), so a relative one is resolved only when it
    exists under ``base`` or is written as a path (``./…``, ``../…``); otherwise it is left as written."""
    for node, key, kind in _path_fields(cls, raw):
        value = node[key]
        if value.startswith("~"):
            node[key] = str(Path(value).expanduser())
        elif kind == "data" and value and not Path(value).is_absolute():
            node[key] = _resolve_data_path(value, base)
        elif value and not Path(value).is_absolute() and \
                (kind == "file" or (base / value).exists() or value.startswith(("./", "../"))):
            node[key] = str((base / value).resolve())
    return raw


def _resolve_data_path(value: str, base: Path) -> str:
    """A data path (kind ``data``): a local file, folder or glob is made absolute against ``base`` (an ``@split``
    suffix kept); a hub id (``org/name``, ``name``, not a path under ``base``, no file suffix) stays as written."""
    import re

    head, sep, split = value.rpartition("@")
    if not (sep and head and split and "/" not in split):
        head, sep, split = value, "", ""
    hub_like = re.fullmatch(r"[A-Za-z0-9_][\w.-]*(/[\w.-]+)?", head) is not None and \
        not head.endswith((".jsonl", ".json", ".parquet", ".arrow"))
    if hub_like and not (base / head).exists():
        return value
    return str((base / head).resolve()) + sep + split


def _explain(err: ValidationError, path: Path | None) -> str:
    where = f"{path}: " if path else ""
    lines = []
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"]) or "(top level)"
        message = "unknown field" if e["type"] == "extra_forbidden" else e["msg"]
        lines.append(f"{where}config field '{field}': {message}")
    return "\n".join(lines)


def dump_config(config: Section) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
