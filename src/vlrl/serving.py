"""What vlrl's HTTP services share (`vlrl serve`, `vlrl synth serve`): loopback checks, listening sockets,
bearer-token authentication, resolving the key, and a uvicorn server on a background thread.

Both services bind to loopback and require ``Authorization: Bearer <key>`` on every endpoint but
``/health`` by default; ``--no-auth`` is refused on a non-loopback address.
"""

from __future__ import annotations

import ipaddress
import secrets
import socket
import threading
from collections.abc import Iterable
from typing import Any

API_KEY_ENV = "VLRL_API_KEY"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket (``port=0`` picks a free port: read it with ``sock.getsockname()[1]``)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def resolve_api_key(api_key: str | None, *, no_auth: bool, host: str, command: str) -> str | None:
    """The key a service requires: ``None`` with ``no_auth`` (loopback only), the given one, or a fresh
    random key that is printed (so a server is never left open by forgetting the key)."""
    if no_auth:
        if not is_loopback(host):
            raise ValueError(f"--no-auth on a non-loopback address ({host}) would serve to anyone")
        return None
    if not api_key:
        api_key = secrets.token_urlsafe(24)
        print(f"{command}: no --api-key and no ${API_KEY_ENV}; generated key: {api_key}", flush=True)
    return api_key


def install_bearer_auth(app: Any, api_key: str | None, *, open_paths: Iterable[str] = ("/health",)) -> None:
    """Answer 401 to every request without ``Authorization: Bearer <api_key>`` except on ``open_paths``.
    ``api_key=None`` leaves the app open."""
    from fastapi.responses import JSONResponse

    if api_key is None:
        return
    expected = f"Bearer {api_key}".encode()
    open_paths = frozenset(open_paths)

    @app.middleware("http")
    async def _auth(request, call_next):
        if request.url.path not in open_paths:
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), expected):
                return JSONResponse({"error": "missing or wrong bearer token (Authorization: Bearer <key>)"}, 401)
        return await call_next(request)


def explain_validation_error(err: Any) -> str:
    """A FastAPI ``RequestValidationError`` as one readable line per problem, naming the field."""
    lines = []
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"] if p != "body") or "(body)"
        if e["type"] == "extra_forbidden":
            lines.append(f"field '{field}': not a field of this request")
        elif e["type"] == "json_invalid":
            lines.append(f"invalid JSON: {e['msg']}")
        elif field == "(body)":
            lines.append("the body must be a JSON object sent with Content-Type: application/json")
        else:
            lines.append(f"field '{field}': {e['msg']}")
    return "; ".join(lines)


class ServerThread:
    """Serve an app with uvicorn on a background thread (tests, notebooks, benchmarks)."""

    def __init__(self, app: Any, *, host: str = "127.0.0.1", port: int = 0) -> None:
        import uvicorn

        self._sock = bind_socket(host, port)
        self.url = f"http://{host}:{self._sock.getsockname()[1]}"
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True)
        self._thread.start()
        for _ in range(500):
            if self._server.started:
                break
            threading.Event().wait(0.01)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)
        self._sock.close()
