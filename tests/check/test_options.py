"""Plug-in options are checked against each plug-in's keyword-only signature when the config loads (and by the
preflight check), naming the config field — never a TypeError at the first step after the model loaded."""

import pytest

from vlrl.check.options import config_problems, load_run_config
from vlrl.config import ConfigError, RLConfig, load_config
from vlrl.registry import option_problems


def _error(*overrides):
    with pytest.raises(ConfigError) as err:
        load_run_config(RLConfig, None, list(overrides))
    return str(err.value)


def test_an_unknown_estimator_option_names_the_field_and_the_known_ones():
    assert _error("algo.advantage_options={epz: 1e-6}") == \
        "config field 'algo.advantage_options.epz': unknown option of grpo; known: eps, norm_by_std"
    assert "'algo.advantage_options.gamma': unknown option of rloo; known: none" in \
        _error("algo.advantage=rloo", "algo.advantage_options={gamma: 0.9}")


def test_wrong_types_missing_required_options_and_options_the_recipe_sets():
    assert "'algo.advantage_options.eps': Input should be a valid number" in _error("algo.advantage_options={eps: tiny}")
    assert "'algo.reward_shaping.0.options.cache_length': required option of overlong_penalty is missing" in \
        _error("algo.reward_shaping=[{name: overlong_penalty}]")
    assert "'algo.policy_loss_options.clip_high': set by algo.clip_high, not an option of ppo_clip" in \
        _error("algo.policy_loss_options={clip_high: 0.3}")
    # every problem of the config at once, in config order
    lines = _error("algo.advantage_options={epz: 1}", "algo.reward_shaping=[{name: reward_scale, options: {scal: 2}}]"
                   ).splitlines()
    assert [line.split("'")[1] for line in lines] == ["algo.advantage_options.epz", "algo.reward_shaping.0.options.scal"]


def test_environment_and_rollout_function_options():
    base = ("rollout.agent.function=multi_turn", "rollout.agent.env=tool_zoom")
    assert "'rollout.agent.env_kwargs.max_call': unknown option of tool_zoom; known: instructions, max_calls, role, zoom_size" \
        in _error(*base, "rollout.agent.env_kwargs={max_call: 2}")
    assert "'rollout.agent.env_kwargs.zoom_size': Input should be a valid integer" in _error(*base, "rollout.agent.env_kwargs={zoom_size: big}")
    assert "'rollout.agent.options.turns': unknown option of multi_turn; known: none" in \
        _error(*base, "rollout.agent.options={turns: 3}")
    load_run_config(RLConfig, None, [*base, "rollout.agent.env_kwargs={max_calls: 2, zoom_size: 56}"])  # fine


def test_step_credit_options_go_through_its_options_model():
    assert "'algo.advantage_shaping.0.options.wieght': unknown option of step_credit" in \
        _error("algo.advantage_shaping=[{name: step_credit, options: {wieght: 1.0}}]")
    assert "'algo.advantage_shaping.0.options.alpha': Input should be less than 1" in \
        _error("algo.advantage_shaping=[{name: step_credit, options: {alpha: 1.5}}]")
    assert "unknown step matcher 'fuzzy'" in _error("algo.advantage_shaping=[{name: step_credit, options: {match: fuzzy}}]")


def test_a_combination_that_cannot_work_is_refused_naming_both_fields():
    message = _error("rollout.agent.function=multi_turn", "rollout.agent.env=shapes_feedback",
                     "algo.advantage_shaping=[{name: step_credit, options: {signal: forward_proxy}}]")
    assert "'algo.advantage_shaping.0.options.signal': forward_proxy scores single-turn responses" in message
    assert "rollout.agent.function=multi_turn" in message
    load_run_config(RLConfig, None, ["rollout.agent.function=multi_turn", "rollout.agent.env=shapes_feedback",
                                 "algo.advantage_shaping=[{name: step_credit, options: {signal: rule}}]"])


def test_stages_and_the_demo_name_their_prefix():
    from vlrl.config import DemoConfig

    with pytest.raises(ConfigError, match=r"'rl.algo.advantage_options.epz': unknown option of grpo"):
        load_run_config(DemoConfig, None, ["rl.algo.advantage_options={epz: 1}"])
    cfg = RLConfig.model_validate({"stages": [{"name": "a"}, {"name": "b", "algo": {"advantage_options": {"x": 1}}}]})
    assert config_problems(cfg) == [("stages.1.algo.advantage_options.x", "unknown option of grpo; known: eps, norm_by_std")]


def test_an_unknown_name_is_left_to_the_preflight_check():
    cfg = load_run_config(RLConfig, None, ["algo.advantage=no_such_estimator", "algo.advantage_options={x: 1}"])
    from vlrl.check.preflight import _check_names
    from vlrl.check.report import CheckReport

    report = CheckReport()
    _check_names(report, cfg, [("", cfg)])
    assert [p.where for p in report.problems] == ["algo.advantage"]


def test_the_preflight_check_lists_option_problems_of_a_config_built_in_code():
    from vlrl.check.preflight import _check_names
    from vlrl.check.report import CheckReport

    cfg = RLConfig.model_validate({"algo": {"advantage_options": {"epz": 1}}})  # no load_config: no check yet
    report = CheckReport()
    _check_names(report, cfg, [("", cfg)])
    assert [str(p) for p in report.problems] == ["algo.advantage_options.epz: unknown option of grpo; known: eps, norm_by_std"]


