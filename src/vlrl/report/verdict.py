"""The demo's verdict: RL against the SFT control given the same budget, computed from summary.json."""

from __future__ import annotations

from typing import Any

BUDGET_WORDS = {"flops": "equal-compute", "wall": "equal-time"}
WELL_FORMED_BAR = 0.95  # the share of RL's held-out answers that must be well-formed for a win to count as one


def demo_verdict(summary: dict[str, Any]) -> dict[str, Any] | None:
    """RL vs the SFT control of a `vlrl demo` summary — held-out sampled pass@1 and greedy accuracy of both, scored
    strictly (right, well-formed and ended: `vlrl.eval.evaluate`) where the summary has it, the differences in
    points, the well-formed fractions, and one sentence that says whether RL beat the control; None without a
    control. A summary written before strict scoring existed is judged on the verifier's accuracy, and says so."""
    if "rl" not in summary or "sft_control" not in summary:
        return None
    strict = "strict" in summary["rl"] and "strict" in summary["sft_control"]
    sampled_key, greedy_key = ("strict", "strict_greedy") if strict else ("accuracy", "greedy")

    def scores(stage: dict[str, Any]) -> tuple[float, float]:
        return stage[sampled_key]["mean"], stage[greedy_key]["mean"]

    def formed(stage: dict[str, Any] | None) -> float | None:
        return stage["well_formed"]["mean"] if stage and "well_formed" in stage else None

    rl_acc, control_acc = scores(summary["rl"]), scores(summary["sft_control"])
    sampled, greedy = ((a - b) * 100 for a, b in zip(rl_acc, control_acc, strict=True))
    unit = summary.get("budget", {}).get("unit", "wall")
    control_name = f"the {BUDGET_WORDS.get(unit, unit)} SFT control"
    if sampled > 0 and greedy > 0:
        sentence = f"RL beat {control_name} by {sampled:.1f} sampled / {greedy:.1f} greedy points"
    elif sampled <= 0 and greedy <= 0:
        sentence = f"RL did not beat {control_name}: {sampled:+.1f} sampled / {greedy:+.1f} greedy points"
    else:
        better, worse = ("sampled", "greedy") if sampled > 0 else ("greedy", "sampled")
        ahead, behind = (sampled, greedy) if sampled > 0 else (greedy, sampled)
        sentence = f"RL beat {control_name} on {better} accuracy (+{ahead:.1f} points) but not on {worse} ({behind:+.1f})"
    sentence += " (strict: right, well-formed and ended)." if strict else " (the verifier's accuracy: not strict)."
    rl_formed = formed(summary["rl"])
    beat = sampled > 0 and greedy > 0 and (rl_formed is None or rl_formed >= WELL_FORMED_BAR)
    if rl_formed is not None and rl_formed < WELL_FORMED_BAR:
        sentence += f" Only {rl_formed:.0%} of RL's held-out answers are well-formed (bar {WELL_FORMED_BAR:.0%})."
    sft = summary.get("sft")
    sft_acc = scores(sft) if sft else (None, None)
    return {"sft": sft_acc, "rl": rl_acc, "control": control_acc, "sampled_points": round(sampled, 1),
            "greedy_points": round(greedy, 1), "beat": beat, "strict": strict, "sentence": sentence,
            "well_formed": (formed(sft), rl_formed, formed(summary["sft_control"]))}
