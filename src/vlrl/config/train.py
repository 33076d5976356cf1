"""The stage sections: the optimizer (`OptimConfig`), the SFT stage (`SFTStage`), and the RL stage's algorithm,
loop, critic, synthesis and selection (`RLStage`, which holds the rollout sections of `vlrl.config.rollout`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from vlrl.config.base import Section
from vlrl.config.rollout import DynamicSamplingConfig, RolloutConfig, StalenessConfig

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


def _max_tokens_field(passes: str):
    """`train.max_tokens_per_micro_batch`, the same field in the SFT and the RL train sections."""
    return Field(
        None, ge=1, description=f"Cut {passes} into micro-batches by cost instead of by micro_batch_size rows: a "
        "micro-batch holds at most this many tokens — prompt (vision tokens included) + response, + the vision tower's "
        "patches weighted by what one keeps for backward relative to a decoder token; padded micro-batches count every "
        "row at the longest row's length, train.shared_prefix a group's prompt once (vlrl.train.microbatch). A row "
        "over the budget runs alone (warned once). Under torchrun the rows are also rebalanced so that every rank's "
        "cost is near-equal (Karmarkar-Karp; perf/rank_imbalance) and every rank runs the same number of "
        "micro-batches. Loss and gradients are those of the count-based split. verl's ppo_max_token_len_per_gpu "
        "with use_dynamic_bsz. Unset: micro_batch_size rows.",
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
    max_tokens_per_micro_batch: int | None = _max_tokens_field("each rank's units (samples or planned bins)")
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


class DistillConfig(Section):
    """On-policy distillation (OPD; `vlrl.algos.distill`, docs/guides/algorithms.md "On-policy distillation"): the
    student samples, a frozen teacher scores every sampled token, and the student minimises the per-token reverse
    KL(π_θ ‖ π_teacher) on its own samples (Agarwal et al. 2024, GKD; Thinking Machines, "On-Policy Distillation",
    2025). Dense, verifier-free supervision at RL's on-policy state distribution, alone or beside GRPO."""

    teacher: str | None = Field(
        None, description="The teacher, in-process: a model path, hub id or tiny preset (as model.path). Frozen, "
        "scored without gradient once per step like π_ref. It must share the student's tokenizer (it scores the "
        "student's token ids): another tokenizer is refused, naming both. Give this or teacher_urls, not both.",
        json_schema_extra={"path": "model"})
    teacher_urls: list[str] | None = Field(
        None, min_length=1, description="The teacher on rollout servers that score input tokens (SGLang's /generate "
        "with return_logprob, logprob_start_len and max_new_tokens 0: `vlrl serve --model TEACHER`, or SGLang; "
        "vLLM's prompt_logprobs for a text teacher), "
        "e.g. [http://127.0.0.1:30001]: one prefill-only request per trajectory (prompt + response, its images), "
        "spread over the servers; the server's tokenizer is checked against the student's (/server_info). SGLang "
        "scores input tokens at temperature 1, so rollout.temperature must be 1. Give this or teacher, not both.")
    teacher_api_key_env: str = Field(
        "VLRL_API_KEY", description="Environment variable holding the teacher servers' bearer token (as "
        "rollout.servers.api_key_env; never put the key itself in a config).")
    teacher_request_timeout: float = Field(
        300.0, gt=0, description="Seconds one teacher request may take before it counts as a failure of its server "
        "(retried on another, up to 3 times).")
    teacher_max_concurrent: int = Field(
        64, ge=1, description="Teacher requests in flight at once (over all teacher_urls); the servers' own "
        "admission bounds the rest (a full server answers 503 and is waited for).")
    coef: float = Field(1.0, ge=0, description="Weight β of the distillation term: sampled, Â_t ← w · Â_t − β · "
                        "(log π_old(y_t) − log π_teacher(y_t)) (slime --use-opd's opd_kl_coef; Thinking Machines: 1); "
                        "topk, loss += β · aggregate(D_t) by algo.loss_agg.")
    estimator: Literal["sampled", "topk"] = Field(
        "sampled", description="sampled: the reverse KL's single-sample estimate on the sampled token, "
        "log π_old(y_t) − log π_teacher(y_t), put into every model token's advantage (slime --use-opd; Thinking "
        "Machines' per-token advantage), so it trains through algo.policy_loss like any advantage. topk: the full "
        "reverse KL D_t = Σ π_θ(i)·(log π_θ(i) − log π_teacher(i)) over the teacher's top_k tokens and one bucket "
        "for the rest of the vocabulary (TRL's GKD), a loss term beside the policy loss, differentiated through "
        "π_θ: no sampling noise, and the teacher's top-k (ids and log-probs, B×R×top_k) held on the host.",
    )
    top_k: int = Field(16, ge=1, description="k of estimator=topk: the teacher's most likely tokens per position "
                       "the reverse KL is summed over (the rest of the vocabulary is one bucket). The teacher's "
                       "pass keeps 8·k + 4 bytes per response token on the host (ids and fp32 log-probs). "
                       "Ignored by sampled.")
    reward_weight: float = Field(
        1.0, ge=0, description="w: the weight of the outcome advantage (algo.advantage over the verifiers' "
        "rewards) beside the distillation term. 1: OPD + GRPO; 0: OPD alone — the rewards are still scored and "
        "logged but teach nothing.",
    )

    @model_validator(mode="after")
    def _check_teacher(self) -> DistillConfig:
        if (self.teacher is None) == (self.teacher_urls is None):
            raise ValueError("algo.distill: give exactly one teacher — teacher (a model, in-process) or teacher_urls "
                             "(servers that score input tokens)" + (", not both" if self.teacher else ""))
        if self.teacher_urls is not None:
            for url in self.teacher_urls:
                if not url.startswith(("http://", "https://")):
                    raise ValueError(f"algo.distill.teacher_urls: {url!r} is not an http(s) URL")
            if self.estimator != "sampled":  # (a server returns the sampled tokens' log-probs alone)
                raise ValueError(f"algo.distill.estimator={self.estimator}: a teacher on servers (teacher_urls) "
                                 "gives the sampled tokens' log-probs only; use estimator sampled or an in-process "
                                 "teacher")
        return self


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
        "budget). Unset: rollout.max_new_tokens × rollout.agent.max_turns. Ignored by the other aggregations.",
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
    strict_reward: bool = Field(
        True, description="Strict scoring (R1 / EasyR1-style): a response that did not end (truncated at "
        "rollout.max_new_tokens) or is not in its sample's answer form (data.answer_format; e.g. "
        "<answer>1</answer>1</answer>1…) scores the minimum of every verifier that reports an accuracy (number, math, "
        "multiple_choice, bbox_iou, …); format and length verifiers (format, answer_format, overlong, …) and your "
        "own verifiers that report no accuracy still score it. false: the verifier alone decides, and most read the "
        "first answer block and ignore what follows, so a policy can win reward with answers no parser accepts "
        "(issue 52: the demo at seed 0).",
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
    distill: DistillConfig | None = Field(
        None, description="On-policy distillation from a frozen teacher (off when unset), alone (reward_weight: 0) "
        "or added to the outcome advantage, with any policy loss; e.g. {teacher: runs/demo/rl, coef: 1.0}.",
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
    max_tokens_per_micro_batch: int | None = _max_tokens_field(
        "the update's rows (and the π_old / π_ref / critic passes')")
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
        "vlrl.models.shared_prefix; logged as perf/shared_prefix_frac). Wherever that is exact; elsewhere the plain "
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
        distill = self.algo.distill
        if distill is not None and distill.teacher_urls is not None and self.rollout.temperature != 1.0:
            raise ValueError(
                f"algo.distill.teacher_urls with rollout.temperature={self.rollout.temperature}: a teacher server "
                "scores input tokens at temperature 1 (SGLang's input_token_logprobs use the raw logits; vlrl serve "
                "does the same) while the student's log-probs are at the rollout temperature; set "
                "rollout.temperature=1 or use an in-process teacher (algo.distill.teacher), scored at the rollout "
                "temperature")
        total = self.train.prompts_per_step * self.rollout.n
        if total % self.train.minibatches:
            raise ValueError(
                f"train.prompts_per_step × rollout.n = {total} responses per step do not split into "
                f"train.minibatches = {self.train.minibatches} equal minibatches"
            )
        return self

