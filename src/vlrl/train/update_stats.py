"""What an update measured (`UpdateStats`), in a module of its own: the actor's update (`vlrl.train.update`) and the
critic's (`vlrl.train.critic`) both return one, and the update module depends on the runtime, which holds the critic."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from vlrl.algos.staleness import behaviour_weight_stats


@dataclass
class UpdateStats:
    """What an update measured, kept so that the logged numbers do not depend on how the batch was split into
    micro-batches or over ranks (`merge` pools every rank's record):

    - ``values``: one value per optimizer step and rank, averaged when logged — grad norms, and the losses
      ``policy/loss`` / ``critic/value_loss`` as this rank's sum over its micro-batches of the minibatch (each
      divided by the all-reduced normaliser ÷ W, so the mean over the W ranks is the minibatch's loss);
    - ``token_sums``: per-token statistics (entropy, KL, clip fractions, …) as [Σ value, Σ tokens] over trained
      tokens, logged as their token mean over the whole batch;
    - the behaviour weights and the drift counters, as the tensors and sums they are;
    - ``peaks``: the largest value seen (the costliest micro-batch, `vlrl.train.microbatch`)."""

    values: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    token_sums: dict[str, list[float]] = field(default_factory=dict)  # name -> [Σ value·mask, Σ mask]
    behaviour_weights: list[torch.Tensor] = field(default_factory=list)  # w of every trained token, per micro-batch
    drift_sum: float = 0.0  # Σ |log π_behave − log π_old| over tokens sampled by the trainer's current weights
    drift_tokens: int = 0
    drift_max: float = 0.0  # max of the same gaps (rollout/logprob_diff_max)
    behaviour_capped: int = 0  # trained tokens whose behaviour weight reached the cap (clamped or dropped)
    behaviour_weight_cap: float = 5.0
    skipped: int | None = None  # optimizer steps dropped for a non-finite loss/grad norm (None: on_nonfinite=stop)
    peaks: dict[str, float] = field(default_factory=dict)  # logged as their maximum over steps and ranks

    def peak(self, name: str, value: float) -> None:
        self.peaks[name] = max(self.peaks.get(name, float(value)), float(value))

    def add(self, name: str, value: float) -> None:
        self.values[name].append(float(value))

    def add_tokens(self, name: str, values: torch.Tensor, mask: torch.Tensor) -> None:
        """Pool a per-token statistic (b, R) over the tokens of ``mask``; logged as Σ value / Σ tokens."""
        mask = mask.to(values.dtype)
        total = self.token_sums.setdefault(name, [0.0, 0.0])
        total[0] += float((values.detach() * mask).sum())
        total[1] += float(mask.sum())

    def extend(self, other: UpdateStats) -> None:
        for name, values in other.values.items():
            self.values[name].extend(values)
        for name, (value, tokens) in other.token_sums.items():
            total = self.token_sums.setdefault(name, [0.0, 0.0])
            total[0] += value
            total[1] += tokens
        self.behaviour_weights += other.behaviour_weights
        self.drift_sum += other.drift_sum
        self.drift_tokens += other.drift_tokens
        self.drift_max = max(self.drift_max, other.drift_max)
        if other.skipped is not None:
            self.skipped = max(self.skipped or 0, other.skipped)  # the ranks agree: the same count on each
        self.behaviour_capped += other.behaviour_capped
        for name, value in other.peaks.items():
            self.peak(name, value)

    @classmethod
    def merge(cls, parts: Sequence[UpdateStats]) -> UpdateStats:
        """One record of several (every rank's, in rank order)."""
        merged = cls(behaviour_weight_cap=parts[0].behaviour_weight_cap if parts else 5.0)
        for part in parts:
            merged.extend(part)
        return merged

    def metrics(self) -> dict[str, float]:
        """Means of ``values``, token means of ``token_sums``, ``policy/behaviour_weight_{mean,max,capped_frac}``
        ``policy/logp_drift`` and ``rollout/logprob_diff_{mean,max}`` (the sampler–trainer mismatch, mean = logp_drift)."""
        out = {name: sum(values) / len(values) for name, values in self.values.items() if values}
        out.update({name: value / max(tokens, 1.0) for name, (value, tokens) in self.token_sums.items()})
        out.update(self.peaks)
        weights = torch.cat(self.behaviour_weights) if self.behaviour_weights else torch.zeros(0)
        for name, value in behaviour_weight_stats(weights, torch.ones_like(weights), cap=self.behaviour_weight_cap).items():
            out[f"policy/behaviour_weight_{name}"] = float(value)
        if len(weights):  # counted where it was computed: a dropped token's weight is 0, not the cap
            out["policy/behaviour_weight_capped_frac"] = self.behaviour_capped / len(weights)
        if self.drift_tokens:  # the sampler–trainer mismatch: |behaviour log-prob − π_old| over same-version tokens
            out["policy/logp_drift"] = self.drift_sum / self.drift_tokens
            out["rollout/logprob_diff_mean"] = out["policy/logp_drift"]  # (the name verl users watch)
            out["rollout/logprob_diff_max"] = self.drift_max
        if self.skipped is not None:
            out["train/nonfinite_skipped"] = float(self.skipped)
        return out
