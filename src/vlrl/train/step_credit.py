"""Step-level credit in the RL step: plan → token spans → step signal → injected advantages (+ analysis).

For every response of the batch (the embodied seed's ``grpo_step`` path, as one advantage shaper):

    1. spans     decode, `locate_plan`, map each step's action_id / action_name value to response tokens
                 (`token_char_offsets`: tokenizer offsets when re-tokenisation round-trips, else prefix decoding)
    2. signal    rule: ±1 per step from matching the gold plan (exact / prefix / lcs on the score source);
                 forward_proxy: Δ_t = log p_T(y_t | image, problem + reference plan, y_<t)
                                      − log p_T(y_t | image, problem, y_<t)
                 scored per step by a `STEP_PROXIES` entry (contrast, or the residual-contrast gate)
    3. inject    A = A^E + ω A^S (grpo_step) or StepOPSD's sign-preserving reweighting, on credit-target tokens
    4. analysis  sign flips over action tokens (by trajectory success and step correctness), the proxy's
                 A^S on rule-correct vs rule-wrong steps, and per-token advantage heatmaps

A response whose plan cannot be located gets A^S = 0 (plain GRPO on it) and is counted (``parse_failures``).
The teacher is the policy itself, a frozen copy of the policy as it was at the first step (``reference``),
or a model path; it must share the policy's tokenizer (it scores the policy's token ids).
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from vlrl.algos.shaping import AdvantageShapingInputs, ShapingOutput, register_advantage_shaping
from vlrl.algos.step_credit import (
    STEP_PROXIES,
    FlipCounts,
    InjectionInputs,
    broadcast_steps,
    flip_counts,
    get_injection,
    get_matcher,
)
from vlrl.data.tasks.embodied import REFERENCE_TEMPLATE, with_reference
from vlrl.models import Policy
from vlrl.models.forward import score
from vlrl.models.spans import token_char_offsets
from vlrl.registry import RegistryError
from vlrl.rewards.plan import locate_plan, plan_steps
from vlrl.train.common import frozen_copy

Source = Literal["action_id", "action_name", "semantic"]


class StepCreditOptions(BaseModel):
    """Options of the ``step_credit`` advantage shaper (``algo.advantage_shaping: [{name: step_credit, options: {...}}]``)."""

    model_config = ConfigDict(extra="forbid")

    signal: Literal["rule", "forward_proxy"] = Field(
        "rule", description="Step signal: rule (match the gold plan) or forward_proxy (teacher log-prob contrast).")
    injection: str = Field(
        "grpo_step", description="How A^S enters: grpo_step (A = A^E + ω·A^S, may flip signs) or stepopsd "
        "(sign-preserving w·A^E), or a dotted path 'pkg.mod:fn' (vlrl.algos.step_credit.STEP_INJECTIONS).")
    weight: float = Field(1.0, ge=0, description="ω of grpo_step: weight of the step advantage (the seed's step_advantage_w).")
    match: str = Field("exact", description="Rule matching of predicted to gold steps: exact, prefix or lcs "
                       "(STEP_MATCHERS); also decides which steps count as correct in the analysis.")
    score_source: Source = Field(
        "action_id", description="What judges a step: the action_id value, the action_name value, or semantic (both; "
        "rule: both must match; forward_proxy: Δ over both fields' tokens).")
    credit_target: Source = Field(
        "semantic", description="Tokens that receive the step's advantage: action_id, action_name or semantic (both).")
    proxy: str = Field("contrast", description="Forward-proxy step score: contrast (tanh of the robust mean Δ) or "
                       "residual_contrast (median residual × decision/budget/confidence gate), or 'pkg.mod:fn'.")
    tau: float = Field(1.0, gt=0, description="Temperature τ of the proxy's tanh squash (the seed's step_score_tau).")
    norm: Literal["none", "per_response"] = Field(
        "none", description="Proxy step-score normalisation: none, or per_response (divide by the response's Δ std).")
    robust: bool = Field(True, description="Winsorised (median ± 2·MAD) mean of Δ over a step's tokens instead of the mean.")
    gate_threshold: float = Field(0.0, description="residual_contrast: decision gate threshold on the importance z-score.")
    gate_tau: float = Field(1.0, gt=0, description="residual_contrast: temperature of the decision gate's sigmoid.")
    budget_tau: float = Field(1.0, gt=0, description="residual_contrast: temperature of the per-response budget softmax.")
    min_score_tokens: int = Field(2, ge=1, description="residual_contrast: steps with fewer score tokens get a reduced confidence.")
    alpha: float = Field(0.5, ge=0, lt=1, description="stepopsd: clip range α of the weight w ∈ [1 − α, 1 + α].")
    mix: float = Field(1.0, ge=0, le=1, description="stepopsd: λ mixing the reweighted and the plain advantage.")
    teacher: str = Field(
        "reference", description="forward_proxy teacher: policy (current weights), reference (a frozen copy of the "
        "policy at the first step) or a model path/preset with the policy's tokenizer.")
    teacher_template: str = Field(
        REFERENCE_TEMPLATE, description="Text appended to the prompt for the teacher context; {reference} = the gold plan as JSON.")
    heatmap_every: int = Field(
        25, ge=0, description="Write a per-token advantage heatmap every N RL steps (0: never); needs an analysis directory.")
    heatmap_rows: int = Field(4, ge=1, description="Responses drawn per heatmap.")
    analysis_dir: str | None = Field(
        None, description="Where step_credit.jsonl and the heatmaps go; unset: the run directory when the recipe "
        "provides one, else no files (metrics are logged either way).")

    @model_validator(mode="after")
    def _check_names(self) -> StepCreditOptions:
        try:  # unknown matcher, injection or proxy names
            get_matcher(self.match), get_injection(self.injection), STEP_PROXIES.get(self.proxy)
        except RegistryError as err:
            raise ValueError(str(err)) from None
        return self


def parse_options(options: dict[str, Any]) -> StepCreditOptions:
    """Validate the shaper's options; the error names the option."""
    try:
        return StepCreditOptions(**options)
    except ValidationError as err:
        lines = [f"step_credit option '{'.'.join(str(p) for p in e['loc']) or '(options)'}': "
                 f"{'unknown option' if e['type'] == 'extra_forbidden' else e['msg']}" for e in err.errors()]
        raise ValueError("; ".join(lines)) from None


