"""A recipe's carry-over state (`vlrl.train.state`) on disk without pickle: tensors in a safetensors file, the
rest in a JSON document that points at them. Loading runs no code from the file: it builds only plain data
(None, bools, numbers, strings, lists, tuples, dicts, tensors, bytes, PNG images) and the record types of an
explicit allow-list (`RECORD_TYPES`, extended with `register_record`), each from its named fields.

    rank_00000.json          {"format": 1, "value": <encoded value>}
    rank_00000.safetensors   every tensor of the value, keyed t0, t1, ... (a tensor referenced twice is stored once)

Encoded forms: JSON scalars and lists as themselves; a dict with only string keys none of which starts with
``$`` as a JSON object; otherwise a one-key object naming the kind — ``{"$tensor": "t3"}``, ``{"$tuple": [...]}``,
``{"$dict": [[key, value], ...]}``, ``{"$bytes": base64}``, ``{"$png": base64}``,
``{"$record": "RLState", "fields": {...}}``.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import json
from pathlib import Path
from typing import Any

import torch

FORMAT = 1
_EXTRA_RECORDS: dict[str, type] = {}


class CarryOverError(ValueError):
    """A carry-over value that cannot be written, or a file that cannot be read back; the message names the
    file or the field path."""


def register_record(cls: type) -> type:
    """Allow the dataclass ``cls`` in carry-over files (e.g. a custom shaper's state); usable as a decorator."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"register_record: {cls.__name__} is not a dataclass")
    known = _record_types().get(cls.__name__)
    if known is not None and known is not cls:
        raise ValueError(f"register_record: another record type is already named {cls.__name__!r}")
    _EXTRA_RECORDS[cls.__name__] = cls
    return cls


def _record_types() -> dict[str, type]:
    """The allow-list: every record a recipe's carry-over is made of, by class name."""
    from vlrl.algos.diversity import DiversityState
    from vlrl.data import Sample
    from vlrl.feed import records
    from vlrl.models.adapters import VisionInputs
    from vlrl.rollout.types import Turn
    from vlrl.synth.workflow import SynthState
    from vlrl.train import state

    types = [records.ResponseRecord, records.GroupRecord, records.DrawRecord, records.Ledger, records.RolloutCut,
             records.SyncFeedState, records.AsyncFeedState, state.ShaperStates, state.AlgorithmState, state.RLState,
             Sample, Turn, VisionInputs, DiversityState, SynthState]
    return {t.__name__: t for t in types} | _EXTRA_RECORDS


RECORD_TYPES = _record_types  # called, not a constant: the list imports the recipes' modules lazily


# ----------------------------------------------------------------------------------------------- writing
def write_carry_over(value: Any, json_path: Path, tensors_path: Path) -> None:
    """Encode ``value`` into ``json_path`` + ``tensors_path`` (the caller fsyncs and checksums them)."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    encoded = _Encoder(tensors).encode(value, "carry_over")
    save_file(tensors, str(tensors_path))
    json_path.write_text(json.dumps({"format": FORMAT, "value": encoded}) + "\n", encoding="utf-8")


class _Encoder:
    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors
        self.seen: dict[int, str] = {}  # id(tensor) → key: a tensor referenced twice is stored (and restored) once
        self.keep: list[torch.Tensor] = []  # holds the originals so their ids stay unique while encoding

    def encode(self, value: Any, where: str) -> Any:
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, torch.Tensor):
            return {"$tensor": self._tensor(value)}
        if isinstance(value, (bytes, bytearray)):
            return {"$bytes": base64.b64encode(bytes(value)).decode("ascii")}
        if isinstance(value, list):
            return [self.encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
        if isinstance(value, tuple) and not hasattr(value, "_fields"):
            return {"$tuple": [self.encode(v, f"{where}[{i}]") for i, v in enumerate(value)]}
        if isinstance(value, dict):
            if all(isinstance(k, str) and not k.startswith("$") for k in value):
                return {k: self.encode(v, f"{where}.{k}") for k, v in value.items()}
            return {"$dict": [[self.encode(k, f"{where} key"), self.encode(v, f"{where}[{k!r}]")]
                              for k, v in value.items()]}
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return self._record(value, where)
        from PIL import Image

        if isinstance(value, Image.Image):
            buffer = io.BytesIO()
            value.save(buffer, format="PNG")
            return {"$png": base64.b64encode(buffer.getvalue()).decode("ascii")}
        raise CarryOverError(f"{where}: a {type(value).__module__}.{type(value).__qualname__} cannot be stored in a "
                             "checkpoint; carry-over state must be plain data (numbers, strings, lists, dicts, "
                             "tensors) or a dataclass registered with vlrl.train.carry.register_record")

    def _tensor(self, tensor: torch.Tensor) -> str:
        key = self.seen.get(id(tensor))
        if key is None:
            key = f"t{len(self.tensors)}"
            self.seen[id(tensor)] = key
            self.keep.append(tensor)
            # a copy of its own: safetensors refuses views sharing one storage (a group's rows of a batch)
            self.tensors[key] = tensor.detach().to("cpu", copy=True).contiguous()
        return key

    def _record(self, value: Any, where: str) -> dict[str, Any]:
        name = type(value).__name__
        if _record_types().get(name) is not type(value):
            raise CarryOverError(f"{where}: record type {type(value).__module__}.{type(value).__qualname__} is not "
                                 "allowed in checkpoints; register it with vlrl.train.carry.register_record")
        fields = {f.name: self.encode(getattr(value, f.name), f"{where}.{f.name}") for f in dataclasses.fields(value)}
        return {"$record": name, "fields": fields}


# ----------------------------------------------------------------------------------------------- reading
def read_carry_over(json_path: Path, tensors_path: Path) -> Any:
    """Decode what `write_carry_over` wrote; a malformed file raises `CarryOverError` naming it."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        document = json.loads(json_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CarryOverError(f"{json_path}: unreadable ({err})") from err
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise CarryOverError(f"{json_path}: not a carry-over file of format {FORMAT}")
    try:
        tensors = load_file(str(tensors_path), device="cpu")
    except (OSError, SafetensorError) as err:
        raise CarryOverError(f"{tensors_path}: unreadable ({err})") from err
    try:
        return _decode(document["value"], tensors)
    except CarryOverError as err:
        raise CarryOverError(f"{json_path}: {err}") from err


def _decode(node: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    if isinstance(node, list):
        return [_decode(v, tensors) for v in node]
    if not isinstance(node, dict):
        raise CarryOverError(f"unexpected JSON value {type(node).__name__}")
    marker = next((k for k in node if k.startswith("$")), None)
    if marker is None:
        return {k: _decode(v, tensors) for k, v in node.items()}
    body = node[marker]
    if marker == "$tensor":
        if body not in tensors:
            raise CarryOverError(f"tensor {body!r} is not in the safetensors file")
        return tensors[body]
    if marker == "$tuple":
        return tuple(_decode(v, tensors) for v in body)
    if marker == "$dict":
        return {_decode(k, tensors): _decode(v, tensors) for k, v in body}
    if marker == "$bytes":
        return base64.b64decode(body)
    if marker == "$png":
        from PIL import Image

        image = Image.open(io.BytesIO(base64.b64decode(body)), formats=["PNG"])
        image.load()
        return image
    if marker == "$record":
        return _decode_record(body, node.get("fields"), tensors)
    raise CarryOverError(f"unknown kind {marker!r}")


def _decode_record(name: Any, fields: Any, tensors: dict[str, torch.Tensor]) -> Any:
    cls = _record_types().get(name) if isinstance(name, str) else None
    if cls is None:
        raise CarryOverError(f"record type {name!r} is not on the allow-list of checkpoint records")
    if not isinstance(fields, dict):
        raise CarryOverError(f"record {name}: no fields")
    declared = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(fields) - set(declared))
    if unknown:
        raise CarryOverError(f"record {name}: unknown field(s) {unknown} (written by another vlrl version?)")
    values = {k: _decode(v, tensors) for k, v in fields.items()}
    record = cls(**{k: v for k, v in values.items() if declared[k].init})
    for key, value in values.items():
        if not declared[key].init:
            setattr(record, key, value)
    return record
