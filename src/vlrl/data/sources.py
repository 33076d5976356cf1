"""Where samples are read from: files, folders, globs, ``save_to_disk`` folders and hub ids, as tables of rows.

A data path (``--data``, ``data.train``) is one of

- a ``.jsonl`` / ``.json`` file (read here, line by line: errors name ``file:line``);
- a ``.parquet`` or ``.arrow`` file, through HF ``datasets`` (``load_dataset("parquet", data_files=...)`` /
  ``Dataset.from_file``): the table is memory-mapped and each image stays in it until a sample is encoded
  (`ArrowImage`); errors name ``file:row N``;
- a folder written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk`` (memory-mapped the same way);
- a folder of ``.jsonl`` / ``.parquet`` / ``.arrow`` files, or a glob (``data/*.parquet``, ``data/*.json``);
- a hub id (``hiyouga/geometry3k``): ``datasets.load_dataset(id, name=subset, split=split, revision=revision)``.

``PATH@split`` picks a split of a hub id or a ``save_to_disk`` folder (EasyR1's ``hiyouga/geometry3k@test``).
"""

from __future__ import annotations

import glob
import json
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlrl.data.decoded import MAX_JSON_DEPTH, ParquetMeasure, json_cost, row_sizes
from vlrl.data.sample import SampleError

FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow")
FOLDER_SUFFIXES = (".jsonl", ".parquet", ".arrow")
_GLOB = re.compile(r"[*?\[]")
_HUB_ID = re.compile(r"[A-Za-z0-9_][\w.-]*(/[\w.-]+)?")
_PARQUET_MARKER = b"vlrl.sample.v1"


class SourceError(ValueError):
    """A data path that cannot be read at all (the reader raises it as `vlrl.data.DataError`)."""


@dataclass
class Table:
    """One readable unit of a data path (a file, a ``save_to_disk`` dataset, a hub split).

    Attributes:
        name: the name errors start with (a file path, ``DIR[split]``, ``hub:ID[split]``).
        stem: a short name, the default task (``geometry3k``; a file named after its split: its folder's name).
        id_prefix: default ids are ``<id_prefix>-<row>`` (``geometry3k-train``, ``verl-test``).
        base_dir: where relative image paths are found.
        columns: the column names (for `vlrl.data.schemas.detect_format`).
        vlrl_parquet: written by vlrl's own parquet writer (JSON-string columns).
        rows: ``rows(image_columns)`` yields ``(where, row or exception)``; image columns come back lazy
            (`ArrowImage`) from Arrow-backed tables.
    """

    name: str
    stem: str
    id_prefix: str
    base_dir: Path
    columns: list[str]
    rows: Any
    vlrl_parquet: bool = False


def split_suffix(path: str) -> tuple[str, str | None]:
    """``hiyouga/geometry3k@test`` → (``hiyouga/geometry3k``, ``test``); no ``@``: (path, None)."""
    head, sep, tail = path.rpartition("@")
    if sep and head and tail and "/" not in tail and not Path(path).exists():
        return head, tail
    return path, None


def looks_like_hub_id(path: str) -> bool:
    """``name`` or ``org/name`` that is not a local path: no file suffix, and its first part (``org``) is not a
    directory here — ``mydata/train`` beside a ``mydata/`` folder is a mistyped local path, not a hub dataset."""
    return (_HUB_ID.fullmatch(path) is not None and not path.endswith(FILE_SUFFIXES)
            and not ("/" in path and Path(path.split("/", 1)[0]).expanduser().is_dir()))


def missing_local(path: str) -> str:
    """The error for a local path that names nothing, with the files of its folder it may have meant."""
    local = Path(path).expanduser()
    near = sorted(f.name for f in local.parent.glob(f"{local.name}*") if f.suffix in FILE_SUFFIXES or f.is_dir()) \
        if local.parent.is_dir() else []
    return f"{path}: no such file or directory" + (f" (in {local.parent}: {', '.join(near[:5])})" if near else "")