# ----------------------------------------------------------------------------------------------- spans
@dataclass
class ResponsePlan:
    """The plan located in one response: per step its values and the response tokens of each value."""

    ids: list[Any]
    names: list[Any]
    id_tokens: list[list[int]]
    name_tokens: list[list[int]]
    path: str  # how token offsets were found: "tokenizer" or "prefix_decode"
    complete: bool  # the plan's list was closed (not cut off)

    def __len__(self) -> int:
        return len(self.ids)

    def tokens(self, k: int, source: Source) -> list[int]:
        if source == "action_id":
            return self.id_tokens[k]
        if source == "action_name":
            return self.name_tokens[k]
        return sorted(set(self.id_tokens[k]) | set(self.name_tokens[k]))

    def keys(self, source: Source) -> list[Any]:
        return [step_key(i, n, source) for i, n in zip(self.ids, self.names, strict=True)]


def parse_response_plan(tokenizer: Any, response_ids: Sequence[int]) -> ResponsePlan | None:
    """Locate the plan in the decoded response and map every step's value spans to token indices; None when
    there is no plan with at least one step."""
    offsets = token_char_offsets(tokenizer, response_ids)
    located = locate_plan(offsets.text)
    if located is None or not located.steps:
        return None
    steps = located.steps
    return ResponsePlan(
        ids=[s.action_id for s in steps], names=[s.action_name for s in steps],
        id_tokens=[offsets.tokens_in(s.id_span) for s in steps],
        name_tokens=[offsets.tokens_in(s.name_span) for s in steps],
        path=offsets.path, complete=located.complete,
    )


