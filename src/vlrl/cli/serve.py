"""`vlrl serve`: a policy over SGLang's native HTTP API."""

from __future__ import annotations

import typer

from vlrl.cli.app import app
from vlrl.cli.common import ATTN, REVISION, TRUST, load_options, pin_numerics


@app.command()
def serve(
    model: str = typer.Option(..., "--model", help="Model directory (transformers layout), preset name or hub id."),
    host: str = typer.Option("127.0.0.1", "--host", help="Bind address; loopback by default."),
    port: int = typer.Option(30000, "--port", help="Port; 0 picks a free one (the address is printed)."),
    api_key: str | None = typer.Option(None, "--api-key", envvar="VLRL_API_KEY", show_envvar=True,
                                       help="Bearer token clients must send; unset: a random one is generated and printed."),
    no_auth: bool = typer.Option(False, "--no-auth", help="Accept requests without a token (loopback addresses only)."),
    dtype: str = typer.Option("float32", "--dtype", help="float32, bfloat16 or float16."),
    device: str = typer.Option("cpu", "--device", help="Torch device, e.g. cpu or cuda."),
    max_batch_size: int = typer.Option(256, "--max-batch-size", help="Sequences decoded at once."),
    max_queued_requests: int = typer.Option(1024, "--max-queued-requests",
                                            help="Queue bound in samples (prompts × n); further requests get 503."),
    max_new_tokens: int = typer.Option(4096, "--max-new-tokens", help="Largest sampling_params.max_new_tokens accepted."),
    max_tokens_in_flight: int = typer.Option(1 << 20, "--max-tokens-in-flight",
                                             help="Budget of Σ samples × (prompt + max_new_tokens) queued or decoding."),
    max_body_mb: float = typer.Option(32.0, "--max-body-mb", help="Largest request body (413 beyond; chunked too)."),
    max_image_pixels: int = typer.Option(16 << 20, "--max-image-pixels", help="Largest image (pixels, from its header)."),
    max_request_pixels: int = typer.Option(128 << 20, "--max-request-pixels",
                                           help="Pixels of all the images of one request together (from their headers)."),
    max_queued_pixels: int = typer.Option(256 << 20, "--max-queued-pixels",
                                          help="Pixels (from their headers) of the images of every request admitted "
                                          "and not yet answered (503 beyond)."),
    max_queued_pixels_per_client: int | None = typer.Option(None, "--max-queued-pixels-per-client", help="What one "
        "client (address; on loopback its process) may hold of it (default: half, at least --max-request-pixels)."),
    max_inflight_body_mb: float = typer.Option(256.0, "--max-inflight-body-mb",
                                               help="Request bytes held at once over all requests, reserved as they "
                                               "arrive (503 beyond)."),
    body_timeout: float = typer.Option(60.0, "--body-timeout", help="Seconds a client may take to send a body (408)."),
    first_byte_timeout: float = typer.Option(10.0, "--first-byte-timeout",
                                             help="Seconds within which a declared body's first byte must arrive (408)."),
    join_timeout: float = typer.Option(120.0, "--join-timeout",
                                       help="Seconds an /init_weights_update_group may wait for the group's ranks."),
    admin_api_key: str | None = typer.Option(None, "--admin-api-key", envvar="VLRL_ADMIN_API_KEY", show_envvar=True,
                                             help="Key the weight and pause routes require instead of the API key "
                                             "(SGLang's --admin-api-key)."),
    request_timeout: float = typer.Option(600.0, "--request-timeout",
                                          help="Seconds after which a request is aborted at the next decode step."),
    image_root: list[str] | None = typer.Option(None, "--image-root", help="Directory whose files image_data may "
                                                "name by path (repeatable; default: no server paths)."),
    drain_seconds: float = typer.Option(30.0, "--drain-seconds",
                                        help="On SIGTERM, requests in flight get this long; the rest are aborted."),
    batch_window_ms: float = typer.Option(10.0, "--batch-window-ms",
                                          help="Wait while requests keep arriving at most this far apart before decoding."),
    threads: int | None = typer.Option(None, "--threads", help="torch CPU threads (default: torch's choice)."),
    init_seed: int = typer.Option(0, "--init-seed", help="Seed of a tiny preset's random initialisation."),
    numerics: str = typer.Option("native", "--numerics", help="CPU kernels: native, portable or auto (the trainer's "
                                 "numerics, for log-probs computed with the same kernels)."),
    attn_implementation: str | None = ATTN,
    revision: str | None = REVISION,
    trust_remote_code: bool | None = TRUST,
) -> None:
    """Serve a policy over SGLang's native HTTP API (/generate, /update_weights_from_disk, /health, /server_info, ...)."""
    pin_numerics("serve", numerics)
    import torch

    from vlrl.check import model_path_problem
    from vlrl.rollout.server import ServeLimits
    from vlrl.rollout.server import serve as run_server

    if model_path_problem(model):
        typer.secho(f"vlrl serve: --model {model_path_problem(model)}", fg="red", err=True)
        raise typer.Exit(2)
    if threads:
        torch.set_num_threads(threads)
    try:
        limits = ServeLimits(max_new_tokens=max_new_tokens, max_body_bytes=int(max_body_mb * (1 << 20)),
                             max_image_pixels=max_image_pixels, request_timeout=request_timeout,
                             image_roots=tuple(image_root or ()), drain_seconds=drain_seconds,
                             max_request_pixels=max_request_pixels, max_queued_pixels=max_queued_pixels,
                             max_queued_pixels_per_client=max_queued_pixels_per_client,
                             max_inflight_body_bytes=int(max_inflight_body_mb * (1 << 20)), body_timeout=body_timeout,
                             first_byte_timeout=first_byte_timeout, join_timeout=join_timeout)
        run_server(model, host=host, port=port, api_key=api_key, no_auth=no_auth, dtype=dtype, device=device,
                   max_batch_size=max_batch_size, max_queued_requests=max_queued_requests,
                   batch_window_ms=batch_window_ms, init_seed=init_seed, max_tokens_in_flight=max_tokens_in_flight,
                   limits=limits, admin_api_key=admin_api_key,
                   options=load_options("serve", attn_implementation, revision, trust_remote_code, None))
    except (ValueError, OSError) as err:  # OSError: a model that cannot be read (no hub, missing files)
        typer.secho(f"vlrl serve: {err}", fg="red", err=True)
        raise typer.Exit(2) from None
