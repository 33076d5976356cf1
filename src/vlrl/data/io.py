"""Read and write Sample files: jsonl (images as relative files or data URLs) and parquet (images as bytes) —
and read the datasets users bring: parquet / arrow / json files, globs, `save_to_disk` folders and hub ids
(`vlrl.data.sources`) in vlrl's, EasyR1's, verl's or TRL's layout (`vlrl.data.schemas`).

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
    DeferredImage,
    Sample,
    SampleError,
    image_size,
    image_to_png_bytes,
    load_image,
    open_image,
    sample_to_json,
)
from vlrl.data.schemas import (
    LAYOUTS,
    RowContext,
    Schema,
    TemplateRefused,
    default_reward_note,
    detect_format,
    row_to_sample,
)
from vlrl.data.sources import SourceError, Table, open_tables
from vlrl.data.video import MediaLimits, prepare_media

log = logging.getLogger(__name__)

OnError = Literal["raise", "skip"]
_PARQUET_MARKER = b"vlrl.sample.v1"


class DataError(ValueError):
    """A data file (or one record in it) that cannot be used; the message names file and line."""


@dataclass
class ReadReport:
    """What a read produced: the samples, every skipped record with its reason, and the layout each table was
    read as (``(table, format, why)``, plus the verifier chosen when the run names none)."""

    samples: list[Sample]
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (file:line, reason)
    formats: list[tuple[str, str, str]] = field(default_factory=list)  # (table, format, why)

    def summary(self) -> str:
        text = f"{len(self.samples)} samples"
        layouts = sorted({f for _, f, _ in self.formats})
        if layouts and layouts != ["vlrl"]:
            text += f" ({', '.join(layouts)} layout)"
        if self.skipped:
            text += f", {len(self.skipped)} skipped (first: {self.skipped[0][0]}: {self.skipped[0][1]})"
        return text

    def layout_lines(self) -> list[str]:
        """One line per table read: its layout and why (what ``data.format: auto`` chose)."""
        return [f"{name}: {fmt} layout ({why})" for name, fmt, why in self.formats]


def read_samples(
    path: str | Path,
    *,
    on_error: OnError = "raise",
    check: Callable[[Sample], None] | None = None,
    verify_images: bool = True,
    media: MediaLimits | None = MediaLimits(),  # noqa: B008  (frozen)
    schema: Schema | None = None,
) -> ReadReport:
    """Read samples from a data path: a ``.jsonl`` / ``.json`` / ``.parquet`` / ``.arrow`` file, a directory of
    them, a glob, a ``save_to_disk`` folder or a hub id (`vlrl.data.sources`), in any layout of
    `vlrl.data.schemas` (``schema``: the ``data.*`` settings; default: detected, vlrl's defaults).

    Args:
        on_error: ``"raise"`` stops at the first bad record; ``"skip"`` skips and counts it.
        check: an extra per-sample validation (e.g. that reward names are registered); it raises
            ``ValueError``/``KeyError`` with a message, which is reported with the file and line.
        verify_images: open every image once at read time so a missing or corrupt file is reported here
            (with its line) rather than in the middle of training. Images that stay in a memory-mapped table
            (`vlrl.data.sources.ArrowImage`) are checked from their header only: nothing is decoded.
        media: how videos become frames and the per-sample image budgets (`vlrl.data.video.prepare_media`);
            a sample over a budget is a bad record. None: samples are returned as read (videos kept). Its
            ``max_record_bytes`` and ``max_source_bytes`` (the default ones when None) bound each record and the
            whole source, once decoded, while it is read (`vlrl.data.sources.open_tables`).
    """
    schema = schema or Schema()
    try:
        limits = media or MediaLimits()
        tables = open_tables(path, split=schema.split, subset=schema.subset, revision=schema.revision,
                             max_record_bytes=limits.max_record_bytes, max_source_bytes=limits.max_source_bytes)
    except SourceError as err:
        raise DataError(str(err)) from err
    report = ReadReport(samples=[])
    try:
        _read_tables(tables, schema, report, on_error, check, verify_images, media)
    except (TemplateRefused, SourceError) as err:  # the template's or the whole source's: whatever on_error says
        raise DataError(str(err)) from None
    if report.skipped:
        log.warning("%s: skipped %d bad record(s); first: %s: %s", path, len(report.skipped), *report.skipped[0])
    return report


def _read_tables(tables: list[Table], schema: Schema, report: ReadReport, on_error: OnError,
                 check: Callable[[Sample], None] | None, verify_images: bool, media: MediaLimits | None) -> None:
    """Every record of ``tables`` into ``report`` (a sample, or a skipped record with its reason)."""
    seen_ids: dict[str, str] = {}
    for table in tables:
        for where, record in _table_records(table, schema, report, on_error):
            try:
                if isinstance(record, Exception):
                    raise record
                sample = record
                sample.source = where
                if media is not None:
                    sample = prepare_media(sample, media)
                if sample.id in seen_ids:
                    raise SampleError(f"duplicate id {sample.id!r} (first seen at {seen_ids[sample.id]})")
                if verify_images:
                    _verify_images(sample)
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


def _table_records(table: Table, schema: Schema, report: ReadReport, on_error: OnError) -> Iterable[tuple[str, Any]]:
    """(where, Sample or the error that row gave) of one table, in the layout detected (or set) for it."""
    try:
        fmt, why = ("vlrl", "vlrl's parquet") if table.vlrl_parquet else detect_format(table.columns, schema)
    except SampleError as err:
        raise DataError(f"{table.name}: {err}") from err
    note = default_reward_note(fmt, schema)
    report.formats.append((table.name, fmt, why + (f"; {note}" if note else "")))
    lazy = [schema.columns["images"]] if "images" in schema.columns else list(LAYOUTS.get(fmt, LAYOUTS["easyr1"]).images)
    context = RowContext(table.stem, table.id_prefix, table.base_dir, fmt)
    for index, (where, record) in enumerate(table.rows(lazy)):
        if isinstance(record, Exception):
            yield where, record
            continue
        try:
            if not isinstance(record, dict):
                raise SampleError(f"expected a JSON object, got {type(record).__name__}")
            if fmt == "vlrl":
                arrow = not table.name.endswith((".jsonl", ".json"))  # parquet / arrow: JSON-string columns
                record = _decode_parquet_row(record, table.vlrl_parquet) if arrow else record
            yield where, row_to_sample(record, index, schema, context)
        except (ValueError, TypeError, KeyError) as err:
            yield where, err if isinstance(err, ValueError) else SampleError(str(err))


def _verify_images(sample: Sample) -> None:
    """Every image of ``sample`` opens: decoded in full, or — kept in its memory-mapped table — from its header."""
    for k, image in enumerate(sample.images):
        try:
            if isinstance(image, DeferredImage):
                image_size(image)
            else:
                load_image(image)
        except SampleError as err:
            raise SampleError(f"field 'images[{k}]': {err}") from err


def _decode_parquet_row(row: dict[str, Any], ours: bool) -> dict[str, Any]:
    """vlrl's parquet columns: messages, metadata (and, in vlrl's own files, answer and reward) as JSON strings."""
    record = {k: v for k, v in row.items() if v is not None}
    for key in ("messages", "metadata", "reward") + (("answer",) if ours else ()):
        value = record.get(key)
        if isinstance(value, str) and (ours or key in ("messages", "metadata")):
            try:
                record[key] = json.loads(value)
            except json.JSONDecodeError as err:
                if key != "reward":
                    raise ValueError(f"field {key!r}: not valid JSON ({err.msg})") from err
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
    """The jsonl path of one image: its own path when it lies under ``root``; encoded bytes (a dataset's JPEG, a
    data URL) written as they are, under images/ with their format's suffix; a decoded image as a PNG there."""
    if isinstance(image, DeferredImage):
        image = image.image_source()
    if isinstance(image, str) and not image.startswith("data:"):
        relative = _relative(image, root)
        if relative is not None:
            return relative
    (root / "images").mkdir(exist_ok=True)
    if isinstance(image, bytes) or (isinstance(image, str) and image.startswith("data:")):
        data = image if isinstance(image, bytes) else _data_url_bytes(image)
        with open_image(data) as opened:
            suffix = {"JPEG": "jpg", "MPO": "jpg"}.get(opened.format or "PNG", (opened.format or "png").lower())
        name = f"images/{stem}.{suffix}"
        (root / name).write_bytes(data)
        return name
    if not isinstance(image, Image.Image):
        image = load_image(image)
    name = f"images/{stem}.png"
    image.save(root / name)
    return name


def _data_url_bytes(url: str) -> bytes:
    import base64

    return base64.b64decode(url.split(",", 1)[1])


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