def step_key(action_id: Any, action_name: Any, source: Source) -> Any:
    """What a step is compared by: the id or the name (normalised text), or both."""
    id_key = None if action_id is None else str(action_id).strip().lower()
    name_key = None if action_name is None else " ".join(str(action_name).split()).lower()
    return {"action_id": id_key, "action_name": name_key, "semantic": (id_key, name_key)}[source]


def gold_keys(answer: Any, source: Source) -> list[Any] | None:
    steps = plan_steps(answer)
    if not steps:
        return None
    return [step_key(s.get("action_id"), s.get("action_name"), source) for s in steps]


def step_index_tensors(plans: Sequence[ResponsePlan | None], loss_mask: torch.Tensor, score_source: Source,
                       credit_target: Source) -> tuple[torch.Tensor, torch.Tensor]:
    """``score_index`` and ``target_index`` (B, T): the step of each token (−1: none), model tokens only."""
    B, T = loss_mask.shape
    score_index = torch.full((B, T), -1, dtype=torch.long)
    target_index = torch.full((B, T), -1, dtype=torch.long)
    for b, plan in enumerate(plans):
        if plan is None:
            continue
        for k in range(len(plan)):
            for index, source in ((score_index, score_source), (target_index, credit_target)):
                tokens = [t for t in plan.tokens(k, source) if t < T and loss_mask[b, t] > 0]
                if tokens:
                    index[b, tokens] = k
    return score_index, target_index


# ----------------------------------------------------------------------------------------------- teacher
def teacher_prompts(policy: Policy, trajectories: Sequence[Any], template: str) -> tuple[list[list[int]], list[Any]]:
    """Prompt ids and vision inputs of the teacher context: each sample's prompt plus its reference plan."""
    from vlrl.data.sample import load_image

    prompts, visions = [], []
    cache: dict[str, Any] = {}
    for t in trajectories:
        sample = t.sample
        if sample.id not in cache:
            messages = with_reference(sample.messages, sample.answer, template)
            encoded = policy.adapter.encode_prompt(messages, [load_image(src) for src in sample.images])
            cache[sample.id] = encoded
        prompts.append(cache[sample.id].input_ids)
        visions.append(cache[sample.id].vision)
    return prompts, visions


def check_same_tokenizer(policy: Policy, teacher: Policy, where: str) -> None:
    if policy.tokenizer.get_vocab() != teacher.tokenizer.get_vocab():
        raise ValueError(f"{where}: the teacher's tokenizer differs from the policy's; the forward proxy scores the "
                         "policy's token ids, so the teacher must share its tokenizer")


# ----------------------------------------------------------------------------------------------- the shaper
@dataclass
class StepCreditState:
    """What the shaper keeps across steps: its teacher (a frozen copy or a loaded model; None = the policy)
    and where its analysis files go."""

    teacher_model: torch.nn.Module | None = None
    analysis_dir: Path | None = None


@register_advantage_shaping("step_credit")  # (it scores responses with a model: the training room's shaper)
def step_credit(inputs: AdvantageShapingInputs, **options: Any) -> ShapingOutput:
    """Step-level credit for JSON action plans (the embodied seed's ``grpo_step`` and StepOPSD), as an
    advantage shaper: A^E = the estimator's advantages; see the module docstring and `StepCreditOptions`.

        grpo_step:  A = A^E + ω · A^S  on credit-target tokens        stepopsd:  A = (1 − λ) A^E + λ · w · A^E

    Metrics (``shaping/step_credit/…``): parse_fail_frac, prefix_decode_frac, truncated_plan_frac, steps_mean,
    step_acc, sign_flip_frac/{all,success,failed,correct_step,wrong_step}, step_adv/{correct,wrong}_mean,
    gate_mean. With an analysis directory (``analysis_dir``, else the run directory) it also writes
    ``step_credit/step_credit.jsonl`` and heatmaps for the report.
    """
    opts = parse_options(options)
    context = inputs.context
    if context is None:
        raise ValueError("step_credit: needs the training loop's context (the policy); run it through the RL recipe")
    state = inputs.state if inputs.state is not None else start_state(opts, context)
    teacher_model = None
    if opts.signal == "forward_proxy":
        teacher_model = context.policy.model if state.teacher_model is None else state.teacher_model
    result = shape_step_credit(inputs.advantages, inputs.loss_mask, inputs.trajectories, policy=context.policy,
                               options=opts, temperature=context.temperature, teacher_model=teacher_model)
    if state.analysis_dir is not None:
        write_analysis(state.analysis_dir, inputs.step + 1, result, inputs.advantages, inputs.trajectories,
                       context.policy.tokenizer, opts)
    return ShapingOutput(values=result.advantages, metrics=result.metrics, state=state)


