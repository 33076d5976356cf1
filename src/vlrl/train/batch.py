"""From scored trajectories to an `UpdateBatch` — the part of an RL step that both recipes share:

    tensors          right-padded (B, R) loss mask (overlong filtering), behaviour log-probs, group index
    extra passes     π_old / π_prox, π_ref, critic values (one no-grad pass each, only when needed)
    rollout corr.    TIS weights / MIS mask from π_old vs the sampler's log-probs (algo.rollout_correction)
    reward shaping   algo.reward_shaping, in order                       (per group, before advantages)
    KL in reward     r_t − β · KL_t(π_old ‖ π_ref)                        (algo.kl_mode = reward)
    advantages       algo.advantage                                      (the estimator; returns for the critic)
    adv. shaping     algo.advantage_shaping, in order                    (token-level post-processing)
    distillation     Â_t ← w · Â_t − β · (log π_old − log π_teacher)(y_t) (algo.distill; π_teacher: one no-grad pass;
                     estimator topk: w · Â_t, the teacher's top-k to the update's loss term)

`Algorithm` binds everything the step needs from config once (estimator, loss, shapers, reference model);
nothing here branches on an algorithm's name.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vlrl.algos import AdvantageInputs, get_advantage, get_policy_loss
from vlrl.algos.advantages import advantage_needs
from vlrl.algos.filters import mask_truncated
from vlrl.algos.kl import kl_reward_penalty
from vlrl.algos.losses import (
    BoundLoss,
    applies_behaviour_weight,
    bind_policy_loss,
    check_zero_at_zero_advantage,
    minibatch_selection,
)
from vlrl.algos.rollout_correction import rollout_correction
from vlrl.algos.shaping import (
    AdvantageShapingInputs,
    RewardShapingInputs,
    get_advantage_shaping,
    get_reward_shaping,
)
from vlrl.config import RLStage, RolloutCorrectionConfig, ShapingSpec
from vlrl.models import Policy
from vlrl.models.forward import score
from vlrl.models.logprobs import HeadQuery
from vlrl.rollout import Status, Trajectory
from vlrl.train import step_credit  # noqa: F401  (registers the training room's shaper, step_credit)
from vlrl.train.common import frozen_copy
from vlrl.train.critic import Critic
from vlrl.train.distill import Teacher, load_teacher
from vlrl.train.update import UpdateBatch, UpdateSettings

EXCLUDED = (Status.FAILED, Status.ABORTED)  # never trained on


@dataclass
class StepContext:
    """What a shaper that needs a model may use (handed over as ``inputs.context``)."""

    policy: Policy
    reference: torch.nn.Module | None
    temperature: float
    step: int
    run_dir: Path | None = None  # where a shaper may write analysis files (None: no files)


class ShapingChain:
    """The configured shapers of one kind, applied in order; each keeps its own state across steps."""

    def __init__(self, specs: Sequence[ShapingSpec], lookup: Callable[[str], Callable], field: str) -> None:
        self.names = [spec.name.rpartition(":")[2] for spec in specs]
        self.fns = [functools.partial(lookup(spec.name), **spec.options) for spec in specs]
        self.states: list[Any] = [None] * len(specs)
        self.field = field  # the input field a shaper rewrites: "rewards" or "advantages"

    def __len__(self) -> int:
        return len(self.fns)

    def apply(self, inputs: Any) -> tuple[torch.Tensor, dict[str, float]]:
        """Run every shaper on ``inputs`` (its ``field`` replaced by the previous shaper's output)."""
        values, metrics = getattr(inputs, self.field), {}
        for k, (name, fn) in enumerate(zip(self.names, self.fns, strict=True)):
            out = fn(dataclasses.replace(inputs, **{self.field: values, "state": self.states[k]}))
            if out.values.shape != values.shape:
                raise ValueError(f"{self.field} shaper {name!r} returned shape {tuple(out.values.shape)}, "
                                 f"expected {tuple(values.shape)}")
            values, self.states[k] = out.values, out.state
            metrics.update({f"shaping/{name}/{key}": float(v) for key, v in out.metrics.items()})
        return values, metrics


@dataclass
class Algorithm:
    """Everything of ``stage.algo`` the step uses, looked up once: no name is compared in the loop."""

    advantage_fn: Callable
    needs: frozenset[str]  # inputs the estimator requires besides rewards ("values", "baseline_rewards")
    reward_shaping: ShapingChain
    advantage_shaping: ShapingChain
    reference: torch.nn.Module | None  # frozen copy of the initial policy; None when kl_coef = 0
    critic: Critic | None  # the value model, when the estimator needs values
    settings: UpdateSettings
    kl_in_reward: float  # β of the KL reward penalty (0: the KL, if any, is a loss term)
    kl_estimator: str
    mask_truncated: bool  # DAPO overlong filtering
    rollout_correction: RolloutCorrectionConfig = dataclasses.field(default_factory=RolloutCorrectionConfig)
    ctx: Any = None  # the ranks (`DistContext`): budgeted scoring passes run as many micro-batches on each
    teacher: Teacher | None = None  # on-policy distillation's frozen teacher (algo.distill; None: off)


def build_algorithm(stage: RLStage, policy: Policy | None, *, apply_behaviour_weight: bool,
                    reference: torch.nn.Module | None = None, critic_model: torch.nn.Module | None = None,
                    ctx: Any = None) -> Algorithm:
    """Bind ``stage.algo`` (and ``stage.critic``) once. ``apply_behaviour_weight``: multiply the loss by
    w = min(π_prox / π_behave, cap) — the async recipe's decoupled objective — unless the loss does it itself
    (then it gets ``cap`` and ``behaviour_weight_mode`` from ``stage.staleness``).
    ``reference``: a frozen reference already built (e.g. FSDP2-sharded by `vlrl.train.runtime.make_runtime`);
    unset, a frozen copy of the policy is made when ``algo.kl_coef > 0``. ``critic_model``: the value model
    already wrapped for the ranks (`make_runtime`), unset: built from the policy when the estimator needs
    values; ``ctx`` (`DistContext`): the critic's ranks agree on a non-finite step."""
    algo, train, staleness = stage.algo, stage.train, stage.staleness
    estimator = get_advantage(algo.advantage)
    needs = advantage_needs(estimator)
    loss = get_policy_loss(algo.policy_loss)
    loss_fn = policy_loss(stage)  # clip from algo.clip_*, a behaviour-weight loss's cap and mode from staleness.*
    weighted = applies_behaviour_weight(loss) or apply_behaviour_weight
    if algo.rollout_correction.tis_cap is not None and weighted:
        raise ValueError("algo.rollout_correction.tis_cap: the behaviour weight π_prox / π_behave is already applied "
                         f"(policy_loss={algo.policy_loss}, async behaviour weight {apply_behaviour_weight}) and is "
                         "the same ratio; TIS on top would count it twice. Use one of them (staleness."
                         "apply_behaviour_weight=false in async mode), or MIS (mis_cap) alone")
    kl_in_loss = algo.kl_coef if algo.kl_mode == "loss" else 0.0
    settings = UpdateSettings(
        loss_fn=loss_fn, loss_agg=algo.loss_agg, kl_coef=kl_in_loss, kl_estimator=algo.kl_estimator,
        temperature=stage.rollout.temperature, micro_batch_size=train.micro_batch_size, minibatches=train.minibatches,
        ppo_epochs=train.ppo_epochs, grad_clip=stage.optim.grad_clip,
        behaviour_weight_cap=staleness.behaviour_weight_cap, behaviour_weight_mode=staleness.behaviour_weight_mode,
        apply_behaviour_weight=apply_behaviour_weight and not applies_behaviour_weight(loss),
        padding_free=train.padding_free,
        shared_prefix=train.shared_prefix,
        logprob_chunk=train.logprob_chunk,
        skip_zero_advantage=train.skip_zero_advantage,
        on_nonfinite=train.on_nonfinite,
        max_tokens_per_micro_batch=train.max_tokens_per_micro_batch,
        loss_agg_max_length=loss_agg_max_length(stage),
        cov_selection=minibatch_selection(loss_fn),
        distill_coef=algo.distill.coef if algo.distill is not None and algo.distill.estimator == "topk" else 0.0,
    )
    if train.skip_zero_advantage:
        check_zero_at_zero_advantage(loss_fn, algo.policy_loss)
    return Algorithm(
        advantage_fn=functools.partial(estimator, **algo.advantage_options),
        needs=needs,
        reward_shaping=ShapingChain(algo.reward_shaping, get_reward_shaping, "rewards"),
        advantage_shaping=ShapingChain(algo.advantage_shaping, get_advantage_shaping, "advantages"),
        # kl_coef = 0: no reference at all
        reference=(reference if reference is not None else reference_model(policy)) if algo.kl_coef > 0 else None,
        critic=Critic(policy, stage.critic, module=critic_model, ctx=ctx) if "values" in needs else None,
        settings=settings,
        kl_in_reward=algo.kl_coef if algo.kl_mode == "reward" else 0.0,
        kl_estimator=algo.kl_estimator,
        mask_truncated=algo.mask_truncated,
        rollout_correction=algo.rollout_correction,
        ctx=ctx,
        teacher=load_teacher(algo.distill, policy) if algo.distill is not None else None,
    )


def policy_loss(stage: RLStage) -> BoundLoss:
    """``algo.policy_loss`` bound as the update runs it (`vlrl.algos.losses.bind_policy_loss`): the clip range from
    ``algo.clip_low`` / ``algo.clip_high``, a behaviour-weight loss's cap and mode from ``staleness.*``, its options
    from ``algo.policy_loss_options``."""
    algo, staleness = stage.algo, stage.staleness
    return bind_policy_loss(algo.policy_loss, clip_low=algo.clip_low, clip_high=algo.clip_high,
                            behaviour_weight_cap=staleness.behaviour_weight_cap,
                            behaviour_weight_mode=staleness.behaviour_weight_mode, options=algo.policy_loss_options)


def loss_agg_max_length(stage: RLStage) -> int:
    """L of ``seq_mean_token_sum_norm``: ``algo.loss_agg_max_length``, else the generation budget of a response
    (``rollout.max_new_tokens`` × ``rollout.agent.max_turns``; observations between turns are not counted)."""
    if stage.algo.loss_agg_max_length is not None:
        return stage.algo.loss_agg_max_length
    return stage.rollout.max_new_tokens * stage.rollout.agent.max_turns


def reference_model(policy: Policy) -> torch.nn.Module:
    """π_ref, the policy as it starts: a frozen copy of its weights, or — with LoRA — the same weights with the
    adapters disabled (`vlrl.models.lora.AdaptersOff`: no second copy of the model)."""
    if policy.lora is not None:
        from vlrl.models.lora import AdaptersOff

        return AdaptersOff(policy.lora)
    return frozen_copy(policy.model)


def prepare_batch(algorithm: Algorithm, policy: Policy | None, trajectories: Sequence[Trajectory], *, step: int,
                  max_new_tokens: int, same_version: torch.Tensor | None = None,
                  baseline_rewards: torch.Tensor | None = None, run_dir: Path | None = None) -> UpdateBatch:
    """Steps 4–5 of an RL step: tensors, the extra no-grad passes, shaped rewards, advantages.
    ``baseline_rewards`` (B,): the reward of the greedy response to each response's prompt (for ``remax``).
    ``run_dir``: where shapers may write analysis files (None: none)."""
    settings = algorithm.settings
    tensors = batch_tensors(trajectories)
    B = len(trajectories)
    loss_mask = mask_truncated(tensors["loss_mask"], tensors["truncated"]) if algorithm.mask_truncated else tensors["loss_mask"]
    # π_old (= π_prox in async) is needed if the weights move before the last minibatch, or for a KL reward
    # penalty; otherwise the update uses logp.detach() of its own forward pass. π_ref only with a KL term.
    # The covariance losses select from π_old before the forward pass, and the rollout correction compares π_old
    # (the trainer's) with the sampler's log-probs: both need the pass; so does distillation (log π_old − log π_T).
    n_updates = settings.ppo_epochs * settings.minibatches
    correction = algorithm.rollout_correction
    teacher = algorithm.teacher
    sampled_distill = teacher is not None and teacher.needs_old
    need_old = (n_updates > 1 or (algorithm.kl_in_reward > 0 and algorithm.reference is not None)
                or settings.cov_selection is not None or correction.enabled or sampled_distill)
    passes = ScoringPasses(algorithm, policy, trajectories)  # whole, or in micro-batches of the token budget
    token_sums = passes.token_sums  # per-token metrics (and perf/shared_prefix_frac's rows), over ranks
    layout = settings.layout
    old_logp, old_argmax = old_pass(passes, policy, settings, argmax=sampled_distill) if need_old else (None, None)
    rollout_weights, corrected = None, {}
    if correction.enabled:  # TIS weights on the loss, MIS-rejected tokens out of the loss and its normaliser
        corr = rollout_correction(old_logp, tensors["behaviour_logp"], loss_mask, tis_cap=correction.tis_cap,
                                  tis_level=correction.tis_level, mis_cap=correction.mis_cap,
                                  mis_level=correction.mis_level)
        loss_mask = corr.loss_mask
        rollout_weights = corr.weights if correction.tis_cap is not None else None
        corrected = {f"policy/{name}": value for name, value in corr.metrics.items()}
    ref_logp = (passes.run(lambda part, sums: score(algorithm.reference, policy, part, settings.temperature,
                                                    layout=layout, sums=sums))
                if algorithm.reference is not None else None)
    values = passes.run(lambda part, _: algorithm.critic.values(part)) if algorithm.critic is not None else None  # (B, R)
    scored = (teacher.score(policy, passes.run, temperature=settings.temperature, layout=layout)
              if teacher is not None else None)  # (B, R) log π_T of the sampled tokens (and its top-k / argmax)
    context = StepContext(policy=policy, reference=algorithm.reference, temperature=settings.temperature, step=step,
                          run_dir=run_dir)
    # reward shaping (per response, per group), then the reward sits on the last model token
    rewards, metrics = algorithm.reward_shaping.apply(RewardShapingInputs(
        rewards=tensors["rewards"], group_index=tensors["group_index"], response_length=tensors["response_length"],
        truncated=tensors["truncated"], max_new_tokens=max_new_tokens, trajectories=trajectories, step=step,
        context=context,
    ))
    token_rewards = place_rewards(rewards, tensors["loss_mask"], tensors["last_index"])  # (B, R)
    if algorithm.kl_in_reward > 0:
        token_rewards, kl = kl_reward_penalty(token_rewards, old_logp, ref_logp, tensors["loss_mask"],
                                              coef=algorithm.kl_in_reward, kind=algorithm.kl_estimator)
        mask = tensors["loss_mask"]  # logged as a token mean over the whole batch (summed over ranks)
        token_sums["policy/kl_ref"] = [float((kl * mask).sum()), float(mask.sum())]
    if "baseline_rewards" in algorithm.needs and baseline_rewards is None:
        raise ValueError("the advantage estimator needs baseline_rewards (greedy responses); the recipe gave none")
    # advantages
    estimate = algorithm.advantage_fn(AdvantageInputs(
        token_rewards=token_rewards, loss_mask=loss_mask, group_index=tensors["group_index"], values=values,
        baseline_rewards=baseline_rewards,
    ))
    advantages, shaping_metrics = algorithm.advantage_shaping.apply(AdvantageShapingInputs(
        advantages=estimate.advantages, loss_mask=loss_mask, group_index=tensors["group_index"],
        rewards=rewards, token_rewards=token_rewards, trajectories=trajectories, step=step, context=context,
    ))  # (B, R)
    if teacher is not None:  # on-policy distillation: Â_t ← w · Â_t − β · (log π_old(y_t) − log π_T(y_t))
        advantages = teacher.advantages(advantages, old_logp, old_argmax, scored, loss_mask, token_sums)
    metrics.update(shaping_metrics)
    metrics.update(corrected)
    return UpdateBatch(
        trajectories=list(trajectories), loss_mask=loss_mask, behaviour_logp=tensors["behaviour_logp"],
        advantages=advantages, old_logp=old_logp, ref_logp=ref_logp if settings.kl_coef > 0 else None,
        group_index=tensors["group_index"], rewards=rewards, token_rewards=token_rewards,
        same_version=same_version if same_version is not None else torch.ones(B, dtype=torch.bool), metrics=metrics,
        old_values=values, returns=estimate.returns if values is not None else None, rollout_weights=rollout_weights,
        token_sums=token_sums, **(scored.batch_fields() if scored is not None else {}),
    )


def old_pass(passes: ScoringPasses, policy: Policy, settings: UpdateSettings, *, argmax: bool
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """π_old's no-grad pass: (B, R) log-probs on the host — and its argmax (B, R) when asked (the sampled
    distillation's ``distill/agreement``, from the same head, `vlrl.models.logprobs.HeadQuery`)."""
    def one(part: list, sums: dict | None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        query = HeadQuery(argmax=True) if argmax else None
        logp = score(policy.model, policy, part, settings.temperature, layout=settings.layout, sums=sums, query=query)
        return (logp, query.result["argmax"].int()) if query is not None else logp

    out = passes.run(one)
    return out if argmax and out is not None else (out, None)


class ScoringPasses:
    """The no-grad passes of `prepare_batch` (π_old, π_ref, the critic's values) over a step's trajectories: one call
    over all of them, or — with ``train.max_tokens_per_micro_batch`` — micro-batches of this rank's rows within the
    budget, as many on every rank (`vlrl.train.microbatch.local_plan`: FSDP2 gathers in each forward), stitched back
    into one (B, R) host tensor. ``token_sums`` collects the passes' ``perf/shared_prefix_frac`` rows."""

    def __init__(self, algorithm: Algorithm, policy: Policy, trajectories: Sequence[Trajectory]) -> None:
        from vlrl.train.microbatch import CostModel, local_plan

        self.trajectories, self.token_sums = list(trajectories), {}
        settings, budget = algorithm.settings, algorithm.settings.max_tokens_per_micro_batch
        self.plan = None
        if budget is not None and policy is not None:
            cost = CostModel.of(policy.model, padding_free=settings.padding_free, shared_prefix=settings.shared_prefix)
            sizes = [cost.size(t.prompt_ids, t.response_ids, t.vision, str(t.sample.id), str(t.group_index))
                     for t in trajectories]
            self.plan = local_plan(range(len(sizes)), sizes.__getitem__, cost, budget, ctx=algorithm.ctx)

    def run(self, fn: Callable[[list[Trajectory], dict | None], Any]) -> Any:
        """``fn(trajectories, sums)`` → (b, R_b, …) host values (or a tuple of them), over the whole batch or its
        micro-batches."""
        if self.plan is None:
            return fn(self.trajectories, self.token_sums)
        width = max(1, max(len(t.response_ids) for t in self.trajectories))
        out, several = None, False
        for micro in self.plan:
            part = fn([self.trajectories[i] for i in micro.rows], None if micro.noop else self.token_sums)
            if micro.noop:
                continue
            several = isinstance(part, tuple)
            parts = part if several else (part,)
            if out is None:
                out = [p.new_zeros(len(self.trajectories), width, *p.shape[2:]) for p in parts]
            for whole, p in zip(out, parts, strict=True):
                whole[list(micro.rows), : p.shape[1]] = p
        return out if out is None or several else out[0]


def batch_tensors(trajectories: Sequence[Trajectory]) -> dict[str, torch.Tensor]:
    """Right-padded (B, R) response tensors — loss mask (0 for failed/aborted), behaviour log-probs — and per
    response (B,): reward, group index, model-token length, truncation flag, index of the last model token."""
    B = len(trajectories)
    R = max(1, max(len(t.response_ids) for t in trajectories))
    loss_mask = torch.zeros(B, R)
    behaviour = torch.zeros(B, R)
    last_index = torch.zeros(B, dtype=torch.long)
    for i, t in enumerate(trajectories):
        n = len(t.response_ids)
        if t.status not in EXCLUDED:
            loss_mask[i, :n] = t.loss_mask.float()
        behaviour[i, :n] = t.behaviour_logp
        model_tokens = t.loss_mask.nonzero()
        last_index[i] = int(model_tokens[-1]) if len(model_tokens) else max(n - 1, 0)
    return {
        "loss_mask": loss_mask, "behaviour_logp": behaviour, "last_index": last_index,
        "rewards": torch.tensor([float(t.reward) for t in trajectories]),
        "group_index": torch.tensor([t.group_index for t in trajectories]),
        "response_length": torch.tensor([t.response_length for t in trajectories]),
        "truncated": torch.tensor([t.status is Status.TRUNCATED for t in trajectories]),
    }


def place_rewards(rewards: torch.Tensor, loss_mask: torch.Tensor, last_index: torch.Tensor) -> torch.Tensor:
    """Outcome rewards (B,) → token rewards (B, R): each on its response's last model token."""
    token_rewards = torch.zeros_like(loss_mask)
    token_rewards[torch.arange(len(rewards)), last_index] = rewards.to(token_rewards.dtype)
    return token_rewards