DEFAULT_MAX_RECORD_BYTES = 64 << 20  # data.max_record_bytes
DEFAULT_MAX_SOURCE_BYTES = 1 << 30  # data.max_source_bytes


@dataclass(frozen=True)
class Bounds:
    """What one record and one source may hold once decoded (``data.max_record_bytes``, ``data.max_source_bytes``)."""

    record: int = DEFAULT_MAX_RECORD_BYTES
    source: int = DEFAULT_MAX_SOURCE_BYTES


def open_tables(path: str | Path, *, split: str = "train", subset: str | None = None, revision: str | None = None,
                max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
                max_source_bytes: int = DEFAULT_MAX_SOURCE_BYTES) -> list[Table]:
    """The tables a data path names (see the module docstring); `SourceError` when it names nothing readable.
    Bounds on decoded bytes (`vlrl.data.decoded`): ``max_record_bytes`` bounds each record while it is read — a
    longer jsonl line is skipped through, never held, and one whose parsed value would take more is not parsed; a
    parquet row group holding a row that decodes to more is not read; an Arrow row over it is measured before it is
    decoded — each a bad record (``file:line`` / ``file:row N``). ``max_source_bytes`` bounds the text (non-binary
    bytes) one source holds once decoded: a source over it is refused as a whole (`SourceError`), measured before
    its rows are read (parquet, Arrow) or as they are (jsonl)."""
    text, chosen = split_suffix(str(path))
    split = chosen or split
    bounds = Bounds(max_record_bytes, max_source_bytes)
    local = Path(text).expanduser()
    if local.is_dir():
        if _is_saved_dataset(local):
            return [_saved_table(local, split, bounds)]
        # a folder's .json files are not read (the sidecars vlrl writes beside data: plan and report .json files);
        # name a .json data file itself, or with a glob
        files = sorted(f for f in local.iterdir() if f.suffix in FOLDER_SUFFIXES and f.is_file())
        if not files:
            raise SourceError(f"{local}: no {', '.join(FOLDER_SUFFIXES)} files (nor a `save_to_disk` dataset) in this "
                              "directory")
        return [_file_table(f, bounds) for f in files]
    if local.is_file():
        return [_file_table(local, bounds)]
    if _GLOB.search(text):
        files = sorted(Path(f) for f in glob.glob(os.path.expanduser(text)) if Path(f).suffix in FILE_SUFFIXES)
        if not files:
            raise SourceError(f"{text}: the pattern matches no {', '.join(FILE_SUFFIXES)} file")
        return [_file_table(f, bounds) for f in files]
    if looks_like_hub_id(text) and not text.startswith((".", "/", "~")):
        return [_hub_table(text, split=split, subset=subset, revision=revision, bounds=bounds)]
    raise SourceError(missing_local(text))


# ----------------------------------------------------------------------------------------------- files
def _file_table(file: Path, bounds: Bounds) -> Table:
    by_split = file.stem.lower() in _SPLIT_NAMES and file.parent.name
    stem, prefix = (file.parent.name, f"{file.parent.name}-{file.stem}") if by_split else (file.stem, file.stem)
    if file.suffix in (".jsonl", ".json"):
        rows = lambda image_columns: _json_records(file, bounds)  # noqa: E731  (read again per pass)
        first = next((r for _, r in rows(()) if isinstance(r, dict)), {})
        return Table(str(file), stem, prefix, file.parent, list(first), rows)
    if file.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            parquet = pq.ParquetFile(file)
            ours = (parquet.schema_arrow.metadata or {}).get(b"vlrl") == _PARQUET_MARKER
            measure = ParquetMeasure.of(file, bounds.record, too_big)
        except Exception as err:  # noqa: BLE001  (pyarrow raises several types for a broken file)
            raise SourceError(f"{file}: cannot read parquet ({err})") from err
        _check_source(str(file), measure.text_bytes, bounds)
        refused = measure.refused
        if refused:  # only the other rows are read (into memory): the big ones never are decoded
            dataset = _datasets_call(file, "Dataset", measure.kept_table(file))
        else:
            dataset = _datasets_call(file, "load_dataset", "parquet", data_files=str(file), split="train")
        return _arrow_table(dataset, str(file), stem, prefix, file.parent, bounds, vlrl_parquet=ours,
                            refused=refused)
    dataset = _datasets_call(file, "Dataset.from_file", str(file))
    return _arrow_table(dataset, str(file), stem, prefix, file.parent, bounds)


