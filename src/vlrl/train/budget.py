"""Compute budgets in a unit that does not depend on machine load: FLOPs counted as the passes run.

`FlopMeter` hooks a policy's decoder, output head and vision tower and adds up, for every forward pass, the
FLOPs of the planner's formulas (`vlrl.launch.planner`; Kaplan et al. 2020) for the tokens that pass actually
processed (padding included — it is computed):

    decoder    2·Ψ_d·B·L + 4·n_layers·d_attn·B·L·S      Ψ_d: decoder parameters without the embedding table,
                                                       L query tokens, S keys (L, or past + L when decoding
                                                       with a KV cache), d_attn = heads · head_dim
    head       2·h·V per token given to the output head (generation asks it for the last position only)
    vision     2·(Ψ_v − Ψ_m)·N_p + 2·Ψ_m·N_p/m² + 4·depth·h_v·Σ_i n_i²
                                                       N_p patches, n_i of them in image i, Ψ_m the merger,
                                                       which sees N_p/m² merged tokens (m = spatial merge);
                                                       a tower fed tiles of pixels (InternVL, Gemma 3, …):
                                                       n_i the patches of tile i

A pass run with autograd on is counted 3× (forward + backward = 6Ψ per token, Kaplan et al.); a pass without
(generation's prefill and decode steps, π_old / π_ref scoring) 1×. The count is deterministic for a given run
(it depends on the tokens generated, so on the seed and the torch thread count, never on load or speed).

`vlrl demo` uses it to give the SFT control the RL stage's compute (`control_steps`); `PhaseMeter` turns it into every
SFT and RL step's ``perf/mfu`` (`vlrl.report.perf`). What this unit hides:
FLOPs treat a decode step as costly as a training step per FLOP, while on CPUs (and for small batches on
GPUs) decoding is memory-bound and much slower per FLOP — the FLOP-matched control gets fewer steps than a
wall-time-matched one would, which flatters RL; the demo records both numbers (``budget`` in summary.json).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch


@dataclass
class Flops:
    """FLOPs of passes with autograd (``train``: forward + backward) and without (``inference``)."""

    train: float = 0.0
    inference: float = 0.0

    @property
    def total(self) -> float:
        return self.train + self.inference

    def __sub__(self, other: Flops) -> Flops:
        return Flops(self.train - other.train, self.inference - other.inference)

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "total": self.total}


@dataclass(frozen=True)
class _Sizes:
    decoder_params: int  # Ψ_d, embedding table excluded
    layers: int
    attn_dim: int  # heads · head_dim
    hidden: int  # h, the head's input width
    vocab: int  # V
    vision_params: int = 0  # Ψ_v (merger included)
    merger_params: int = 0  # Ψ_m
    merge: int = 1  # spatial merge size m
    vision_depth: int = 0
    vision_hidden: int = 0  # h_v
    patch: int = 14  # pixels per patch side (towers fed tiles of pixels)


def _eager(hook: Callable) -> Callable:
    """``torch.compiler.disable`` (a compiled decode step, rollout.engine.compile, runs the count eagerly), applied at
    the hook's first call rather than at import: the decorator imports torch._dynamo, ~1.4 CPU-seconds of every
    process's start (each CLI run and torchrun rank) that never compiles. The first call is always eager — a decode
    step is compiled only after the prompt's prefill, an eager forward, has run the hooks."""
    disabled: Callable | None = None

    @functools.wraps(hook)
    def call(*args, **kwargs):
        nonlocal disabled
        if disabled is None:
            disabled = torch.compiler.disable(hook)
        return disabled(*args, **kwargs)

    return call


