"""pyproject.toml against the code and the lock: every package src/vlrl imports is declared, a module imported by
every install needs core dependencies only, the lock (constraints/test.txt) holds every declared package inside its
bounds and agrees with the demo's pins, and the install guide (docs/guides/installing.md) quotes the lock's versions."""

from __future__ import annotations

import ast
import re
import sys
from importlib import metadata
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement

ROOT = Path(__file__).parents[1]
SRC = ROOT / "src" / "vlrl"
sys.path.insert(0, str(ROOT / "constraints"))
from pins import floor_pins, normalize, read_pins, requirements  # noqa: E402

PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
LOCK = read_pins(ROOT / "constraints" / "test.txt")


def _declared(extras) -> set[str]:
    return {name for name, _ in requirements(PROJECT, list(extras))}


def imports(path: Path, *, module_level_only: bool = False) -> set[str]:
    """Top-level names of the absolute imports in ``path`` other than the standard library's and vlrl's;
    ``module_level_only``: the imports that run when the module is imported (not those inside functions)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    nodes = ast.walk(tree)
    if module_level_only:
        nodes = [n for top in tree.body if not isinstance(top, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                 for n in ast.walk(top)]
        nodes += [n for top in tree.body if isinstance(top, ast.ClassDef) for n in top.body
                  if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n != "vlrl"}


def distributions(import_name: str) -> set[str]:
    """The distributions that install ``import_name`` (``PIL`` → pillow, ``skimage`` → scikit-image)."""
    return {normalize(d) for d in metadata.packages_distributions().get(import_name, [])}


def undeclared(import_names: dict[str, set[str]], declared: set[str]) -> list[str]:
    """One line per imported name no declared distribution provides (or that nothing installed provides)."""
    problems = []
    for name, where in sorted(import_names.items()):
        dists = distributions(name)
        if not dists:
            problems.append(f"{name} (imported by {', '.join(sorted(where))}): no installed distribution provides it")
        elif not dists & declared:
            problems.append(f"{name} (imported by {', '.join(sorted(where))}): from {', '.join(sorted(dists))}, "
                            "which pyproject.toml does not declare")
    return problems


def _scan(module_level_only: bool = False) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in sorted(SRC.rglob("*.py")):
        for name in imports(path, module_level_only=module_level_only):
            found.setdefault(name, set()).add(str(path.relative_to(SRC.parent)))
    return found


def test_every_imported_package_is_declared():
    extras = [e for e in PROJECT["optional-dependencies"] if e != "dev"]
    assert undeclared(_scan(), _declared(extras)) == []


def test_modules_import_only_core_dependencies_when_imported():
    """A package of an extra is imported inside the function that needs it, so `import vlrl.<anything>` works on a
    core install (and the missing extra is reported where it is needed)."""
    assert undeclared(_scan(module_level_only=True), _declared([])) == []


def test_the_scan_catches_an_undeclared_import(tmp_path):
    """The checks above can fail: scipy imported by a module while only the core is declared."""
    module = tmp_path / "mod.py"
    module.write_text("import os\nfrom scipy import ndimage\n\ndef f():\n    import matplotlib.pyplot\n")
    assert imports(module) == {"scipy", "matplotlib"}
    assert imports(module, module_level_only=True) == {"scipy"}
    problems = undeclared({"scipy": {"mod.py"}}, _declared([]))
    assert len(problems) == 1 and "scipy (imported by mod.py): from scipy" in problems[0]


def test_install_messages_name_extras_that_exist():
    extras = set(PROJECT["optional-dependencies"])
    for path in SRC.rglob("*"):
        if path.suffix in (".py", ".yaml"):
            for match in re.finditer(r"vlrl\[([a-z_]+)\]", path.read_text(encoding="utf-8")):
                if match[1] != "extra":  # deps.py's docstring placeholder
                    assert match[1] in extras, f"{path}: {match[0]}"


def test_verifier_requirements_are_in_the_extra_they_name():
    for path in (SRC / "rewards").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "requires":
                extra = next(k.value.value for k in node.keywords if k.arg == "extra")
                for module in (a.value for a in node.args):
                    assert distributions(module) & _declared([extra]), f"{path.name}: {module} not in vlrl[{extra}]"


# ----------------------------------------------------------------------------------------------- the lock
def test_the_lock_holds_every_declared_package_within_its_bounds():
    for line in [*PROJECT["dependencies"], *(r for e in PROJECT["optional-dependencies"].values() for r in e)]:
        requirement = Requirement(line)
        name = normalize(requirement.name)
        if name == "vlrl" or name not in _declared(["dev"]):
            continue  # an extra outside dev (wandb, mlflow, compare) is not in the suite's lock
        assert name in LOCK, f"{name} is not in constraints/test.txt (run `make lock`)"
        assert requirement.specifier.contains(LOCK[name], prereleases=True), f"{name}=={LOCK[name]} vs {line}"


def test_the_lock_agrees_with_the_demo_pins_and_pulls_no_cuda():
    demo = read_pins(ROOT / "constraints" / "demo.txt")
    assert {name: LOCK.get(name) for name in demo} == demo
    assert not [name for name in LOCK if re.match(r"nvidia-|cuda-|triton$", name)]
    assert "vlrl" not in LOCK


def test_floors_are_a_pin_per_declared_package():
    pins = dict(pin.split("==") for pin in floor_pins(PROJECT))
    assert set(pins) == _declared(["dev"])
    # torch 2.13.0 is the CPU build on the development machines' disk: a lower floor would make `make test-floor`
    # download a multi-GB CUDA build
    assert pins["torch"] == "2.13"


def test_the_install_guide_quotes_the_locks_versions():
    """docs/guides/installing.md (the README's former "Installing" section) quotes the lock's versions."""
    section = (ROOT / "docs" / "guides" / "installing.md").read_text(encoding="utf-8")
    quoted = dict(re.findall(r"`([a-z0-9_.-]+)==([0-9][0-9a-z.]*)`", section))
    assert {"torch", "transformers", "tokenizers", "numpy"} <= set(quoted)
    assert {name: LOCK.get(normalize(name)) for name in quoted} == quoted


@pytest.mark.parametrize("name", ["matplotlib"])
def test_report_only_packages_are_not_core(name):
    assert name not in _declared([]) and name in _declared(["report"]) and name in _declared(["all"])
