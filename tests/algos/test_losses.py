import dataclasses
import math

import pytest
import torch

from vlrl.algos import (
    AGGREGATIONS,
    POLICY_LOSSES,
    PolicyLossInputs,
    aggregate,
    get_policy_loss,
    kl_estimate,
    normaliser_for,
)


def _inputs(logp, old, adv, mask=None):
    logp = torch.tensor(logp, requires_grad=True)
    return PolicyLossInputs(logp=logp, old_logp=torch.tensor(old), advantages=torch.tensor(adv),
                            loss_mask=torch.ones_like(logp) if mask is None else torch.tensor(mask))


def test_ppo_clip_by_hand():
    # ratios: e^0.5 = 1.6487 (A=+1: clipped at 1.28 → loss −1.28, no gradient),
    #         e^-0.5 = .6065 (A=−1: clipped at .8 → loss max(.6065, .8) = .8, no gradient),
    #         e^0.1 = 1.1052 (A=+2: inside → loss −2.2103, gradient −2·1.1052)
    inputs = _inputs([[0.5, -0.5, 0.1]], [[0.0, 0.0, 0.0]], [[1.0, -1.0, 2.0]])
    out = get_policy_loss("ppo_clip")(inputs, clip_low=0.2, clip_high=0.28)
    assert torch.allclose(out.per_token_loss, torch.tensor([[-1.28, 0.8, -2 * math.exp(0.1)]]), atol=1e-4)
    assert out.metrics["clip_high"].tolist() == [[1.0, 0.0, 0.0]]
    assert out.metrics["clip_low"].tolist() == [[0.0, 1.0, 0.0]]
    out.per_token_loss.sum().backward()
    assert torch.allclose(inputs.logp.grad, torch.tensor([[0.0, 0.0, -2 * math.exp(0.1)]]), atol=1e-4)


def test_ppo_clip_on_policy_gradient_is_minus_advantage():
    inputs = _inputs([[-1.0, -2.0]], [[-1.0, -2.0]], [[0.5, -0.25]])
    get_policy_loss("ppo_clip")(inputs).per_token_loss.sum().backward()
    assert torch.allclose(inputs.logp.grad, torch.tensor([[-0.5, 0.25]]))


def test_aggregation_modes_by_hand():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert aggregate(loss, mask, "token_mean").item() == pytest.approx(10 / 4)
    assert aggregate(loss, mask, "seq_mean_token_mean").item() == pytest.approx((6 / 3 + 4 / 1) / 2)
    assert aggregate(loss, mask, "seq_mean_token_sum").item() == pytest.approx(10 / 2)
    # Dr.GRPO's constant normaliser: Σ l / (N_seqs · L) = 10 / (2 · 4), whatever the padded width (3 here)
    assert aggregate(loss, mask, "seq_mean_token_sum_norm", max_length=4).item() == pytest.approx(10 / 8)
    assert normaliser_for("seq_mean_token_sum_norm", mask, max_length=4) == 8.0
    with pytest.raises(ValueError, match="needs max_length"):  # never the padded width by default
        aggregate(loss, mask, "seq_mean_token_sum_norm")
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        aggregate(loss, mask, "mean")


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_micro_batches_with_global_normaliser_equal_one_big_batch(mode):
    """Rows of lengths 5, 2, 3, 1, 4, 2; micro-batches of two rows padded to their own widths (5, 3, 4), as the
    update's forward passes pad them: with the whole batch's normaliser their sum is the big batch's value."""
    torch.manual_seed(0)
    lengths = [5, 2, 3, 1, 4, 2]
    per_token = torch.randn(6, 5)
    mask = (torch.arange(5) < torch.tensor(lengths).unsqueeze(-1)).float()  # (6, 5)
    full = aggregate(per_token, mask, mode, max_length=8)
    normaliser = normaliser_for(mode, mask, max_length=8)
    parts = 0.0
    for i in range(0, 6, 2):
        width = max(lengths[i : i + 2])
        parts = parts + aggregate(per_token[i : i + 2, :width], mask[i : i + 2, :width], mode, normaliser=normaliser)
    assert parts.item() == pytest.approx(full.item(), rel=1e-6)