def test_option_problems_by_hand():
    def plugin(inputs, *, a: int, b: float = 1.0, c: bool = False):
        return inputs

    def open_ended(inputs, *, a: int = 0, **rest):
        return inputs

    assert option_problems(plugin, {"a": 1, "b": "2.5"}, where="x", name="p") == []  # "2.5" is a float (lax)
    assert option_problems(plugin, {"b": 1.0, "d": 1}, where="x", name="p") == [
        ("x.d", "unknown option of p; known: a, b, c"), ("x.a", "required option of p is missing")]
    assert option_problems(plugin, {"a": 1}, where="x", name="p", bound={"a": "the recipe"}) == [
        ("x.a", "set by the recipe, not an option of p")]
    assert option_problems(open_ended, {"anything": 1}, where="x", name="q") == []
    assert option_problems(open_ended, {"a": "x"}, where="x", name="q")[0][0] == "x.a"


# ------------------------------------------------------------------------------------- issue 25: losses, corrections
def test_a_loss_option_value_the_loss_refuses_stops_the_load():
    """The loss runs once on a fake batch at load: kl_cov's fraction must lie in (0, 1]; decoupled's dual-clip c > 1."""
    assert _error("algo.policy_loss=kl_cov", "algo.policy_loss_options={fraction: 2.0}") == \
        "config field 'algo.policy_loss_options': kl_cov: fraction must lie in (0, 1], got 2.0 (policy_loss=kl_cov)"
    assert "dual_clip: clip_ratio_c must be > 1, got 0.5" in \
        _error("algo.policy_loss=decoupled", "algo.policy_loss_options={clip_ratio_c: 0.5}")
    load_run_config(RLConfig, None, ["algo.policy_loss=kl_cov", "algo.policy_loss_options={fraction: 0.02}"])


def test_decoupled_takes_its_cap_and_mode_from_the_staleness_section():
    assert "'algo.policy_loss_options.cap': set by staleness.behaviour_weight_cap, not an option of decoupled" in \
        _error("algo.policy_loss=decoupled", "algo.policy_loss_options={cap: 2.0}")
    assert "'algo.policy_loss_options.behaviour_weight_mode': set by staleness.behaviour_weight_mode" in \
        _error("algo.policy_loss=decoupled", "algo.policy_loss_options={behaviour_weight_mode: drop}")
    assert "'staleness.behaviour_weight_mode': Input should be 'clamp' or 'drop'" in \
        _error("staleness.behaviour_weight_mode=cut")
    from vlrl.train.batch import policy_loss

    cfg = load_run_config(RLConfig, None, ["algo.policy_loss=decoupled", "staleness.behaviour_weight_cap=2.0",
                                       "staleness.behaviour_weight_mode=drop"])
    assert policy_loss(cfg).keywords == {"clip_low": 0.2, "clip_high": 0.28, "cap": 2.0, "behaviour_weight_mode": "drop"}


def test_tis_with_the_behaviour_weight_is_refused_at_load_naming_both_fields():
    assert "'algo.rollout_correction.tis_cap': rollout.mode=async applies the behaviour weight" in \
        _error("algo.rollout_correction.tis_cap=2", "rollout.mode=async")
    assert "'algo.rollout_correction.tis_cap': algo.policy_loss=decoupled applies the behaviour weight" in \
        _error("algo.rollout_correction.tis_cap=2", "algo.policy_loss=decoupled")
    assert "'algo.rollout_correction.tis_cap': Input should be greater than 1" in _error("algo.rollout_correction.tis_cap=1")
    for fine in (["algo.rollout_correction.tis_cap=2"],  # sync, ppo_clip: the one correction
                 ["algo.rollout_correction.tis_cap=2", "rollout.mode=async", "staleness.apply_behaviour_weight=false"],
                 ["algo.rollout_correction.mis_cap=2", "rollout.mode=async"]):  # MIS is a filter
        load_run_config(RLConfig, None, fine)


def test_skip_zero_advantage_with_a_loss_not_zero_there_is_refused_at_load():
    assert "'train.skip_zero_advantage': algo.policy_loss='entropy_bonus' is not 0 where the advantage is 0" in \
        _error("algo.policy_loss=entropy_bonus", "train.skip_zero_advantage=true")
    load_run_config(RLConfig, None, ["algo.policy_loss=entropy_advantage", "train.skip_zero_advantage=true"])


def test_seq_mean_token_sum_norm_takes_its_length_from_config():
    from vlrl.train.batch import loss_agg_max_length

    cfg = load_run_config(RLConfig, None, ["algo.loss_agg=seq_mean_token_sum_norm", "rollout.max_new_tokens=12"])
    assert loss_agg_max_length(cfg) == 12  # max_new_tokens × max_turns (1)
    cfg = load_run_config(RLConfig, None, ["algo.loss_agg=seq_mean_token_sum_norm", "algo.loss_agg_max_length=40"])
    assert loss_agg_max_length(cfg) == 40
    assert "'algo.loss_agg_max_length': Input should be greater than or equal to 1" in _error("algo.loss_agg_max_length=0")


def test_the_typed_config_alone_does_not_reach_the_plug_ins():
    """`vlrl.config.load_config` validates types only (the config room imports no plug-in); the commands load through
    `load_run_config`, which adds the plug-in checks."""
    cfg = load_config(RLConfig, None, ["algo.advantage_options={epz: 1e-6}"])
    assert config_problems(cfg) == [("algo.advantage_options.epz", "unknown option of grpo; known: eps, norm_by_std")]
    with pytest.raises(ConfigError, match="algo.advantage_options.epz"):
        load_run_config(RLConfig, None, ["algo.advantage_options={epz: 1e-6}"])
