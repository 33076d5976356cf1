"""`vlrl synth serve`: the synthesis server on the command line."""

from __future__ import annotations

from typing import Any

import typer

from vlrl import safe_yaml

app = typer.Typer(no_args_is_help=True, help="Online data synthesis (Syn-GRPO): the synthesis server.")


def _options(items: list[str] | None, flag: str) -> dict[str, Any]:
    """``["model_path=/m", "steps=25"]`` → ``{"model_path": "/m", "steps": 25}`` (values parsed as YAML)."""
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"{flag} {item!r}: expected key=value, e.g. {flag} steps=25")
        try:
            out[key.strip()] = safe_yaml.load(value, f"{flag} {item!r}") if value.strip() else ""
        except safe_yaml.YamlRefused as err:
            raise typer.BadParameter(str(err)) from None
    return out


@app.command()
def serve(
    backend: str = typer.Option("classical", "--backend", help="Generator: classical, diffusers, or pkg.mod:factory."),
    backend_option: list[str] | None = typer.Option(None, "--backend-option", help="Back-end option key=value "
                                                    "(repeatable), e.g. model_path=/models/sd-inpaint, steps=25."),
    segmenter: str | None = typer.Option(None, "--segmenter", help="Refine boxes into masks: border, model (unset: boxes)."),
    segmenter_option: list[str] | None = typer.Option(None, "--segmenter-option", help="Segmenter option key=value, "
                                                      "e.g. path=/models/seg."),
    workers: int = typer.Option(1, "--workers", help="Jobs run at once (worker processes)."),
    executor: str = typer.Option("process", "--executor", help="process (timeouts kill the worker) or thread."),
    max_queued_jobs: int = typer.Option(64, "--max-queued-jobs", help="Queue bound; further jobs get 429."),
    max_queued_per_client: int | None = typer.Option(None, "--max-queued-per-client", min=1, help="Queued jobs one "
                                                     "client (token + address, + process on loopback) may hold; "
                                                     "unset: a quarter of the queue."),
    job_timeout: float = typer.Option(60.0, "--job-timeout", help="Seconds one job may run."),
    results_dir: str | None = typer.Option(None, "--results-dir", help="Where result PNGs are kept (default: a temporary directory)."),
    max_results_mb: float = typer.Option(512.0, "--max-results-mb", help="Size cap of the results; the oldest are deleted beyond it."),
    max_image_side: int = typer.Option(4096, "--max-image-side", help="Longest image side accepted."),
    max_body_mb: float = typer.Option(64.0, "--max-body-mb", help="Largest request body (413 beyond; chunked too)."),
    drain_seconds: float = typer.Option(10.0, "--drain-seconds",
                                        help="On SIGTERM, requests in flight get this long before the server stops."),
    host: str = typer.Option("127.0.0.1", "--host", help="Bind address; loopback by default."),
    port: int = typer.Option(30100, "--port", help="Port; 0 picks a free one (the address is printed)."),
    api_key: str | None = typer.Option(None, "--api-key", envvar="VLRL_API_KEY", show_envvar=True,
                                       help="Bearer token clients must send; unset: a random one is generated and printed."),
    no_auth: bool = typer.Option(False, "--no-auth", help="Accept requests without a token (loopback addresses only)."),
) -> None:
    """Serve foreground-preserving image synthesis: POST /jobs, GET /jobs/{id}, GET /jobs?ids=…, GET /health."""
    from vlrl.synth.schema import SynthSettings
    from vlrl.synth.server import serve as run_server

    if executor not in ("process", "thread"):
        typer.secho("vlrl synth serve: --executor must be process or thread", fg="red", err=True)
        raise typer.Exit(2)
    settings = SynthSettings(backend=backend, backend_options=_options(backend_option, "--backend-option"),
                             segmenter=segmenter, segmenter_options=_options(segmenter_option, "--segmenter-option"),
                             workers=workers, executor=executor, max_queued_jobs=max_queued_jobs,
                             max_queued_per_client=max_queued_per_client, job_timeout=job_timeout,
                             results_dir=results_dir, max_results_bytes=int(max_results_mb * (1 << 20)),
                             max_image_side=max_image_side, max_body_bytes=int(max_body_mb * (1 << 20)),
                             drain_seconds=drain_seconds)
    try:
        run_server(settings, host=host, port=port, api_key=api_key, no_auth=no_auth)
    except (ValueError, RuntimeError) as err:
        typer.secho(f"vlrl synth serve: {err}", fg="red", err=True)
        raise typer.Exit(2) from None
