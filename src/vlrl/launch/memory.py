"""Memory per device of a step, per phase (`vlrl plan`, `vlrl.launch.planner`): what is held through the step, what
each phase adds, and where each GiB goes — every term with its formula and the values substituted.

**Memory** (bytes per device; Ψ parameters, b_w bytes of ``model.dtype``, b_c bytes of the compute dtype —
2 under ``dist.mixed_precision``, else b_w; d the FSDP size, 1 under DDP):

    parameters Ψ·b_w/d · gradients Ψ·b_w/d · AdamW moments 2·Ψ·b_w/d (ZeRO; Rajbhandari et al. 2020)
    FSDP2 gather buffers 2·U·b_c (U the largest unit: the current one and the prefetched one)
    activations of one micro-batch of m sequences of L tokens (prompt + vision tokens + response):
        text   n_layers · m·L · (8h + 2k + 4I) · b_c   — what a Llama/Qwen2 layer saves for backward with SDPA
               (per token: RMSNorm input, normalised and output ×2 norms = 6h, rotated q + k and v = h + 2k,
               attention output h, SwiGLU gate, up, act, product = 4I; no L² term: SDPA keeps only a log-sum-exp)
               + inputs 2·m·L·h·b_c (token embeddings, and their copy with the image features scattered in)
        vision depth · m·N_p · (12h_v + 3I_v) · b_c + m·N_p·C · b_c   (N_p patches per sequence, C = patch values;
               per patch: 2 LayerNorms' input and output 4h_v, q, k, v around the rotary embedding and SDPA's
               contiguous copies ≈ 6h_v, attention output and its concatenation over images 2h_v, quick-GELU
               MLP 3I_v; the pixel patches themselves C)
        logits 3 · min(m·(R + 1), c)·V · 4        (fp32 logits of the response, log-softmax, its gradient; c the
               tokens of one chunk under ``train.logprob_chunk``, `vlrl.models.logprobs.chunk_tokens`; 4 with
               algo.distill's topk estimator: the log-softmax's copy its rest mass is summed over)
    KV cache (generation) 2 · n_layers · k · (P + R) · B · b_c; B = sequences generated at once (the engine keeps
        one log-prob per sampled token, not the step logits)

(Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", counted for this
layer type; `vlrl plan --measure` and tests/launch/test_planner.py compare it with a measured CPU step.)

**Families.** The same formulas serve every family, with its sizes read from its config: the vision tower's
depth (``depth`` or ``num_hidden_layers``), width and patch values; N_p = the patches the tower encodes
(`VisionInputs.patches`: Qwen-style patch rows, or tiles × (H/p)(W/p) of InternVL / Gemma 3 / LLaVA-OV / SmolVLM
pixels); I = the MLP width a token passes through (a mixture of experts: the chosen experts' plus the shared
one's; Ψ still counts every expert). Stated approximations, measured against a CPU step of each tiny preset
(tests/models/test_families.py): parameters, gradients and AdamW moments exact; activations 0.76–1.14× of
measured for attention-only families (MoE routing buffers are not counted); Qwen3.5's Gated DeltaNet layers
are counted as attention layers, which gives ~0.5× of their activations (chunked delta-rule intermediates,
convolution states) — budget Qwen3.5 activations at 2× the printed value.

**Memory options.** ``train.gradient_checkpointing``: each block keeps only its input, n_layers·m·L·h·b_c
(vision: depth·m·N_p·h_v·b_c), plus one block's full activations while it is recomputed in backward.
``model.lora``: the base is frozen (no gradients, no moments); the Ψ_lora = Σ r·(in + out) adapter parameters
of the targeted projections are fp32 with fp32 gradients and moments — under FSDP2 all of them sharded d ways
(the base and the adapters of a layer are shards of its unit), under DDP whole on every device. ``train.trainable``: only the Ψ_t
parameters of the chosen groups get gradients and moments; a vision tower that trains nothing keeps no
activations.

``dist.cpu_offload`` (FSDP2 on ≥ 2 ranks): the parameters, gradients and moments above (and a reference copy) are
a per-rank host figure instead of device memory; the time adds their copies, steps·(2·micro·Ψ + Ψ_t)·b_w/n over
PCIe (P_cie), a host AdamW step (7 reads and writes of b_w per trained parameter of the shard, host bandwidth H), and
for colocated generation one copy of the rank's shards per decode step (`offload_seconds`).

**Phases.** Held through the step: parameters, AdamW moments (and a reference, a critic), FSDP2's gather buffers.
Each phase adds its own (the peak is the costliest phase; `PhaseMemory`):

    generate           the KV cache (gradients were freed by the last optimizer step: ``zero_grad(set_to_none)``)
    old/ref log-probs  a no-grad pass over one micro-batch (π_old, π_ref, the critic's values): one decoder layer's
                       working set m·L·(4h + 2k + 3I)·b_c, the embeddings 2·m·L·h·b_c, one vision block's
                       m·N_p·(12h_v + 3I_v + C)·b_c, and the fp32 logits with their log-softmax 2·min(m·(R+1), c)·V·4
    forward + backward the gradients (accumulated over the micro-batches) + one micro-batch's activations (above)
    optimizer step     the gradients + AdamW's temporaries: on a GPU its multi-tensor (foreach) step computes
                       √v̂ + ε for every parameter at once — one more copy of the trained state, Ψ_t·b_w/d
                       (torch.optim.AdamW's default on CUDA); on a CPU the per-parameter step holds two copies of the
                       largest parameter, 2·max|p|·b_w

**The token budget.** With ``train.max_tokens_per_micro_batch`` B a micro-batch holds what the budget admits:
m = B / (L + w_v·N_p) rows of the workload's longest shape (`vlrl.train.microbatch.patch_weight`: w_v weighs a
vision patch as the tower's kept activations over a decoder token's), at least one row (a longer one runs alone),
at most the rank's share — so the activations are those of B cost units, whatever the rows' mix.

Measured against torch's MemTracker on a CPU step per phase (`vlrl.launch.measure`, tests/launch/test_planner.py:
the tiny and ~20M presets within ±15 % per phase).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from vlrl.launch.shapes import GB, ModelShape, Workload

PHASES = ("generate", "old/ref log-probs", "forward + backward", "optimizer step")


@dataclass
class Term:
    """One estimated number with its formula and the values substituted."""

    name: str
    value: float  # bytes or seconds
    formula: str
    values: str

    def line(self, unit: str) -> str:
        shown = human_bytes(self.value) if unit == "bytes" else human_seconds(self.value)
        return f"    {self.name:<22s}{shown:>11s}   = {self.formula}   = {self.values}"


def human_bytes(n: float) -> str:
    for unit, size in (("GiB", GB), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def human_seconds(t: float) -> str:
    return f"{t:.3f} s" if t >= 1 else f"{t * 1e3:.3f} ms" if t >= 1e-3 else f"{t * 1e6:.1f} µs"


def count_text(n: float) -> str:
    return f"{n / 1e6:.3g}M" if n >= 1e5 else f"{n:.0f}"


def trained_state(s: ModelShape, w: Workload, d: int, role: str) -> list[Term]:
    """Parameters, gradients and AdamW moments of a trained model, sharded d ways: gradients and moments only for
    the trained Ψ_t (``train.trainable``); LoRA adds Ψ_lora fp32 adapters (4 bytes) with their own."""
    p, b = s.params, w.weight_bytes
    t = p if w.trained_params is None or role != "actor" else w.trained_params
    a = w.adapter_params if role == "actor" else 0
    if not a and t == p:
        return [
            Term(f"{role} parameters", p * b / d, "Ψ·b_w/d", f"{count_text(p)}·{b}/{d}"),
            Term(f"{role} gradients", p * b / d, "Ψ·b_w/d", f"{count_text(p)}·{b}/{d}"),
            Term(f"{role} AdamW moments", 2 * p * b / d, "2·Ψ·b_w/d", f"2·{count_text(p)}·{b}/{d}"),
        ]
    return [
        Term(f"{role} parameters", (p * b + a * 4) / d, "(Ψ·b_w + Ψ_lora·4)/d", f"({count_text(p)}·{b} + {count_text(a)}·4)/{d}"),
        Term(f"{role} gradients", (t * b + a * 4) / d, "(Ψ_t·b_w + Ψ_lora·4)/d", f"({count_text(t)}·{b} + {count_text(a)}·4)/{d}"),
        Term(f"{role} AdamW moments", 2 * (t * b + a * 4) / d, "2·(Ψ_t·b_w + Ψ_lora·4)/d",
             f"2·({count_text(t)}·{b} + {count_text(a)}·4)/{d}"),
    ]


def gather_buffers(s: ModelShape, w: Workload, d: int) -> list[Term]:
    if d == 1:
        return []
    return [Term("FSDP gather buffers", 2 * s.largest_unit * w.compute_bytes, "2·U·b_c",
                 f"2·{count_text(s.largest_unit)}·{w.compute_bytes}")]


def activations(s: ModelShape, w: Workload, role: str = "actor", *, ranks: int = 1) -> list[Term]:
    """What one training micro-batch keeps for backward, on one of ``ranks`` data-parallel ranks: m rows of the
    workload's length (`micro_rows`: ``train.micro_batch_size``, or the rows the token budget admits, at most the
    rank's share of the batch)."""
    m, L, b = micro_rows(w, ranks), w.length, w.compute_bytes
    per_token = 8 * s.hidden + 2 * s.kv_dim + 4 * s.intermediate
    if w.checkpointing:  # block inputs kept, one block's activations alive while it is recomputed
        terms = [Term(f"{role} activations", (s.layers * s.hidden + per_token) * m * L * b,
                      "(n_layers·h + 8h+2k+4I)·m·L·b_c  [checkpointed]",
                      f"({s.layers}·{s.hidden} + 8·{s.hidden}+2·{s.kv_dim}+4·{s.intermediate})·{m}·{L}·{b}")]
    else:
        terms = [Term(f"{role} activations", s.layers * m * L * per_token * b, "n_layers·m·L·(8h+2k+4I)·b_c",
                      f"{s.layers}·{m}·{L}·(8·{s.hidden}+2·{s.kv_dim}+4·{s.intermediate})·{b}")]
    terms.append(Term("input embeddings", 2 * m * L * s.hidden * b, "2·m·L·h·b_c", f"2·{m}·{L}·{s.hidden}·{b}"))
    if s.vision_depth and w.patches and w.trained_vision != 0:  # a tower that trains nothing keeps no activations
        per_patch = 12 * s.vision_hidden + 3 * s.vision_intermediate
        if w.checkpointing:
            terms.append(Term("vision activations", (s.vision_depth * s.vision_hidden + per_patch + s.patch_values)
                              * m * w.patches * b, "(depth·h_v + 12h_v+3I_v + C)·m·N_p·b_c  [checkpointed]",
                              f"({s.vision_depth}·{s.vision_hidden} + 12·{s.vision_hidden}+3·{s.vision_intermediate} + "
                              f"{s.patch_values})·{m}·{w.patches}·{b}"))
        else:
            terms.append(Term("vision activations", (s.vision_depth * per_patch + s.patch_values) * m * w.patches * b,
                              "(depth·(12h_v+3I_v) + C)·m·N_p·b_c",
                              f"({s.vision_depth}·(12·{s.vision_hidden}+3·{s.vision_intermediate}) + {s.patch_values})"
                              f"·{m}·{w.patches}·{b}"))
    from vlrl.models.logprobs import chunk_tokens

    R = w.response_tokens
    chunk = chunk_tokens(w.logprob_chunk, math.ceil(m * (R + 1)), s.vocab)  # None: the whole logits
    n = 4 if w.distill_topk else 3  # topk: + the log-softmax with the teacher's top-k masked (its rest mass)
    if chunk is None:
        terms.append(Term("logits (fp32)", n * m * (R + 1) * s.vocab * 4, f"{n}·m·(R+1)·V·4",
                          f"{n}·{m}·{R + 1}·{s.vocab}·4"))
    else:
        terms.append(Term("logits (fp32)", n * chunk * s.vocab * 4, f"{n}·c·V·4  [chunked]", f"{n}·{chunk}·{s.vocab}·4"))
    return terms


