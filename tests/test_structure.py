"""The house's limits, checked over all of ``src/vlrl`` with ``ast``: no file over 600 lines, no function over 80,
no import from a higher room into a lower one (module-level, under ``TYPE_CHECKING`` and inside functions alike),
no private name (``_name``) of one module used in another, and no import cycle inside ``vlrl.train``.

The room order, lowest first (a room may import only from rooms at its level or below):
base (registry, compat, numerics, safe_yaml) < config < algos, rewards < data < models < rollout < eval, synth
< report < train < launch < check, serving, cli.

``VLRL_STRUCTURE_ROOMS=train,launch`` narrows every check to the files of those rooms (for work in progress)."""

import ast
import os
from pathlib import Path

import pytest

import vlrl

SRC = Path(vlrl.__file__).parent
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80

ROOMS = {
    "registry": 1, "compat": 1, "numerics": 1, "safe_yaml": 1, "__init__": 1,
    "config": 2,
    "algos": 3, "rewards": 3,
    "data": 4,
    "models": 5,
    "rollout": 6,
    "eval": 7, "synth": 7,
    "report": 8,
    "train": 9,
    "launch": 10,
    "check": 11, "serving": 11, "cli": 11,
}


def room_of(module: str) -> str:
    """``vlrl.train.grpo`` → ``train``; ``vlrl.config`` → ``config``; ``vlrl`` → ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _selected() -> list[Path]:
    paths = sorted(SRC.rglob("*.py"))
    only = os.environ.get("VLRL_STRUCTURE_ROOMS")
    if only:
        wanted = set(only.split(","))
        paths = [p for p in paths if room_of(module_name(p)) in wanted]
    return paths


FILES = _selected()
TREES = {path: ast.parse(path.read_text(encoding="utf-8")) for path in FILES}


def _label(path: Path) -> str:
    return str(path.relative_to(SRC.parent))


def _imported_modules(path: Path, tree: ast.AST) -> list[tuple[int, str, list[str]]]:
    """Every ``vlrl`` import in the file, anywhere in it: (line, module, the names taken from it)."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, []) for a in node.names if a.name.split(".")[0] == "vlrl"]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:  # relative: resolved against this file's package
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                module = ".".join([*base, module] if module else base)
            if module.split(".")[0] == "vlrl":
                found.append((node.lineno, module, [a.name for a in node.names]))
    return found


def _is_module(module: str) -> bool:
    relative = Path(*module.split(".")[1:]) if "." in module else Path()
    return (SRC / relative).with_suffix(".py").is_file() or (SRC / relative / "__init__.py").is_file()


def test_no_file_over_600_lines():
    over = {_label(p): n for p in FILES if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_FILE_LINES}
    assert not over, f"files over {MAX_FILE_LINES} lines: {over}"


def test_no_function_over_80_lines():
    over = {}
    for path, tree in TREES.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    over[f"{_label(path)}:{node.lineno} {node.name}"] = length
    assert not over, f"functions over {MAX_FUNCTION_LINES} lines: {over}"


def upward_imports(path: Path, tree: ast.AST) -> list[str]:
    here = room_of(module_name(path))
    found = []
    for line, module, _ in _imported_modules(path, tree):
        there = room_of(module)
        assert there in ROOMS, f"{_label(path)}:{line} imports {module}, a room the structure test does not know"
        if ROOMS[there] > ROOMS[here]:
            found.append(f"{_label(path)}:{line} ({here}) imports {module} ({there})")
    return found