class FlopMeter:
    """Count the FLOPs of every forward (and backward) pass of ``model`` while installed (a context manager).

    ``model``: a transformers causal LM or image-text-to-text model (``get_decoder`` and
    ``get_output_embeddings``; the vision tower at ``model.model.visual`` or ``model.model.vision_tower``)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.flops = Flops()
        self.decoder = model.get_decoder()
        self.head = model.get_output_embeddings()
        inner = getattr(model, "model", model)
        self.vision = getattr(inner, "visual", None) or getattr(inner, "vision_tower", None)
        self.sizes = _sizes(model, self.decoder, self.head, self.vision)
        self._handles: list[Any] = []

    def snapshot(self) -> Flops:
        return Flops(self.flops.train, self.flops.inference)

    def __enter__(self) -> FlopMeter:
        self._handles = [self.decoder.register_forward_hook(self._on_decoder, with_kwargs=True),
                         self.head.register_forward_hook(self._on_head)]
        if self.vision is not None:
            self._handles.append(self.vision.register_forward_hook(self._on_vision, with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # -- hooks
    def _add(self, forward_flops: float, module: torch.nn.Module) -> None:
        trained = torch.is_grad_enabled() and any(p.requires_grad for p in module.parameters())
        if trained:
            self.flops.train += 3 * forward_flops
        else:
            self.flops.inference += forward_flops

    @_eager
    def _on_decoder(self, module, args, kwargs, output) -> None:
        s = self.sizes
        hidden = output[0] if isinstance(output, tuple) else output.last_hidden_state  # (B, L, h)
        B, L = hidden.shape[0], hidden.shape[1]
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        keys = cache.get_seq_length() if cache is not None and hasattr(cache, "get_seq_length") else L  # after update
        keys = max(int(keys), L)
        self._add(2 * s.decoder_params * B * L + 4 * s.layers * s.attn_dim * B * L * keys, module)

    @_eager
    def _on_head(self, module, args, output) -> None:
        tokens = args[0].numel() // self.sizes.hidden
        self._add(2 * self.sizes.hidden * self.sizes.vocab * tokens, module)

    @_eager
    def _on_vision(self, module, args, kwargs, output) -> None:
        s = self.sizes
        pixels = args[0] if args else kwargs.get("hidden_states", kwargs.get("pixel_values"))
        if not isinstance(pixels, torch.Tensor):
            return
        if pixels.dim() == 2:  # Qwen-style rows of patch values (N_p, C), images given by grid_thw (images, 3)
            grid = kwargs.get("grid_thw", args[1] if len(args) > 1 else None)
            patches = int(pixels.shape[0])
            per_image = [int(t * h * w) for t, h, w in grid.tolist()] if grid is not None else [patches]
        else:  # tiles of pixels (…, C, H, W) (InternVL, Gemma 3, LLaVA-OneVision, SmolVLM): attention within a tile
            tiles = int(torch.tensor(pixels.shape[:-3]).prod()) if pixels.dim() > 3 else 1
            per_tile = (pixels.shape[-2] // s.patch) * (pixels.shape[-1] // s.patch)
            patches, per_image = tiles * per_tile, [per_tile] * tiles
        linear = 2 * (s.vision_params - s.merger_params) * patches + 2 * s.merger_params * patches / s.merge**2
        attention = 4 * s.vision_depth * s.vision_hidden * sum(n * n for n in per_image)
        self._add(linear + attention, module)


def _count(module: torch.nn.Module | None) -> int:
    return sum(p.numel() for p in module.parameters()) if module is not None else 0


def _sizes(model, decoder, head, vision) -> _Sizes:
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    embed = decoder.get_input_embeddings() if hasattr(decoder, "get_input_embeddings") else None
    sizes: dict[str, Any] = dict(decoder_params=_count(decoder) - _count(embed), layers=text.num_hidden_layers,
                                 attn_dim=heads * head_dim, hidden=head.in_features, vocab=head.out_features)
    vision_config = getattr(config, "vision_config", None)
    if vision is not None and vision_config is not None:
        patch = getattr(vision_config, "patch_size", 14) or 14
        sizes.update(vision_params=_count(vision), merger_params=_count(getattr(vision, "merger", None)),
                     merge=getattr(vision_config, "spatial_merge_size", 1) or 1,
                     vision_depth=getattr(vision_config, "depth", None) or getattr(vision_config, "num_hidden_layers", 0),
                     vision_hidden=getattr(vision_config, "embed_dim", None) or vision_config.hidden_size,
                     patch=patch[0] if isinstance(patch, (list, tuple)) else patch)
    return _Sizes(**sizes)


def control_steps(rl_flops: Flops, sft_step_flops: float) -> int:
    """SFT steps whose FLOPs equal the RL stage's (training + generation), at least 1."""
    if sft_step_flops <= 0:
        raise ValueError("control budget: the SFT stage ran no measurable step to convert FLOPs into steps")
    return max(1, round(rl_flops.total / sft_step_flops))