def generation(s: ModelShape, w: Workload, rows: int) -> list[Term]:
    """KV cache of one generate call of ``rows`` sequences (a group's prompt is prefilled once, then its cache
    expanded to the n rows: the expanded cache is this size)."""
    B = min(rows, w.gen_batch)
    L, b = w.length, w.compute_bytes
    return [
        Term("KV cache", 2 * s.layers * s.kv_dim * L * B * b, "2·n_layers·k·(P+R)·B·b_c",
             f"2·{s.layers}·{s.kv_dim}·{L}·{B}·{b}"),
    ]


def frozen(s: ModelShape, w: Workload, d: int, role: str) -> list[Term]:
    p, b = s.params, w.weight_bytes
    return [Term(f"{role} parameters", p * b / d, "Ψ·b_w/d", f"{count_text(p)}·{b}/{d}")]


def model_state(s: ModelShape, w: Workload, d: int) -> list[Term]:
    """Per device: the actor's parameters, gradients and AdamW moments, the critic's, and a frozen reference copy
    (not under LoRA: its reference is the base with the adapters off), each sharded d ways — what FSDP2's
    ``dist.cpu_offload`` keeps in host memory instead —, and a distillation teacher's parameters, whole."""
    state = trained_state(s, w, d, "actor")
    if w.critic:
        state += trained_state(s, w, d, "critic")
    if w.reference and not w.adapter_params:
        state += frozen(s, w, d, "reference")
    if w.teacher_params:  # algo.distill: not sharded (each rank holds the whole teacher)
        state.append(Term("teacher parameters", w.teacher_params * w.weight_bytes, "Ψ_T·b_w",
                          f"{count_text(w.teacher_params)}·{w.weight_bytes}"))
    return state


