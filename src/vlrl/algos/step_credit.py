"""Step-level credit for structured plans: rule step rewards, forward-proxy step scores, gates, injections.

The embodied seed (2505.22050 + StepOPSD + the EasyR1 fork it describes) turns a trajectory-level GRPO
advantage A^E (B, T) into a per-token advantage by writing a step signal onto the tokens of each plan step:

    additive (``grpo_step``):     A = A^E + ω · A^S                       may flip a step's sign
    multiplicative (``stepopsd``): A = (1 − λ) · A^E + λ · w · A^E,
                                   w = clip(2 σ(sign(A^E) · Δ), 1 − α, 1 + α)   sign-preserving (w > 0)

Steps are carried as index tensors over response tokens (B responses, T tokens, K steps at most):

- ``score_index`` (B, T): the step whose *score source* tokens include token t (``action_id`` value
  tokens, ``action_name`` value tokens, or both = ``semantic``), −1 elsewhere — where a step is judged;
- ``target_index`` (B, T): the step whose *credit target* tokens include token t, −1 elsewhere — where its
  advantage is written. Everything else (JSON scaffolding, reasoning text) keeps A^E.

Step signals, each (B, K) with a validity mask:

- rule (`rule_step_rewards`): +1 for a step that matches the gold plan, −1 otherwise, under ``exact``
  (position i equals gold i), ``prefix`` (inside the longest correct prefix) or ``lcs`` (in a longest
  common subsequence) — registry `STEP_MATCHERS`;
- forward proxy (registry `STEP_PROXIES`): the teacher–student log-prob contrast Δ_t = log p_T(y_t | image,
  reference plan, y_<t) − log p_S(y_t | image, problem, y_<t) aggregated per step: ``contrast`` =
  tanh(normalise(robust_mean Δ) / τ); ``residual_contrast`` = the same on the response-median residual,
  times a decision × budget × confidence gate.

All functions are pure: tensors and lists in, tensors out; the recipe (`vlrl.train.step_credit`) parses
plans, maps spans to tokens and computes the teacher's log-probs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import torch

from vlrl.registry import Registry

STEP_MATCHERS: Registry = Registry("step matcher", signature="fn(predicted: Sequence, gold: Sequence) -> list[bool]")
STEP_PROXIES: Registry = Registry(
    "step proxy", signature="fn(delta, score_index, loss_mask, *, num_steps, **options) -> StepScores"
)
STEP_INJECTIONS: Registry = Registry("step injection", signature="fn(inputs: InjectionInputs, **options) -> Tensor")

MAD_SCALE = 1.4826  # MAD → standard deviation of a normal distribution


# ----------------------------------------------------------------------------------------------- rule steps
@STEP_MATCHERS.register("exact")
def match_exact(predicted: Sequence[Hashable], gold: Sequence[Hashable]) -> list[bool]:
    """Step i is right iff ``predicted[i] == gold[i]`` (steps past the gold plan's end are wrong)."""
    return [i < len(gold) and p == gold[i] for i, p in enumerate(predicted)]


@STEP_MATCHERS.register("prefix")
def match_prefix(predicted: Sequence[Hashable], gold: Sequence[Hashable]) -> list[bool]:
    """Steps inside the longest correct prefix are right; the first wrong step and everything after it are
    wrong (2505.22050's prefix view: once the plan went astray, later steps earn nothing)."""
    n = 0
    while n < min(len(predicted), len(gold)) and predicted[n] == gold[n]:
        n += 1
    return [i < n for i in range(len(predicted))]


@STEP_MATCHERS.register("lcs")
def match_lcs(predicted: Sequence[Hashable], gold: Sequence[Hashable]) -> list[bool]:
    """Steps in a longest common subsequence with the gold plan are right (lenient to inserted or shifted
    steps). The alignment is read from the front with a suffix table, ``L[i][j]`` = LCS length of
    ``predicted[i:]`` and ``gold[j:]``; equal steps are matched at once, and on a tie a predicted step is
    skipped before a gold one (``bac`` vs ``abc`` → ``a``, ``c`` right)."""
    n, m = len(predicted), len(gold)
    table = [[0] * (m + 1) for _ in range(n + 1)]
    for i in range(n - 1, -1, -1):
        for j in range(m - 1, -1, -1):
            table[i][j] = table[i + 1][j + 1] + 1 if predicted[i] == gold[j] else max(table[i + 1][j], table[i][j + 1])
    matched, i, j = [False] * n, 0, 0
    while i < n and j < m:
        if predicted[i] == gold[j] and table[i][j] == table[i + 1][j + 1] + 1:
            matched[i], i, j = True, i + 1, j + 1
        elif table[i + 1][j] >= table[i][j + 1]:
            i += 1
        else:
            j += 1
    return matched


def get_matcher(name: str) -> Callable[[Sequence, Sequence], list[bool]]:
    return STEP_MATCHERS.get(name)


def rule_step_rewards(predicted: Sequence[Hashable], gold: Sequence[Hashable], *, mode: str = "exact") -> list[float]:
    """+1 for every predicted step the matcher ``mode`` accepts, −1 for the others (the seed's rule A^S)."""
    return [1.0 if ok else -1.0 for ok in get_matcher(mode)(predicted, gold)]


def prefix_reward(n: int, k: int) -> float:
    """2505.22050's prefix reward R(n; k) = n(n + 1) / (k(k + 1)) for n correct leading steps of k gold steps."""
    if k <= 0 or not 0 <= n <= k:
        raise ValueError(f"prefix_reward: need 0 ≤ n ≤ k and k ≥ 1, got n={n}, k={k}")
    return n * (n + 1) / (k * (k + 1))


# ----------------------------------------------------------------------------------------------- step tensors
def broadcast_steps(step_values: torch.Tensor, target_index: torch.Tensor) -> torch.Tensor:
    """Per-token values (B, T): token t of response b gets ``step_values[b, target_index[b, t]]``, 0 where
    ``target_index`` is −1 (tokens outside every credit target)."""
    B, T = target_index.shape
    if step_values.shape[1] == 0:
        return torch.zeros(B, T, dtype=step_values.dtype)
    gathered = step_values.gather(1, target_index.clamp(min=0))  # (B, T)
    return torch.where(target_index >= 0, gathered, torch.zeros_like(gathered))


def median(values: torch.Tensor) -> torch.Tensor:
    """The median of a 1-D tensor, the mean of the two middle values for an even count (``torch.median``
    would return the lower one)."""
    return values.float().quantile(0.5)


def robust_mean(values: torch.Tensor, *, clip: float = 2.0) -> torch.Tensor:
    """Winsorised mean of a 1-D tensor: values clipped to median ± clip · 1.4826 · MAD, then averaged.
    One or two values are left as they are (MAD then spans them); a single outlier among ≥ 3 is pulled in.
    (The seed names a ``robust_mean`` without a formula; this is vlrl's.)"""
    if values.numel() == 0:
        return values.new_zeros(())
    center = median(values)
    spread = clip * MAD_SCALE * median((values - center).abs())
    return values.clamp(center - spread, center + spread).mean()


def _members(index_row: torch.Tensor, k: int) -> torch.Tensor:
    return (index_row == k).nonzero().flatten()


def step_reduce(values: torch.Tensor, index: torch.Tensor, num_steps: int, *, robust: bool = True,
                absolute: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-step (robust) mean, token count and token standard deviation of ``values`` (B, T) over the tokens
    of each step in ``index`` (B, T); each (B, K). Empty steps give 0."""
    B = values.shape[0]
    mean = values.new_zeros(B, num_steps)
    count = values.new_zeros(B, num_steps)
    spread = values.new_zeros(B, num_steps)
    for b in range(B):
        for k in range(num_steps):
            members = _members(index[b], k)
            if members.numel() == 0:
                continue
            x = values[b, members].abs() if absolute else values[b, members]
            mean[b, k] = robust_mean(x) if robust else x.mean()
            count[b, k] = members.numel()
            spread[b, k] = x.std(unbiased=False) if members.numel() > 1 else 0.0
    return mean, count, spread


@dataclass
class StepScores:
    """A step signal: ``scores`` (B, K) in [−1, 1] (0 where ``valid`` is False), plus named diagnostics
    of the same shape (``raw``, ``gate``, ...)."""

    scores: torch.Tensor
    valid: torch.Tensor
    parts: dict[str, torch.Tensor] = field(default_factory=dict)


def normalise_steps(raw: torch.Tensor, delta: torch.Tensor, loss_mask: torch.Tensor, mode: str,
                    eps: float = 1e-6) -> torch.Tensor:
    """``none``: raw; ``per_response``: raw / (std of the response's Δ over its loss-mask tokens + ε) — a
    scale normalisation that keeps the sign (centring is the residual gate's job)."""
    if mode == "none":
        return raw
    if mode != "per_response":
        raise ValueError(f"step score normalisation must be 'none' or 'per_response', got {mode!r}")
    mask = loss_mask.to(delta.dtype)
    n = mask.sum(-1).clamp(min=1)
    mean = (delta * mask).sum(-1) / n
    std = (((delta - mean.unsqueeze(-1)) ** 2 * mask).sum(-1) / n).sqrt()  # (B,)
    return raw / (std.unsqueeze(-1) + eps)


@STEP_PROXIES.register("contrast")
def contrast_scores(delta: torch.Tensor, score_index: torch.Tensor, loss_mask: torch.Tensor, *, num_steps: int,
                    tau: float = 1.0, norm: str = "none", robust: bool = True) -> StepScores:
    """Forward-proxy step score (the seed's ``step_squash: contrast``):

        raw_k = robust_mean(Δ_t over the score tokens of step k),   A^S_k = tanh(normalise(raw_k) / τ)

    ``delta`` (B, T) is the teacher–student log-prob contrast; a step with no score token is not valid."""
    raw, count, _ = step_reduce(delta, score_index, num_steps, robust=robust)
    valid = count > 0
    scores = torch.tanh(normalise_steps(raw, delta, loss_mask, norm) / tau) * valid
    return StepScores(scores, valid, {"raw": raw, "tokens": count})


def median_residual(delta: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """d'_t = d_t − median(d over the response's loss-mask tokens), per response; 0 outside the mask."""
    out = torch.zeros_like(delta)
    for b in range(delta.shape[0]):
        members = loss_mask[b].nonzero().flatten()
        if members.numel():
            out[b, members] = delta[b, members] - median(delta[b, members])
    return out


def _within_response_z(values: torch.Tensor, valid: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """(x − mean) / (std + ε) over each response's valid steps (population std); 0 with fewer than 2 steps."""
    mask = valid.to(values.dtype)
    n = mask.sum(-1, keepdim=True)
    mean = (values * mask).sum(-1, keepdim=True) / n.clamp(min=1)
    std = (((values - mean) ** 2 * mask).sum(-1, keepdim=True) / n.clamp(min=1)).sqrt()
    return torch.where(n >= 2, (values - mean) / (std + eps), torch.zeros_like(values)) * mask


@STEP_PROXIES.register("residual_contrast")
def residual_contrast_scores(delta: torch.Tensor, score_index: torch.Tensor, loss_mask: torch.Tensor, *,
                             num_steps: int, tau: float = 1.0, norm: str = "none", robust: bool = True,
                             threshold: float = 0.0, gate_tau: float = 1.0, budget_tau: float = 1.0,
                             min_score_tokens: int = 2) -> StepScores:
    """The seed's residual-contrast gate (``step_gate: residual_contrast``), per response b and step k:

        d'_t        = Δ_t − median(Δ over the response)                       (response-median residual)
        soft_k      = tanh(normalise(robust_mean d' over score tokens) / τ)    direction
        imp_k       = robust_mean |d'| over score tokens                       importance
        decision_k  = σ((z(imp)_k − threshold) / gate_tau)                     z within the response
        budget_k    = clamp(softmax_k(imp / budget_tau) · K_b, 0, 1)           K_b = the response's steps
        confidence_k = min(1, n_k / min_score_tokens) · 1 / (1 + std_k(d'))    length × agreement
        A^S_k       = decision_k · budget_k · confidence_k · soft_k

    The seed gives ``confidence = len_gate · var_gate`` without the var gate's formula; 1 / (1 + std of the
    step's residuals) is vlrl's (steps whose tokens disagree are trusted less).
    """
    residual = median_residual(delta, loss_mask)
    raw, count, spread = step_reduce(residual, score_index, num_steps, robust=robust)
    importance, _, _ = step_reduce(residual, score_index, num_steps, robust=robust, absolute=True)
    valid = count > 0
    soft = torch.tanh(normalise_steps(raw, delta, loss_mask, norm) / tau)
    decision = torch.sigmoid((_within_response_z(importance, valid) - threshold) / gate_tau)
    logits = torch.where(valid, importance / budget_tau, torch.full_like(importance, -math.inf))
    steps_per_response = valid.sum(-1, keepdim=True).to(delta.dtype)
    weights = torch.where(steps_per_response > 0, torch.softmax(logits, dim=-1), torch.zeros_like(logits))
    budget = (weights.nan_to_num(0.0) * steps_per_response).clamp(0.0, 1.0)
    confidence = (count / max(min_score_tokens, 1)).clamp(max=1.0) / (1.0 + spread)
    gate = decision * budget * confidence * valid
    return StepScores(gate * soft, valid, {"raw": raw, "soft": soft * valid, "importance": importance,
                                           "decision": decision * valid, "budget": budget, "confidence": confidence * valid,
                                           "gate": gate, "tokens": count})


# ----------------------------------------------------------------------------------------------- injection
@dataclass
class InjectionInputs:
    """What an injection may use. Shapes (B, T)."""

    episode_advantages: torch.Tensor  # A^E: the trajectory-level (e.g. GRPO) advantage on every response token
    step_advantages: torch.Tensor  # A^S on credit-target tokens, 0 elsewhere (and for unparsed responses)
    delta: torch.Tensor  # Δ on credit-target tokens, 0 elsewhere: StepOPSD's signal
    target_mask: torch.Tensor  # 1 on credit-target tokens
    loss_mask: torch.Tensor  # 1 = the model's token


@STEP_INJECTIONS.register("grpo_step")
def grpo_step(inputs: InjectionInputs, *, weight: float = 1.0) -> torch.Tensor:
    """Additive step advantage (the seed's ``grpo_step`` estimator): A = A^E + ω · A^S on the model's tokens.

    A step judged right (A^S > 0) inside a failed trajectory (A^E < 0) can turn positive, and a wrong step
    of a successful one negative — the sign may flip. ω = 0 (or A^S = 0) gives back A^E exactly."""
    return (inputs.episode_advantages + weight * inputs.step_advantages * inputs.target_mask) * inputs.loss_mask


@STEP_INJECTIONS.register("stepopsd")
def stepopsd(inputs: InjectionInputs, *, alpha: float = 0.5, mix: float = 1.0) -> torch.Tensor:
    """StepOPSD's sign-preserving reweighting (arXiv:2605.27140):

        w = clip(2 σ(sign(A) · Δ), 1 − α, 1 + α),    Ã = (1 − λ) · A + λ · w · A     (λ = ``mix``)

    on credit-target tokens (elsewhere Δ = 0, so w = 2σ(0) = 1 and Ã = A). w > 0 whenever α < 1, so Ã has
    the sign of A: a step can be punished less or more, never rewarded inside a failed trajectory."""
    if not 0.0 <= alpha < 1.0:
        raise ValueError(f"stepopsd: alpha must be in [0, 1) so that w stays positive, got {alpha}")
    if not 0.0 <= mix <= 1.0:
        raise ValueError(f"stepopsd: mix (λ) must be in [0, 1], got {mix}")
    advantage = inputs.episode_advantages
    delta = inputs.delta * inputs.target_mask
    w = (2.0 * torch.sigmoid(torch.sign(advantage) * delta)).clamp(1.0 - alpha, 1.0 + alpha)
    return ((1.0 - mix) * advantage + mix * w * advantage) * inputs.loss_mask


def get_injection(name: str):
    return STEP_INJECTIONS.get(name)


# ----------------------------------------------------------------------------------------------- analysis
@dataclass
class FlipCounts:
    """Sign changes of the advantage over a set of tokens: ``flips`` of ``signed`` tokens (A^E ≠ 0) turned
    to the opposite sign; ``new_signal`` of ``unsigned`` tokens (A^E = 0, e.g. a group with equal rewards)
    got a non-zero advantage."""

    flips: int = 0
    signed: int = 0
    new_signal: int = 0
    unsigned: int = 0

    def add(self, other: FlipCounts) -> FlipCounts:
        return FlipCounts(self.flips + other.flips, self.signed + other.signed, self.new_signal + other.new_signal,
                          self.unsigned + other.unsigned)

    @property
    def ratio(self) -> float | None:
        return self.flips / self.signed if self.signed else None


def flip_counts(episode: torch.Tensor, final: torch.Tensor, mask: torch.Tensor) -> FlipCounts:
    """Count sign flips sign(A) ≠ sign(A^E) over the tokens where ``mask`` (B, T) is true (the seed's
    ``sign_flip_ratio`` over action tokens, split into A^E ≠ 0 and A^E = 0)."""
    mask = mask.bool()
    signed = mask & (episode != 0)
    unsigned = mask & (episode == 0)
    flipped = signed & (torch.sign(final) != torch.sign(episode))
    return FlipCounts(int(flipped.sum()), int(signed.sum()), int((unsigned & (final != 0)).sum()), int(unsigned.sum()))