step_credit.options_model = StepCreditOptions  # config load checks algo.advantage_shaping options against it


def start_state(options: StepCreditOptions, context: Any) -> StepCreditState:
    """At the first step: the teacher (``reference``: the recipe's frozen reference model, or a frozen copy of
    the policy as it is now; a path: that model, frozen) and a fresh analysis directory."""
    from vlrl.report.step_credit import ANALYSIS_DIR

    teacher = None
    if options.signal == "forward_proxy" and options.teacher == "reference":
        teacher = context.reference if context.reference is not None else frozen_copy(context.policy.model)
    elif options.signal == "forward_proxy" and options.teacher != "policy":
        from vlrl.models import load_policy

        loaded = load_policy(options.teacher, device=str(next(context.policy.model.parameters()).device))
        check_same_tokenizer(context.policy, loaded, f"step_credit option 'teacher' ({options.teacher})")
        teacher = frozen_copy(loaded.model)
    root = options.analysis_dir or getattr(context, "run_dir", None)
    directory = None
    if root is not None:
        directory = Path(root)
        for old in (directory / ANALYSIS_DIR).glob("*"):  # a rerun in the same directory starts afresh
            if old.is_file():
                old.unlink()
    return StepCreditState(teacher_model=teacher, analysis_dir=directory)


@dataclass
class StepCreditResult:
    advantages: torch.Tensor  # (B, T)
    metrics: dict[str, float]
    record: dict[str, Any]  # the analysis record of this step (step_credit.jsonl)
    step_advantages: torch.Tensor  # (B, T) ω-free A^S on target tokens
    target_index: torch.Tensor  # (B, T)


def shape_step_credit(advantages: torch.Tensor, loss_mask: torch.Tensor, trajectories: Sequence[Any], *,
                      policy: Policy, options: StepCreditOptions, temperature: float = 1.0,
                      teacher_model: torch.nn.Module | None = None) -> StepCreditResult:
    """Steps 1–4 of the module docstring for one batch; ``teacher_model`` is needed for ``forward_proxy``."""
    B, T = advantages.shape
    plans = [parse_response_plan(policy.tokenizer, t.response_ids) for t in trajectories]
    golds = [gold_keys(t.sample.answer, options.score_source) for t in trajectories]
    matcher = get_matcher(options.match)
    correct: list[list[bool] | None] = [
        matcher(plan.keys(options.score_source), gold) if plan is not None and gold is not None else None
        for plan, gold in zip(plans, golds, strict=True)
    ]
    usable = [plan if ok is not None else None for plan, ok in zip(plans, correct, strict=True)]
    score_index, target_index = step_index_tensors(usable, loss_mask, options.score_source, options.credit_target)
    K = max((len(p) for p in usable if p is not None), default=0)
    valid = torch.zeros(B, K, dtype=torch.bool)
    rule = torch.zeros(B, K)
    for b, ok in enumerate(correct):
        if ok is not None:
            valid[b, : len(ok)] = True
            rule[b, : len(ok)] = torch.tensor([1.0 if x else -1.0 for x in ok])
    delta = torch.zeros(B, T)
    parts: dict[str, torch.Tensor] = {}
    if options.signal == "rule":
        scores = rule
    else:
        if teacher_model is None:
            raise ValueError("step_credit: signal=forward_proxy needs a teacher model")
        if any(getattr(t, "turns", None) for t in trajectories):
            raise ValueError("step_credit: signal=forward_proxy scores single-turn responses (the teacher context is "
                             "the prompt plus the reference plan); use signal=rule for multi-turn episodes")
        prompts, visions = teacher_prompts(policy, trajectories, options.teacher_template)
        teacher = score(teacher_model, policy, trajectories, temperature, prompts=prompts, visions=visions)
        student = score(teacher_model, policy, trajectories, temperature)
        delta = (teacher[:, :T].float().cpu() - student[:, :T].float().cpu()) * loss_mask
        proxy_kwargs = dict(tau=options.tau, norm=options.norm, robust=options.robust)
        if options.proxy == "residual_contrast":
            proxy_kwargs.update(threshold=options.gate_threshold, gate_tau=options.gate_tau,
                                budget_tau=options.budget_tau, min_score_tokens=options.min_score_tokens)
        out = STEP_PROXIES.get(options.proxy)(delta, score_index, loss_mask, num_steps=K, **proxy_kwargs)
        scores, parts = out.scores * valid, out.parts
        valid = valid & out.valid
    step_adv = broadcast_steps(scores, target_index) * loss_mask  # (B, T) A^S
    target_mask = (target_index >= 0).float() * loss_mask
    injection_delta = delta * target_mask if options.signal == "forward_proxy" else step_adv
    inject = get_injection(options.injection)
    injection_options = {"weight": options.weight} if options.injection == "grpo_step" else (
        {"alpha": options.alpha, "mix": options.mix} if options.injection == "stepopsd" else {})
    final = inject(InjectionInputs(episode_advantages=advantages, step_advantages=step_adv, delta=injection_delta,
                                   target_mask=target_mask, loss_mask=loss_mask), **injection_options)
    record = analysis_record(advantages, final, target_index, trajectories, plans, correct, scores, valid, parts)
    record["signal"] = options.signal if options.signal == "rule" else f"forward_proxy/{options.proxy}"
    return StepCreditResult(final, step_metrics(record), record, step_adv, target_index)


