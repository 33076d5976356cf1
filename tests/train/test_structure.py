"""The training room's modules import each other without a cycle (module-level and inside functions): each one
can be read, tested and replaced on its own (batch ↔ step_credit and distributed ↔ checkpoint were cycles)."""

import ast
from pathlib import Path

import vlrl

TRAIN = Path(vlrl.__file__).parent / "train"


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith("vlrl.train."):
                found.add(node.module.split(".")[2])
            elif node.module == "vlrl.train":
                found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[2] for a in node.names if a.name.startswith("vlrl.train.")}
    return found - {path.stem}


def test_no_import_cycle_inside_vlrl_train():
    graph = {path.stem: _imports(path) for path in TRAIN.glob("*.py")}
    state: dict[str, str] = {}  # visiting / done

    def visit(module: str, path: list[str]) -> None:
        state[module] = "visiting"
        for dep in sorted(graph.get(module, ())):
            assert state.get(dep) != "visiting", f"import cycle: {' → '.join([*path, dep])}"
            if dep not in state:
                visit(dep, [*path, dep])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert {"checkpoint", "distributed", "batch", "step_credit"} <= set(graph)  # the graph is the real one