def test_kl_estimators_by_hand():
    logp, ref = torch.tensor([-1.0]), torch.tensor([-1.5])  # δ = ref − logp = −0.5
    assert kl_estimate(logp, ref, "k1").item() == pytest.approx(0.5)
    assert kl_estimate(logp, ref, "k2").item() == pytest.approx(0.125)
    assert kl_estimate(logp, ref, "k3").item() == pytest.approx(math.exp(-0.5) + 0.5 - 1)
    assert kl_estimate(logp, logp, "k3").item() == 0.0
    with pytest.raises(ValueError):
        kl_estimate(logp, ref, "k9")


def _full_inputs(B=2, T=3, *, seed=0, advantages=None):
    """Every field a registered loss may read, the trainable ones leaves with grad (logp, entropy)."""
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(B, T, generator=g) * 2).requires_grad_()
    old = logp.detach() + 0.2 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, 1, generator=g).expand(B, T).clone() if advantages is None else advantages
    return PolicyLossInputs(logp=logp, old_logp=old, advantages=adv, loss_mask=torch.ones(B, T),
                            behaviour_logp=old - 0.1 * torch.rand(B, T, generator=g),
                            entropy=torch.rand(B, T, generator=g).requires_grad_())


def test_every_policy_loss_runs_on_a_fake_batch():
    """The registry contract: every entry takes (inputs, clip_low=, clip_high=), returns (B, T) losses and (B, T)
    metrics, and back-propagates finite gradients into log π_θ; what it declares in ``needs`` it cannot do without."""
    from vlrl.algos import policy_loss_needs

    for name, fn in POLICY_LOSSES.items():
        if not fn.__module__.startswith("vlrl."):  # plug-ins registered by other tests
            continue
        inputs = _full_inputs()
        out = fn(inputs, clip_low=0.2, clip_high=0.28)
        assert out.per_token_loss.shape == (2, 3), name
        assert all(v.shape == (2, 3) and not v.requires_grad for v in out.metrics.values()), name
        out.per_token_loss.sum().backward()
        assert inputs.logp.grad is not None and torch.isfinite(inputs.logp.grad).all(), name
        for field_name in policy_loss_needs(fn):
            missing = dataclasses.replace(_full_inputs(), **{field_name: None})
            with pytest.raises(ValueError, match=f"{name}: needs {field_name}"):
                fn(missing, clip_low=0.2, clip_high=0.28)


def test_which_losses_are_zero_where_the_advantage_is_zero():
    """``train.skip_zero_advantage`` is exact only for losses that are 0 at Â = 0: all but the entropy bonus
    (−β·H everywhere) and KL-Cov (β·|Δ| on its selected tokens, chosen even when every Â is 0)."""
    nonzero = set()
    for name, fn in POLICY_LOSSES.items():
        if not fn.__module__.startswith("vlrl."):
            continue
        out = fn(_full_inputs(advantages=torch.zeros(2, 3)), clip_low=0.2, clip_high=0.28)
        if bool((out.per_token_loss != 0).any()):
            nonzero.add(name)
    assert nonzero == {"entropy_bonus", "kl_cov"}


def test_dual_clip_by_hand():
    # A = −1, r = e^1.5 = 4.4817: PPO clip gives max(4.4817, 1.28) = 4.4817 > c·(−A) = 3 → 3, no gradient
    # A = −1, r = e^0.1 = 1.1052: 1.1052 < 3 → unchanged, gradient −A·r = 1.1052
    # A = +1, r = e^1.5: clipped at 1 + ε_high → −1.28 (the dual clip only bounds negative advantages)
    inputs = _inputs([[1.5, 0.1, 1.5]], [[0.0, 0.0, 0.0]], [[-1.0, -1.0, 1.0]])
    out = get_policy_loss("dual_clip")(inputs, clip_low=0.2, clip_high=0.28, clip_ratio_c=3.0)
    assert torch.allclose(out.per_token_loss, torch.tensor([[3.0, math.exp(0.1), -1.28]]), atol=1e-4)
    assert out.metrics["clip_dual"].tolist() == [[1.0, 0.0, 0.0]]
    out.per_token_loss.sum().backward()
    assert torch.allclose(inputs.logp.grad, torch.tensor([[0.0, math.exp(0.1), 0.0]]), atol=1e-4)
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
        get_policy_loss("dual_clip")(inputs, clip_ratio_c=1.0)


