"""What the placement planner (`vlrl.launch.planner`) reads: the model's sizes (`ModelShape`, from the model built on
the ``meta`` device, no weights), one step's sizes (`Workload`, from the config and a few encoded samples) and the
devices (`Device`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vlrl.models.config_only import is_config_only

GB = 1024**3
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelShape:
    """Sizes the formulas need, read from the model built on the ``meta`` device (no weights)."""

    params: int  # Ψ
    params_vision: int  # Ψ_v
    largest_unit: int  # U: parameters of the largest FSDP unit (a block, the vision tower's rest, or the root)
    layers: int
    hidden: int  # h
    intermediate: int  # I
    kv_dim: int  # k = n_kv_heads · head_dim
    vocab: int  # V
    vision_depth: int = 0
    vision_hidden: int = 0  # h_v
    vision_intermediate: int = 0  # I_v
    patch_values: int = 0  # C = channels · temporal patch · patch²
    largest_param: int = 0  # the largest parameter tensor's size (a CPU AdamW step's temporaries)

    @property
    def params_text(self) -> int:
        return self.params - self.params_vision


@dataclass(frozen=True)
class Workload:
    """One step's sizes, from the config and a few encoded samples."""

    recipe: str  # sft | rl
    prompt_tokens: int  # P: longest encoded prompt (vision tokens included)
    response_tokens: int  # R: rollout.max_new_tokens (RL) or the longest reference response + EOS (SFT)
    patches: int  # N_p: vision patches per sequence (before the spatial merge)
    sequences: int  # sequences trained on per step (prompts_per_step · n, or batch_size)
    micro_batch: int  # m
    prompts: int = 0  # distinct prompts generated from per step (prompts_per_step; 0 = sequences: none shared)
    epochs: int = 1  # ppo_epochs
    minibatches: int = 1  # optimizer steps per epoch
    old_pass: bool = False  # a π_old scoring pass (several optimizer steps per RL step)
    reference: bool = False  # a frozen reference model (kl_coef > 0); under LoRA a pass only (adapters disabled)
    critic: bool = False  # a value model (advantage gae)
    teacher_params: int = 0  # Ψ_T: algo.distill's frozen teacher, whole on every rank (0: no teacher)
    distill_topk: int = 0  # k of algo.distill's topk estimator (0: none); its B·R·(8k + 4) bytes stay on the host
    gen_batch: int = 256  # B: rollout.engine.max_batch_size
    asynchronous: bool = False
    weight_bytes: int = 4  # b_w
    compute_bytes: int = 4  # b_c
    checkpointing: bool = False  # train.gradient_checkpointing resolved
    trained_params: int | None = None  # Ψ_t of the base weights (None: all of Ψ; 0 under LoRA)
    trained_vision: int | None = None  # of which in the vision tower (None: all of Ψ_v)
    adapter_params: int = 0  # Ψ_lora: fp32 adapter parameters (model.lora)
    shared_prefix: bool = False  # train.shared_prefix: teacher-forced passes run a group's prompt once
    cpu_offload: bool = False  # dist.cpu_offload: FSDP2 keeps the trained state (and a reference) in host memory
    logprob_chunk: int | str = "auto"  # train.logprob_chunk: tokens per chunk of the LM head and log-softmax
    max_tokens: int | None = None  # train.max_tokens_per_micro_batch: a micro-batch by cost (None: micro_batch rows)
    patch_weight: float = 0.0  # w_v: a vision patch's cost in decoder tokens (vlrl.train.microbatch.patch_weight)

    @property
    def length(self) -> int:  # L
        return self.prompt_tokens + self.response_tokens


def distill_topk(cfg) -> int:
    """k of ``algo.distill`` with ``estimator: topk`` (0: no top-k term)."""
    distill = cfg.algo.distill
    return distill.top_k if distill is not None and distill.estimator == "topk" else 0


@dataclass(frozen=True)
class Device:
    count: int
    memory_gb: float
    tflops: float = 312.0  # bf16 dense, A100
    bandwidth_gbs: float = 2039.0  # HBM, A100-80GB
    link_gbs: float = 300.0  # NVLink (use ~25 between machines)
    mfu: float = 0.4
    pcie_gbs: float = 25.0  # host ↔ device (PCIe 4.0 x16, what a copy reaches; dist.cpu_offload)
    host_gbs: float = 20.0  # host memory bandwidth one rank's CPU optimizer step gets (dist.cpu_offload)


