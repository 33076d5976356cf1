"""`vlrl data gen | import | pack | balance | select`: generate, convert, pack, balance and select data."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from vlrl.cli.app import data_app
from vlrl.cli.common import (
    ATTN,
    REVISION,
    TEMPLATE_KWARGS,
    TRUST,
    first_line,
    load_options,
    preflight_failed,
    progress_bars,
)


@data_app.command("gen")
def data_gen(
    suite: str = typer.Argument(..., help="Task suite: shapes, arith or embodied."),
    n: int = typer.Option(100, "--n", help="Number of samples."),
    split: str = typer.Option("train", "--split", help="train or test (separate random streams)."),
    out: Path = typer.Option(..., "--out", help="Output directory (writes <split>.jsonl and images/) or a .parquet file."),
    seed: int = typer.Option(0, "--seed"),
    tasks: str | None = typer.Option(None, "--tasks", help="Comma-separated sub-tasks, e.g. count,color."),
    template: str | None = typer.Option(
        None, "--template", help="Prompt template of shapes/arith: answer (their default), think or none."),
) -> None:
    """Generate a procedural task suite as Sample files."""
    from vlrl.data import TASK_SUITES, generate, write_samples
    from vlrl.registry import RegistryError

    progress = progress_bars()
    try:
        with progress.task(f"generate {n} {suite} samples"):
            options = {"template": template} if template is not None else {}  # embodied has a fixed JSON prompt
            samples = generate(suite, n, split=split, seed=seed, tasks=tasks.split(",") if tasks else None, **options)
    except (RegistryError, ValueError) as err:
        typer.secho(f"vlrl data gen: {err}", fg="red", err=True)
        raise typer.Exit(2) from None
    target = out if out.suffix in (".jsonl", ".parquet") else out / f"{split}.jsonl"
    with progress.task(f"write {target}"):
        path = write_samples(samples, target)
    typer.echo(f"wrote {len(samples)} {suite} samples to {path} (suites: {', '.join(TASK_SUITES.names())})")


@data_app.command("import")
def data_import(
    source: str = typer.Argument(..., help="A data path: file, folder, glob, `save_to_disk` folder or hub id (PATH@split "
                                 "picks a split)."),
    out: Path = typer.Option(..., "--out", help="Output directory: <split>.jsonl and images/ (or a .jsonl / .parquet file)."),
    fmt: str = typer.Option("auto", "--format", help="Layout of the rows: auto, vlrl, easyr1, verl or trl (as data.format)."),
    column: list[str] | None = typer.Option(None, "--column", help="FIELD=COLUMN (repeatable), as data.columns, e.g. "
                                            "--column prompt=question --column answer=label."),
    split: str = typer.Option("train", "--split", help="Split of a hub id or `save_to_disk` DatasetDict (as data.split)."),
    subset: str | None = typer.Option(None, "--subset", help="Hub dataset configuration (as data.subset)."),
    revision: str | None = typer.Option(None, "--revision", help="Hub dataset revision (as data.revision)."),
    prompt_template: str | None = typer.Option(None, "--prompt-template", help="Jinja text or .jinja file (as "
                                               "data.prompt_template)."),
    system_prompt: str | None = typer.Option(None, "--system-prompt", help="System message (as data.system_prompt)."),
    reward: str | None = typer.Option(None, "--reward", help="Default verifier (as data.reward)."),
    on_error: str = typer.Option("raise", "--on-error", help="Bad records: raise, or skip them (listed)."),
) -> None:
    """Read a dataset in any supported layout and write it as vlrl's own jsonl + images, to inspect or edit it."""
    from vlrl.config import ConfigError, DataConfig
    from vlrl.data import DataError, read_samples, write_samples
    from vlrl.data.sources import split_suffix
    from vlrl.data.splits import sample_check, schema_for

    pairs = [c.partition("=") for c in column or []]
    try:
        if any(not sep or not field or not name for field, sep, name in pairs):
            raise ValueError("--column: give FIELD=COLUMN, e.g. --column answer=solution")
        cfg = DataConfig(format=fmt, columns={field: name for field, _, name in pairs}, split=split, subset=subset,
                         revision=revision, prompt_template=prompt_template, system_prompt=system_prompt, reward=reward,
                         on_error=on_error)
        schema = schema_for(cfg)
    except (ValueError, ConfigError, OSError) as err:
        typer.secho(f"vlrl data import: {first_line(err)}", fg="red", err=True)
        raise typer.Exit(2) from None
    progress = progress_bars()
    try:
        with progress.task(f"read {source}"):
            report = read_samples(source, on_error=cfg.on_error, check=sample_check, schema=schema, verify_images=True)
        chosen = split_suffix(source)[1] or schema.split  # SOURCE@test: test.jsonl
        target = out if out.suffix in (".jsonl", ".parquet") else out / f"{chosen}.jsonl"
        with progress.task(f"write {target}"):
            path = write_samples(report.samples, target)
    except DataError as err:
        typer.secho(f"vlrl data import: {err}", fg="red", err=True)
        raise typer.Exit(1) from None
    for line in report.layout_lines():
        typer.echo(line)
    for where, reason in report.skipped:
        typer.secho(f"skipped {where}: {reason}", fg="yellow", err=True)
    typer.echo(f"wrote {len(report.samples)} samples to {path}" + (f" ({len(report.skipped)} skipped)" if report.skipped else ""))


