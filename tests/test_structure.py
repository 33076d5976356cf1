"""The house's limits, checked over all of ``src/vlrl`` with ``ast``: no file over 600 lines, no function over 80,
no private name (``_name``) of one module imported or read by another, no private torch or transformers name outside
vlrl/compat.py, no import from a higher room into a lower one, and no circle of modules importing each other.

An import is every import statement — at module level, inside a function, under ``TYPE_CHECKING`` — and every
registration by location: a ``"pkg.mod:attr"`` string (`vlrl.registry.Registry.register_path`'s form, which the
registry imports at the first lookup) or the module named to ``importlib.import_module``. So a plug-in registered by
a string in a lower room for a higher one is an upward import like any other, and a ``TYPE_CHECKING`` import that
closes a circle (a back-reference) is a circle like any other. A package that finds its own modules at run time
(`vlrl.models.families`, `vlrl.registry.Registry`'s ``discover``) names no module: its plug-ins import it, it does
not import them.

The room order, lowest first (a room imports only from rooms at its level or below):

    base (registry, compat, numerics, safe_yaml, serving, the package root) < config < algos, rewards < data
    < models < rollout < eval, synth < feed < report < train < check < recipes < launch < cli

The tree does not meet all of it yet. What it breaks today is written down below, each exception with its size
or its edge, and may only shrink: a file on the list may not grow, a function on it may not lengthen, and no new
upward edge between rooms may appear. A new file, function or import is held to the limits outright. When an entry
is fixed, the test says so and asks for the entry to be removed, so the lists stay true.
"""

import ast
import re
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
    "feed": 7,
    "report": 8,
    "train": 9,
    "check": 10,
    "recipes": 11,
    "launch": 12,
    "cli": 13,
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


REGISTRATION = re.compile(r"^(vlrl(?:\.\w+)+):\w+$")  # "pkg.mod:attr", a registration by location


def _string_imports(tree: ast.Module):
    """The vlrl modules a file names in strings that are imported at run time: ``"vlrl.mod:attr"`` anywhere, and the
    first argument of ``import_module(...)`` / ``register_path(name, path)``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            match = REGISTRATION.match(node.value)
            if match:
                yield match.group(1)
        elif isinstance(node, ast.Call) and isinstance(node.func, (ast.Name, ast.Attribute)):
            name = node.func.id if isinstance(node.func, ast.Name) else node.func.attr
            if name == "import_module" and node.args and isinstance(node.args[0], ast.Constant) \
                    and str(node.args[0].value).startswith("vlrl."):
                yield str(node.args[0].value)


def _type_checking_imports(tree: ast.Module, module: str) -> set[str]:
    """The vlrl modules imported under ``if TYPE_CHECKING:``."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for target, names in _imports(ast.Module(body=node.body, type_ignores=[]), module):
                found |= _targets(target, names)
    return found


MODULES = {_module(path): path for path in FILES}


def _targets(target: str, names: list[str]) -> set[str]:
    """The modules an import of ``names`` from ``target`` loads: each name that is a module of its own, else the most
    specific module ``target`` resolves to (``vlrl.rollout`` → its ``__init__``)."""
    found = {f"{target}.{name}" for name in names if f"{target}.{name}" in MODULES}
    if len(found) < len(names) or not names:
        while target and target not in MODULES:
            target = target.rpartition(".")[0]
        if target:
            found.add(target)
    return found


