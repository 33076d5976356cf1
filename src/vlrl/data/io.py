"""Read and write Sample files: jsonl (images as relative files or data URLs) and parquet (images as bytes).

Bad input never disappears silently: with ``on_error="raise"`` the first bad record raises a `DataError`
naming the file and line (or row); with ``on_error="skip"`` it is skipped and counted in the returned
`ReadReport`, which the recipes log.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from PIL import Image

from vlrl.data.sample import (
    Sample,
    SampleError,
    image_to_png_bytes,
    load_image,
    sample_from_json,
    sample_to_json,
)
from vlrl.data.video import MediaLimits, prepare_media

log = logging.getLogger(__name__)

OnError = Literal["raise", "skip"]
_PARQUET_MARKER = b"vlrl.sample.v1"


class DataError(ValueError):
    """A data file (or one record in it) that cannot be used; the message names file and line."""


@dataclass
class ReadReport:
    """What a read produced: the samples, and every skipped record with its reason."""

    samples: list[Sample]
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (file:line, reason)

    def summary(self) -> str:
        text = f"{len(self.samples)} samples"
        if self.skipped:
            text += f", {len(self.skipped)} skipped (first: {self.skipped[0][0]}: {self.skipped[0][1]})"
        return text


def read_samples(
    path: str | Path,
    *,
    on_error: OnError = "raise",
    check: Callable[[Sample], None] | None = None,
    verify_images: bool = True,
    media: MediaLimits | None = MediaLimits(),  # noqa: B008  (frozen)
) -> ReadReport:
    """Read samples from a ``.jsonl`` or ``.parquet`` file, or every such file in a directory.

    Args:
        on_error: ``"raise"`` stops at the first bad record; ``"skip"`` skips and counts it.
        check: an extra per-sample validation (e.g. that reward names are registered); it raises
            ``ValueError``/``KeyError`` with a message, which is reported with the file and line.
        verify_images: open every image once at read time so a missing or corrupt file is reported here
            (with its line) rather than in the middle of training.
        media: how videos become frames and the per-sample image budgets (`vlrl.data.video.prepare_media`);
            a sample over a budget is a bad record. None: samples are returned as read (videos kept). Its
            ``max_record_bytes`` (the default one when None) bounds each record while it is read.
    """
    path = Path(path)
    if path.is_dir():
        files = sorted([*path.glob("*.jsonl"), *path.glob("*.parquet")])
        if not files:
            raise DataError(f"{path}: no .jsonl or .parquet files in this directory")
    elif path.is_file():
        files = [path]
    else:
        raise DataError(f"{path}: no such file or directory")
    report = ReadReport(samples=[])
    seen_ids: dict[str, str] = {}
    max_record = (media or MediaLimits()).max_record_bytes
    for file in files:
        if file.suffix == ".jsonl":
            records = _jsonl_records(file, max_record)
        elif file.suffix == ".parquet":
            records = _parquet_records(file, max_record)
        else:
            raise DataError(f"{file}: unsupported file type (use .jsonl or .parquet)")
        for where, record in records:
            try:
                if isinstance(record, Exception):
                    raise record
                sample = sample_from_json(record, file.parent)
                sample.source = where
                if media is not None:
                    sample = prepare_media(sample, media)
                if sample.id in seen_ids:
                    raise SampleError(f"duplicate id {sample.id!r} (first seen at {seen_ids[sample.id]})")
                if verify_images:
                    for k, image in enumerate(sample.images):
                        try:
                            load_image(image)
                        except SampleError as err:
                            raise SampleError(f"field 'images[{k}]': {err}") from err
                if check is not None:
                    check(sample)
            except (ValueError, KeyError) as err:
                message = str(err.args[0]) if isinstance(err, KeyError) and err.args else str(err)
                if on_error == "raise":
                    raise DataError(f"{where}: {message}") from err
                report.skipped.append((where, message))
                continue
            seen_ids[sample.id] = where
            report.samples.append(sample)
    if report.skipped:
        log.warning("%s: skipped %d bad record(s); first: %s: %s", path, len(report.skipped), *report.skipped[0])
    return report


def _too_big(size: int, limit: int, *, at_least: bool = False) -> SampleError:
    return SampleError(f"a record of {'at least ' if at_least else ''}{size:,} bytes, more than "
                       f"data.max_record_bytes ({limit:,})")


def _jsonl_records(file: Path, max_record_bytes: int) -> Iterable[tuple[str, Any]]:
    """(file:line, record or the error that makes it bad) of each non-blank line. A line is read at most
    ``max_record_bytes`` (+ its newline) at a time: a longer one is skipped through in 1 MiB pieces, never held."""
    with open(file, "rb") as handle:
        number = 0
        while line := handle.readline(max_record_bytes + 1):
            number += 1
            where = f"{file}:{number}"
            if len(line) > max_record_bytes and not line.endswith(b"\n"):
                size = len(line)
                del line
                while piece := handle.readline(1 << 20):
                    size += len(piece)
                    if piece.endswith(b"\n"):
                        size -= 1
                        break
                yield where, _too_big(size, max_record_bytes)
                continue
            if not line.strip():
                continue
            try:
                yield where, json.loads(line.decode("utf-8"))
            except UnicodeDecodeError as err:
                yield where, SampleError(f"not UTF-8 text (byte {err.start + 1} of the line)")
            except json.JSONDecodeError as err:
                yield where, SampleError(f"malformed JSON ({err.msg} at column {err.colno})")


def _parquet_records(file: Path, max_record_bytes: int) -> Iterable[tuple[str, Any]]:
    """(file:row N, record or the error that makes it bad), read one row group at a time. A row group whose
    uncompressed size exceeds ``max_record_bytes`` × its rows holds a row over the bound (its largest row is at
    least its mean): the whole group is one bad record, not read; otherwise each row is measured once read."""
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(file)
        ours = (parquet.schema_arrow.metadata or {}).get(b"vlrl") == _PARQUET_MARKER
    except Exception as err:
        raise DataError(f"{file}: cannot read parquet ({err})") from err
    first = 0
    for group in range(parquet.num_row_groups):
        meta = parquet.metadata.row_group(group)
        rows = range(first, first + meta.num_rows)
        first += meta.num_rows
        if meta.total_byte_size > max_record_bytes * max(1, meta.num_rows):
            where = f"{file}:rows {rows.start}-{rows.stop - 1}" if len(rows) > 1 else f"{file}:row {rows.start}"
            yield where, _too_big(-(-meta.total_byte_size // max(1, meta.num_rows)), max_record_bytes, at_least=True)
            continue
        try:
            table = parquet.read_row_group(group)
        except Exception as err:
            raise DataError(f"{file}: cannot read parquet row group {group} ({err})") from err
        for row_number, row in zip(rows, table.to_pylist(), strict=True):
            where = f"{file}:row {row_number}"
            size = _row_bytes(row)
            if size > max_record_bytes:
                yield where, _too_big(size, max_record_bytes)
                continue
            try:
                yield where, _decode_parquet_row(row, ours)
            except (ValueError, TypeError) as err:
                yield where, SampleError(str(err))


def _row_bytes(value: Any) -> int:
    """Bytes of a parquet row's strings and binary values (what its record holds), nested values included."""
    if isinstance(value, (bytes, str)):
        return len(value)
    if isinstance(value, dict):
        return sum(_row_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_row_bytes(v) for v in value)
    return 8