def model_shape(model: torch.nn.Module) -> ModelShape:
    """`ModelShape` of a transformers model (call it on a model built on the meta device)."""
    from vlrl.train.distributed import fsdp_units

    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    params = sum(p.numel() for p in model.parameters())
    from vlrl.models.adapters import vision_tower

    tower = vision_tower(model)
    tower_modules = {id(m) for m in tower.modules()} if tower is not None else set()
    blocks = [u for u in fsdp_units(model) if u is not tower]
    sizes = [_count(b) for b in blocks]
    if tower is not None:  # the tower's own unit: patch embedding and merger (its blocks are units of their own)
        sizes.append(_count(tower) - sum(_count(b) for b in blocks if id(b) in tower_modules))
    top_level = sum(_count(b) for b in blocks if id(b) not in tower_modules) + (_count(tower) if tower is not None else 0)
    sizes.append(params - top_level)  # the root unit: embeddings, final norm, lm_head
    shape: dict[str, Any] = dict(
        params=params, params_vision=_count(tower) if tower is not None else 0,
        largest_unit=max(sizes), largest_param=max(p.numel() for p in model.parameters()),
        layers=text.num_hidden_layers, hidden=text.hidden_size,
        intermediate=_active_intermediate(text), kv_dim=getattr(text, "num_key_value_heads", heads) * head_dim,
        vocab=text.vocab_size,
    )
    vision = getattr(config, "vision_config", None)
    if vision is not None and tower is not None:
        width = getattr(vision, "embed_dim", None) or vision.hidden_size
        inter = getattr(vision, "intermediate_size", None) or int(width * getattr(vision, "mlp_ratio", 4))
        depth = getattr(vision, "depth", None) or vision.num_hidden_layers
        channels = getattr(vision, "in_channels", None) or getattr(vision, "num_channels", 3)
        patch = vision.patch_size[0] if isinstance(vision.patch_size, (list, tuple)) else vision.patch_size
        shape.update(vision_depth=depth, vision_hidden=width, vision_intermediate=inter,
                     patch_values=channels * getattr(vision, "temporal_patch_size", 1) * patch**2)
    return ModelShape(**shape)


def _active_intermediate(text: Any) -> int:
    """I of the formulas: the MLP width a token passes through — a dense MLP's ``intermediate_size``; for a
    mixture of experts the chosen experts' (``num_experts_per_tok · moe_intermediate_size``) plus a shared
    expert's."""
    experts = getattr(text, "num_experts_per_tok", None)
    if experts and getattr(text, "moe_intermediate_size", None):
        return experts * text.moe_intermediate_size + (getattr(text, "shared_expert_intermediate_size", 0) or 0)
    return text.intermediate_size


def _patch_size(adapter: Any) -> int:
    vision = getattr(getattr(adapter, "config", None), "vision_config", None)
    patch = getattr(vision, "patch_size", 14) or 14
    return patch[0] if isinstance(patch, (list, tuple)) else patch


def _count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def meta_model(path: str, *, init_seed: int = 0) -> tuple[torch.nn.Module, Any]:
    """(model on the meta device, adapter) of a preset, a local directory, a hub id, or a ``config.json`` alone
    (a file, or a directory without tokenizer files: the family's stand-in tokenizer and image processor,
    `vlrl.models.config_only`) — nothing is loaded."""
    from vlrl.models import PRESETS, build_preset
    from vlrl.models.config_only import stand_in_policy

    name = path.removeprefix("preset:")
    if name in PRESETS and not Path(path).exists():
        with torch.device("meta"):
            policy = build_preset(name, seed=init_seed)
        return policy.model, policy.adapter
    if is_config_only(path):
        policy = stand_in_policy(path, device="meta")
        return policy.model, policy.adapter
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    from vlrl.models.adapters import adapter_for
    from vlrl.models.policy import load_image_processor

    config = AutoConfig.from_pretrained(path)
    is_vision = hasattr(config, "vision_config")
    with torch.device("meta"):
        model = (AutoModelForImageTextToText if is_vision else AutoModelForCausalLM).from_config(config)
    processor = load_image_processor(path) if is_vision else None
    return model, adapter_for(config, AutoTokenizer.from_pretrained(path), processor, source=path, model=model)


def workload(cfg, adapter, *, samples: int = 16, model: torch.nn.Module | None = None) -> Workload:
    """Sizes of one step of ``cfg`` (an `SFTConfig` or `RLConfig`): the longest of a few encoded samples. Given
    the (meta) ``model``, also what trains and what is kept: `memory_options`."""
    w = _workload(cfg, adapter, samples=samples)
    return memory_options(cfg, model, adapter, w) if model is not None else w