def micro_rows(w: Workload, ranks: int = 1) -> float:
    """m, the rows of one training micro-batch on one of ``ranks`` ranks: ``train.micro_batch_size``, or with a token
    budget B the rows of the workload's cost L + w_v·N_p it admits (B / cost, ≥ 1) — at most the rank's share."""
    share = math.ceil(w.sequences / ranks)
    if w.max_tokens is None:
        return min(w.micro_batch, share)
    return min(share, max(1.0, w.max_tokens / (w.length + w.patch_weight * w.patches)))


def rows_text(m: float) -> str:
    return f"{m:g}" if float(m).is_integer() else f"{m:.3g}"


def scoring(s: ModelShape, w: Workload, ranks: int = 1) -> list[Term]:
    """What a no-grad teacher-forced pass (π_old, π_ref, the critic's values) holds beyond the weights, for one
    micro-batch: one decoder layer's working set, the embeddings, one vision block's, the fp32 logits + log-softmax."""
    from vlrl.models.logprobs import chunk_tokens

    m, L, b = micro_rows(w, ranks), w.length, w.compute_bytes
    terms = [Term("scoring layer", m * L * (4 * s.hidden + 2 * s.kv_dim + 3 * s.intermediate) * b, "m·L·(4h+2k+3I)·b_c",
                  f"{rows_text(m)}·{L}·(4·{s.hidden}+2·{s.kv_dim}+3·{s.intermediate})·{b}"),
             Term("input embeddings", 2 * m * L * s.hidden * b, "2·m·L·h·b_c", f"2·{rows_text(m)}·{L}·{s.hidden}·{b}")]
    if s.vision_depth and w.patches:
        per_patch = 12 * s.vision_hidden + 3 * s.vision_intermediate + s.patch_values
        terms.append(Term("scoring vision block", m * w.patches * per_patch * b, "m·N_p·(12h_v+3I_v+C)·b_c",
                          f"{rows_text(m)}·{w.patches}·(12·{s.vision_hidden}+3·{s.vision_intermediate}+{s.patch_values})·{b}"))
    R = w.response_tokens
    tokens = math.ceil(m * (R + 1))
    chunk = chunk_tokens(w.logprob_chunk, tokens, s.vocab) or tokens
    terms.append(Term("logits (fp32)", 2 * chunk * s.vocab * 4, "2·min(m·(R+1), c)·V·4", f"2·{chunk}·{s.vocab}·4"))
    return terms