@data_app.command("pack")
def data_pack(
    data: Path = typer.Option(..., "--data", help="Sample file (.jsonl/.parquet) or directory to plan."),
    out: Path = typer.Option(..., "--out", help="Plan file (.npz); the statistics go to the .json beside it."),
    capacity: int = typer.Option(..., "--capacity", help="Tokens per packed sequence (e.g. 8192)."),
    model: str = typer.Option("tiny-qwen2-vl", "--model", help="Model whose tokenizer/processor counts tokens (no weights loaded)."),
    min_pixels: int | None = typer.Option(None, "--min-pixels", help="Native-resolution lower bound (as model.min_pixels)."),
    max_pixels: int | None = typer.Option(None, "--max-pixels", help="Native-resolution upper bound (as model.max_pixels)."),
    init_seed: int = typer.Option(0, "--init-seed", help="model.init_seed of a tiny preset."),
    workers: int = typer.Option(1, "--workers", help="Processes counting tokens."),
    seed: int = typer.Option(0, "--seed", help="The plan is deterministic for a seed."),
    on_overlong: str = typer.Option("drop", "--on-overlong", help="Samples longer than the capacity: drop, truncate or raise."),
    greedy_only: bool = typer.Option(False, "--greedy-only", help="Skip the diversity-first phase (fill greedily)."),
    on_error: str = typer.Option("raise", "--on-error", help="Bad records: raise, or skip (they are then not in the plan's file set)."),
    video_fps: float = typer.Option(2.0, "--video-fps", help="Frames per second taken from video files (as data.video_fps)."),
    max_frames: int = typer.Option(8, "--max-frames", help="Most frames per video (as data.max_frames)."),
    max_images: int = typer.Option(32, "--max-images", help="Most images per sample, frames included (as data.max_images)."),
    revision: str | None = REVISION,
    trust_remote_code: bool | None = TRUST,
    chat_template_kwargs: str | None = TEMPLATE_KWARGS,
) -> None:
    """Offline packing: count every sample's tokens, plan bins of --capacity tokens, write the plan once."""
    from vlrl.data import DataError, MediaLimits, read_samples
    from vlrl.data.packing import PackingError, plan_samples
    from vlrl.models.lengths import TokenCounter
    from vlrl.models.policy import load_processor

    if on_overlong not in ("drop", "truncate", "raise") or on_error not in ("raise", "skip"):
        typer.secho("vlrl data pack: --on-overlong is drop, truncate or raise; --on-error is raise or skip", fg="red", err=True)
        raise typer.Exit(2)
    progress = progress_bars()
    try:
        with progress.task(f"read {data}"):
            media = MediaLimits(video_fps=video_fps, max_frames=max_frames, max_images=max_images)
            samples = read_samples(data, on_error=on_error, verify_images=False, media=media).samples
        with progress.task(f"load the processor of {model}"):
            processor = load_processor(model, seed=init_seed, min_pixels=min_pixels, max_pixels=max_pixels,
                                       options=load_options("data pack", None, revision, trust_remote_code,
                                                             chat_template_kwargs))
        with progress.task(f"count tokens of {len(samples)} samples and pack"):
            plan = plan_samples(samples, TokenCounter(processor), capacity, workers=workers, source=str(data),
                                model={"path": model, "init_seed": init_seed, "min_pixels": min_pixels,
                                       "max_pixels": max_pixels},
                                seed=seed, on_overlong=on_overlong, diversity=not greedy_only)
        path = plan.save(out)
    except (DataError, PackingError, ValueError, OSError) as err:
        typer.secho(f"vlrl data pack: {err}", fg="red", err=True)
        raise typer.Exit(2) from None
    s = plan.meta["stats"]
    typer.echo(f"wrote {path} (+ {path.with_suffix('.json').name}): {s['packed_samples']} samples in {s['bins']} bins of "
               f"{capacity} tokens (lower bound {s['lower_bound']}), fill {s['fill_ratio']:.2%}, padding compression "
               f"vs one sample per sequence {s['compression_vs_naive']:.1f}x; {s['truncated']} truncated, "
               f"{s['dropped']} dropped (longer than the capacity, listed in the .json)")


