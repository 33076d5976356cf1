"""The RL wing's shape (issue 48): one loop over a feed and a learner, short enough to read at a glance; the training
room neither builds nor drives the rollout side — no async engine, no weight publisher, no weight update of its own."""

import ast
from pathlib import Path

import vlrl

SRC = Path(vlrl.__file__).parent
TRAIN = SRC / "train"


def _function(path: Path, name: str) -> ast.FunctionDef:
    return next(node for node in ast.walk(ast.parse(path.read_text()))
                if isinstance(node, ast.FunctionDef) and node.name == name)


def test_one_rl_loop_under_fifty_lines_over_a_feed_and_a_learner():
    loop = _function(TRAIN / "loop.py", "rl_loop")
    assert loop.end_lineno - loop.lineno + 1 < 50
    assert [a.arg for a in loop.args.args][:2] == ["feed", "learner"]
    called = {node.func.attr for node in ast.walk(loop) if isinstance(node, ast.Call)
              and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name)
              and node.func.value.id == "feed"}
    assert called == {"start", "next_batch", "publish", "finish_step", "close"}
    assert not (TRAIN / "async_grpo.py").exists() and not (TRAIN / "grpo.py").exists()
    # sync and async differ only inside the feed: the loop never asks which one it has
    source = ast.unparse(loop)
    assert "async" not in source and "mode" not in source


def test_no_training_module_imports_the_async_engine_or_the_weight_publisher_or_updates_weights():
    rollout_side = {"AsyncEngine", "WeightPublisher", "ThreadedEngine", "HTTPEngine", "capability"}
    found = []
    for path in sorted(TRAIN.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("vlrl."):
                names = {a.name for a in node.names} & rollout_side
                if names or node.module in ("vlrl.rollout.publish", "vlrl.feed.publish", "vlrl.rollout.threaded_engine",
                                            "vlrl.rollout.http_engine"):
                    found.append(f"{path.name}: from {node.module} import {', '.join(a.name for a in node.names)}")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr in ("update_weights", "publish") and "feed" not in ast.unparse(node.func):
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node.func)}(...)")
    assert found == []
