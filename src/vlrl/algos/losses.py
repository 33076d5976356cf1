"""Policy losses (one registry, one signature) and the aggregation of per-token losses.

A policy loss is ``fn(inputs: PolicyLossInputs, *, clip_low, clip_high, **options) -> LossOutput`` (`PolicyLoss`):
per-token losses (B, T) and per-token metric indicators (B, T) that the recipe averages over ``loss_mask``. Every
argument it receives is named by the contract: its inputs, the clip range every loss takes (``algo.clip_low`` /
``algo.clip_high``), the behaviour weight's ``cap`` and ``behaviour_weight_mode`` for a loss that applies it
(``decoupled``), and its own options (``algo.policy_loss_options``) — `bind_policy_loss` binds all of them once. Aggregation into a scalar
is a separate function, `aggregate`, with an explicit normaliser so that gradient accumulation and data
parallelism reproduce the gradient of one big batch.

Token-level losses (``ppo_clip``, ``dual_clip``, ``decoupled``, ``cispo``, ``gspo_token``) give each token its
own loss. Sequence-level losses (``gspo``, ``gmpo``) compute one loss L_i per response and put it on every
one of its model tokens, so that ``seq_mean_token_mean`` gives the papers' 1/G Σ_i L_i exactly (``token_mean``
would weight each response by its length). The entropy- and covariance-based losses (``entropy_bonus``,
``entropy_advantage``, ``clip_cov``, ``kl_cov``) live in `vlrl.algos.entropy_methods`, in the same registry.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from vlrl.registry import Registry


@dataclass
class PolicyLossInputs:
    """Shapes: B sequences, T response tokens."""

    logp: torch.Tensor  # (B, T) log π_θ, with grad
    old_logp: torch.Tensor  # (B, T) log π_old (the proximal policy in decoupled PPO), no grad
    advantages: torch.Tensor  # (B, T)
    loss_mask: torch.Tensor  # (B, T)
    behaviour_logp: torch.Tensor | None = None  # (B, T) log π_behave recorded at sampling
    entropy: torch.Tensor | None = None  # (B, T) token entropy of π_θ from the same forward pass, with grad
    cov_selection: torch.Tensor | None = None  # (B, T) bool: Clip-Cov / KL-Cov tokens chosen over the whole
    #   minibatch (`vlrl.algos.entropy_methods`); None → the loss selects within the rows it is given


@dataclass
class LossOutput:
    per_token_loss: torch.Tensor  # (B, T)
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> (B, T) values, masked-mean'd


class PolicyLoss(Protocol):
    """The contract of a registered policy loss: its inputs, the clip range (every loss takes ``clip_low`` and
    ``clip_high``; `tests/algos/test_losses.py` checks each one), and keyword-only options of its own. A loss that
    applies the behaviour weight itself (``applies_behaviour_weight``) also takes ``cap`` and
    ``behaviour_weight_mode``."""

    def __call__(self, inputs: PolicyLossInputs, *, clip_low: float, clip_high: float, **options: Any) -> LossOutput:
        ...


BoundLoss = Callable[[PolicyLossInputs], LossOutput]  # a policy loss with every argument but its inputs bound

POLICY_LOSSES: Registry[PolicyLoss] = Registry(
    "policy loss", signature="fn(inputs: PolicyLossInputs, *, clip_low: float, clip_high: float, **options) -> LossOutput")


POLICY_LOSS_INPUTS = ("behaviour_logp", "entropy")  # the optional `PolicyLossInputs` a loss may need


def register_policy_loss(name: str, *, needs: tuple[str, ...] = ()):
    """Decorator: register a policy loss. ``needs`` names the optional `PolicyLossInputs` fields it cannot do
    without (``behaviour_logp``, ``entropy``), so the update fills them in without knowing the loss's name."""
    unknown = set(needs) - set(POLICY_LOSS_INPUTS)
    if unknown:
        raise ValueError(f"policy loss {name!r}: unknown needs {sorted(unknown)}; choose from {POLICY_LOSS_INPUTS}")

    def decorator(fn):
        fn.needs = frozenset(needs)
        return POLICY_LOSSES.register(name)(fn)

    return decorator


def policy_loss_needs(fn) -> frozenset[str]:
    """The optional inputs a policy loss (registered, bound with `functools.partial`, or a plug-in with a
    ``needs`` attribute) requires: a subset of ``POLICY_LOSS_INPUTS``."""
    return frozenset(getattr(getattr(fn, "func", fn), "needs", ()))