@data_app.command("balance")
def data_balance(
    data: Path = typer.Option(..., "--data", help="Sample file (.jsonl/.parquet) or directory to balance."),
    vocabulary: Path = typer.Option(..., "--vocabulary", help="Concept vocabulary: one concept per line."),
    out: Path = typer.Option(..., "--out", help="Output directory: index.json, report.json, coverage.png, train.jsonl."),
    embedder: str = typer.Option("clip", "--embedder", help="Registered embedder (clip) or pkg.mod:factory."),
    embedder_path: str = typer.Option(..., "--embedder-path", help="Local directory of the embedding model."),
    template: str = typer.Option("a photo of {}.", "--template", help="Prompt each concept is embedded in ({} = the concept)."),
    top_k: int = typer.Option(5, "--top-k", help="Concepts retrieved per sample."),
    n_out: int | None = typer.Option(None, "--n-out", help="Samples to draw (default: as many as the input holds)."),
    power: float = typer.Option(1.0, "--power", help="Weight exponent: w ∝ mean f_c^(−power) over the sample's concepts."),
    replace: bool | None = typer.Option(None, "--replace/--no-replace", help="Draw with replacement (default: only when --n-out exceeds the input)."),
    seed: int = typer.Option(0, "--seed"),
    batch_size: int = typer.Option(64, "--batch-size", help="Samples embedded per batch."),
    write_data: bool = typer.Option(True, "--write-data/--index-only", help="Also write the resampled samples as train.jsonl."),
    on_error: str = typer.Option("raise", "--on-error", help="Bad records: raise, or skip them."),
) -> None:
    """Concept balancing: top-K concepts per image, inverse-frequency resampling, coverage before/after."""
    from vlrl.data import DataError, read_samples, write_samples
    from vlrl.data.balance import balance_samples, get_embedder, plot_coverage, read_vocabulary, resampled
    from vlrl.data.packing import ids_fingerprint
    from vlrl.registry import RegistryError

    progress = progress_bars()
    try:
        words = read_vocabulary(str(vocabulary))
        samples = read_samples(data, on_error=on_error).samples
        model = get_embedder(embedder)(embedder_path)
        with progress.task(f"embed {len(samples)} samples, {len(words)} concepts"):
            result = balance_samples(samples, model, words, top_k=top_k, n_out=n_out, power=power, replace=replace,
                                     seed=seed, batch_size=batch_size, template_texts=[template.replace("{}", w) for w in words])
    except (DataError, RegistryError, ValueError, OSError) as err:
        typer.secho(f"vlrl data balance: {err}", fg="red", err=True)
        raise typer.Exit(2) from None
    out.mkdir(parents=True, exist_ok=True)
    ids = [s.id for s in samples]
    (out / "index.json").write_text(json.dumps({"data": str(data), "ids_sha256": ids_fingerprint(ids),
                                                "indices": result.indices.tolist(),
                                                "ids": [ids[i] for i in result.indices.tolist()]}) + "\n")
    (out / "report.json").write_text(json.dumps(result.report, indent=2) + "\n")
    from vlrl.report.plots import NO_CHARTS, can_draw

    if can_draw():
        plot_coverage(result, str(out / "coverage.png"))
    else:
        typer.secho(f"coverage.png not drawn: {NO_CHARTS.split(': ', 1)[1].split(';')[0]}", fg="yellow", err=True)
    if write_data:
        write_samples(resampled(samples, result.indices), out / "train.jsonl")
    r = result.report
    for name in ("pool", "uniform", "balanced"):
        c = r[name]
        typer.echo(f"{name:9s} {c['samples']:>8} samples: {c['concepts_covered']}/{len(words)} concepts covered "
                   f"({c['coverage']:.1%}), evenness {c['evenness']:.3f}, top-1% concepts hold {c['head_1pct_share']:.1%} "
                   "of mentions")
    typer.echo(f"wrote {out}/index.json, report.json, coverage.png" + (", train.jsonl" if write_data else ""))


