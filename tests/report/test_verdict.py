from vlrl.report.environment import describe, environment
from vlrl.report.verdict import demo_verdict


def _summary(rl, control, unit="flops", rl_formed=1.0):
    def stage(sampled, greedy, formed=1.0):  # the verifier's accuracy 0.1 above the strict figures
        return {"accuracy": {"mean": sampled + 0.1}, "greedy": {"mean": greedy + 0.1}, "strict": {"mean": sampled},
                "strict_greedy": {"mean": greedy}, "well_formed": {"mean": formed}}
    return {"sft": stage(0.30, 0.35), "rl": stage(*rl, formed=rl_formed), "sft_control": stage(*control),
            "budget": {"unit": unit}}


STRICT = " (strict: right, well-formed and ended)."


def test_the_verdict_is_computed_from_the_strict_numbers():
    v = demo_verdict(_summary((0.62, 0.60), (0.40, 0.45)))
    # (0.62 − 0.40) · 100 = 22.0, (0.60 − 0.45) · 100 = 15.0
    assert (v["sampled_points"], v["greedy_points"], v["beat"], v["strict"]) == (22.0, 15.0, True, True)
    assert v["sentence"] == "RL beat the equal-compute SFT control by 22.0 sampled / 15.0 greedy points" + STRICT
    assert v["sft"] == (0.30, 0.35) and v["rl"] == (0.62, 0.60) and v["control"] == (0.40, 0.45)
    v = demo_verdict(_summary((0.40, 0.45), (0.50, 0.45), unit="wall"))
    assert not v["beat"]
    assert v["sentence"] == "RL did not beat the equal-time SFT control: -10.0 sampled / +0.0 greedy points" + STRICT
    v = demo_verdict(_summary((0.50, 0.40), (0.45, 0.47)))
    assert v["sentence"] == ("RL beat the equal-compute SFT control on sampled accuracy (+5.0 points) but not on "
                             "greedy (-7.0)" + STRICT)


def test_a_win_with_broken_answers_is_no_win():
    """Issue 52: RL ahead on the numbers while few of its answers are well-formed is not called a win."""
    v = demo_verdict(_summary((0.62, 0.60), (0.40, 0.45), rl_formed=0.5))
    assert not v["beat"] and v["well_formed"] == (1.0, 0.5, 1.0)
    assert v["sentence"].endswith("Only 50% of RL's held-out answers are well-formed (bar 95%).")


def test_a_summary_from_before_strict_scoring_says_it_is_not_strict():
    summary = _summary((0.62, 0.60), (0.40, 0.45))
    for stage in ("sft", "rl", "sft_control"):
        summary[stage] = {k: summary[stage][k] for k in ("accuracy", "greedy")}
    v = demo_verdict(summary)
    assert not v["strict"] and v["rl"] == (0.72, 0.70) and v["sentence"].endswith("(the verifier's accuracy: not strict).")


def test_no_verdict_without_a_control():
    summary = _summary((0.5, 0.5), (0.4, 0.4))
    del summary["sft_control"]
    assert demo_verdict(summary) is None


def test_environment_names_the_versions_and_threads():
    import torch

    info = environment()
    assert info["torch"].split("+")[0] == torch.__version__.split("+")[0]
    assert info["torch_threads"] == torch.get_num_threads()
    assert all(name in info for name in ("transformers", "tokenizers", "pillow", "numpy"))
    line = describe(info)
    assert f"torch {info['torch']}" in line and f"transformers {info['transformers']}" in line
    assert f"{torch.get_num_threads()} torch thread(s)" in line