def _decode_parquet_row(row: dict[str, Any], ours: bool) -> dict[str, Any]:
    record = {k: v for k, v in row.items() if v is not None}
    for key in ("messages", "metadata", "reward") + (("answer",) if ours else ()):
        value = record.get(key)
        if isinstance(value, str) and (ours or key in ("messages", "metadata")):
            try:
                record[key] = json.loads(value)
            except json.JSONDecodeError as err:
                if key != "reward":
                    raise ValueError(f"field {key!r}: not valid JSON ({err.msg})") from err
    images = []
    for k, image in enumerate(record.get("images") or []):
        if isinstance(image, dict):  # the HF `datasets` Image feature: {"bytes": ..., "path": ...}
            image = image.get("bytes") or image.get("path")
        if isinstance(image, bytes):
            import base64

            image = "data:image/png;base64," + base64.b64encode(image).decode()
        if not isinstance(image, str):
            raise ValueError(f"field 'images[{k}]': expected bytes or a path")
        images.append(image)
    record["images"] = images
    return record


def write_samples(samples: Iterable[Sample], out: str | Path) -> Path:
    """Write samples to ``out`` (``.jsonl`` with images under ``images/`` beside it, or ``.parquet``)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == ".parquet":
        return _write_parquet(list(samples), out)
    if out.suffix != ".jsonl":
        raise DataError(f"{out}: choose a .jsonl or .parquet file name")
    with open(out, "w", encoding="utf-8") as handle:
        for sample in samples:
            paths = [_write_image(image, out.parent, f"{_safe(sample.id)}_{k}") for k, image in enumerate(sample.images)]
            videos: list[Any] = []
            for k, video in enumerate(sample.videos):
                if isinstance(video, str):  # a video file: referenced where it is (relative when beside `out`)
                    videos.append(_relative(video, out.parent) or str(Path(video).resolve()))
                else:
                    videos.append([_write_image(frame, out.parent, f"{_safe(sample.id)}_v{k}_{f}")
                                   for f, frame in enumerate(video)])
            handle.write(json.dumps(sample_to_json(sample, paths, videos), ensure_ascii=False) + "\n")
    return out


def _relative(path: str, root: Path) -> str | None:
    try:
        return str(Path(path).resolve().relative_to(root.resolve()))
    except ValueError:
        return None


def _write_image(image: Any, root: Path, stem: str) -> str:
    """The jsonl path of one image: its own path when it lies under ``root``, else a PNG written to images/."""
    if isinstance(image, str) and not image.startswith("data:"):
        relative = _relative(image, root)
        if relative is not None:
            return relative
    if not isinstance(image, Image.Image):
        image = load_image(image)
    (root / "images").mkdir(exist_ok=True)
    name = f"images/{stem}.png"
    image.save(root / name)
    return name


def _write_parquet(samples: list[Sample], out: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    if any(sample.videos for sample in samples):
        raise DataError(f"{out}: samples with videos are written to .jsonl (frames as PNG files), not .parquet")
    columns: dict[str, list[Any]] = {k: [] for k in ("id", "task", "messages", "images", "answer", "reward", "response", "metadata")}
    for sample in samples:
        columns["id"].append(sample.id)
        columns["task"].append(sample.task)
        columns["messages"].append(json.dumps(sample.messages, ensure_ascii=False))
        columns["images"].append([image_to_png_bytes(load_image(image)) for image in sample.images])
        columns["answer"].append(json.dumps(sample.answer, ensure_ascii=False))
        columns["reward"].append(json.dumps(sample.reward))
        columns["response"].append(sample.response)
        columns["metadata"].append(json.dumps(sample.metadata, ensure_ascii=False))
    table = pa.table(columns, schema=pa.schema(
        [("id", pa.string()), ("task", pa.string()), ("messages", pa.string()), ("images", pa.list_(pa.binary())),
         ("answer", pa.string()), ("reward", pa.string()), ("response", pa.string()), ("metadata", pa.string())],
        metadata={b"vlrl": _PARQUET_MARKER},
    ))
    pq.write_table(table, out)
    return out


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