def test_decoupled_by_hand():
    # π_prox − π_behave = 0 − (−0.5) → w = e^0.5 = 1.6487; r = e^0.1 = 1.1052 (inside the clip), A = 1
    #   → L = −w·r = −1.8221, ∂L/∂logp = −w·r
    # second token: π_behave = −2 → e^2 = 7.39 > cap 5 → w = 5 (capped); r = 1, A = −1 → L = 5·1 = 5, grad 5
    inputs = _inputs([[0.1, 0.0]], [[0.0, 0.0]], [[1.0, -1.0]])
    inputs.behaviour_logp = torch.tensor([[-0.5, -2.0]])
    out = get_policy_loss("decoupled")(inputs, clip_low=0.2, clip_high=0.28, cap=5.0)
    w_r = math.exp(0.5) * math.exp(0.1)
    assert torch.allclose(out.per_token_loss, torch.tensor([[-w_r, 5.0]]), atol=1e-4)
    assert out.metrics["behaviour_weight_capped"].tolist() == [[0.0, 1.0]]
    out.per_token_loss.sum().backward()
    assert torch.allclose(inputs.logp.grad, torch.tensor([[-w_r, 5.0]]), atol=1e-4)
    with pytest.raises(ValueError, match="needs behaviour_logp"):
        get_policy_loss("decoupled")(_inputs([[0.0]], [[0.0]], [[1.0]]))


def test_decoupled_equals_ppo_clip_on_policy():
    """π_behave = π_prox (synchronous, fresh samples): w = 1 and the decoupled loss is PPO clip."""
    inputs = _inputs([[0.3, -0.2]], [[0.0, 0.1]], [[1.0, -0.5]])
    inputs.behaviour_logp = inputs.old_logp.clone()
    a = get_policy_loss("decoupled")(inputs, clip_low=0.2, clip_high=0.28).per_token_loss
    b = get_policy_loss("ppo_clip")(inputs, clip_low=0.2, clip_high=0.28).per_token_loss
    assert torch.equal(a, b)


def test_every_policy_loss_names_its_arguments_as_the_contract_says():
    """`PolicyLoss`: the clip range is a keyword-only parameter of every built-in loss (written, not left to
    ``**options``), and a loss that applies the behaviour weight takes ``cap`` and ``behaviour_weight_mode`` too;
    `bind_policy_loss` binds exactly those (and the loss's own options)."""
    import inspect

    from vlrl.algos import applies_behaviour_weight, bind_policy_loss

    for name, fn in POLICY_LOSSES.items():
        if not fn.__module__.startswith("vlrl."):
            continue
        keyword = {p.name for p in inspect.signature(fn).parameters.values() if p.kind is p.KEYWORD_ONLY}
        wanted = {"clip_low", "clip_high"} | ({"cap", "behaviour_weight_mode"} if applies_behaviour_weight(fn) else set())
        assert wanted <= keyword, (name, wanted - keyword)
    bound = bind_policy_loss("decoupled", clip_low=0.1, clip_high=0.3, behaviour_weight_cap=2.0,
                             behaviour_weight_mode="drop", options={"clip_ratio_c": 3.0})
    assert bound.keywords == {"clip_low": 0.1, "clip_high": 0.3, "cap": 2.0, "behaviour_weight_mode": "drop",
                              "clip_ratio_c": 3.0}
    assert bind_policy_loss("ppo_clip", clip_low=0.2, clip_high=0.28).keywords == {"clip_low": 0.2, "clip_high": 0.28}


def test_which_losses_apply_the_behaviour_weight_themselves():
    import functools

    from vlrl.algos import applies_behaviour_weight

    assert applies_behaviour_weight(get_policy_loss("decoupled"))
    assert applies_behaviour_weight(functools.partial(get_policy_loss("decoupled"), cap=2.0))
    assert not applies_behaviour_weight(get_policy_loss("ppo_clip"))
    assert not applies_behaviour_weight(get_policy_loss("dual_clip"))


