"""MetricsLogger: metrics.jsonl always, every sink gets every record, notes merge into the next record."""

import io
import json

from rich.console import Console

from vlrl.report import MetricsLogger


class ListSink:
    def __init__(self):
        self.records, self.closed = [], False

    def write(self, record):
        self.records.append(dict(record))

    def close(self):
        self.closed = True


def test_jsonl_and_sinks_receive_the_same_records(tmp_path):
    sink = ListSink()
    logger = MetricsLogger(tmp_path / "metrics.jsonl", sinks=[sink], quiet=True)
    logger.log("rl", 1, {"reward/mean": 0.5, "policy/entropy": float("nan")})
    logger.log("rl", 2, {"reward/mean": 0.75})
    logger.close()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["stage"], r["step"], r["reward/mean"]) for r in lines] == [("rl", 1, 0.5), ("rl", 2, 0.75)]
    assert lines[0]["policy/entropy"] == "nan"  # JSON has no NaN: written as a string, read back by the report
    assert [r["reward/mean"] for r in sink.records] == [0.5, 0.75] and sink.closed


def test_notes_merge_into_the_next_record_of_their_stage_and_the_loop_wins(tmp_path):
    logger = MetricsLogger(None, quiet=True)
    logger.note("rl", {"rollout/gen_prob": 0.4, "reward/mean": -1.0})
    logger.log("sft", 1, {"sft/loss": 2.0})  # another stage: the note waits
    logger.log("rl", 1, {"reward/mean": 0.5})
    logger.log("rl", 2, {"reward/mean": 0.6})
    assert "rollout/gen_prob" not in logger.records[0]
    assert logger.records[1]["rollout/gen_prob"] == 0.4 and logger.records[1]["reward/mean"] == 0.5
    assert "rollout/gen_prob" not in logger.records[2]  # consumed once


def test_console_line_and_a_failing_sink_on_close(tmp_path):
    class Broken(ListSink):
        def close(self):
            raise OSError("disk full")

    out = io.StringIO()
    good = ListSink()
    logger = MetricsLogger(None, console=Console(file=out, width=200), sinks=[Broken(), good])
    logger.log("rl", 3, {"reward/mean": 0.123456, "perf/step_seconds": 1.0}, show=("reward/mean",))
    logger.close()
    text = out.getvalue()
    assert "rl step 3 reward/mean=0.1235" in text and "perf/step_seconds" not in text
    assert "Broken: disk full" in text and good.closed  # the other sink was still closed