def require(inputs: PolicyLossInputs, field_name: str, loss: str) -> torch.Tensor:
    """``inputs.<field_name>``, or a ValueError naming the loss and what the update must provide."""
    value = getattr(inputs, field_name)
    if value is None:
        what = {"behaviour_logp": "the log-probs recorded at sampling",
                "entropy": "the per-token entropy of π_θ from the update's forward pass"}[field_name]
        raise ValueError(f"{loss}: needs {field_name} ({what})")
    return value


def get_policy_loss(name: str):
    """Look up a policy loss by name (``ppo_clip``) or dotted path ``pkg.mod:fn``."""
    return POLICY_LOSSES.get(name)


@register_policy_loss("ppo_clip")
def ppo_clip(inputs: PolicyLossInputs, *, clip_low: float = 0.2, clip_high: float = 0.2) -> LossOutput:
    """PPO clipped surrogate with asymmetric clip (DAPO "clip-higher", eq. 10; LLaVA-OV-1.5 ε=0.2, ε′=0.28).

        r_t = exp(log π_θ − log π_old)
        L_t = max(−A_t · r_t, −A_t · clip(r_t, 1 − ε_low, 1 + ε_high))

    Metrics: ``clip_low`` / ``clip_high`` mark tokens whose gradient the clip removed (A < 0 with
    r < 1 − ε_low, A > 0 with r > 1 + ε_high); ``ratio`` is r_t.
    """
    log_ratio = (inputs.logp - inputs.old_logp).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)  # (B, T)
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    A = inputs.advantages
    loss = torch.maximum(-A * ratio, -A * clipped)  # (B, T)
    with torch.no_grad():
        metrics = {
            "clip_low": ((A < 0) & (ratio < 1.0 - clip_low)).float(),
            "clip_high": ((A > 0) & (ratio > 1.0 + clip_high)).float(),
            "ratio": ratio.detach(),
        }
    return LossOutput(per_token_loss=loss, metrics=metrics)