def test_value_loss_by_hand():
    from vlrl.algos import value_loss

    # token 0: V = 1, V_old = .5, R = 2: V_clip = .5 + clip(.5, ±.2) = .7; errors 1 and 1.69 → ½·1.69 = .845,
    #          the clipped branch wins → no gradient through V
    # token 1: V = .4, V_old = .5, R = 0: V_clip = .4 (inside); errors .16 = .16 → .08, gradient V − R = .4
    values = torch.tensor([[1.0, 0.4]], requires_grad=True)
    out = value_loss(values, torch.tensor([[0.5, 0.5]]), torch.tensor([[2.0, 0.0]]), clip=0.2)
    assert torch.allclose(out.per_token_loss, torch.tensor([[0.845, 0.08]]), atol=1e-6)
    assert out.metrics["value_clip"].tolist() == [[1.0, 0.0]]
    out.per_token_loss.sum().backward()
    assert torch.allclose(values.grad, torch.tensor([[0.0, 0.4]]), atol=1e-6)
    # V = .1 inside the range of V_old = .25: V_clip = .25 + (.1 − .25) is .1 up to float32 rounding (an ulp
    # off), so with R = .1 the clipped error is ~1e-17 > 0 — not a clip: the metric counts none
    out = value_loss(torch.tensor([[0.1]]), torch.tensor([[0.25]]), torch.tensor([[0.1]]), clip=0.2)
    assert out.metrics["value_clip"].tolist() == [[0.0]]


def test_kl_reward_penalty_by_hand():
    from vlrl.algos import kl_reward_penalty

    # k1 = log π − log π_ref = .5 and −.5; β = .1 → rewards 0 − .05 and 1 + .05; no gradient into π
    logp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    rewards, kl = kl_reward_penalty(torch.tensor([[0.0, 1.0]]), logp, torch.tensor([[-1.5, -0.5]]),
                                    torch.tensor([[1.0, 1.0]]), coef=0.1, kind="k1")
    assert torch.allclose(rewards, torch.tensor([[-0.05, 1.05]])) and torch.allclose(kl, torch.tensor([[0.5, -0.5]]))
    assert not rewards.requires_grad
    # masked tokens get no penalty
    rewards, _ = kl_reward_penalty(torch.zeros(1, 2), logp, torch.tensor([[-1.5, -0.5]]), torch.tensor([[1.0, 0.0]]),
                                   coef=1.0, kind="k2")
    assert torch.allclose(rewards, torch.tensor([[-0.125, 0.0]]))


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_gradients_by_hand(kind):
    # ∂/∂logp at δ = ref − logp = −.5:  k1 = logp − ref → 1;  k2 = ½δ² → −δ = .5;  k3 = e^δ − δ − 1 → 1 − e^δ = .3935
    logp = torch.tensor([-1.0], requires_grad=True)
    kl_estimate(logp, torch.tensor([-1.5]), kind).sum().backward()
    expected = {"k1": 1.0, "k2": 0.5, "k3": 1 - math.exp(-0.5)}[kind]
    assert logp.grad.item() == pytest.approx(expected, rel=1e-5)


ON_POLICY_OPTIONS = {"clip_cov": {"cov_low": 1e3, "cov_high": 1e4}}  # no token in Clip-Cov's band


@pytest.mark.parametrize("name", sorted(n for n, fn in POLICY_LOSSES.items() if fn.__module__.startswith("vlrl.")))
def test_on_policy_gradient_of_every_loss_is_minus_advantage(name):
    """At π_θ = π_old = π_behave (and H = 0) every loss is the policy gradient: ∂(Σ_t L_t)/∂log π_θ(t) = −A_t (r = w
    = s = ρ = 1, no clip active; a sequence loss sits on each of its |y| tokens and its gradient is 1/|y| of
    each), and nothing flows into the constants (π_old, π_behave, Â are built without grad)."""
    logp = torch.tensor([[-1.0, -0.5, -2.0], [-0.3, -1.5, -0.8]], requires_grad=True)
    constant = logp.detach().clone()
    inputs = PolicyLossInputs(logp=logp, old_logp=constant, advantages=torch.tensor([[1.0, 1.0, 1.0], [-0.5, -0.5, -0.5]]),
                              loss_mask=torch.ones(2, 3), behaviour_logp=constant, entropy=torch.zeros(2, 3))
    get_policy_loss(name)(inputs, clip_low=0.2, clip_high=0.28, **ON_POLICY_OPTIONS.get(name, {})).per_token_loss.sum().backward()
    assert torch.allclose(logp.grad, torch.tensor([[-1.0, -1.0, -1.0], [0.5, 0.5, 0.5]]), atol=1e-6)


