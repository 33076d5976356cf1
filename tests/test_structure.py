"""The house's limits, checked over all of ``src/vlrl`` with ``ast``: no file over 600 lines, no function over 80,
no private name (``_name``) of one module imported or read by another, no private torch or transformers name outside
vlrl/compat.py, and no import from a higher room into a lower one.

The room order, lowest first (a room imports only from rooms at its level or below):

    base (registry, compat, numerics, safe_yaml, serving, the package root) < config < algos, rewards < data
    < models < rollout < eval, synth < report < check < train < launch < cli

The tree does not meet all of it yet. What it breaks today is written down below, each exception with its size
or its edge, and may only shrink: a file on the list may not grow, a function on it may not lengthen, and no new
upward edge between rooms may appear. A new file, function or import is held to the limits outright. When an entry
is fixed, the test says so and asks for the entry to be removed, so the lists stay true.
"""

import ast
from pathlib import Path

import pytest

import vlrl

SRC = Path(vlrl.__file__).parent
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80

LEVEL = {
    "__init__": 0, "registry": 0, "compat": 0, "numerics": 0, "safe_yaml": 0, "serving": 0,
    "config": 1,
    "algos": 2, "rewards": 2,
    "data": 3,
    "models": 4,
    "rollout": 5,
    "eval": 6, "synth": 6,
    "report": 7,
    "check": 8,
    "train": 9,
    "launch": 10,
    "cli": 11,
}

# Files over MAX_FILE_LINES on 2026-11-28, with their lengths then: each may shrink, none may grow.
LONG_FILES: dict[str, int] = {}
# Functions over MAX_FUNCTION_LINES on 2026-11-28 ("file:function": lines).
LONG_FUNCTIONS: dict[str, int] = {}
# Imports from a higher room into a lower one on 2026-11-28, as (room, room it imports from).
UPWARD_EDGES: set[tuple[str, str]] = set()


def _module(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


FILES = sorted(SRC.rglob("*.py"))
TREES = {path: ast.parse(path.read_text(), filename=str(path)) for path in FILES}


def _name(path: Path) -> str:
    return path.relative_to(SRC).as_posix()


def _imports(tree: ast.Module, module: str):
    """(imported module, names) for every vlrl import in ``tree``: module level, under TYPE_CHECKING and inside
    functions alike; relative imports resolved against ``module``."""
    package = module.split(".")
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "vlrl" or alias.name.startswith("vlrl."):
                    yield alias.name, []
        elif isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level:
                base = package[: len(package) - node.level + (1 if _is_package(module) else 0)]
                target = ".".join([*base, target] if target else base)
            if target == "vlrl" or target.startswith("vlrl."):
                names = [a.name for a in node.names]
                if target == "vlrl":  # `from vlrl import data`: each name is a room
                    for name in names:
                        yield f"vlrl.{name}", []
                else:
                    yield target, names


def _is_package(module: str) -> bool:
    return (SRC.parent / Path(*module.split(".")) / "__init__.py").is_file()


def test_every_room_has_a_level():
    rooms = {_room(_module(p)) for p in FILES}
    assert rooms <= set(LEVEL), f"rooms without a level in LEVEL: {sorted(rooms - set(LEVEL))}"


def test_no_file_over_the_limit_and_the_listed_ones_do_not_grow():
    problems, fixed = [], []
    for path in FILES:
        name, lines = _name(path), len(path.read_text().splitlines())
        allowed = LONG_FILES.get(name, MAX_FILE_LINES)
        if lines > allowed:
            problems.append(f"{name}: {lines} lines (limit {allowed})")
        elif name in LONG_FILES and lines <= MAX_FILE_LINES:
            fixed.append(name)
    assert not problems, "files over their limit:\n" + "\n".join(problems)
    assert not fixed, f"now within {MAX_FILE_LINES} lines — remove from LONG_FILES: {fixed}"
    assert set(LONG_FILES) <= {_name(p) for p in FILES}, "LONG_FILES names a file that is gone"


def test_no_function_over_the_limit_and_the_listed_ones_do_not_lengthen():
    problems, seen = [], set()
    for path, tree in TREES.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                key, lines = f"{_name(path)}:{node.name}", node.end_lineno - node.lineno + 1
                allowed = LONG_FUNCTIONS.get(key, MAX_FUNCTION_LINES)
                if lines > allowed:
                    problems.append(f"{key} (line {node.lineno}): {lines} lines (limit {allowed})")
                elif key in LONG_FUNCTIONS and lines > MAX_FUNCTION_LINES:
                    seen.add(key)
    assert not problems, "functions over their limit:\n" + "\n".join(problems)
    assert set(LONG_FUNCTIONS) == seen, f"within the limit now — remove: {sorted(set(LONG_FUNCTIONS) - seen)}"


def test_no_private_name_of_one_module_is_imported_by_another():
    found = [f"{_name(path)}: from {target} import {name}" for path, tree in TREES.items()
             for target, names in _imports(tree, _module(path)) for name in names
             if name.startswith("_") and not name.startswith("__")]
    assert not found, "private names used across modules (make them public or move the code):\n" + "\n".join(found)


def _module_aliases(tree: ast.Module, module: str) -> set[str]:
    """Names under which ``tree`` holds another vlrl *module* (``from vlrl.rollout import decode``, ``import
    vlrl.compat as compat``)."""
    aliases = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname for a in node.names if a.asname and a.name.startswith("vlrl.")}
        elif isinstance(node, ast.ImportFrom):
            for target, names in _imports(ast.Module(body=[node], type_ignores=[]), module):
                for alias, name in zip(node.names, names or [], strict=False):
                    if _is_package(f"{target}.{name}") or (SRC.parent / Path(*target.split("."), f"{name}.py")).is_file():
                        aliases.add(alias.asname or name)
            if node.module == "vlrl" and not node.level:
                aliases |= {a.asname or a.name for a in node.names}
    return aliases