def _graph(trees=None) -> dict[str, set[str]]:
    """module → the vlrl modules it imports (statements anywhere, and registrations by location)."""
    graph: dict[str, set[str]] = {}
    for path, tree in (trees or TREES).items():
        module = _module(path)
        edges = set()
        for target, names in _imports(tree, module):
            edges |= _targets(target, names)
        for target in _string_imports(tree):
            edges |= _targets(target, [])
        graph[module] = edges - {module}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


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
        for target in [t for t, _ in _imports(tree, module)] + list(_string_imports(tree)):
            there = _room(target)
            if there != here and LEVEL.get(there, 0) > LEVEL[here]:
                edges.setdefault((here, there), []).append(f"{_name(path)} → {target}")
    new = {edge: where for edge, where in edges.items() if edge not in UPWARD_EDGES}
    assert not new, "imports from a higher room:\n" + "\n".join(f"{a} → {b}: {w}" for (a, b), w in new.items())
    assert set(UPWARD_EDGES) <= set(edges), f"no longer imported — remove: {sorted(set(UPWARD_EDGES) - set(edges))}"


def test_no_circle_of_imports():
    """No modules import each other, directly or round a circle — counting imports inside functions, under
    ``TYPE_CHECKING`` and registrations by location: each module can be read, tested and replaced on its own."""
    circles = _circles(_graph())
    assert not circles, "modules that import each other (cut the circle at its seam):\n" + "\n".join(
        " ↔ ".join(circle) for circle in circles)


def test_no_type_checking_back_reference():
    """A ``TYPE_CHECKING`` import is for an annotation only; one whose module imports this one back (a split that
    needs its other half's types) is a seam in the wrong place."""
    graph = _graph()
    found = []
    for path, tree in TREES.items():
        module = _module(path)
        for target in _type_checking_imports(tree, module):
            seen, todo = set(), [target]
            while todo:
                v = todo.pop()
                if v == module:
                    found.append(f"{_name(path)}: TYPE_CHECKING import of {target}, which imports {module} back")
                    break
                if v not in seen:
                    seen.add(v)
                    todo.extend(graph.get(v, ()))
    assert not found, "TYPE_CHECKING back-references:\n" + "\n".join(found)


@pytest.mark.parametrize("source, message", [
    ("from vlrl.data.sample import _secret\n", "private names used"),
    ("from vlrl.train import loop\n", "imports from a higher room"),
    ("from vlrl.rollout import decode\nX = decode._hidden\n", "private names read across modules"),
    ("import torch\nX = torch.nn.Linear(1, 1)._parameters_probe\n", "private torch/transformers names"),
    ("from torch.distributed._tools import mem_tracker\n", "private torch/transformers names"),
    ("from vlrl.registry import Registry\nR = Registry('x')\nR.register_path('x', 'vlrl.train.loop:train_rl')\n",
     "imports from a higher room"),
    ("def f():\n    from vlrl.rewards import structure_probe_peer\n", "modules that import each other"),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from vlrl.rewards.structure_probe_peer import X\n",
     "TYPE_CHECKING back-references"),
])
def test_the_checks_catch_what_they_are_for(tmp_path, monkeypatch, source, message):
    """A planted violation in the rewards room (level 2) trips the check meant for it."""
    planted = SRC / "rewards" / "structure_probe.py"
    monkeypatch.setitem(TREES, planted, ast.parse(source))
    # a peer that imports the probe back (for the circle checks)
    peer = SRC / "rewards" / "structure_probe_peer.py"
    monkeypatch.setitem(TREES, peer, ast.parse("from vlrl.rewards.structure_probe import Y\n"))
    monkeypatch.setitem(MODULES, "vlrl.rewards.structure_probe", planted)
    monkeypatch.setitem(MODULES, "vlrl.rewards.structure_probe_peer", peer)
    checks = {"private names used": test_no_private_name_of_one_module_is_imported_by_another,
              "private names read": test_no_private_name_of_one_module_is_read_through_it,
              "private torch": test_private_names_of_torch_and_transformers_only_in_compat,
              "imports from": test_no_new_upward_import_between_rooms,
              "modules that import": test_no_circle_of_imports,
              "TYPE_CHECKING back": test_no_type_checking_back_reference}
    check = next(test for start, test in checks.items() if message.startswith(start))
    with pytest.raises(AssertionError, match=message):
        check()
