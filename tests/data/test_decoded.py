"""Issue 47, item 4 and the JSON items: bounds on decoded bytes, not encoded ones (`vlrl.data.decoded`). Small files
whose decoded size is far beyond their encoded one: a parquet row group whose dictionary page holds one string that
every row repeats, a jsonl line of empty lists, a line nested 100,000 deep."""

from __future__ import annotations

import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from vlrl.cli import app
from vlrl.data import DataError, read_samples
from vlrl.data.video import MediaLimits


def _dictionary_parquet(path, rows: int, size: int):
    """``rows`` rows whose ``problem`` is one ``size``-byte string: a dictionary page of ``size`` bytes, zstd."""
    problem = pa.DictionaryArray.from_arrays(pa.array([0] * rows, pa.int32()), pa.array(["x" * size]))
    pq.write_table(pa.table({"problem": problem, "answer": pa.array(["4"] * rows)}), path, compression="zstd")
    return path


def _check(tmp_path, data, *overrides):
    config = tmp_path / "rl.yaml"
    config.write_text(f"model: {{path: tiny-qwen2}}\ndata: {{train: {data}, test: {data}, reward: string_match}}\n"
                      "check: {samples_per_task: 1}\n")
    return CliRunner().invoke(app, ["check", str(config), "--recipe", "rl", *overrides])


def test_a_parquet_row_is_measured_decoded_not_encoded(tmp_path, monkeypatch):
    """Before: a row group's `total_byte_size` (its encoded size: one 2 MB dictionary entry for 30 rows, a mean of
    70 KB) passed a 1 MB bound, so the file went whole through `datasets` — 60 MB of strings decoded into its cache
    (the issue's 2.6 KB file: 1.8 GB there, > 5.9 GB of memory) — before each row was found too big. Now the row is
    measured decoded (through its dictionary) first: each is a bad record naming its row, and none is decoded."""
    import datasets

    cache = tmp_path / "cache"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    data = _dictionary_parquet(tmp_path / "train.parquet", 30, 2 << 20)
    assert data.stat().st_size < 4096
    result = _check(tmp_path, data, "data.max_record_bytes=1000000")
    cached = sum(f.stat().st_size for f in cache.rglob("*") if f.is_file()) if cache.exists() else 0
    assert cached < 1 << 20, f"{cached:,} bytes decoded into the datasets cache"
    problems = [line for line in result.output.splitlines() if line.startswith("  ✗")]
    rows = [f"  ✗ {data}:row {k}: a record of 2,097,153 bytes, more than data.max_record_bytes (1,000,000)"
            for k in range(10)]  # (the preflight lists ten, then counts)
    assert result.exit_code == 1 and problems == [
        line for split in ("train", "test") for line in (*rows, f"  ✗ data.{split}: 20 more bad record(s) in {data}",
                                                         f"  ✗ data.{split}: {data}: no usable samples")], result.output


def test_a_source_over_its_decoded_total_is_refused_before_it_is_read(tmp_path):
    data = _dictionary_parquet(tmp_path / "train.parquet", 30, 100_000)  # 3 MB of text from a ~1 KB file
    result = _check(tmp_path, data, "data.max_source_bytes=1000000")
    problems = [line for line in result.output.splitlines() if line.startswith("  ✗")]
    assert result.exit_code == 1 and len(problems) == 2 and all(
        f"{data}: its records hold 3,000,030 bytes of text once decoded (at least), more than data.max_source_bytes "
        "(1,000,000)" in line for line in problems), result.output
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text("".join(json.dumps({"id": f"q{k}", "task": "t", "prompt": "p" * 400_000, "answer": "4",
                                         "reward": "string_match"}) + "\n" for k in range(3)))
    with pytest.raises(DataError, match=r"t.jsonl: its records hold 1,\d{3},\d{3} bytes of text .* more than "
                                        r"data.max_source_bytes \(1,000,000\)"):
        read_samples(jsonl, media=MediaLimits(max_source_bytes=1_000_000))


def test_a_json_record_is_bounded_by_its_parsed_size_and_its_depth(tmp_path):
    """Before: a line under the byte bound was parsed whatever it expanded to (two 60 MB lines of ``[[],…]`` took
    3.3 GB), and a line nested 100,000 deep raised a raw RecursionError with no file:line, even with
    on_error=skip. Now both are bad records naming file:line, skipped and counted with on_error=skip (default
    bounds: 64 MiB)."""
    good = {"id": "ok", "task": "t", "prompt": "What is 2+2?", "answer": "4", "reward": "string_match"}
    wide = {**good, "id": "wide", "metadata": {"pad": [[]] * 1_100_000}}  # 4.4 MB of text, over 64 MiB parsed
    lines = [json.dumps(good), json.dumps(wide), "[" * 100_000 + "]" * 100_000]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(lines) + "\n")
    report = read_samples(path, on_error="skip")
    assert [s.id for s in report.samples] == ["ok"]
    (wide_where, wide_why), (deep_where, deep_why) = report.skipped
    assert wide_where == f"{path}:2" and re.fullmatch(r"a record that takes about [\d,]+ bytes once parsed \(JSON "
                                                      r"values cost memory beyond their text\), more than "
                                                      r"data.max_record_bytes \(67,108,864\)", wide_why), wide_why
    assert deep_where == f"{path}:3" and deep_why == "JSON nested 100,000 deep, more than 512"
    path.write_text("\n".join([lines[0], lines[2]]) + "\n")
    with pytest.raises(DataError, match=rf"{re.escape(str(path))}:2: JSON nested 100,000 deep, more than 512"):
        read_samples(path)


def test_decoded_sizes_of_dictionaries_and_json():
    """``row_sizes`` measures a dictionary column through its dictionary (binary apart), ``json_cost`` counts
    ~64 bytes per value outside strings and the bracket depth, strings (with their escapes) aside."""
    from vlrl.data.decoded import json_cost, row_sizes

    table = pa.table({"s": pa.DictionaryArray.from_arrays(pa.array([0, 0, 1, None], pa.int32()), pa.array(["abc", "z"])),
                      "b": pa.array([b"12", b"", None, b"1"]), "n": pa.array([1, 2, 3, 4])})
    assert row_sizes(table) == ([3 + 2 + 8, 3 + 0 + 8, 1 + 0 + 8, 0 + 1 + 8], [11, 11, 9, 8])
    line = b'{"a": "x, [ { : \\" ]"}'  # 6 marks in the raw bytes, 2 outside the string: '{' and ':'
    assert json_cost(line, 10**6) == (len(line) + 64 * 7, 3)  # within the limit: the raw bound, no scan
    assert json_cost(line, 300) == (len(line) + 64 * 3, 3)  # the raw bound passes 300: the strings are taken out
    assert json_cost(b"[" * 600 + b"]" * 600, 10**6)[1] == 600
