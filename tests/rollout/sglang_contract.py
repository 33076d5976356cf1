"""SGLang's own request and response contract, read from its released wheel (never imported as a package).

``sglang/api/v1/api_types.py`` is the schema SGLang checks every ``/generate`` body against (its HTTP gate,
``srt/entrypoints/api_contract.py``, answers 400 with the schema's error); it needs only ``msgspec`` and is loaded
by path. The weight-update request structs (``srt/managers/io_struct.py``) import torch and zmq, so their fields are
read with ``ast``: names, whether each has a default, and the annotation to check a value against.

The wheel is downloaded once (``pip download --no-deps``, 39 MB) into the user's cache and reused; a wheel already
on disk can be named by ``$VLRL_SGLANG_WHEEL``. It is never committed.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

SGLANG_VERSION = "0.5.23"
WHEEL_ENV = "VLRL_SGLANG_WHEEL"
API_TYPES = "sglang/api/v1/api_types.py"
IO_STRUCT = "sglang/srt/managers/io_struct.py"


def cache_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "vlrl" / f"sglang-{SGLANG_VERSION}"


class WheelUnavailable(RuntimeError):
    """The pinned wheel is not cached and cannot be downloaded (offline): the tests that read it are skipped."""


def wheel_path() -> Path:
    """The pinned SGLang wheel: ``$VLRL_SGLANG_WHEEL``, else the cached download, else downloaded now
    (`WheelUnavailable` when that fails)."""
    given = os.environ.get(WHEEL_ENV)
    if given:
        return Path(given)
    if _UNAVAILABLE:  # (tried in this process already: offline stays offline, one attempt is enough)
        raise _UNAVAILABLE[0]
    try:
        return _download()
    except WheelUnavailable as err:
        _UNAVAILABLE.append(err)
        raise


_UNAVAILABLE: list[WheelUnavailable] = []


def _download() -> Path:
    folder = cache_dir()
    found = sorted(folder.glob(f"sglang-{SGLANG_VERSION}-*.whl"))
    if found:
        return found[0]
    folder.mkdir(parents=True, exist_ok=True)
    partial = folder / f"download-{os.getpid()}"
    # the one wheel SGLang publishes for this release (its files are read, never installed or imported)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.11",
               "--platform", "manylinux_2_34_x86_64", "--implementation", "cp", "-d", str(partial),
               f"sglang=={SGLANG_VERSION}"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired as err:
        raise WheelUnavailable(f"downloading sglang=={SGLANG_VERSION} took over 900 s (set ${WHEEL_ENV} to a local copy "
                               "of the wheel)") from err
    wheels = sorted(partial.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        shutil.rmtree(partial, ignore_errors=True)
        raise WheelUnavailable(f"sglang=={SGLANG_VERSION}'s wheel is not cached under {folder} and could not be "
                               f"downloaded (set ${WHEEL_ENV} to a local copy of the wheel): {done.stderr[-500:]}")
    target = folder / wheels[0].name
    os.replace(wheels[0], target)  # atomic: a concurrent run sees the whole wheel or none
    shutil.rmtree(partial, ignore_errors=True)
    return target


@dataclasses.dataclass(frozen=True)
class Field:
    name: str
    annotation: ast.expr
    required: bool


@dataclasses.dataclass
class Contract:
    api: Any  # the api_types module
    structs: dict[str, dict[str, Field]]  # io_struct class → its fields (bases included)

    def generate_error(self, body: Any) -> str | None:
        """SGLang's answer to a ``/generate`` body: None if its gate admits it, else the 400's error text."""
        try:
            self.api.GenerateRequest.from_json_value(body)
        except self.api.JsonContractError as err:
            return str(err)
        return None

    def struct_problems(self, name: str, body: dict[str, Any]) -> list[str]:
        """What SGLang's request struct ``name`` makes of ``body``: unknown keys (silently dropped by SGLang — a
        misspelt field), missing required fields, values of the wrong type."""
        fields = self.structs[name]
        problems = [f"unknown field {key!r}" for key in body if key not in fields]
        problems += [f"missing required field {f.name!r}" for f in fields.values() if f.required and f.name not in body]
        for key, value in body.items():
            if key in fields and not matches(value, fields[key].annotation):
                problems.append(f"field {key!r}: {value!r} is not {ast.unparse(fields[key].annotation)}")
        return problems


def load_contract() -> Contract:
    wheel = wheel_path()
    folder = cache_dir() / "extracted"
    with zipfile.ZipFile(wheel) as archive:
        for member in (API_TYPES, IO_STRUCT):
            target = folder / member
            if not target.exists():
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(archive.read(member))
    spec = importlib.util.spec_from_file_location("sglang_api_types_contract", folder / API_TYPES)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (msgspec resolves the string annotations through the module)
    spec.loader.exec_module(module)
    return Contract(module, struct_fields((folder / IO_STRUCT).read_text()))


def struct_fields(source: str) -> dict[str, dict[str, Field]]:
    """Every class of ``source`` → its annotated fields, its bases' first (bases found in the same file)."""
    classes = {node.name: node for node in ast.parse(source).body if isinstance(node, ast.ClassDef)}
    out: dict[str, dict[str, Field]] = {}

    def fields(name: str) -> dict[str, Field]:
        if name not in out:
            node = classes[name]
            own: dict[str, Field] = {}
            for base in node.bases:
                if isinstance(base, ast.Name) and base.id in classes:
                    own.update(fields(base.id))
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    own[item.target.id] = Field(item.target.id, item.annotation, item.value is None)
            out[name] = own
        return out[name]

    for name in classes:
        fields(name)
    return out


def matches(value: Any, annotation: ast.expr) -> bool:
    """Whether a JSON value fits a struct annotation (the forms the weight-update structs use)."""
    if isinstance(annotation, ast.Constant) and annotation.value is None:
        return value is None
    if isinstance(annotation, ast.Name):
        kind = annotation.id
        if kind == "Any":
            return True
        if kind == "bool":
            return isinstance(value, bool)
        if kind == "int":
            return isinstance(value, int) and not isinstance(value, bool)
        if kind == "float":
            return isinstance(value, (int, float)) and not isinstance(value, bool)
        if kind == "str":
            return isinstance(value, str)
        raise ValueError(f"annotation {kind} is not handled by this checker")
    if isinstance(annotation, ast.Subscript) and isinstance(annotation.value, ast.Name):
        outer, inner = annotation.value.id, annotation.slice
        args = list(inner.elts) if isinstance(inner, ast.Tuple) else [inner]
        if outer == "Optional":
            return value is None or matches(value, args[0])
        if outer == "Union":
            return any(matches(value, a) for a in args)
        if outer == "List":
            return isinstance(value, list) and all(matches(v, args[0]) for v in value)
        if outer == "Dict":
            return isinstance(value, dict) and all(matches(k, args[0]) and matches(v, args[1]) for k, v in value.items())
        if outer == "Literal":
            return value in [ast.literal_eval(a) for a in args]
    raise ValueError(f"annotation {ast.unparse(annotation)} is not handled by this checker")