def optimizer_temporaries(s: ModelShape, w: Workload, d: int, *, foreach: bool = True) -> list[Term]:
    """AdamW's temporaries in its step (module docstring): one copy of the trained state, multi-tensor (a GPU), or
    two of the largest parameter (a CPU's per-parameter loop)."""
    if not foreach:
        return [Term("AdamW step temporaries", 2 * s.largest_param * w.weight_bytes, "2·max|p|·b_w  [per parameter]",
                     f"2·{count_text(s.largest_param)}·{w.weight_bytes}")]
    t = s.params if w.trained_params is None else w.trained_params
    a = w.adapter_params
    if a or t != s.params:
        return [Term("AdamW step temporaries", (t * w.weight_bytes + a * 4) / d, "(Ψ_t·b_w + Ψ_lora·4)/d  [foreach]",
                     f"({count_text(t)}·{w.weight_bytes} + {count_text(a)}·4)/{d}")]
    return [Term("AdamW step temporaries", t * w.weight_bytes / d, "Ψ·b_w/d  [foreach]",
                 f"{count_text(t)}·{w.weight_bytes}/{d}")]


@dataclass
class PhaseMemory:
    """A device group's memory over a step: what is held throughout (``resident``) and what each phase adds."""

    resident: list[Term]
    phases: dict[str, list[Term]]

    def total(self, phase: str) -> float:
        return sum(t.value for t in self.resident) + sum(t.value for t in self.phases[phase])

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.total)

    def peak_terms(self) -> list[Term]:
        """The resident terms and the costliest phase's: what sums to the peak."""
        return self.resident + self.phases[self.peak_phase]


