"""Loading a config: a YAML file and dotted overrides merged, input paths resolved, validated once into a
config class, the plug-in options checked; `dump_config` writes one back."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from vlrl import safe_yaml
from vlrl.config.base import ConfigError, Section


# ----------------------------------------------------------------------------------------------- loading
def apply_overrides(raw: dict[str, Any], overrides: list[str], *, cls: type[BaseModel] | None = None,
                    base: Path | None = None) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides (values parsed as YAML) to a nested dict, in place; a number indexes a
    list already there (``stages.0.train.steps=10``). Given the config class, a field typed as a string takes the
    text as typed where YAML reads something else or nothing (`_value`); given a ``base`` directory as well, input
    paths among the values are resolved against it (`resolve_paths`)."""
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r}: expected key=value, e.g. algo.clip_high=0.28")
        parts = key.strip().split(".")
        value = _value(item, text, _field_annotation(cls, parts) if cls is not None else None)
        if cls is not None and base is not None:  # resolve the value where it sits in a config of its own
            alone: dict[str, Any] = {}
            node = alone
            for part in parts[:-1]:
                node = node.setdefault(part, {})
            node[parts[-1]] = value
            resolve_paths(cls, alone, base)
            value = node[parts[-1]]
        node = raw
        for depth, part in enumerate(parts[:-1]):
            if isinstance(node, list):  # stages.1.train.steps: an index into a list of sections
                if not part.isdigit() or int(part) >= len(node):
                    raise ConfigError(f"override {item!r}: {part!r} is not an index of the {len(node)} item(s) there")
                child = node[int(part)]
            else:
                child = node.setdefault(part, {})
            if not isinstance(child, (dict, list)):
                moved = _moved_hint(parts[: depth + 1])
                raise ConfigError(f"override {item!r}: {part!r} is not a section{moved}")
            node = child
        if isinstance(node, list):
            raise ConfigError(f"override {item!r}: {parts[-1]!r} would replace one item of a list; set a field inside "
                              f"it{_moved_hint(parts[:-1])}")
        node[parts[-1]] = value
    return raw


def _value(item: str, text: str, annotation: Any) -> Any:
    """The value of one override's text: YAML's reading of it — except for a field typed as a string, where text
    YAML cannot read (``{{ content }} Answer.``) or reads as a mapping, list, number or bool (``Q: {x}``) is the
    string as typed, since nothing else could be meant (``null`` still unsets an optional one). Any other field
    refuses text that is not YAML, naming the override."""
    text_field = annotation is not None and _takes_text(annotation)
    try:
        value = safe_yaml.load(text, f"override {item!r}") if text.strip() else ""
    except safe_yaml.YamlRefused as err:  # an unclosed bracket, a tag, a billion laughs: one line
        if text_field:
            return text
        raise ConfigError(f"override {item!r}: the value is not valid YAML ({err.reason})") from None
    if text_field and value is not None and not isinstance(value, str) and _only_text(annotation):
        return text
    return value


def _alternatives(annotation: Any) -> list[Any]:
    """The types a field's annotation admits, unions and ``Annotated`` unwrapped (``str | None`` → [str, None])."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return _alternatives(get_args(annotation)[0])
    if origin in (Union, UnionType):
        return [alt for arg in get_args(annotation) for alt in _alternatives(arg)]
    return [annotation]


def _takes_text(annotation: Any) -> bool:
    return str in _alternatives(annotation)


def _only_text(annotation: Any) -> bool:
    return all(alt in (str, type(None)) for alt in _alternatives(annotation))


def _field_annotation(cls: type[BaseModel], parts: list[str]) -> Any:
    """The annotation of the field an override's dotted key names (sections, list indices and mapping keys
    followed); None where the key names no field (the validation then says so)."""
    annotation: Any = cls
    for part in parts:
        for alt in _alternatives(annotation):
            if isinstance(alt, type) and issubclass(alt, BaseModel):
                if part in alt.model_fields:
                    annotation = alt.model_fields[part].annotation
                    break
            elif get_origin(alt) is dict:
                annotation = get_args(alt)[1]
                break
            elif get_origin(alt) is list and part.isdigit():
                annotation = get_args(alt)[0]
                break
        else:
            return None
    return annotation


def _moved_hint(path: list[str]) -> str:
    """Where a config still holding an old flat rollout key (``rollout.servers: [url]``) must put it now."""
    from vlrl.config.rollout import MOVED_KEYS

    if len(path) >= 2 and path[-2] == "rollout" and path[-1] in MOVED_KEYS:
        return f" in this config: it still sets the old rollout.{path[-1]}, now rollout.{MOVED_KEYS[path[-1]]}"
    return ""


def load_config(cls: type[Section], path: str | Path | None = None, overrides: list[str] | None = None, *,
                prepare: Callable[[Any], None] | None = None,
                check: Callable[[Any], list[tuple[str, str]]] | None = None) -> Any:
    """Read YAML (optional), apply dotted overrides, validate into ``cls``; ``prepare(cfg)`` runs between the
    validation and ``check(cfg)`` — (field, message) problems, each a line of the `ConfigError`: the plug-in checks
    of `vlrl.check.options.load_run_config`, which run tensor operations (the CLI pins ``numerics`` in ``prepare``).

    Input paths (the fields marked ``json_schema_extra={"path": ...}``: data files, packing plans, model
    directories) are made absolute: a relative one written in the YAML file is taken from the file's own
    directory, one given as an override (or ``--data`` / ``--test``) from the current directory. Output
    locations (``out``, ``rollout.weight_sync.dir``) stay as written, relative to the current directory.
    """
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            raw = safe_yaml.load_file(path) or {}
        except safe_yaml.YamlRefused as err:  # bounded: aliases, depth, duplicate keys, tags (`vlrl.safe_yaml`)
            raise ConfigError(str(err)) from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections")
        resolve_paths(cls, raw, path.resolve().parent)
    apply_overrides(raw, overrides or [], cls=cls, base=Path.cwd())
    try:
        cfg = cls.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_explain(err, path)) from None
    if prepare is not None:
        prepare(cfg)
    problems = check(cfg) if check is not None else []
    if problems:
        where = f"{path}: " if path else ""
        raise ConfigError("\n".join(f"{where}config field '{field}': {message}" for field, message in problems))
    return cfg


def _sections(annotation: Any) -> list[type[BaseModel]]:
    """The config classes inside a field's annotation (``DataConfig | None``, ``list[SFTStageSpec]``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [cls for arg in get_args(annotation) for cls in _sections(arg)]


def _path_fields(cls: type[BaseModel], node: Any):
    """(dict holding the field, key, kind) of every input-path field set in the raw config dict ``node``."""
    if not isinstance(node, dict):
        return
    for name, field in cls.model_fields.items():
        if name not in node:
            continue
        extra = field.json_schema_extra
        kind = extra.get("path") if isinstance(extra, dict) else None
        if kind is not None:
            if isinstance(node[name], str):
                yield node, name, kind
            continue
        children = node[name] if isinstance(node[name], list) else [node[name]]
        if isinstance(node[name], dict) and node[name] and all(str(k).isdigit() for k in node[name]):
            children = list(node[name].values())  # an override into a list item: {"0": {...}}
        for section in _sections(field.annotation):
            for child in children:
                yield from _path_fields(section, child)


def resolve_paths(cls: type[BaseModel], raw: dict[str, Any], base: Path) -> dict[str, Any]:
    """Make the input paths of a raw config dict absolute against ``base``, in place.

    A data file or packing plan (kind ``file``) is always a path. A ``model.path`` (kind ``model``) may also
    be a preset name or a hub id (``Qwen/Qwen2-VL-2B-Instruct``), so a relative one is resolved only when it
    exists under ``base`` or is written as a path (``./…``, ``../…``); otherwise it is left as written."""
    for node, key, kind in _path_fields(cls, raw):
        value = node[key]
        if value.startswith("~"):
            node[key] = str(Path(value).expanduser())
        elif kind == "data" and value and not Path(value).is_absolute():
            node[key] = _resolve_data_path(value, base)
        elif value and not Path(value).is_absolute() and \
                (kind == "file" or (base / value).exists() or value.startswith(("./", "../"))):
            node[key] = str((base / value).resolve())
    return raw


def _resolve_data_path(value: str, base: Path) -> str:
    """A data path (kind ``data``): a local file, folder or glob is made absolute against ``base`` (an ``@split``
    suffix kept); a hub id (``org/name``, ``name``, not a path under ``base``, no file suffix, ``org`` not a folder
    under ``base``) stays as written."""
    import re

    head, sep, split = value.rpartition("@")
    if not (sep and head and split and "/" not in split):
        head, sep, split = value, "", ""
    hub_like = re.fullmatch(r"[A-Za-z0-9_][\w.-]*(/[\w.-]+)?", head) is not None and \
        not head.endswith((".jsonl", ".json", ".parquet", ".arrow"))
    local_folder = "/" in head and (base / head.split("/", 1)[0]).is_dir()  # mydata/train beside mydata/: local
    if hub_like and not (base / head).exists() and not local_folder:
        return value
    return str((base / head).resolve()) + sep + split


def _explain(err: ValidationError, path: Path | None) -> str:
    where = f"{path}: " if path else ""
    lines = []
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"]) or "(top level)"
        message = "unknown field" if e["type"] == "extra_forbidden" else e["msg"]
        if e["type"] == "value_error" and "error" in e.get("ctx", {}):  # a validator's own words, not "Value error, …"
            message = str(e["ctx"]["error"])
        lines.append(f"{where}config field '{field}': {message}")
    return "\n".join(lines)


def dump_config(config: Section) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