def _batch_for_equivalence():
    """6 responses of 5, 2, 3, 1, 4, 2 model tokens, one advantage each; logp and entropy are the leaves."""
    g = torch.Generator().manual_seed(3)
    lengths = [5, 2, 3, 1, 4, 2]
    mask = (torch.arange(5) < torch.tensor(lengths).unsqueeze(-1)).float()
    logp = (-torch.rand(6, 5, generator=g) * 3).requires_grad_()
    old = logp.detach() + 0.3 * torch.randn(6, 5, generator=g)
    advantages = torch.randn(6, 1, generator=g).expand(6, 5) * mask
    entropy = torch.rand(6, 5, generator=g).requires_grad_()
    inputs = PolicyLossInputs(logp=logp, old_logp=old, advantages=advantages, loss_mask=mask,
                              behaviour_logp=old - 0.5 * torch.rand(6, 5, generator=g), entropy=entropy)
    return inputs, lengths


EQUIVALENCE_OPTIONS = {"clip_cov": {"cov_low": 0.05, "cov_high": 10.0, "fraction": 0.2}, "kl_cov": {"fraction": 0.2},
                       "decoupled": {"cap": 1.3, "behaviour_weight_mode": "drop", "clip_ratio_c": 2.0}}


@pytest.mark.parametrize("mode", AGGREGATIONS)
@pytest.mark.parametrize("name", sorted(n for n, fn in POLICY_LOSSES.items() if fn.__module__.startswith("vlrl.")))
def test_micro_batches_of_every_loss_give_the_one_big_batch_gradient(name, mode):
    """Σ over micro-batches (two rows each, padded to their own widths) of ∇ aggregate(loss(micro), N_global) =
    ∇ aggregate(loss(batch)), for every loss and aggregation — with Clip-Cov / KL-Cov's tokens selected once over
    the whole batch (``cov_selection``)."""
    from vlrl.algos import clip_cov_selection, kl_cov_selection, token_covariance

    inputs, lengths = _batch_for_equivalence()
    options = EQUIVALENCE_OPTIONS.get(name, {})
    if name in ("clip_cov", "kl_cov"):
        cov = token_covariance(inputs.logp, inputs.advantages, inputs.loss_mask)
        if name == "clip_cov":
            selection = clip_cov_selection(cov, inputs.loss_mask, fraction=0.2, low=0.05, high=10.0,
                                           generator=torch.Generator().manual_seed(0))
        else:
            selection = kl_cov_selection(cov, inputs.loss_mask, fraction=0.2)
        assert 1 <= int(selection.sum()) <= 3  # ⌊.2 · 17⌋ = 3 tokens at most
        inputs.cov_selection = selection
    fn = get_policy_loss(name)
    normaliser = normaliser_for(mode, inputs.loss_mask, max_length=6)
    aggregate(fn(inputs, clip_low=0.2, clip_high=0.28, **options).per_token_loss, inputs.loss_mask, mode,
              normaliser=normaliser).backward()
    full = inputs.logp.grad.clone(), inputs.entropy.grad.clone() if inputs.entropy.grad is not None else None
    assert float(full[0].abs().max()) > 1e-3  # a real gradient
    inputs.logp.grad, inputs.entropy.grad = None, None
    total = 0.0
    for i in range(0, 6, 2):
        width = max(lengths[i : i + 2])
        rows = {f.name: getattr(inputs, f.name) for f in dataclasses.fields(inputs)}
        micro = PolicyLossInputs(**{k: None if v is None else v[i : i + 2, :width] for k, v in rows.items()})
        total = total + aggregate(fn(micro, clip_low=0.2, clip_high=0.28, **options).per_token_loss, micro.loss_mask,
                                  mode, normaliser=normaliser)
    total.backward()
    assert torch.allclose(inputs.logp.grad, full[0], atol=1e-6), name
    if full[1] is not None:
        assert torch.allclose(inputs.entropy.grad, full[1], atol=1e-6), name