def private_crossings(path: Path, tree: ast.AST) -> list[str]:
    """``from vlrl.x import _name`` in another module, or ``x._name`` on an imported vlrl module. A private module
    (``rewards/_sandbox_child.py``) is itself a name: only modules of its own package may import it."""
    me = module_name(path)
    aliases = {}  # local name → the vlrl module it stands for
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname or a.name: a.name for a in node.names if a.name.split(".")[0] == "vlrl"}
    for line, module, names in _imported_modules(path, tree):
        private_parts = [p for p in module.split(".") if p.startswith("_")]
        if private_parts and module.rpartition(".")[0] != me.rpartition(".")[0]:
            found.append(f"{_label(path)}:{line} imports the private module {module}")
        for name in names:
            if _is_module(f"{module}.{name}"):
                aliases[name] = f"{module}.{name}"
                if name.startswith("_") and module != me.rpartition(".")[0]:
                    found.append(f"{_label(path)}:{line} imports the private module {module}.{name}")
            elif name.startswith("_") and module != me:
                found.append(f"{_label(path)}:{line} takes {module}.{name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            target, dotted = node.value, []
            while isinstance(target, ast.Attribute):
                dotted.insert(0, target.attr)
                target = target.value
            if isinstance(target, ast.Name) and target.id in aliases:
                module = ".".join([aliases[target.id], *dotted])
                if module != me:
                    found.append(f"{_label(path)}:{node.lineno} uses {module}.{node.attr}")
    return found


def test_no_upward_import():
    upward = [v for path, tree in TREES.items() for v in upward_imports(path, tree)]
    assert not upward, "imports from a higher room into a lower one:\n" + "\n".join(upward)


def test_no_private_name_across_modules():
    crossing = [v for path, tree in TREES.items() for v in private_crossings(path, tree)]
    assert not crossing, "private names used outside their module:\n" + "\n".join(crossing)


def _train_imports(path: Path) -> set[str]:
    found = set()
    for _, module, names in _imported_modules(path, TREES.get(path) or ast.parse(path.read_text())):
        if module.startswith("vlrl.train."):
            found.add(module.split(".")[2])
        elif module == "vlrl.train":
            found |= set(names)
    return found - {path.stem}


def test_no_import_cycle_inside_vlrl_train():
    """Each module of the training room can be read, tested and replaced on its own (batch ↔ step_credit and
    distributed ↔ checkpoint were cycles)."""
    graph = {path.stem: _train_imports(path) for path in (SRC / "train").glob("*.py")}
    state: dict[str, str] = {}  # visiting / done

    def visit(module: str, trail: list[str]) -> None:
        state[module] = "visiting"
        for dep in sorted(graph.get(module, ())):
            assert state.get(dep) != "visiting", f"import cycle: {' → '.join([*trail, dep])}"
            if dep not in state:
                visit(dep, [*trail, dep])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert {"checkpoint", "distributed", "batch", "grpo"} <= set(graph)  # the graph is the real one


@pytest.mark.parametrize("source, expected", [
    ("from vlrl.data import Sample\nfrom vlrl.train.grpo import _private_here\n", []),
    ("def f():\n    from vlrl.cli import main\n", ["vlrl/train/grpo.py:2 (train) imports vlrl.cli (cli)"]),
    ("if TYPE_CHECKING:\n    from vlrl.launch import plan\n", ["vlrl/train/grpo.py:2 (train) imports vlrl.launch (launch)"]),
    ("from vlrl.algos.losses import _clip\n", ["vlrl/train/grpo.py:1 takes vlrl.algos.losses._clip"]),
    ("import vlrl.registry as registry\nx = registry._REGISTRIES\n",
     ["vlrl/train/grpo.py:2 uses vlrl.registry._REGISTRIES"]),
    ("from vlrl import registry\nx = registry._REGISTRIES\n", ["vlrl/train/grpo.py:2 uses vlrl.registry._REGISTRIES"]),
    ("from vlrl.rewards import _sandbox_child\n",
     ["vlrl/train/grpo.py:1 imports the private module vlrl.rewards._sandbox_child"]),
])
def test_the_checks_see_what_they_look_for(source, expected):
    """The checks are only as good as their parsing: an upward import inside a function or under TYPE_CHECKING and
    a private name taken either way are found, as if the source were vlrl/train/grpo.py."""
    path, tree = SRC / "train" / "grpo.py", ast.parse(source)
    assert upward_imports(path, tree) + private_crossings(path, tree) == expected
