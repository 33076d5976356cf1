from vlrl.report.environment import describe, environment
from vlrl.report.verdict import demo_verdict


def _summary(rl, control, unit="flops"):
    def stage(sampled, greedy):
        return {"accuracy": {"mean": sampled}, "greedy": {"mean": greedy}}
    return {"sft": stage(0.30, 0.35), "rl": stage(*rl), "sft_control": stage(*control), "budget": {"unit": unit}}


def test_the_verdict_is_computed_from_the_numbers():
    v = demo_verdict(_summary((0.62, 0.60), (0.40, 0.45)))
    # (0.62 − 0.40) · 100 = 22.0, (0.60 − 0.45) · 100 = 15.0
    assert (v["sampled_points"], v["greedy_points"], v["beat"]) == (22.0, 15.0, True)
    assert v["sentence"] == "RL beat the equal-compute SFT control by 22.0 sampled / 15.0 greedy points."
    assert v["sft"] == (0.30, 0.35) and v["rl"] == (0.62, 0.60) and v["control"] == (0.40, 0.45)
    v = demo_verdict(_summary((0.40, 0.45), (0.50, 0.45), unit="wall"))
    assert not v["beat"]
    assert v["sentence"] == "RL did not beat the equal-time SFT control: -10.0 sampled / +0.0 greedy points."
    v = demo_verdict(_summary((0.50, 0.40), (0.45, 0.47)))
    assert v["sentence"] == "RL beat the equal-compute SFT control on sampled accuracy (+5.0 points) but not on greedy (-7.0)."


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