def test_covariance_selection_inside_each_micro_batch_is_not_the_big_batch_selection():
    """Why ``cov_selection`` exists: selecting within each micro-batch (the reference code's behaviour) picks
    max(⌊f · N_micro⌋, 1) tokens per micro-batch — here 1 + 1 + 1 = 3 where the big batch picks ⌊.1 · 17⌋ = 1."""
    inputs, lengths = _batch_for_equivalence()
    whole = get_policy_loss("kl_cov")(inputs, fraction=0.1).metrics["kl_cov"]
    per_micro = sum(float(get_policy_loss("kl_cov")(PolicyLossInputs(
        logp=inputs.logp[i : i + 2], old_logp=inputs.old_logp[i : i + 2], advantages=inputs.advantages[i : i + 2],
        loss_mask=inputs.loss_mask[i : i + 2]), fraction=0.1).metrics["kl_cov"].sum()) for i in range(0, 6, 2))
    assert float(whole.sum()) == 1.0 and per_micro == 3.0


# ------------------------------------------------------------------------------- sequence- and ratio-level losses
def _ragged():
    """Row 0: 3 model tokens, A = +1; row 1: 2 model tokens (the third masked, its values must not count), A = −2.
    log π_θ − log π_old: row 0 [.3, −.1, .1] → mean .1;  row 1 [.2, −.4, (5.0)] → mean −.1."""
    logp = torch.tensor([[0.3, -0.1, 0.1], [0.2, -0.4, 5.0]], requires_grad=True)
    return PolicyLossInputs(logp=logp, old_logp=torch.zeros(2, 3), advantages=torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, 7.0]]),
                            loss_mask=torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]))


def test_gspo_sequence_ratio_with_ragged_lengths_by_hand():
    # s_0 = e^{.1} = 1.10517, s_1 = e^{−.1} = .90484 (the masked 5.0 and 7.0 ignored); ε = .2: both inside the clip
    #   L_0 = −1 · 1.10517 = −1.10517,  L_1 = −(−2) · .90484 = 1.80967, each on every token of its row
    #   seq_mean_token_mean = (L_0 + L_1) / 2 = .35225
    # ∂/∂logp: row 0 each token ½ · (−A_0 s_0 / 3) = −.18420; row 1 ½ · (2 s_1 / 2) = .45242 on its 2 tokens, 0 masked
    inputs = _ragged()
    out = get_policy_loss("gspo")(inputs, clip_low=0.2, clip_high=0.2)
    s0, s1 = math.exp(0.1), math.exp(-0.1)
    assert torch.allclose(out.per_token_loss, torch.tensor([[-s0] * 3, [2 * s1] * 3]), atol=1e-6)
    assert torch.allclose(out.metrics["ratio"], torch.tensor([[s0] * 3, [s1] * 3]), atol=1e-6)
    total = aggregate(out.per_token_loss, inputs.loss_mask, "seq_mean_token_mean")
    assert total.item() == pytest.approx((-s0 + 2 * s1) / 2, rel=1e-6)
    total.backward()
    assert torch.allclose(inputs.logp.grad, torch.tensor([[-s0 / 6] * 3, [s1 / 2, s1 / 2, 0.0]]), atol=1e-6)


def test_gspo_paper_clip_removes_whole_sequences():
    # ε = 3e-4 / 4e-4: s_0 = 1.105 > 1.0004 with A > 0 → clipped: L_0 = −1.0004, no gradient to any token of row 0
    #                  s_1 = .905 < .9997 with A < 0 → clipped: L_1 = 2 · .9997 = 1.9994, no gradient either
    # a third row, A = +1 with s = .905 < .9997: the clip does not bind for A > 0 → L = −.90484 and a gradient
    inputs = _ragged()
    inputs = PolicyLossInputs(logp=torch.cat([inputs.logp.detach(), torch.tensor([[-0.1, -0.1, 0.0]])]).requires_grad_(),
                              old_logp=torch.zeros(3, 3), loss_mask=torch.tensor([[1.0, 1, 1], [1, 1, 0], [1, 1, 0]]),
                              advantages=torch.cat([inputs.advantages, torch.ones(1, 3)]))
    out = get_policy_loss("gspo")(inputs)  # the paper's defaults
    assert torch.allclose(out.per_token_loss[:, 0], torch.tensor([-1.0004, 2 * 0.9997, -math.exp(-0.1)]), atol=1e-6)
    assert out.metrics["clip_high"][:, 0].tolist() == [1.0, 0.0, 0.0]
    assert out.metrics["clip_low"][:, 0].tolist() == [0.0, 1.0, 0.0]
    aggregate(out.per_token_loss, inputs.loss_mask, "seq_mean_token_mean").backward()
    assert torch.equal(inputs.logp.grad[:2], torch.zeros(2, 3))
    assert torch.allclose(inputs.logp.grad[2], torch.tensor([-math.exp(-0.1) / 3 / 2 * 1.0] * 2 + [0.0]), atol=1e-6)