def control_budget(unit: str, *, rl_flops: Flops, rl_seconds: float, sft_flops: Flops, sft_steps: int,
                   sft_seconds: float) -> dict:
    """The SFT control's budget in ``unit`` (``flops``: the RL stage's FLOPs converted to SFT steps at the SFT
    stage's measured FLOPs per step; ``wall``: the RL stage's seconds), with the other unit's step count beside
    it, so a reader can judge both: ``flops_matched_steps`` (deterministic) and ``wall_matched_steps`` (RL
    seconds ÷ SFT seconds per step of this run, which moves with machine load)."""
    if unit not in ("flops", "wall"):
        raise ValueError(f"control_budget: expected 'flops' or 'wall', got {unit!r}")
    if sft_steps < 1:
        raise ValueError("control_budget: the SFT stage ran no step, so there is no cost per SFT step to convert the "
                         "RL stage's budget into; set sft.train.steps ≥ 1")
    step_flops, step_seconds = sft_flops.train / sft_steps, sft_seconds / sft_steps
    flops_steps = control_steps(rl_flops, step_flops)
    return {
        "unit": unit,
        "rl_flops": rl_flops.as_dict(),
        "rl_seconds": round(rl_seconds, 1),
        "sft_step_flops": step_flops,
        "sft_step_seconds": round(step_seconds, 4),
        "flops_matched_steps": flops_steps,
        "wall_matched_steps": max(1, round(rl_seconds / max(step_seconds, 1e-9))),
        "control_steps": flops_steps if unit == "flops" else None,  # wall: whatever the control reaches in time
        "max_seconds": rl_seconds if unit == "wall" else None,
    }


class PhaseMeter:
    """The model FLOPs and seconds of a training loop's phases, as ``perf/…`` metrics (`vlrl.report.perf`):
    ``perf/mfu`` and ``perf/tflops`` for the update, ``perf/gen_mfu`` and ``perf/gen_tflops`` for generation.

    A `FlopMeter` on the policy's model while installed (a context manager); ``begin()`` marks the start of a
    step, ``phase(prefix)`` closes the phase since the last mark, ``metrics()`` returns the closed phases' metrics
    — under torchrun the mean over the ranks (one all-reduce; every rank calls it) — and starts afresh. Counted:
    the passes of the policy's own model (generation in the in-process engine, the π_old / π_ref scoring passes
    that run on it, the update's forward and backward); not a rollout server's, a private async engine copy's, a
    separate reference copy's or the critic's."""

    def __init__(self, model: torch.nn.Module, device: torch.device | str, dtype: torch.dtype, ctx: Any = None) -> None:
        from vlrl.report.perf import device_peak

        try:
            self.meter: FlopMeter | None = FlopMeter(model)
        except (AttributeError, TypeError, ValueError) as err:  # a model FlopMeter cannot size: train without MFU
            import logging

            logging.getLogger(__name__).warning("perf/mfu not logged: %s cannot be metered (%s: %s)",
                                                type(model).__name__, type(err).__name__, err)
            self.meter = None
        self.peak = device_peak(device, dtype)
        self.ctx = ctx
        self._mark = (0.0, Flops())
        self._phases: dict[str, tuple[float, float]] = {}  # prefix → (FLOPs, seconds)

    def __enter__(self) -> PhaseMeter:
        if self.meter is not None:
            self.meter.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.meter is not None:
            self.meter.__exit__(*exc)

    def _flops(self) -> Flops:
        return self.meter.snapshot() if self.meter is not None else Flops()

    def begin(self) -> None:
        import time

        self._mark = (time.perf_counter(), self._flops())

    def phase(self, prefix: str) -> None:
        import time

        now, flops = time.perf_counter(), self._flops()
        self._phases[prefix] = ((flops - self._mark[1]).total, now - self._mark[0])
        self._mark = (now, flops)

    def metrics(self) -> dict[str, float]:
        from vlrl.report.perf import phase_metrics

        out: dict[str, float] = {}
        for prefix, (flops, seconds) in self._phases.items():
            out.update(phase_metrics(flops, seconds, self.peak, prefix=prefix))
        if self.ctx is not None and self.ctx.enabled:  # the mean over ranks: the same names (and order) on every rank
            names = [f"perf/{p}{k}" for p in self._phases for k in ("tflops", "mfu")]
            means = [v / self.ctx.world_size for v in self.ctx.all_reduce_sum([out.get(k, 0.0) for k in names])]
            out = {k: v for k, v in zip(names, means, strict=True) if v > 0}
        self._phases = {}
        if out:
            out["perf/peak_tflops"] = self.peak.tflops
        return out


def compute_dtype(model: torch.nn.Module, mixed_precision: str = "none") -> torch.dtype:
    """The dtype the matmuls run in: ``dist.mixed_precision``'s (bf16 / fp16), else the parameters'."""
    if mixed_precision == "bf16":
        return torch.bfloat16
    if mixed_precision == "fp16":
        return torch.float16
    return next(model.parameters()).dtype