def memory_options(cfg, model: torch.nn.Module, adapter, w: Workload) -> Workload:
    """``w`` with train.gradient_checkpointing (resolved for this model), train.trainable's Ψ_t and model.lora's
    Ψ_lora = Σ r·(in + out) over the targeted linear layers (counted on the meta model, nothing built)."""
    import dataclasses
    import re

    from vlrl.train.modules import ALL, assign, checkpointing_wanted

    tower = next((p for p in ("model.visual.", "model.vision_tower.", "vision_tower.") if any(
        n.startswith(p) for n, _ in model.named_parameters())), None)

    def in_tower(name: str) -> bool:
        return tower is not None and name.startswith(tower)

    options: dict[str, Any] = {"checkpointing": checkpointing_wanted(model, cfg.train.gradient_checkpointing)}
    distill = getattr(getattr(cfg, "algo", None), "distill", None)
    if distill is not None and distill.teacher is not None:  # the in-process teacher's size, from its config
        # (a teacher on servers, teacher_urls, takes no memory here)
        options["teacher_params"] = _count(meta_model(distill.teacher)[0])
    lora = cfg.model.lora
    if lora is not None:
        targets, adapters, vision = lora.target_modules, 0, 0
        for name, module in model.named_modules():
            if not isinstance(module, torch.nn.Linear):
                continue
            if isinstance(targets, str):
                hit = name != "lm_head" if targets == "all-linear" else re.fullmatch(targets, name) is not None
            else:
                hit = any(name == t or name.endswith("." + t) for t in targets)
            if hit:
                adapters += lora.r * (module.in_features + module.out_features)
                vision += lora.r * (module.in_features + module.out_features) if in_tower(name + ".") else 0
        options.update(trained_params=0, trained_vision=0 if not vision else None, adapter_params=adapters)
    elif list(cfg.train.trainable) != [ALL]:
        chosen = assign(model, cfg.train.trainable, adapter.module_groups, field="train.trainable")
        sizes = dict((n, p.numel()) for n, p in model.named_parameters())
        options.update(trained_params=sum(sizes[n] for n in chosen),
                       trained_vision=sum(sizes[n] for n in chosen if in_tower(n)))
    return dataclasses.replace(w, **options)


def _workload(cfg, adapter, *, samples: int = 16) -> Workload:
    from vlrl.config import RLConfig
    from vlrl.data import load_image, read_samples
    from vlrl.data.splits import generate_split, media_limits
    from vlrl.train.microbatch import patch_weight

    data = cfg.data
    if data.train is not None:
        picked = read_samples(data.train, on_error="skip", media=media_limits(data)).samples[:samples]
    else:
        picked = generate_split(data, "train", samples)
    prompt, patches, response = 1, 0, 1
    for sample in picked:
        encoded = adapter.encode_prompt(sample.messages, [load_image(src) for src in sample.images])
        prompt = max(prompt, len(encoded.input_ids))
        if encoded.vision is not None:
            patches = max(patches, encoded.vision.patches(_patch_size(adapter)))
        if sample.response is not None:
            response = max(response, len(adapter.encode_text(sample.response)) + 1)
    weight = DTYPE_BYTES[cfg.model.dtype]
    compute = 2 if cfg.dist.mixed_precision != "none" else weight
    config = getattr(adapter, "config", None)
    budget = {"max_tokens": cfg.train.max_tokens_per_micro_batch,
              "patch_weight": patch_weight(config) if config is not None else 0.0}
    if isinstance(cfg, RLConfig):
        rows = cfg.train.prompts_per_step * cfg.rollout.n
        return Workload(
            "rl", prompt, cfg.rollout.max_new_tokens, patches, rows, min(cfg.train.micro_batch_size, rows),
            prompts=cfg.train.prompts_per_step, epochs=cfg.train.ppo_epochs, minibatches=cfg.train.minibatches,
            old_pass=cfg.train.ppo_epochs * cfg.train.minibatches > 1 or (cfg.algo.distill is not None
                                                                       and cfg.algo.distill.estimator == "sampled"),
            reference=cfg.algo.kl_coef > 0, critic=cfg.algo.advantage == "gae", gen_batch=cfg.rollout.engine.max_batch_size,
            asynchronous=cfg.rollout.mode == "async", weight_bytes=weight, compute_bytes=compute,
            shared_prefix=cfg.train.shared_prefix, cpu_offload=cfg.dist.cpu_offload,
            logprob_chunk=cfg.train.logprob_chunk, distill_topk=distill_topk(cfg), **budget)
    return Workload("sft", prompt, response, patches, cfg.train.batch_size,
                    min(cfg.train.micro_batch_size, cfg.train.batch_size), weight_bytes=weight, compute_bytes=compute,
                    cpu_offload=cfg.dist.cpu_offload, **budget)
