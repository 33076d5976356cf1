"""The HTTP application of the synthesis server (`vlrl.synth.server`): `create_app` over one `JobService` —
the error handlers, ``POST /jobs`` (`_submit_route`) and the status routes (``/health``, ``GET /jobs``,
``/jobs/{id}``, ``/jobs/{id}/image``) — and `client_identity`, who a request comes from for the queue's fair shares.
"""

from __future__ import annotations

import base64
from typing import Any, Protocol

from vlrl.serving import (
    BodyError,
    BodyParser,
    encode_json,
    explain_validation_error,
    on_close,
    peer_identity,
    protect,
)
from vlrl.synth.schema import BadRequest, JobBody, QueueFull, SynthSettings, parse_job


class JobService(Protocol):
    """What the routes ask of the service behind them (`vlrl.synth.server.SynthService`)."""

    settings: SynthSettings

    def submit(self, image: Any, keep: Any, boxes: list[list[float]], description: str, seed: int,
               refine: bool = True, *, client: str = "local") -> Any: ...

    def health(self) -> dict[str, Any]: ...

    def get(self, job_id: str) -> Any: ...

    def result(self, job: Any) -> bytes | None: ...


def client_identity(request: Any) -> str:
    """Who a request comes from, for the queue's fair shares: ``sha256(bearer token)[:8]@peer host``, and on a
    loopback connection ``#pid`` of the peer process (`vlrl.serving.peer_identity`: what the server can see of a
    local client — one shared key no longer makes every local process one client). The token is the only
    credential a client cannot forge; the address (a peer address, not a header: ``X-Forwarded-For`` is the
    client's to write) and the local process tell apart the holders of one shared token."""
    import hashlib

    token = request.headers.get("authorization", "")
    return f"{hashlib.sha256(token.encode()).hexdigest()[:8]}@{peer_identity(request.scope)}"


def create_app(service: JobService, *, api_key: str | None) -> Any:
    """The FastAPI application of ``service``. ``api_key=None`` disables authentication. Bodies are bounded by
    ``max_body_bytes`` as they are received (`vlrl.serving.BodyLimit`) and parsed off the event loop
    (`vlrl.serving.BodyParser`); an unexpected error answers 500 with an id, never a traceback."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    class SafeJSON(JSONResponse):
        def render(self, content: Any) -> bytes:
            return encode_json(content)

    app = FastAPI(title="vlrl synthesis server", default_response_class=SafeJSON)
    settings = service.settings
    # a job is an image, at most max_boxes boxes of 4 numbers, masks, a description and a seed
    parser = BodyParser(max_values=8 * settings.max_boxes + 4096, max_string_chars=max(settings.max_description_chars, 4096))
    on_close(app, parser.close)
    protect(app, api_key=api_key, max_body_bytes=settings.max_body_bytes,
            setting="max_body_bytes; vlrl synth serve --max-body-mb")
    _error_handlers(app, SafeJSON)
    app.router.add_route("/jobs", _submit_route(service, parser, SafeJSON), methods=["POST"])
    _job_routes(app, service)
    return app


def _error_handlers(app: Any, answer: type) -> None:
    """400 with the message for a body FastAPI rejects and for a `BadRequest`."""
    from fastapi import Request
    from fastapi.exceptions import RequestValidationError

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError):
        return answer({"error": explain_validation_error(err)}, 400)

    @app.exception_handler(BadRequest)
    async def _bad(request: Request, err: BadRequest):
        return answer({"error": str(err)}, 400)


def _submit_route(service: JobService, parser: BodyParser, answer: type) -> Any:
    """``POST /jobs``: parse and check the body, queue the job (202), or 429 when the queue is full."""
    import asyncio

    from fastapi import Request
    from pydantic import ValidationError

    settings = service.settings

    async def submit(request: Request):  # (a plain Starlette route: the raw body is read, not injected)
        if "json" not in request.headers.get("content-type", ""):
            raise BadRequest("the body must be a JSON object sent with Content-Type: application/json")
        try:
            payload = await parser.parse(await request.body(), base64_fields=("image", "masks"))
        except BodyError as err:
            raise BadRequest(str(err)) from None
        if not isinstance(payload, dict):
            raise BadRequest("the body must be a JSON object sent with Content-Type: application/json")
        try:
            body = await asyncio.to_thread(JobBody.model_validate, payload)
        except ValidationError as err:
            raise BadRequest(explain_validation_error(err)) from None
        image, keep, boxes = await asyncio.to_thread(parse_job, body, settings)
        client = await asyncio.to_thread(client_identity, request)  # (reads /proc once per loopback connection)
        try:
            job = service.submit(image, keep, boxes, body.description.strip(), body.seed, body.refine, client=client)
        except QueueFull as err:
            return answer({"error": f"server busy: {err}"}, 429, headers={"Retry-After": "1"})
        return answer({"id": job.id, "status": job.status, "queued": service.health()["queued"]}, 202,
                      headers={"Location": f"/jobs/{job.id}"})

    return submit


def _job_routes(app: Any, service: JobService) -> None:
    """``/health``, ``GET /jobs?ids=`` (many statuses), ``GET /jobs/{id}`` and ``GET /jobs/{id}/image``."""
    from fastapi.responses import JSONResponse, Response

    settings = service.settings

    @app.get("/health")
    async def health():
        return service.health()

    def _job(job_id: str):
        job = service.get(job_id)
        if job is None:
            return None, JSONResponse({"error": f"unknown job {job_id!r}"}, 404)
        if job.status == "evicted":
            return None, JSONResponse({"error": f"job {job_id}: its result was deleted by the size cap "
                                                f"(max_results_bytes = {settings.max_results_bytes})"}, 410)
        return job, None

    @app.get("/jobs")
    async def statuses(ids: str = ""):
        """Status of many jobs in one request (``?ids=a,b,c``): what a client polls; no images."""
        wanted = [i for i in ids.split(",") if i][:1000]
        jobs = []
        for job_id in wanted:
            job = service.get(job_id)
            jobs.append({"id": job_id, "status": "unknown"} if job is None else
                        {"id": job_id, "status": job.status, "error": job.error,
                         "metadata": job.metadata if job.status == "done" else None})
        return {"jobs": jobs}

    @app.get("/jobs/{job_id}")
    async def poll(job_id: str, image: bool = True):
        job, error = _job(job_id)
        if error is not None:
            return error
        out = job.public()
        png = service.result(job) if image and job.status == "done" else None
        out["image"] = "data:image/png;base64," + base64.b64encode(png).decode() if png is not None else None
        return out

    @app.get("/jobs/{job_id}/image")
    async def result_image(job_id: str):
        job, error = _job(job_id)
        if error is not None:
            return error
        png = service.result(job)
        if png is None:
            return JSONResponse({"error": f"job {job_id} is {job.status}, no image"}, 409)
        return Response(png, media_type="image/png")