def test_gspo_token_equals_gspo_with_one_advantage_per_response():
    """Same values and, under seq_mean_token_mean, the same gradient (GSPO §4.3): s_{i,t} has s_i's value and
    the gradient of log π_θ(y_{i,t}) alone."""
    a, b = _ragged(), _ragged()
    la = get_policy_loss("gspo")(a, clip_low=0.2, clip_high=0.2).per_token_loss
    lb = get_policy_loss("gspo_token")(b, clip_low=0.2, clip_high=0.2).per_token_loss
    mask = a.loss_mask.bool()
    assert torch.allclose(la[mask], lb[mask], atol=1e-6)
    aggregate(la, a.loss_mask, "seq_mean_token_mean").backward()
    aggregate(lb, b.loss_mask, "seq_mean_token_mean").backward()
    assert torch.allclose(a.logp.grad, b.logp.grad, atol=1e-6)


def test_gspo_token_with_token_advantages_by_hand():
    # row 0 of _ragged with advantages [1, −1, 2]: s = e^{.1} on every token, inside the clip (ε = .2)
    #   L_t = −A_t · s = [−1.10517, 1.10517, −2.21034]; ∂L_t/∂logp_t = −A_t · s (the value times 1: s_{i,t} has
    #   the gradient of log π_θ(y_t) only, not of the other tokens through s_i)
    inputs = _ragged()
    inputs.advantages = torch.tensor([[1.0, -1.0, 2.0], [0.0, 0.0, 0.0]])
    out = get_policy_loss("gspo_token")(inputs, clip_low=0.2, clip_high=0.2)
    s = math.exp(0.1)
    assert torch.allclose(out.per_token_loss[0], torch.tensor([-s, s, -2 * s]), atol=1e-6)
    out.per_token_loss[0].sum().backward()
    assert torch.allclose(inputs.logp.grad[0], torch.tensor([-s, s, -2 * s]), atol=1e-6)


def test_cispo_by_hand_and_its_weight_carries_no_gradient():
    # Δ = [.5, −1, 0] → r = [1.6487, .3679, 1]; ε_low = 1 (floor 0), ε_high = .28 → w = [1.28, .3679, 1]
    # A = [1, 1, −2], log π = [−1, −2, −.5]:  L = −w·A·log π = [1.28, .7358, −1.0]
    # ∂L/∂log π = −w·A = [−1.28, −.3679, 2.0]: the clipped token keeps a gradient (PPO would give it 0); with a
    #   differentiable w the middle token would get a further −A·log π·r = −.7358
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    inputs = PolicyLossInputs(logp=logp, old_logp=torch.tensor([[-1.5, -1.0, -0.5]]), advantages=torch.tensor([[1.0, 1.0, -2.0]]),
                              loss_mask=torch.ones(1, 3))
    out = get_policy_loss("cispo")(inputs)  # defaults: ε_low = 1, ε_high = .28
    r1 = math.exp(-1.0)
    assert torch.allclose(out.per_token_loss, torch.tensor([[1.28, 2 * r1, -1.0]]), atol=1e-6)
    assert out.metrics["clip_high"].tolist() == [[1.0, 0.0, 0.0]] and out.metrics["clip_low"].tolist() == [[0.0, 0.0, 0.0]]
    out.per_token_loss.sum().backward()
    assert torch.allclose(logp.grad, torch.tensor([[-1.28, -r1, 2.0]]), atol=1e-6)