@data_app.command("select")
def data_select(
    data: Path = typer.Option(..., "--data", help="Prompts (.jsonl/.parquet file or directory) with answers and rewards."),
    model: str = typer.Option(..., "--model", help="The current model: directory, preset or hub id."),
    out: Path = typer.Option(..., "--out", help="Output directory: selected.jsonl, stats.jsonl, summary.json."),
    n: int = typer.Option(8, "--n", help="Rollouts per prompt (N)."),
    k: int | None = typer.Option(None, "--k", help="pass@k of the gap (default: k = N)."),
    temperature: float = typer.Option(1.0, "--temperature"),
    top_k: int = typer.Option(0, "--top-k", min=0, help="Top-k of the rollouts, 0 = off (the full vocabulary); give "
                              "the RL run's rollout.top_k to select with the distribution it will sample."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens"),
    min_mean_reward: float | None = typer.Option(0.1, "--min-mean-reward", help="Drop items whose mean reward is lower (unsolvable)."),
    max_mean_reward: float | None = typer.Option(0.9, "--max-mean-reward", help="Drop items whose mean reward is higher (trivial)."),
    min_gap: float | None = typer.Option(None, "--min-gap", help="Keep only items with pass@k − pass@1 ≥ this."),
    store: Path | None = typer.Option(None, "--store", help="Rollout cache (jsonl) to reuse and extend; default OUT/rollouts.jsonl."),
    servers: str | None = typer.Option(None, "--servers", help="Comma-separated rollout servers (vlrl serve / SGLang) already serving --model."),
    batch_prompts: int = typer.Option(64, "--batch-prompts", help="Prompts per generate call."),
    seed: int = typer.Option(0, "--seed"),
    strict: bool = typer.Option(True, "--strict/--lenient", help="Score as RL's algo.strict_reward does (default): a "
                                "right answer that is cut off or not in its answer form counts as wrong; --lenient: "
                                "the verifier alone."),
    on_error: str = typer.Option("raise", "--on-error", help="Bad records: raise, or skip them."),
    attn_implementation: str | None = ATTN,
    revision: str | None = REVISION,
    trust_remote_code: bool | None = TRUST,
    chat_template_kwargs: str | None = TEMPLATE_KWARGS,
) -> None:
    """Discrepancy-driven selection: N rollouts per prompt, pass@1 / pass@k / mean reward, keep the band."""
    from vlrl.config import RolloutConfig, ServersConfig, WeightSyncConfig
    from vlrl.data import DataError, write_samples
    from vlrl.eval.select import Band, RolloutStore, rollout_and_score, select, summarise
    from vlrl.models import load_policy
    from vlrl.rollout import SamplingParams, build_engine, close_engine
    from vlrl.train.common import seed_everything

    if on_error not in ("raise", "skip"):
        typer.secho("vlrl data select: --on-error is raise or skip", fg="red", err=True)
        raise typer.Exit(2)
    samples, options = _checked_prompts(data, model, on_error, max_new_tokens, attn_implementation, revision,
                                        trust_remote_code, chat_template_kwargs)
    progress = progress_bars()
    engine = None
    try:
        band = Band(min_mean_reward=min_mean_reward, max_mean_reward=max_mean_reward, min_gap=min_gap, k=k or n)
        rollout_store = RolloutStore(store or out / "rollouts.jsonl")
        seed_everything(seed)
        with progress.task(f"load {model}"):
            if servers:  # they already serve --model: only its tokenizer and processor are loaded here
                from vlrl.models.policy import load_processor

                urls = [u.strip() for u in servers.split(",") if u.strip()]
                rollout = RolloutConfig(servers=ServersConfig(urls=urls),
                                        weight_sync=WeightSyncConfig(dir=str(out / "weights")))
                engine = build_engine(rollout, load_processor(model, options=options), sync_weights=False)
            else:
                engine = build_engine(RolloutConfig(), load_policy(model, options=options))
        sampling = SamplingParams(n=n, temperature=temperature, top_k=top_k, max_new_tokens=max_new_tokens)
        with progress.task(f"roll out {len(samples)} prompts × {n}", total=len(samples)) as task:
            rollouts, generated, failures = rollout_and_score(
                engine, samples, sampling, rollout_store, model=model, batch_prompts=batch_prompts,
                on_progress=lambda done: task.update(completed=done), strict=strict)
        kept, stats = select(samples, rollouts, band)
    except (DataError, ValueError, OSError) as err:
        typer.secho(f"vlrl data select: {err}", fg="red", err=True)
        raise typer.Exit(2) from None
    finally:
        close_engine(engine)
    out.mkdir(parents=True, exist_ok=True)
    write_samples(kept, out / "selected.jsonl")
    with open(out / "stats.jsonl", "w", encoding="utf-8") as handle:
        for s in stats:
            handle.write(json.dumps({**s.__dict__, "gap": s.gap}) + "\n")
    summary = {**summarise(stats), "band": band.__dict__, "generated": generated,
               "reused_from_store": len(samples) - generated, "reward_failures": failures,
               "store": str(rollout_store.path), "model": model, "n": n}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    typer.echo(f"kept {len(kept)} of {len(samples)} items ({summary['verdicts']}); rolled out {generated}, reused "
               f"{len(samples) - generated} from {rollout_store.path}; wrote {out}/selected.jsonl, stats.jsonl, summary.json")


def _checked_prompts(data: Path, model: str, on_error: str, max_new_tokens: int, attn_implementation: str | None,
                     revision: str | None, trust_remote_code: bool | None, chat_template_kwargs: str | None):
    """`vlrl data select`'s prompts and the model's load options, after the preflight check; a failed check ends
    the command with its list of problems."""
    from vlrl.check import CheckReport, preflight, read_data
    from vlrl.config import DataConfig, ModelConfig, RunConfig

    report = CheckReport()  # the preflight: every record, the model, prompt + --max-new-tokens within the context
    samples = read_data(report, "--data", data, on_error)
    options = load_options("data select", attn_implementation, revision, trust_remote_code, chat_template_kwargs)
    model_cfg = ModelConfig(path=model, attn_implementation=options.attn_implementation, revision=options.revision,
                            trust_remote_code=options.trust_remote_code,
                            chat_template_kwargs=dict(options.chat_template_kwargs))
    report = preflight(RunConfig(model=model_cfg, data=DataConfig(on_error=on_error)),
                       splits={"train": samples}, budgets=[("train", "--max-new-tokens", max_new_tokens)], report=report)
    if not report.ok:
        preflight_failed("data select", str(data), report)
    for warning in report.warnings:
        typer.secho(f"warning: {warning}", fg="yellow", err=True)
    return samples, options