# ----------------------------------------------------------------------------------------------- analysis
def trajectory_success(t: Any) -> bool:
    """A trajectory counts as successful when its verifiers' accuracy is ≥ 0.5 (else its reward)."""
    value = t.accuracy if t.accuracy is not None else (t.reward if t.reward is not None else 0.0)
    return float(value) >= 0.5


def analysis_record(episode: torch.Tensor, final: torch.Tensor, target_index: torch.Tensor, trajectories: Sequence[Any],
                    plans: Sequence[ResponsePlan | None], correct: Sequence[list[bool] | None], scores: torch.Tensor,
                    valid: torch.Tensor, parts: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Counts of one batch: sign flips over action (credit-target) tokens split by trajectory success and by
    step correctness, parse outcomes, and the A^S of every scored step by rule correctness."""
    B = episode.shape[0]
    success = torch.tensor([trajectory_success(t) for t in trajectories], dtype=torch.bool).unsqueeze(-1)  # (B, 1)
    step_ok = torch.zeros_like(target_index, dtype=torch.bool)
    for b, ok in enumerate(correct):
        if ok is not None and len(ok):
            table = torch.tensor(ok, dtype=torch.bool)
            inside = target_index[b] >= 0
            step_ok[b, inside] = table[target_index[b, inside]]
    action = target_index >= 0
    groups = {"all": action, "success": action & success, "failed": action & ~success,
              "correct_step": action & step_ok, "wrong_step": action & ~step_ok}
    flips = {name: flip_counts(episode, final, mask).__dict__ for name, mask in groups.items()}
    right, wrong = [], []
    for b, ok in enumerate(correct):
        for k, is_right in enumerate(ok or []):
            if k < valid.shape[1] and valid[b, k]:
                (right if is_right else wrong).append(round(float(scores[b, k]), 4))
    n_steps = [len(p) for p in plans if p is not None]
    record: dict[str, Any] = {
        "responses": B,
        "parsed": sum(p is not None for p in plans),
        "parse_failures": sum(p is None for p in plans),
        "no_gold": sum(p is not None and c is None for p, c in zip(plans, correct, strict=True)),
        "truncated_plans": sum(p is not None and not p.complete for p in plans),
        "prefix_decode": sum(p is not None and p.path == "prefix_decode" for p in plans),
        "steps": sum(n_steps),
        "correct_steps": sum(sum(c) for c in correct if c),
        "successes": int(success.sum()),
        "flips": flips,
        "step_scores": {"correct": right, "wrong": wrong},
    }
    if "gate" in parts:
        gates = parts["gate"][valid]
        record["gate_mean"] = float(gates.mean()) if gates.numel() else 0.0
    return record


def step_metrics(record: dict[str, Any]) -> dict[str, float]:
    """The per-step metrics of an analysis record (logged as ``shaping/step_credit/<name>``)."""
    B = max(record["responses"], 1)
    metrics: dict[str, float] = {
        "parse_fail_frac": record["parse_failures"] / B,
        "prefix_decode_frac": record["prefix_decode"] / max(record["parsed"], 1),
        "truncated_plan_frac": record["truncated_plans"] / max(record["parsed"], 1),
        "steps_mean": record["steps"] / max(record["parsed"], 1),
        "step_acc": record["correct_steps"] / max(record["steps"], 1),
    }
    for name, counts in record["flips"].items():
        ratio = FlipCounts(**counts).ratio
        if ratio is not None:
            metrics[f"sign_flip_frac/{name}"] = ratio
    for name, values in record["step_scores"].items():
        if values:
            metrics[f"step_adv/{name}_mean"] = sum(values) / len(values)
    if "gate_mean" in record:
        metrics["gate_mean"] = record["gate_mean"]
    return metrics


@functools.cache
def _warn_no_heatmaps() -> None:
    from vlrl.report.plots import NO_CHARTS

    logging.getLogger(__name__).warning("step-credit heatmaps not drawn: %s", NO_CHARTS.split(": ", 1)[1])


def write_analysis(run_dir: Path, step: int, result: StepCreditResult, episode: torch.Tensor,
                   trajectories: Sequence[Any], tokenizer: Any, options: StepCreditOptions) -> None:
    """Append this step's record to ``RUN_DIR/step_credit/step_credit.jsonl``; every ``heatmap_every`` steps
    (and at the first) also draw ``heatmap_stepNNNNN.png`` (not without matplotlib: warned once)."""
    from vlrl.report.plots import can_draw
    from vlrl.report.step_credit import ANALYSIS_DIR, RECORDS_FILE, render_heatmap

    directory = Path(run_dir) / ANALYSIS_DIR
    directory.mkdir(parents=True, exist_ok=True)
    with (directory / RECORDS_FILE).open("a", encoding="utf-8") as f:
        f.write(json.dumps({"step": step, **result.record}) + "\n")
    if options.heatmap_every and step % options.heatmap_every == 0:
        if not can_draw():
            _warn_no_heatmaps()
        elif rows := heatmap_rows(result, episode, trajectories, tokenizer, options.heatmap_rows):
            (directory / f"heatmap_step{step:05d}.png").write_bytes(render_heatmap(rows))


def heatmap_rows(result: StepCreditResult, episode: torch.Tensor, trajectories: Sequence[Any], tokenizer: Any,
                 count: int) -> list:
    """Up to ``count`` responses with located steps, successful and failed ones alternating."""
    from vlrl.report.step_credit import HeatmapRow

    with_steps = [b for b in range(len(trajectories)) if bool((result.target_index[b] >= 0).any())]
    good = [b for b in with_steps if trajectory_success(trajectories[b])]
    bad = [b for b in with_steps if not trajectory_success(trajectories[b])]
    chosen = [b for pair in zip(good, bad, strict=False) for b in pair] + good[len(bad):] + bad[len(good):]
    rows = []
    for b in chosen[:count]:
        ids = trajectories[b].response_ids.tolist()
        title = (f"#{b} {'success' if trajectory_success(trajectories[b]) else 'failure'} · "
                 f"A^E = {float(episode[b, 0]):+.2f} · reward {float(trajectories[b].reward or 0):.2f}")
        rows.append(HeatmapRow(title, [tokenizer.decode([i]) for i in ids], result.advantages[b, : len(ids)].tolist(),
                               (result.target_index[b, : len(ids)] >= 0).tolist()))
    return rows