@register_policy_loss("dual_clip")
def dual_clip(inputs: PolicyLossInputs, *, clip_low: float = 0.2, clip_high: float = 0.2,
              clip_ratio_c: float = 3.0) -> LossOutput:
    """Dual-clip PPO (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep RL"; verl
    ``clip_ratio_c``): PPO clip plus a lower bound on the objective of negative-advantage tokens,

        L_t = max(−A_t · r_t, −A_t · clip(r_t, 1 − ε_low, 1 + ε_high))          (ppo_clip)
        L_t ← min(L_t, −A_t · c)   where A_t < 0                                  c > 1 (3.0)

    so a token the policy already made far more likely (r ≫ 1) with A < 0 cannot produce an unbounded
    loss; such tokens get no gradient. Metric ``clip_dual``: tokens where the second clip was active.
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"dual_clip: clip_ratio_c must be > 1, got {clip_ratio_c}")
    out = ppo_clip(inputs, clip_low=clip_low, clip_high=clip_high)
    A = inputs.advantages
    bound = -A * clip_ratio_c  # (B, T)
    dual = (A < 0) & (out.per_token_loss > bound)
    loss = torch.where(dual, bound, out.per_token_loss)
    out.metrics["clip_dual"] = dual.float()
    return LossOutput(per_token_loss=loss, metrics=out.metrics)


BEHAVIOUR_WEIGHT_MODES = ("clamp", "drop")


def behaviour_weight(proximal_logp: torch.Tensor, behaviour_logp: torch.Tensor, *, cap: float = 5.0,
                     mode: str = "clamp") -> tuple[torch.Tensor, torch.Tensor]:
    """The decoupled loss's behaviour weight, no gradient, and where it reached the cap, each (B, T):

        clamp (the LLaVA-OV-1.5 seed's BehavWeight):  w_t = min(exp(log π_prox − log π_behave), cap)
        drop  (AReaL ``behav_imp_weight_cap``):        w_t = exp(log π_prox − log π_behave) if ≤ cap, else 0

    ``drop`` leaves the tokens whose weight exceeds the cap out of the loss (they still count in the
    normaliser, as in AReaL); ``clamp`` keeps them at weight ``cap``. Computed as exp(min(Δ, log cap)), so a
    huge Δ never overflows.
    """
    if cap <= 0:
        raise ValueError(f"behaviour weight: cap must be > 0, got {cap}")
    if mode not in BEHAVIOUR_WEIGHT_MODES:
        raise ValueError(f"behaviour weight: unknown mode {mode!r}; choose from {BEHAVIOUR_WEIGHT_MODES}")
    delta = (proximal_logp - behaviour_logp).detach()  # (B, T) log π_prox − log π_behave
    over = delta > math.log(cap)
    w = torch.exp(delta.clamp(max=math.log(cap)))
    if mode == "drop":
        w = torch.where(over, torch.zeros_like(w), w)
    return w, delta >= math.log(cap)


@register_policy_loss("decoupled", needs=("behaviour_logp",))
def decoupled(inputs: PolicyLossInputs, *, clip_low: float = 0.2, clip_high: float = 0.2, cap: float = 5.0,
              behaviour_weight_mode: str = "clamp", clip_ratio_c: float | None = None) -> LossOutput:
    """Decoupled PPO of AReaL (LLaVA-OV-1.5 RL seed, "GRPO Algorithm & AReaL Async Framework"):

        r_t = exp(log π_θ − log π_prox)                                  ratio against the proximal policy
        w_t = min(exp(log π_prox − log π_behave), cap)                  behaviour weight, no gradient (cap 5.0)
        L_t = w_t · max(−A_t · r_t, −A_t · clip(r_t, 1 − ε_low, 1 + ε_high))

    ``old_logp`` is π_prox (the weights at the start of the step) and ``behaviour_logp`` π_behave (the
    weights that sampled). This loss applies w itself (``applies_behaviour_weight``), so the update does not
    apply it a second time. Options:

    - ``behaviour_weight_mode``: ``clamp`` (default, the seed's) or ``drop`` — AReaL's filter, w_t = 0 for
      the tokens whose weight exceeds ``cap`` (see `behaviour_weight`);
    - ``clip_ratio_c``: dual-clip (`dual_clip`, AReaL ``c_clip``) of the PPO term before the weight,
      min(·, −A_t · c) where A_t < 0; None (default) leaves it out.

    Metrics ``behaviour_weight_capped`` (tokens whose weight reached the cap: clamped, or dropped) and, with
    dual-clip, ``clip_dual``.
    """
    behaviour = require(inputs, "behaviour_logp", "decoupled")
    if clip_ratio_c is None:
        out = ppo_clip(inputs, clip_low=clip_low, clip_high=clip_high)
    else:
        out = dual_clip(inputs, clip_low=clip_low, clip_high=clip_high, clip_ratio_c=clip_ratio_c)
    w, capped = behaviour_weight(inputs.old_logp, behaviour, cap=cap, mode=behaviour_weight_mode)
    out.metrics["behaviour_weight_capped"] = capped.float()
    return LossOutput(per_token_loss=w * out.per_token_loss, metrics=out.metrics)


decoupled.applies_behaviour_weight = True


def sequence_mean(values: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Mean of each row over its model tokens, (B, T) → (B,); 0 for a row without any."""
    mask = loss_mask.to(values.dtype)
    return (values * mask).sum(-1) / mask.sum(-1).clamp(min=1)


def _per_sequence(loss: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A per-sequence quantity (B,) on every token of its row, (B, T)."""
    return loss.unsqueeze(-1).expand_as(like)


@register_policy_loss("gspo")
def gspo(inputs: PolicyLossInputs, *, clip_low: float = 3e-4, clip_high: float = 4e-4) -> LossOutput:
    """GSPO, sequence-level (Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv:2507.18071):

        s_i = (π_θ(y_i) / π_old(y_i))^{1/|y_i|} = exp(mean_t (log π_θ − log π_old))     over y_i's model tokens
        L_i = max(−Â_i · s_i, −Â_i · clip(s_i, 1 − ε_low, 1 + ε_high))                     Â_i = mean_t Â_t

    The paper's ranges are tiny because s_i is a per-token geometric mean: ε_low = 3e-4, ε_high = 4e-4 (the
    defaults here; the recipe passes ``algo.clip_low`` / ``clip_high``). A clipped sequence gives no gradient
    to any of its tokens. L_i sits on every model token of response i: aggregate with ``seq_mean_token_mean``
    for the paper's 1/G Σ_i L_i. GSPO assumes one advantage per response; with token advantages their mean
    is used (``gspo_token`` keeps them). Metrics: ``clip_low`` / ``clip_high`` (tokens of sequences whose
    clip removed the gradient), ``ratio`` (s_i on its tokens).
    """
    mask = inputs.loss_mask
    log_s = sequence_mean(inputs.logp - inputs.old_logp, mask).clamp(-20.0, 20.0)  # (B,)
    s = torch.exp(log_s)
    A = sequence_mean(inputs.advantages, mask)  # (B,)
    loss = torch.maximum(-A * s, -A * s.clamp(1.0 - clip_low, 1.0 + clip_high))  # (B,)
    with torch.no_grad():
        metrics = {
            "clip_low": _per_sequence(((A < 0) & (s < 1.0 - clip_low)).float(), mask),
            "clip_high": _per_sequence(((A > 0) & (s > 1.0 + clip_high)).float(), mask),
            "ratio": _per_sequence(s.detach(), mask),
        }
    return LossOutput(per_token_loss=_per_sequence(loss, inputs.logp), metrics=metrics)


@register_policy_loss("gspo_token")
def gspo_token(inputs: PolicyLossInputs, *, clip_low: float = 3e-4, clip_high: float = 4e-4) -> LossOutput:
    """GSPO-token (Zheng et al. 2025, §4.3): GSPO's sequence ratio with per-token advantages,

        s_{i,t} = sg[s_i] · π_θ(y_{i,t}) / sg[π_θ(y_{i,t})]          (value s_i, gradient of log π_θ(y_{i,t}))
        L_{i,t} = max(−Â_{i,t} · s_{i,t}, −Â_{i,t} · clip(s_{i,t}, 1 − ε_low, 1 + ε_high))

    With one advantage per response its gradient equals ``gspo``'s under ``seq_mean_token_mean`` (as the
    paper notes; tested). Defaults ε = 3e-4 / 4e-4 as in ``gspo``; metrics as in ``gspo``.
    """
    mask = inputs.loss_mask
    log_s = sequence_mean(inputs.logp - inputs.old_logp, mask).clamp(-20.0, 20.0).detach()  # (B,) sg[log s_i]
    s_t = torch.exp(inputs.logp - inputs.logp.detach() + log_s.unsqueeze(-1))  # (B, T), value s_i
    A = inputs.advantages
    loss = torch.maximum(-A * s_t, -A * s_t.clamp(1.0 - clip_low, 1.0 + clip_high))
    with torch.no_grad():
        s = _per_sequence(torch.exp(log_s), mask)
        metrics = {
            "clip_low": ((A < 0) & (s < 1.0 - clip_low)).float(),
            "clip_high": ((A > 0) & (s > 1.0 + clip_high)).float(),
            "ratio": s,
        }
    return LossOutput(per_token_loss=loss, metrics=metrics)


@register_policy_loss("cispo")
def cispo(inputs: PolicyLossInputs, *, clip_low: float = 1.0, clip_high: float = 0.28) -> LossOutput:
    """CISPO (MiniMax-M1, 2025, arXiv:2506.13585, §3.1): clip the importance weight, not the update — every token keeps
    a gradient,

        r_t = exp(log π_θ − log π_old)
        L_t = −sg[clip(r_t, 1 − ε_low, 1 + ε_high)] · Â_t · log π_θ(y_t)          sg = no gradient

    so ∂L_t/∂log π_θ = −clip(r_t) · Â_t. MiniMax-M1 sets no lower bound (ε_low large: the default 1.0 gives
    a floor of 0) and tunes only ε_high (not published; 0.28 here, as Trinity-RFT's default). Metrics
    ``clip_low`` / ``clip_high``: tokens whose weight was clipped (their gradient is scaled, not removed);
    ``ratio``: r_t.
    """
    log_ratio = (inputs.logp - inputs.old_logp).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio).detach()  # (B, T)
    weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)  # no gradient
    loss = -weight * inputs.advantages * inputs.logp
    metrics = {"clip_low": (ratio < 1.0 - clip_low).float(), "clip_high": (ratio > 1.0 + clip_high).float(),
               "ratio": ratio}
    return LossOutput(per_token_loss=loss, metrics=metrics)


@register_policy_loss("gmpo")
def gmpo(inputs: PolicyLossInputs, *, clip_low: float = 0.4, clip_high: float = 0.4) -> LossOutput:
    """GMPO (Zhao et al. 2025, "Geometric-Mean Policy Optimization", arXiv:2507.20673): the geometric mean of the token
    ratios instead of their arithmetic mean, clipped token by token in log space,

        Δ_t  = log π_θ(y_t) − log π_old(y_t)
        Δ̃_t  = sgn(Â_t) · min(sgn(Â_t) · Δ_t, sgn(Â_t) · clip(Δ_t, −ε_low, ε_high))      PPO's min, in log space
        ρ_i  = exp(mean_t Δ̃_t)                                                            over y_i's model tokens
        L_i  = −Â_i · ρ_i                                                                  Â_i = mean_t Â_t

    ε are log-space bounds: the paper's (e^{−0.4}, e^{0.4}) is ε_low = ε_high = 0.4 (the defaults here; the
    recipe passes ``algo.clip_low`` / ``clip_high``). A token whose clip binds (Â > 0 with Δ > ε_high,
    Â < 0 with Δ < −ε_low) gets no gradient; the others get −Â_i · ρ_i / |y_i| · ∂Δ_t. L_i sits on every
    model token of response i: aggregate with ``seq_mean_token_mean`` (verl ``geo_mean``: the mean over
    sequences). Metrics ``clip_low`` / ``clip_high`` (tokens whose clip bound), ``ratio`` (ρ_i on its tokens).
    """
    mask = inputs.loss_mask
    delta = (inputs.logp - inputs.old_logp).clamp(-20.0, 20.0)  # (B, T)
    sign = torch.sign(inputs.advantages)
    clipped = sign * torch.minimum(sign * delta, sign * delta.clamp(-clip_low, clip_high))  # (B, T)
    rho = torch.exp(sequence_mean(clipped, mask))  # (B,)
    A = sequence_mean(inputs.advantages, mask)  # (B,)
    loss = -A * rho
    with torch.no_grad():
        metrics = {
            "clip_low": ((inputs.advantages < 0) & (delta < -clip_low)).float(),
            "clip_high": ((inputs.advantages > 0) & (delta > clip_high)).float(),
            "ratio": _per_sequence(rho.detach(), mask),
        }
    return LossOutput(per_token_loss=_per_sequence(loss, inputs.logp), metrics=metrics)


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, *, clip: float = 0.2) -> LossOutput:
    """Clipped value loss of PPO (the critic of ``gae``; verl ``compute_value_loss``, OpenAI baselines):

        V_clip = V_old + clip(V − V_old, −ε_v, ε_v)
        L_t = ½ · max((V − R_t)², (V_clip − R_t)²)

    ``old_values`` are the critic's values when the batch was prepared, ``returns`` R the GAE targets.
    Metric ``value_clip``: tokens where V left the clip range (|V − V_old| > ε_v) and the clipped error was the
    larger one (no gradient through V there). Inside the range V_clip = V, so the two errors are equal —
    floating point may put them an ulp apart, which is not a clip. Aggregate it with `aggregate` like a policy loss.
    """
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    unclipped_error = (values - returns) ** 2
    clipped_error = (clipped - returns) ** 2
    loss = 0.5 * torch.maximum(unclipped_error, clipped_error)  # (B, T)
    active = ((values - old_values).abs() > clip) & (clipped_error > unclipped_error)
    return LossOutput(per_token_loss=loss, metrics={"value_clip": active.float().detach()})


def applies_behaviour_weight(fn) -> bool:
    """True for a policy loss that multiplies by the behaviour weight itself (``decoupled``)."""
    return bool(getattr(getattr(fn, "func", fn), "applies_behaviour_weight", False))


def bind_policy_loss(name: str, *, clip_low: float, clip_high: float, behaviour_weight_cap: float = 5.0,
                     behaviour_weight_mode: str = "clamp", options: Mapping[str, Any] | None = None) -> BoundLoss:
    """The policy loss ``name`` (registered, or ``pkg.mod:fn``) with every argument of `PolicyLoss` bound but its
    inputs: the clip range, the behaviour weight's cap and mode when the loss applies the weight itself, and its own
    ``options``. The one place a loss is bound (the update's and the config check's probes use the same)."""
    loss = get_policy_loss(name)
    bound: dict[str, Any] = dict(clip_low=clip_low, clip_high=clip_high)
    if applies_behaviour_weight(loss):
        bound.update(cap=behaviour_weight_cap, behaviour_weight_mode=behaviour_weight_mode)
    return functools.partial(loss, **bound, **dict(options or {}))


def check_zero_at_zero_advantage(loss_fn: BoundLoss, name: str) -> None:
    """``train.skip_zero_advantage`` is exact only for a policy loss that is 0 wherever Â = 0 (Â · f(ratio), or
    an advantage shaped to stay 0 there like ``entropy_advantage``; not ``entropy_bonus`` or ``kl_cov``); probe
    the bound loss once on random log-probs and entropies and refuse it otherwise."""
    g = torch.Generator().manual_seed(0)
    logp, old = -torch.rand(2, 3, generator=g), -torch.rand(2, 3, generator=g)
    out = loss_fn(PolicyLossInputs(logp=logp, old_logp=old, advantages=torch.zeros(2, 3), loss_mask=torch.ones(2, 3),
                                   behaviour_logp=old - 0.1, entropy=torch.rand(2, 3, generator=g)))
    if bool((out.per_token_loss != 0).any()):
        raise ValueError(f"train.skip_zero_advantage: algo.policy_loss={name!r} is not 0 where the advantage is 0, "
                         "so leaving those sequences out would change the gradient; set it to false")


def minibatch_selection(fn):
    """The function a covariance loss (``clip_cov``, ``kl_cov``) chooses its tokens with over a whole minibatch,
    ``select(old_logp, advantages, loss_mask, *, generator, **loss options) -> (B, T) bool``, with the options
    bound in ``fn`` (a `functools.partial`) bound to it too; None for every other loss."""
    base = getattr(fn, "func", fn)
    select = getattr(base, "minibatch_selection", None)
    if select is None:
        return None
    return functools.partial(select, **getattr(fn, "keywords", {}))


AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")


def aggregate(
    per_token: torch.Tensor, loss_mask: torch.Tensor, mode: str = "token_mean", *, normaliser: float | None = None,
    max_length: int | None = None,
) -> torch.Tensor:
    """Reduce per-token losses (B, T) to a scalar.

    - ``token_mean`` (DAPO eq. 12): Σ_i Σ_t l_it / N_tokens — every token weighs the same.
    - ``seq_mean_token_mean`` (GRPO eq. 5): Σ_i (Σ_t l_it / |o_i|) / N_seqs.
    - ``seq_mean_token_sum`` (Dr.GRPO): Σ_i Σ_t l_it / N_seqs — no length normalisation.
    - ``seq_mean_token_sum_norm`` (Dr.GRPO's constant normaliser, as in its code): Σ_i Σ_t l_it / (N_seqs · L),
      L a constant for the whole run (``max_length``, e.g. the rollout's ``max_new_tokens``) — the gradient
      of ``seq_mean_token_sum`` scaled by 1/L, so that its size matches ``token_mean`` on full-length
      responses. (verl's ``seq-mean-token-sum-norm`` divides by L only, not by N_seqs.)

    ``normaliser`` is the whole denominator of the *whole* optimiser batch, across micro-batches and ranks:
    N_tokens (token_mean), N_seqs (the seq modes) or N_seqs · L (seq_mean_token_sum_norm), from
    `normaliser_for`; by default that of this call's tensors (correct only for one micro-batch).
    """
    mask = loss_mask.to(per_token.dtype)
    if mode == "token_mean":
        total = (per_token * mask).sum()
    elif mode == "seq_mean_token_mean":
        total = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).sum()
    elif mode in ("seq_mean_token_sum", "seq_mean_token_sum_norm"):
        total = (per_token * mask).sum()
    else:
        raise ValueError(f"unknown loss aggregation {mode!r}; choose from {AGGREGATIONS}")
    denominator = normaliser_for(mode, loss_mask, max_length=max_length) if normaliser is None else normaliser
    return total / max(float(denominator), 1.0)


def normaliser_for(mode: str, loss_mask: torch.Tensor, *, max_length: int | None = None) -> float:
    """The denominator `aggregate` needs for ``mode`` over a whole batch's ``loss_mask`` (B, T): N_tokens,
    N_seqs (sequences with at least one model token), or N_seqs · ``max_length`` for ``seq_mean_token_sum_norm``
    (required there: a constant L, never the padded width, which changes with every micro-batch and rank).
    Under data parallelism each rank's value is summed over ranks (all counts are additive)."""
    if mode not in AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {mode!r}; choose from {AGGREGATIONS}")
    if mode == "token_mean":
        return float(loss_mask.sum())
    sequences = float((loss_mask.sum(-1) > 0).sum())
    if mode == "seq_mean_token_sum_norm":
        if max_length is None or max_length < 1:
            raise ValueError("seq_mean_token_sum_norm: needs max_length ≥ 1, Dr.GRPO's constant L (e.g. the "
                             f"rollout's max_new_tokens), got {max_length}")
        return sequences * max_length
    return sequences


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1)