def phase_memory(s: ModelShape, w: Workload, d: int, *, ranks: int, generate_rows: int | None = None,
                 offload: bool = False, foreach: bool = True) -> PhaseMemory:
    """The memory of a trainer device (d-way FSDP2, ``ranks`` data-parallel ranks) per phase; ``generate_rows``: the
    rows it generates at once (None: no colocated generation); ``offload``: ``dist.cpu_offload`` keeps parameters,
    gradients and moments (and the optimizer step) on the host; ``foreach``: AdamW's multi-tensor step (a GPU)."""
    state = model_state(s, w, d)
    grads = [t for t in state if t.name.endswith(" gradients")]
    resident = ([] if offload else [t for t in state if t not in grads]) + gather_buffers(s, w, d)
    on_device = [] if offload else grads
    phases: dict[str, list[Term]] = {}
    if generate_rows is not None:
        phases["generate"] = generation(s, w, generate_rows)
    if w.recipe == "rl" and (w.old_pass or w.reference or w.critic):
        phases["old/ref log-probs"] = scoring(s, w, ranks)
    phases["forward + backward"] = on_device + activations(s, w, ranks=ranks)
    phases["optimizer step"] = on_device + ([] if offload else optimizer_temporaries(s, w, d, foreach=foreach))
    return PhaseMemory(resident, phases)


def estimate_train_step(s: ModelShape, w: Workload) -> dict[str, float]:
    """The single-device estimate `measure_train_step` is compared with, by category."""
    state = {t.name.split()[-1]: t.value for t in trained_state(s, w, 1, "actor")}
    return {"param": state["parameters"], "grad": state["gradients"], "opt": state["moments"],
            "act": sum(t.value for t in activations(s, w))}


def estimate_phases(s: ModelShape, w: Workload, *, foreach: bool = False) -> dict[str, float]:
    """One device's peak per phase (bytes; a CPU's per-parameter AdamW unless ``foreach``): what
    `vlrl.launch.measure.measure_phases` measures."""
    memory = phase_memory(s, w, 1, ranks=1, foreach=foreach)
    if "old/ref log-probs" not in memory.phases:
        memory.phases["old/ref log-probs"] = scoring(s, w)
    return {phase: memory.total(phase) for phase in memory.phases}
