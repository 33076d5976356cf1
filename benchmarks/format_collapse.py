"""Does any shipped RL config collapse the answers' form? (issue 52) Each RL config runs briefly from an SFT
checkpoint that writes its task's answer form, through `vlrl rl` as a user runs it, and the held-out well-formed
fraction (ended and in the sample's answer form) before and after RL is printed beside strict and verifier accuracy.

    OMP_NUM_THREADS=1 python benchmarks/format_collapse.py --steps 30 --out runs/format_collapse
    python benchmarks/format_collapse.py --configs shapes_grpo.yaml shapes_dapo.yaml --steps 60

Warm starts (built once under ``OUT/sft_*``, reused on a re-run): the shapes SFT (configs/shapes_sft.yaml, 300 steps on
count + color) for every shapes config, the arith SFT (tiny-qwen2, 300 steps) for arith_grpo, and the embodied SFT
(configs/embodied_sft.yaml, 300 steps) for the embodied configs. Configs that need a server, a judge model, a tool-
calling or Syn-GRPO checkpoint (judge_grpo, tool_zoom_grpo, shapes_syn_grpo) are left out and listed as such. Each
RL run: ``train.steps=STEPS`` of the config's own recipe at ``train.prompts_per_step=16`` and its own group size,
then 64 held-out prompts × 2 samples. A run whose summary.json exists is read, not re-run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "src" / "vlrl" / "configs"
SKIPPED = {"judge_grpo.yaml": "a judge model on a server", "tool_zoom_grpo.yaml": "a tool-calling checkpoint",
           "shapes_syn_grpo.yaml": "a Syn-GRPO checkpoint and its synthesis server"}
EVAL = ("data.n_test=64", "eval.samples=2", "report.html=false", 'report.progress="off"')
SFTS = {  # warm start → (vlrl sft arguments)
    "shapes": ("--config", str(CONFIGS / "shapes_sft.yaml"), "train.steps=300", "data.tasks=[count,color]"),
    "arith": ("--config", str(CONFIGS / "shapes_sft.yaml"), "model.path=tiny-qwen2", "data.suite=arith",
              "data.tasks=[add,sub]", "train.steps=300"),
    "embodied": ("--config", str(CONFIGS / "embodied_sft.yaml"), "train.steps=300", "train.max_seconds=null",
                 "eval.max_new_tokens=128"),
}


def vlrl(*args: str, log: Path) -> None:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    with open(log, "w") as handle:
        done = subprocess.run([sys.executable, "-m", "vlrl.cli", *args], stdout=handle, stderr=subprocess.STDOUT,
                              env=env, cwd=REPO)
    if done.returncode:
        raise SystemExit(f"vlrl {' '.join(args)} failed ({done.returncode}); see {log}")


def warm_start(kind: str, out: Path) -> Path:
    run = out / f"sft_{kind}"
    if not (run / "summary.json").is_file():
        run.mkdir(parents=True, exist_ok=True)
        vlrl("sft", *SFTS[kind], "data.n_test=64", "eval.samples=2", "report.html=false", 'report.progress="off"',
             f"out={run}", log=out / f"sft_{kind}.log")
    return run / "checkpoints" / "final"


def family(raw: dict) -> str:
    suite = (raw.get("data") or {}).get("suite", "shapes")
    return {"arith": "arith", "embodied": "embodied"}.get(suite, "shapes")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="*", help="config file names (default: every shipped RL config)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", type=Path, default=Path("runs/format_collapse"))
    args = parser.parse_args()

    import yaml

    args.out.mkdir(parents=True, exist_ok=True)
    names = args.configs or sorted(p.name for p in CONFIGS.glob("*.yaml"))
    rows = []
    for name in names:
        raw = yaml.safe_load((CONFIGS / name).read_text())
        if "sft" in name or name == "demo.yaml" or "rollout" not in raw and "stages" not in raw:
            continue  # not an RL config
        if name in SKIPPED:
            rows.append((name, None, f"left out: needs {SKIPPED[name]}"))
            continue
        start = warm_start(family(raw), args.out)
        run = args.out / name.removesuffix(".yaml")
        if not (run / "summary.json").is_file():
            config, steps = CONFIGS / name, [f"train.steps={args.steps}", "train.prompts_per_step=16"]
            if "stages" in raw:  # dotted overrides do not reach into the stages: a copy with the steps in each
                for stage in raw["stages"]:
                    stage["train"] = {**stage["train"], "steps": args.steps, "prompts_per_step": 16}
                config, steps = args.out / name, []
                config.write_text(yaml.safe_dump(raw, sort_keys=False))
            vlrl("rl", "--config", str(config), f"model.path={start}", *steps, *EVAL, "checkpoint.every=0",
                 f"out={run}", log=args.out / f"{run.name}.log")
        summary = json.loads((run / "summary.json").read_text())
        after = [k for k in summary if k not in ("initial", "train", "check", "rl") and isinstance(summary[k], dict)
                 and "well_formed" in summary[k]][-1:] or ["rl"]
        rows.append((name, (summary["initial"], summary[after[0]]), ""))
    print(f"| config | well-formed before → after RL ({args.steps} steps) | strict before → after | verifier's "
          "accuracy before → after |")
    print("| --- | --- | --- | --- |")
    for name, evals, note in rows:
        if evals is None:
            print(f"| {name} | {note} | | |")
            continue
        before, after = evals
        cells = [f"{before[k]['mean']:.3f} → {after[k]['mean']:.3f}" for k in ("well_formed", "strict", "accuracy")]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
