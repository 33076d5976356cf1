"""The demo's verdict: RL against the SFT control given the same budget, computed from summary.json."""

from __future__ import annotations

from typing import Any

BUDGET_WORDS = {"flops": "equal-compute", "wall": "equal-time"}


def demo_verdict(summary: dict[str, Any]) -> dict[str, Any] | None:
    """RL vs the SFT control of a `vlrl demo` summary — held-out sampled pass@1 and greedy accuracy of both, the
    differences in points, and one sentence that says whether RL beat the control; None without a control."""
    if "rl" not in summary or "sft_control" not in summary:
        return None
    rl, control = summary["rl"], summary["sft_control"]
    rl_acc = (rl["accuracy"]["mean"], rl["greedy"]["mean"])
    control_acc = (control["accuracy"]["mean"], control["greedy"]["mean"])
    sampled, greedy = ((a - b) * 100 for a, b in zip(rl_acc, control_acc, strict=True))
    unit = summary.get("budget", {}).get("unit", "wall")
    control_name = f"the {BUDGET_WORDS.get(unit, unit)} SFT control"
    if sampled > 0 and greedy > 0:
        sentence = f"RL beat {control_name} by {sampled:.1f} sampled / {greedy:.1f} greedy points."
    elif sampled <= 0 and greedy <= 0:
        sentence = f"RL did not beat {control_name}: {sampled:+.1f} sampled / {greedy:+.1f} greedy points."
    else:
        better, worse = ("sampled", "greedy") if sampled > 0 else ("greedy", "sampled")
        ahead, behind = (sampled, greedy) if sampled > 0 else (greedy, sampled)
        sentence = (f"RL beat {control_name} on {better} accuracy (+{ahead:.1f} points) but not on {worse} "
                    f"({behind:+.1f}).")
    sft = summary.get("sft")
    sft_acc = (sft["accuracy"]["mean"], sft["greedy"]["mean"]) if sft else (None, None)
    return {"sft": sft_acc, "rl": rl_acc, "control": control_acc, "sampled_points": round(sampled, 1),
            "greedy_points": round(greedy, 1), "beat": sampled > 0 and greedy > 0, "sentence": sentence}