def test_gmpo_by_hand():
    # ε = .4 / .4 in log space (the paper's (e^{−.4}, e^{.4}))
    # row 0, A = +1, Δ = [.6, −.5, .2]: clip → [.4, −.4, .2]; min(Δ, clip Δ) = [.4, −.5, .2] → mean .1/3
    #   ρ_0 = e^{.0333} = 1.033895, L_0 = −1.033895; token 0's clip binds (A > 0, Δ > .4) → no gradient;
    #   tokens 1, 2: ∂L_0/∂logp = −A ρ_0 / 3 = −.344632
    # row 1, A = −1, Δ = [−.6, .3, (9, masked)]: −Δ = [.6, −.3], −clip Δ = [.4, −.3] → min [.4, −.3] → Δ̃ = [−.4, .3]
    #   mean −.05 → ρ_1 = .951229, L_1 = +.951229; token 0's clip binds (A < 0, Δ < −.4) → no gradient;
    #   token 1: −A ρ_1 / 2 = .475615
    logp = torch.tensor([[0.6, -0.5, 0.2], [-0.6, 0.3, 9.0]], requires_grad=True)
    inputs = PolicyLossInputs(logp=logp, old_logp=torch.zeros(2, 3), advantages=torch.tensor([[1.0, 1, 1], [-1.0, -1, 5]]),
                              loss_mask=torch.tensor([[1.0, 1, 1], [1, 1, 0]]))
    out = get_policy_loss("gmpo")(inputs)
    rho0, rho1 = math.exp(0.1 / 3), math.exp(-0.05)
    assert torch.allclose(out.per_token_loss, torch.tensor([[-rho0] * 3, [rho1] * 3]), atol=1e-6)
    # metrics are read through the loss mask (the recipe masked-means them): the masked token does not count
    assert (out.metrics["clip_high"] * inputs.loss_mask).tolist() == [[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    assert (out.metrics["clip_low"] * inputs.loss_mask).tolist() == [[0.0, 0.0, 0.0], [1.0, 0.0, 0.0]]
    # one sequence loss per row: take it once (token 0 of each row)
    out.per_token_loss[:, 0].sum().backward()
    assert torch.allclose(logp.grad, torch.tensor([[0.0, -rho0 / 3, -rho0 / 3], [0.0, rho1 / 2, 0.0]]), atol=1e-6)


def test_decoupled_drop_mode_and_dual_clip_by_hand():
    # as test_decoupled_by_hand: token 0 w = e^.5, r = e^.1, A = 1 → −w·r; token 1 weight e^2 = 7.39 > cap 5
    #   clamp (default): w = 5 → L = 5;  drop (AReaL): w = 0 → L = 0, no gradient
    inputs = _inputs([[0.1, 0.0]], [[0.0, 0.0]], [[1.0, -1.0]])
    inputs.behaviour_logp = torch.tensor([[-0.5, -2.0]])
    out = get_policy_loss("decoupled")(inputs, clip_low=0.2, clip_high=0.28, cap=5.0, behaviour_weight_mode="drop")
    w_r = math.exp(0.5) * math.exp(0.1)
    assert torch.allclose(out.per_token_loss, torch.tensor([[-w_r, 0.0]]), atol=1e-5)
    assert out.metrics["behaviour_weight_capped"].tolist() == [[0.0, 1.0]]
    out.per_token_loss.sum().backward()
    assert torch.allclose(inputs.logp.grad, torch.tensor([[-w_r, 0.0]]), atol=1e-5)
    with pytest.raises(ValueError, match="unknown mode"):
        get_policy_loss("decoupled")(inputs, behaviour_weight_mode="clip")
    # dual clip, w = e^.5 on both tokens: A = −1, r = e^1.5: PPO term 4.4817 > c = 3 → 3, × w = 4.9462, no gradient;
    #   A = −1, r = e^.1: 1.1052 < 3 → w · 1.1052, gradient w · r
    inputs = _inputs([[1.5, 0.1]], [[0.0, 0.0]], [[-1.0, -1.0]])
    inputs.behaviour_logp = torch.tensor([[-0.5, -0.5]])
    out = get_policy_loss("decoupled")(inputs, clip_low=0.2, clip_high=0.28, clip_ratio_c=3.0)
    w = math.exp(0.5)
    assert torch.allclose(out.per_token_loss, torch.tensor([[3 * w, w * math.exp(0.1)]]), atol=1e-5)
    assert out.metrics["clip_dual"].tolist() == [[1.0, 0.0]]
    out.per_token_loss.sum().backward()
    assert torch.allclose(inputs.logp.grad, torch.tensor([[0.0, w * math.exp(0.1)]]), atol=1e-5)