def test_no_private_name_of_one_module_is_read_through_it():
    found = []
    for path, tree in TREES.items():
        aliases = _module_aliases(tree, _module(path))
        found += [f"{_name(path)}:{node.lineno}: {ast.unparse(node)}" for node in ast.walk(tree)
                  if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                  and node.attr.startswith("_") and not node.attr.startswith("__")]
    assert not found, "private names read across modules (make them public or move the code):\n" + "\n".join(found)


# Private names of the standard library that its documentation publishes (``os._exit``).
STDLIB_PRIVATE = {"_exit"}


def test_private_names_of_torch_and_transformers_only_in_compat():
    """vlrl.compat holds every use of a name torch or transformers does not publish (issue: installs that keep
    working). Found statically: a private module or name imported from either package, or an attribute ``._name``
    that vlrl itself never defines (so it belongs to a library object) — outside compat.py."""
    defined = set()
    for tree in TREES.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                defined.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and \
                    isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                defined.add(node.attr)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                defined.add(node.target.id)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
                defined.add(node.value)  # object.__setattr__(self, "_peft", ...)
    found = []
    for path, tree in TREES.items():
        if _name(path) == "compat.py":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ("torch", "transformers"):
                private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
                if private or any(p.startswith("_") for p in node.module.split(".")):
                    found.append(f"{_name(path)}:{node.lineno}: from {node.module} import {', '.join(a.name for a in node.names)}")
            elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__") \
                    and node.attr not in defined and node.attr not in STDLIB_PRIVATE:
                found.append(f"{_name(path)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "private torch/transformers names outside vlrl/compat.py (wrap them there):\n" + "\n".join(found)


def test_no_new_upward_import_between_rooms():
    edges: dict[tuple[str, str], list[str]] = {}
    for path, tree in TREES.items():
        module = _module(path)
        here = _room(module)
        for target, _ in _imports(tree, module):
            there = _room(target)
            if there != here and LEVEL.get(there, 0) > LEVEL[here]:
                edges.setdefault((here, there), []).append(f"{_name(path)} → {target}")
    new = {edge: where for edge, where in edges.items() if edge not in UPWARD_EDGES}
    assert not new, "imports from a higher room:\n" + "\n".join(f"{a} → {b}: {w}" for (a, b), w in new.items())
    assert set(UPWARD_EDGES) <= set(edges), f"no longer imported — remove: {sorted(set(UPWARD_EDGES) - set(edges))}"


@pytest.mark.parametrize("source, message", [
    ("from vlrl.data.sample import _secret\n", "private names used"),
    ("from vlrl.train import grpo\n", "imports from a higher room"),
    ("from vlrl.rollout import decode\nX = decode._hidden\n", "private names read across modules"),
    ("import torch\nX = torch.nn.Linear(1, 1)._parameters_probe\n", "private torch/transformers names"),
    ("from torch.distributed._tools import mem_tracker\n", "private torch/transformers names"),
])
def test_the_checks_catch_what_they_are_for(tmp_path, monkeypatch, source, message):
    """A planted violation in the rewards room (level 2) trips the check meant for it."""
    planted = SRC / "rewards" / "structure_probe.py"
    monkeypatch.setitem(TREES, planted, ast.parse(source))
    checks = {"private names used": test_no_private_name_of_one_module_is_imported_by_another,
              "private names read": test_no_private_name_of_one_module_is_read_through_it,
              "private torch": test_private_names_of_torch_and_transformers_only_in_compat,
              "imports from": test_no_new_upward_import_between_rooms}
    check = next(test for start, test in checks.items() if message.startswith(start))
    with pytest.raises(AssertionError, match=message):
        check()