def too_big(size: int, limit: int, *, at_least: bool = False) -> SampleError:
    return SampleError(f"a record of {'at least ' if at_least else ''}{size:,} bytes, more than "
                       f"data.max_record_bytes ({limit:,})")


def _check_source(name: str, text_bytes: int, bounds: Bounds) -> None:
    if text_bytes > bounds.source:
        raise SourceError(f"{name}: its records hold {text_bytes:,} bytes of text once decoded (at least), more than "
                          f"data.max_source_bytes ({bounds.source:,}); raise it if this source is meant to be that "
                          "large")


_SPLIT_NAMES = {"train", "test", "validation", "val", "dev", "eval"}


def _json_records(file: Path, bounds: Bounds) -> Iterator[tuple[str, Any]]:
    """(``file:line``, record or error) of a jsonl file, streamed: a line is read at most ``bounds.record``
    (+ its newline) at a time, a longer one skipped through in 1 MiB pieces, never held; a line whose parsed value
    would take more (`vlrl.data.decoded.json_cost`) or nest deeper than `MAX_JSON_DEPTH` is not parsed. A ``.json``
    file holding one array (``file:row N``) is one document: read whole, so it must fit the bound itself. Past
    ``bounds.source`` bytes of records the source is refused (`SourceError`)."""
    if file.suffix == ".json":
        with open(file, "rb") as handle:
            head = handle.read(4096).lstrip()
        if head.startswith(b"["):
            size = file.stat().st_size
            if size > bounds.record:
                yield str(file), too_big(size, bounds.record)  # (write it as jsonl: bounded per line)
                return
            raw = file.read_bytes()
            problem = _json_problem(raw, bounds.record)
            if problem is not None:
                yield str(file), problem
                return
            try:
                rows = json.loads(raw.decode("utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                yield f"{file}:{getattr(err, 'lineno', 1)}", SampleError(f"malformed JSON ({err})")
                return
            yield from ((f"{file}:row {k}", row) for k, row in enumerate(rows))
            return
    held = 0
    with open(file, "rb") as handle:
        number = 0
        while line := handle.readline(bounds.record + 1):
            number += 1
            where = f"{file}:{number}"
            if len(line) > bounds.record and not line.endswith(b"\n"):
                size = len(line)
                del line  # (not held while the rest is skipped)
                yield where, too_big(size + _skip_line(handle), bounds.record)
                continue
            if not line.strip():
                continue
            held += len(line)
            _check_source(str(file), held, bounds)
            yield where, _json_line(line, bounds.record)


def _skip_line(handle: Any) -> int:
    """Read past the rest of a line in 1 MiB pieces; its bytes (without the newline)."""
    size = 0
    while piece := handle.readline(1 << 20):
        size += len(piece)
        if piece.endswith(b"\n"):
            return size - 1
    return size


def _json_problem(raw: bytes, limit: int) -> SampleError | None:
    """Why the JSON text ``raw`` is not parsed (its parsed value too big or too deep), or None."""
    cost, depth = json_cost(raw, limit)
    if cost > limit:
        return SampleError(f"a record that takes about {cost:,} bytes once parsed (JSON values cost memory beyond "
                           f"their text), more than data.max_record_bytes ({limit:,})")
    if depth > MAX_JSON_DEPTH:
        return SampleError(f"JSON nested {depth:,} deep, more than {MAX_JSON_DEPTH}")
    return None


def _json_line(line: bytes, limit: int) -> Any:
    """One jsonl line's record, or the error that names what is wrong with it."""
    problem = _json_problem(line, limit)
    if problem is not None:
        return problem
    try:
        return json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as err:
        return SampleError(f"not UTF-8 text (byte {err.start + 1} of the line)")
    except json.JSONDecodeError as err:
        return SampleError(f"malformed JSON ({err.msg} at column {err.colno})")
    except RecursionError:
        return SampleError(f"JSON nested too deeply (more than {MAX_JSON_DEPTH} levels)")


# ----------------------------------------------------------------------------------------------- datasets
def _datasets():
    try:
        import datasets
    except ImportError as err:
        raise SourceError("reading parquet, arrow, `save_to_disk` folders and hub datasets needs the 'datasets' "
                          f"package: pip install datasets ({err})") from err
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    return datasets


def _datasets_call(where: Any, fn: str, *args: Any, **kwargs: Any):
    """``datasets.<fn>(...)``, its failures as `SourceError` naming ``where``."""
    datasets = _datasets()
    target: Any = datasets
    for part in fn.split("."):
        target = getattr(target, part)
    try:
        return target(*args, **kwargs)
    except SourceError:
        raise
    except Exception as err:  # noqa: BLE001  (datasets and the hub client raise many types)
        lines = str(err).strip().splitlines()
        raise SourceError(f"{where}: {type(err).__name__}: {lines[0] if lines else ''}") from err


def _is_saved_dataset(folder: Path) -> bool:
    return (folder / "dataset_dict.json").is_file() or \
        ((folder / "state.json").is_file() and (folder / "dataset_info.json").is_file())


def _saved_table(folder: Path, split: str, bounds: Bounds) -> Table:
    loaded = _datasets_call(folder, "load_from_disk", str(folder))
    name, prefix = str(folder), folder.name
    if hasattr(loaded, "keys"):  # a DatasetDict
        if split not in loaded:
            raise SourceError(f"{folder}: no split {split!r} (splits: {', '.join(loaded)}); choose one with "
                              f"data.split / data.test_split or {folder}@SPLIT")
        loaded, name, prefix = loaded[split], f"{folder}[{split}]", f"{folder.name}-{split}"
    return _arrow_table(loaded, name, folder.name, prefix, folder, bounds)


def _hub_table(repo: str, *, split: str, subset: str | None, revision: str | None, bounds: Bounds) -> Table:
    dataset = _datasets_call(f"{repo} (as a hub dataset id)", "load_dataset", repo, name=subset, split=split,
                             revision=revision)
    stem = repo.rsplit("/", 1)[-1]
    return _arrow_table(dataset, f"{repo}[{split}]", stem, f"{stem}-{split}", Path.cwd(), bounds)


def _arrow_table(dataset: Any, name: str, stem: str, prefix: str, base_dir: Path, bounds: Bounds, *,
                 vlrl_parquet: bool = False, refused: list[tuple[int, range, Exception]] = ()) -> Table:
    """A memory-mapped (or in-memory) dataset as a table; ``refused``: parquet row groups left out, each reported
    as one bad record where its rows would have been. Its rows are measured here, on the columns' buffers
    (`vlrl.data.decoded.row_sizes`): a source over ``bounds.source`` bytes of text is refused before any is read."""
    if getattr(dataset, "_indices", None) is not None:  # a selection of another table: make its rows contiguous
        dataset = dataset.flatten_indices()
    sizes, text = row_sizes(dataset.data.table)
    _check_source(name, sum(text), bounds)

    def rows(image_columns: Iterable[str]) -> Iterator[tuple[str, Any]]:
        numbers = iter(sorted(set(range(sum(len(r) for _, r, _ in refused) + len(dataset)))
                              - {n for _, r, _ in refused for n in r}))  # the file's row number of each kept row
        for _, span, error in refused:  # the refused groups first: reported once each, before the rows read
            yield (f"{name}:rows {span.start}-{span.stop - 1}" if len(span) > 1 else f"{name}:row {span.start}"), error
        for (_, record), number in zip(_arrow_rows(dataset, name, image_columns, base_dir, bounds.record, sizes),
                                       numbers, strict=True):
            yield f"{name}:row {number}", record

    return Table(name, stem, prefix, base_dir, list(dataset.column_names), rows, vlrl_parquet=vlrl_parquet)


def _arrow_rows(dataset: Any, name: str, image_columns: Iterable[str], base_dir: Path, max_record_bytes: int,
                sizes: list[int], batch_size: int = 256) -> Iterator[tuple[str, Any]]:
    """Rows of a memory-mapped dataset: the image columns as `ArrowImage` handles (nothing decoded, no bytes
    copied), every other column as `datasets` decodes it — except other image/audio/video features, dropped. A
    row whose bytes (all its columns, measured in the table) exceed ``max_record_bytes`` is a bad record."""
    table = dataset.data.table  # the pyarrow Table (memory-mapped from the cache / the saved folder)
    lazy = [c for c in image_columns if c in dataset.column_names]
    plain = [c for c in dataset.column_names if c not in lazy and not _media_feature(dataset.features.get(c))]
    counts = {c: _image_counts(table.column(c)) for c in lazy}
    view = dataset.select_columns(plain) if plain else None
    batches = view.iter(batch_size=batch_size) if view is not None else iter(())
    row = 0
    for batch in batches:
        size = len(next(iter(batch.values()))) if batch else 0
        for k in range(size):
            where = f"{name}:row {row}"
            if sizes[row] > max_record_bytes:
                yield where, too_big(sizes[row], max_record_bytes)
                row += 1
                continue
            record: dict[str, Any] = {c: batch[c][k] for c in plain}
            for c in lazy:
                count = counts[c][row]
                if count is None:
                    record[c] = None
                elif count == -1:  # a single image per row (TRL's `image`)
                    record[c] = ArrowImage(table.column(c), row, None, base_dir, where)
                else:
                    record[c] = [ArrowImage(table.column(c), row, i, base_dir, where) for i in range(count)]
            yield where, record
            row += 1
    while not plain and row < len(dataset):  # a table of images only
        where = f"{name}:row {row}"
        yield where, {c: [ArrowImage(table.column(c), row, i, base_dir, where) for i in range(counts[c][row] or 0)]
                      for c in lazy}
        row += 1


def _media_feature(feature: Any) -> bool:
    """An Image / Audio / Video feature (or a list of them) that is not an image column of the layout."""
    kind = type(feature).__name__
    if kind in ("Image", "Audio", "Video"):
        return True
    inner = getattr(feature, "feature", None)
    return inner is not None and _media_feature(inner)


def _image_counts(column: Any) -> list[int | None]:
    """Per row: the number of images of a list column, -1 for a single image, None for a null."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
        return pc.list_value_length(column).to_pylist()
    return [None if null else -1 for null in column.is_null().to_pylist()]


class ArrowImage:
    """One image in a row of a memory-mapped Arrow table, read only when a sample is encoded
    (`vlrl.data.sample.DeferredImage`): the reader keeps this handle (a column, a row, an index), not the bytes.

    Pickled (a worker process, another rank) it travels as the image's own bytes or path."""

    __slots__ = ("column", "row", "index", "base_dir", "where")

    def __init__(self, column: Any, row: int, index: int | None, base_dir: Path, where: str) -> None:
        self.column, self.row, self.index, self.base_dir, self.where = column, row, index, base_dir, where

    def image_source(self) -> str | bytes:
        from vlrl.data.schemas import image_source

        value = self.column[self.row].as_py()
        if self.index is not None:
            value = value[self.index]
        return image_source(value, self.base_dir)

    def __reduce__(self):
        return (_identity, (self.image_source(),))

    def __repr__(self) -> str:
        return f"ArrowImage({self.where}, {self.index})"


def _identity(value: Any) -> Any:
    return value
