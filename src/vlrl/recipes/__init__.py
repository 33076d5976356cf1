"""The runnable recipes behind `vlrl sft`, `vlrl rl` and `vlrl demo`, by name (`RECIPES`): check, load, train,
evaluate, save, report. Every recipe reads the same way:

    run directory + metric sinks → data → preflight check (no weights yet) → policy → train / eval → report.html

``report.html`` is written at the end even when the run fails part-way (then it shows what was logged). The loops
they run are the training room's (`vlrl.train`); what they share around them is `vlrl.recipes.run`.
"""

from vlrl.recipes.demo import run_demo
from vlrl.recipes.rl import run_rl
from vlrl.recipes.sft import run_sft

RECIPES = {"demo": run_demo, "rl": run_rl, "sft": run_sft}  # `vlrl <name>` runs RECIPES[name]

__all__ = ["RECIPES", "run_demo", "run_rl", "run_sft"]
