"""What a record costs once decoded — measured before it is held — for the readers of `vlrl.data.sources`.

Encoded sizes say little: a 2.6 KB parquet file (zstd, one dictionary entry) decodes to 30 rows of a 60 MB string,
and a 60 MB jsonl line of ``[[],[],…]`` parses into 1.4 GB of Python lists. So the bounds hold on decoded bytes:

- `row_sizes`: each row's bytes in an Arrow table (strings and binaries, nested ones included, plus 8 per other
  value), from the columns' buffers — a dictionary-encoded column is measured on its dictionary, never expanded;
- `ParquetMeasure`: a parquet file read one row group at a time with every byte-array column as a dictionary
  (its memory is the dictionary page, what the file holds — not rows × value), measured by `row_sizes`: row groups
  holding a row over ``max_record_bytes`` are refused, and the text of the whole file against ``max_source_bytes``;
- `json_cost`: the memory a JSON line takes once parsed (its bytes plus ~64 bytes per value outside strings), and
  its nesting depth, from one scan of its bytes, before ``json.loads``.

Binary values (images) count per record but not in the source's total: they stay in the memory-mapped table and
are decoded one at a time, within the pixel bounds.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

PARSED_VALUE_BYTES = 64  # a parsed JSON value outside a string: an int is 28 bytes, a list 56 + 8 per item, a dict 64+
MAX_JSON_DEPTH = 512  # CPython's json recursion gives a raw RecursionError near 1000; no dataset nests this deep
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)


def row_sizes(table: Any) -> tuple[list[int], list[int]]:
    """(bytes of each row, the non-binary part of them) of a pyarrow table: strings and binaries (nested ones
    included; a dictionary-encoded column through its dictionary) plus 8 per other value — computed on the
    columns' buffers, no row decoded."""
    import pyarrow as pa
    import pyarrow.compute as pc

    total, text = [0] * table.num_rows, [0] * table.num_rows

    def add(array: Any, rows: list[int]) -> None:  # array: one value per entry of ``rows``
        kind = array.type
        if pa.types.is_dictionary(kind):
            lengths = pc.take(_lengths(array.dictionary), array.indices) if len(array.dictionary) else None
            binary = pa.types.is_binary(kind.value_type) or pa.types.is_large_binary(kind.value_type)
            values = lengths.to_pylist() if lengths is not None else [0] * len(rows)
            _count(rows, values, binary, total, text)
        elif _is_bytes(kind):
            binary = pa.types.is_binary(kind) or pa.types.is_large_binary(kind)
            _count(rows, _lengths(array).to_pylist(), binary, total, text)
        elif pa.types.is_list(kind) or pa.types.is_large_list(kind):
            lengths = pc.list_value_length(array).fill_null(0).to_pylist()
            flat_rows = [row for row, n in zip(rows, lengths, strict=True) for _ in range(n)]
            add(pc.list_flatten(array), flat_rows)
        elif pa.types.is_struct(kind):
            for index in range(kind.num_fields):
                add(array.field(index), rows)
        else:
            _count(rows, [8] * len(rows), False, total, text)

    for column in table.columns:
        add(column.combine_chunks() if column.num_chunks != 1 else column.chunk(0), list(range(table.num_rows)))
    return total, text


def _is_bytes(kind: Any) -> bool:
    import pyarrow as pa

    return (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_binary(kind)
            or pa.types.is_large_binary(kind))


def _lengths(array: Any) -> Any:
    import pyarrow.compute as pc

    return pc.binary_length(array)


def _count(rows: list[int], lengths: Iterable[int | None], binary: bool, total: list[int], text: list[int]) -> None:
    for row, length in zip(rows, lengths, strict=True):
        total[row] += length or 0
        if not binary:
            text[row] += length or 0


@dataclass
class ParquetMeasure:
    """The decoded sizes of a parquet file, row group by row group (see the module docstring).

    Attributes:
        refused: (row group, the rows refused, the error): a whole group whose encoded size alone is over
            ``max_record_bytes`` per row (never decoded), or one row that decodes to more.
        text_bytes: the decoded non-binary bytes of the rows kept (what the source holds in memory).
    """

    refused: list[tuple[int, range, Exception]] = field(default_factory=list)
    text_bytes: int = 0

    @classmethod
    def of(cls, file: Any, max_record_bytes: int, too_big: Any) -> ParquetMeasure:
        """Measure ``file``; ``too_big(size, limit, at_least=False)`` makes a record's error."""
        reader, out, first = dictionary_reader(file), cls(), 0
        for group in range(reader.num_row_groups):
            meta = reader.metadata.row_group(group)
            rows = range(first, first + meta.num_rows)
            first += meta.num_rows
            if meta.total_byte_size > max_record_bytes * max(1, meta.num_rows):  # encoded alone: over already
                mean = -(-meta.total_byte_size // max(1, meta.num_rows))
                out.refused.append((group, rows, too_big(mean, max_record_bytes, at_least=True)))
                continue
            sizes, text = row_sizes(reader.read_row_group(group, use_threads=False))
            for row, size in enumerate(sizes):
                if size > max_record_bytes:
                    out.refused.append((group, range(rows.start + row, rows.start + row + 1),
                                        too_big(size, max_record_bytes)))
                else:
                    out.text_bytes += text[row]
        return out

    def kept_table(self, file: Any) -> Any:
        """The rows not refused, as one in-memory pyarrow table of the file's own schema: a group with a refused row
        is read with dictionaries, filtered, then decoded — the refused rows never are."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        plain, reader = pq.ParquetFile(file), dictionary_reader(file)
        whole = {group for group, rows, _ in self.refused if len(rows) > 1}  # (refused unread, by their encoded size)
        starts = list(itertools.accumulate((plain.metadata.row_group(g).num_rows for g in range(plain.num_row_groups)),
                                           initial=0))
        parts = []
        for group in range(plain.num_row_groups):
            if group in whole:
                continue
            bad = {row - starts[group] for g, rows, _ in self.refused if g == group for row in rows}
            if not bad:
                parts.append(plain.read_row_group(group, use_threads=False))
                continue
            table = reader.read_row_group(group, use_threads=False)
            if len(bad) < table.num_rows:
                keep = pa.array([row not in bad for row in range(table.num_rows)])
                parts.append(table.filter(keep).cast(plain.schema_arrow))
        return pa.concat_tables(parts) if parts else plain.schema_arrow.empty_table()


def dictionary_reader(file: Any) -> Any:
    """A ``pyarrow.parquet.ParquetFile`` reading every byte-array column (strings, binaries, nested ones) as a
    dictionary: a repeated value is held once, as the file holds it."""
    import pyarrow.parquet as pq

    schema = pq.ParquetFile(file).schema
    byte_arrays = [schema.column(i).path for i in range(len(schema)) if schema.column(i).physical_type == "BYTE_ARRAY"]
    return pq.ParquetFile(file, read_dictionary=byte_arrays)


def json_cost(line: bytes, limit: int) -> tuple[int, int]:
    """(bytes the parsed value of the JSON text ``line`` takes, at most; its nesting depth, or a bound on it that
    is at most `MAX_JSON_DEPTH` where the exact depth does not matter), from its bytes: the
    strings' bytes plus `PARSED_VALUE_BYTES` per value outside them (a ``,``, ``[``, ``{`` or ``:``), and the
    depth of its brackets — before ``json.loads``, which holds the GIL and memory for all of it. Counted on the
    raw bytes first (an upper bound: marks inside strings count too); the strings are taken out only when that
    bound passes ``limit`` or `MAX_JSON_DEPTH` (one regular-expression pass, ~1 s for 60 MB)."""
    cost, brackets = _marks_cost(line), line.count(b"[") + line.count(b"{")
    if cost <= limit and brackets <= MAX_JSON_DEPTH:
        return cost, min(brackets, MAX_JSON_DEPTH)
    bare = _JSON_STRING.sub(b'""', line)  # strings out: what is left is structure (and numbers, literals)
    cost = len(line) - len(bare) + _marks_cost(bare)
    return cost, (_depth(bare) if cost <= limit and brackets > MAX_JSON_DEPTH else min(brackets, MAX_JSON_DEPTH))


def _marks_cost(text: bytes) -> int:
    return len(text) + PARSED_VALUE_BYTES * (1 + sum(text.count(mark) for mark in (b",", b"[", b"{", b":")))


def _depth(bare: bytes, chunk: int = 1 << 22) -> int:
    """The deepest bracket nesting of JSON text whose strings were removed (numpy, 4 MiB at a time)."""
    import numpy as np

    depth = deepest = 0
    for start in range(0, len(bare), chunk):
        codes = np.frombuffer(bare, dtype=np.uint8, count=min(chunk, len(bare) - start), offset=start)
        steps = ((codes == 91) | (codes == 123)).astype(np.int32) - ((codes == 93) | (codes == 125))  # [{ ]}
        levels = np.cumsum(steps) + depth
        if len(levels):
            deepest, depth = max(deepest, int(levels.max())), int(levels[-1])
    return deepest
