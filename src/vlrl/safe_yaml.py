"""The one YAML reader of config files (and of the YAML values of overrides): bounded before anything is built.

``yaml.safe_load`` runs no code, but it admits a document that the machine cannot hold or that the config
cannot mean: a "billion laughs" of nested aliases (9 kB that expand to 10⁹ values), an anchor that contains
itself (a recursive structure, then a ``RecursionError`` in validation), nesting 50,000 deep (a
``RecursionError`` in the composer), a key given twice (the second silently wins), and explicit tags
(``!!binary`` turns a string into bytes, ``!!python/...`` is refused only by luck of the safe loader). `load`
refuses each one while the document is composed — before any value is constructed — with one line that
names the source and the place:

- aliases: the document expanded (every alias counted as the whole node it repeats) may hold at most
  `MAX_NODES` nodes and `MAX_EXPANDED_BYTES` bytes of scalars (a 1 MB string repeated by a thousand aliases is
  a few nodes, and a multi-GB ``config.yaml`` once dumped); an alias inside the node it names (a recursive
  anchor) is refused;
- nesting: at most `MAX_DEPTH` levels;
- duplicate keys in one mapping;
- any explicit tag (``!!str`` too): a config is plain YAML.

Text longer than `MAX_BYTES` is refused before it is parsed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

MAX_NODES = 100_000  # a config file holds hundreds; what an alias repeats counts every time
MAX_DEPTH = 64  # sections nest four or five levels deep
MAX_BYTES = 8 << 20  # a config file of 8 MiB is already absurd
MAX_EXPANDED_BYTES = 16 << 20  # the scalars of the expanded document (what config.yaml and the run hold)


class YamlRefused(ValueError):
    """A YAML document that is malformed or refused; the message is one line naming the source and the place,
    ``reason`` the same without the source."""

    def __init__(self, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason if reason is not None else message


def load(text: str, source: str) -> Any:
    """The value of the YAML document ``text``; ``source`` names it in errors (a file path, an override)."""
    if len(text) > MAX_BYTES:
        raise YamlRefused(f"{source}: {len(text):,} characters, more than a config may hold ({MAX_BYTES:,})")
    loader = _BoundedLoader(text)
    try:
        return loader.get_single_data()
    except YamlRefused as err:
        raise YamlRefused(f"{source}: {err}", str(err)) from None
    except yaml.YAMLError as err:
        raise YamlRefused(f"{source}: invalid YAML: {_one_line(err)}", _one_line(err)) from None
    finally:
        loader.dispose()


def load_file(path: str | Path) -> Any:
    """`load` of a file, its size checked before it is read."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > MAX_BYTES:
            raise YamlRefused(f"{path}: {size:,} bytes, more than a config may hold ({MAX_BYTES:,})")
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise YamlRefused(f"{path}: cannot be read ({type(err).__name__}: {err})") from None
    return load(text, str(path))


def _one_line(err: yaml.YAMLError) -> str:
    if isinstance(err, yaml.MarkedYAMLError):
        mark = err.problem_mark or err.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        return f"{err.problem or type(err).__name__}{where}" + (f", {err.context}" if err.context else "")
    return " ".join(str(err).split())


def _at(mark) -> str:
    return f"line {mark.line + 1}, column {mark.column + 1}"


class _BoundedLoader(yaml.SafeLoader):  # the pure-Python loader: its composer is where the bounds are kept
    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0
        self._open: set[str] = set()  # anchors of the collections being composed
        self._sizes: dict[int, int] = {}  # id(node) → nodes it holds, aliases expanded
        self._bytes: dict[int, int] = {}  # id(node) → bytes of the scalars it holds, aliases expanded

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            if event.anchor in self._open:
                raise YamlRefused(f"{_at(event.start_mark)}: recursive anchor: the alias *{event.anchor} is inside "
                                  f"the node &{event.anchor} it repeats")
            return super().compose_node(parent, index)
        tag = getattr(event, "tag", None)
        if tag is not None:
            shown = "!!" + tag.removeprefix("tag:yaml.org,2002:") if tag.startswith("tag:yaml.org,2002:") else tag
            raise YamlRefused(f"{_at(event.start_mark)}: the tag {shown} is refused: config files are plain YAML "
                              "(no tags)")
        self._depth += 1
        if self._depth > MAX_DEPTH:
            raise YamlRefused(f"{_at(event.start_mark)}: nested more than {MAX_DEPTH} levels deep")
        anchor = event.anchor
        if anchor is not None:
            self._open.add(anchor)
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
            self._open.discard(anchor)
        children = _children(node)
        self._sizes[id(node)] = size = 1 + sum(self._sizes[id(child)] for child in children)
        if size > MAX_NODES:
            raise YamlRefused(f"{_at(node.start_mark)}: expands to more than {MAX_NODES:,} values (aliases counted "
                              "as the nodes they repeat)")
        scalar = len(node.value) if isinstance(node, yaml.ScalarNode) else 0
        self._bytes[id(node)] = held = scalar + sum(self._bytes[id(child)] for child in children)
        if held > MAX_EXPANDED_BYTES:
            raise YamlRefused(f"{_at(node.start_mark)}: expands to more than {MAX_EXPANDED_BYTES:,} bytes of values "
                              "(aliases counted as the text they repeat)")
        return node

    def compose_mapping_node(self, anchor):
        node = super().compose_mapping_node(anchor)
        seen: dict[tuple[str, str], Any] = {}
        for key, _ in node.value:
            if not isinstance(key, yaml.ScalarNode):
                continue
            first = seen.setdefault((key.tag, key.value), key)
            if first is not key:
                raise YamlRefused(f"{_at(key.start_mark)}: duplicate key {key.value!r} (first at {_at(first.start_mark)})")
        return node


def _children(node) -> list:
    if isinstance(node, yaml.SequenceNode):
        return node.value
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []
