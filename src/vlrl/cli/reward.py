"""``vlrl reward ...``: score responses offline with the same verifiers and executor as the RL loop.

``vlrl reward score --data samples.jsonl --responses responses.jsonl --out scored.jsonl``

``responses.jsonl`` holds one ``{"id": <sample id>, "response": "<text>"}`` per line (several lines may
share an id: n samples of one prompt); an optional ``response_length`` (tokens) feeds ``overlong``. Each
output line is the response line plus ``task``, ``reward`` and ``reward_parts``. Failed units are appended
to ``reward_failures.jsonl`` next to the output (``--failures`` to move it).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import typer

app = typer.Typer(no_args_is_help=True, help="Score responses with the reward verifiers.")


def read_responses(path: Path) -> list[dict]:
    """Response records; a bad line stops with ``file:line: reason``."""
    records = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as err:
                raise typer.BadParameter(f"{path}:{number}: not JSON ({err})") from None
            if not isinstance(record, dict) or not isinstance(record.get("id"), str) \
                    or not isinstance(record.get("response"), str):
                raise typer.BadParameter(f"{path}:{number}: needs string fields 'id' and 'response'")
            records.append(record)
    return records


@app.command("score")
def score(
    data: Path = typer.Option(..., "--data", help="Samples (.jsonl/.parquet or a directory): answers and reward names."),
    responses: Path = typer.Option(..., "--responses", help="JSONL of {id, response[, response_length]}."),
    out: Path = typer.Option(..., "--out", help="Scored JSONL to write."),
    failures: Path | None = typer.Option(None, "--failures", help="Failure log (default: reward_failures.jsonl next to --out)."),
    workers: int | None = typer.Option(None, "--workers", help="Worker processes for pool verifiers (default: CPUs)."),
    fallback: float = typer.Option(0.0, "--fallback", help="Score of an item whose verifier failed or timed out."),
) -> None:
    """Score every response against its sample's verifier(s); print per-task means and failure counts."""
    from vlrl.data import DataError, read_samples
    from vlrl.rewards.execution import RewardExecutor, RewardItem

    try:
        samples = {s.id: s for s in read_samples(data, verify_images=False).samples}
    except DataError as err:
        typer.secho(f"vlrl reward score: {err}", fg="red", err=True)
        raise typer.Exit(2) from None
    try:
        records = read_responses(responses)
    except typer.BadParameter as err:
        typer.secho(f"vlrl reward score: {err}", fg="red", err=True)
        raise typer.Exit(2) from None
    missing = sorted({r["id"] for r in records} - samples.keys())
    if missing:
        typer.secho(f"vlrl reward score: {len(missing)} response id(s) not in {data}, e.g. {missing[0]!r}", fg="red", err=True)
        raise typer.Exit(2)
    items = []
    for r in records:
        sample = samples[r["id"]]
        meta = dict(sample.metadata)
        if "response_length" in r:
            meta["response_length"] = r["response_length"]
        items.append(RewardItem(r["response"], sample.answer, sample.reward, meta, sample.id, sample.task))
    with RewardExecutor(workers=workers) as executor:
        outputs, report = executor.score(items, fallback=fallback,
                                         failures_path=failures or out.parent / "reward_failures.jsonl")
    out.parent.mkdir(parents=True, exist_ok=True)
    by_task: dict[str, list[float]] = defaultdict(list)
    with out.open("w", encoding="utf-8") as f:
        for record, item, output in zip(records, items, outputs, strict=True):
            by_task[item.task].append(output.overall)
            f.write(json.dumps({**record, "task": item.task, "reward": output.overall,
                                "reward_parts": output.parts}, ensure_ascii=False) + "\n")
    for task, values in sorted(by_task.items()):
        typer.echo(f"{task}: mean reward {sum(values) / len(values):.4f} over {len(values)}")
    typer.echo(f"scored {len(items)} responses in {report.wall_seconds:.2f} s -> {out}; "
               f"failures: {len(report.details)} ({report.counts['timeouts']} timeouts, {report.counts['errors']} errors, "
               f"{report.counts['worker_deaths']} worker deaths), too long: {report.counts['too_long']}")
