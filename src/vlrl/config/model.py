"""The run sections of the policy and its data: `ModelConfig` (with `LoraConfig`), `DataConfig`, `EvalConfig`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from vlrl.config.base import SEED_MAX, Section


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
    answer_format: Literal["auto", "answer", "think", "none"] = Field(
        "auto", description="The form a response must give its answer in, for rows that declare none (a jsonl row's "
        "`format`): answer (exactly one non-empty <answer>…</answer> and nothing else), think (the same after at "
        "most one leading <think>…</think>), none (any text). auto: the form the prompt asks for — answer when it "
        "asks for <answer></answer>, think when also for <think></think>, else none. Strict scoring requires it "
        "(evaluation's strict and well_formed; algo.strict_reward in RL).",
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
        16 << 20, ge=1, description="Most pixels of one image or frame as stored (width×height from its header, "
        "before any decoding or resizing); a bigger one makes its sample a bad record. The default is vlrl serve's "
        "--max-image-pixels (16,777,216: a decoded RGB image of 48 MB). None: no limit (Pillow's own "
        "decompression-bomb check still applies — a 1-bit 12000² PNG of 17.6 KB is under it).",
    )
    max_sample_pixels: int | None = Field(
        128 << 20, ge=1, description="Most pixels of all a sample's images and frames together, as stored; a sample "
        "over it is a bad record. The default is vlrl serve's --max-request-pixels (134,217,728: ~400 MB "
        "decoded). None: no limit.",
    )
    max_record_bytes: int = Field(
        64 << 20, ge=1, description="Most bytes of one record of a data file (a jsonl line, a parquet row; images "
        "sent inline as data URLs count), checked while the file is read — a longer line is skipped through, never "
        "held — so it is a bad record (data.on_error) before it takes memory. Measured once decoded: a parquet row "
        "group is measured on its column chunks (strings as their dictionary, never expanded) before it is read, "
        "and a JSON line by what its parsed value would take (~64 bytes per value beyond its text) before it is "
        "parsed; a line nested over 512 deep is a bad record too.",
    )
    max_source_bytes: int = Field(
        1 << 30, ge=1, description="Most bytes of text (every decoded value but binaries: images stay in the "
        "memory-mapped table and are decoded one at a time) one data source — a file, a save_to_disk folder, a hub "
        "split — holds once decoded; a source over it is refused as a whole, measured before its rows are read "
        "(parquet, arrow) or as they are (jsonl). A 2.6 KB parquet file decoded to 1.8 GB of text before this bound.",
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
        "0: evaluate only before (RL) and after training. With rollout.mode=async the evaluation waits for the "
        "step's weights to reach the engine and pauses the rollout's admissions meanwhile (one process). Not in "
        "`vlrl demo`.",
    )
    samples_table: int = Field(
        0, ge=0, description="With `every`: this many held-out prompts per validation, with their greedy responses, "
        "answers and rewards, as a table in the trackers (TensorBoard text, W&B table; verl's "
        "trainer.log_val_generations). 0: none (samples.jsonl holds responses either way).",
    )
