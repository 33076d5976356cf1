"""What vlrl's HTTP services share (`vlrl serve`, `vlrl synth serve`): loopback checks, listening sockets,
bearer-token authentication, request bounds, JSON bodies parsed off the event loop, error answers, and running
uvicorn with a bounded drain on SIGTERM.

Both services bind to loopback and require ``Authorization: Bearer <key>`` on every endpoint but
``/health`` by default; ``--no-auth`` is refused on a non-loopback address.

Every request passes, outermost first (`protect`):

- `ErrorBoundary`: an unexpected error is answered ``500 {"error": "internal server error (id …)"}``; the
  traceback goes to the server's log under that id, never to the client;
- `BearerAuth`: ``401`` without the token (before any body is read); with an admin key, the admin routes take
  that key and only it (SGLang's ``--admin-api-key``);
- `BodyLimit`: ``413`` once the body passes ``max_body_bytes`` — counted on the bytes received, so a chunked
  body (no ``Content-Length``) is stopped as early as a declared one; ``408`` when its first byte is not there
  within ``first_byte_timeout`` or the whole of it within ``body_timeout``; ``503`` when the bytes of every request
  held at once would pass ``max_inflight_bytes`` (bytes are reserved as they arrive — a declared length reserves
  nothing — and count until the request is answered). The application sees the body only once it is whole and
  within the limits.

`BodyParser` turns a body into JSON off the event loop: a small body in a thread, a large one in a worker
process (``json.loads`` holds the GIL for its whole run — 2.4 s for 14 MB of ``[[],[],…]`` measured here — so a
thread would stall every other request, ``/health`` included). The worker refuses a body with more JSON values
than the caller allows and base64-decodes the image fields it is told of, so the event loop's process only
unpickles a bounded result.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import collections
import ipaddress
import json
import logging
import multiprocessing
import os
import re
import secrets
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any

API_KEY_ENV = "VLRL_API_KEY"
ADMIN_API_KEY_ENV = "VLRL_ADMIN_API_KEY"  # `vlrl serve --admin-api-key`'s variable (the client reads it too)
log = logging.getLogger(__name__)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket (``port=0`` picks a free port: read it with ``sock.getsockname()[1]``).

    Created with ``proto=IPPROTO_TCP``, not the default 0: asyncio sets ``TCP_NODELAY`` only on sockets that say
    they are TCP, and the connections accepted here inherit the listener's ``proto``. Without it every answer
    (headers, then body: two writes) waited for the client's delayed ACK — 48 ms per request measured here."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
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


# ----------------------------------------------------------------------------------------------- who is calling
_PEERS: collections.OrderedDict[tuple, int | None] = collections.OrderedDict()  # (client, server) → PID, latest last
_PEERS_LOCK = threading.Lock()


def loopback_peer_pid(client: tuple[str, int], server: tuple[str, int]) -> int | None:
    """The PID of the process at the other end of a loopback TCP connection (``client`` its address and port,
    ``server`` ours), or None where it cannot be seen (not loopback, not Linux, another user's process without
    root): its socket's inode from ``/proc/net/tcp{,6}``, then the process holding that inode among those of the
    socket's user. Cached per connection (a few ms for ~100 processes, once)."""
    if not is_loopback(client[0]):
        return None
    key = (tuple(client), tuple(server))
    with _PEERS_LOCK:
        if key in _PEERS:
            _PEERS.move_to_end(key)
            return _PEERS[key]
    found = _socket_owner(*_socket_inode(client, server))
    with _PEERS_LOCK:
        _PEERS[key] = found
        while len(_PEERS) > 4096:
            _PEERS.popitem(last=False)
    return found


def peer_identity(scope: dict) -> str:
    """Who an HTTP request comes from, as far as the server can see: its peer host, and on a loopback connection
    ``#pid`` of the peer process (`loopback_peer_pid`) — for the servers' fair shares."""
    client, server = scope.get("client"), scope.get("server")
    if not client:
        return "unknown"
    pid = loopback_peer_pid((client[0], client[1]), (server[0], server[1])) if server else None
    return client[0] + (f"#{pid}" if pid is not None else "")


def _proc_address(host: str, port: int) -> str:
    """``host:port`` as ``/proc/net/tcp{,6}`` writes it (each 32-bit word in host byte order, hex)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    raw = socket.inet_pton(family, host)
    words = [raw[i:i + 4] for i in range(0, len(raw), 4)]
    return "".join(w[::-1].hex().upper() if sys.byteorder == "little" else w.hex().upper() for w in words) + \
        f":{port:04X}"


def _socket_inode(client: tuple[str, int], server: tuple[str, int]) -> tuple[int | None, int | None]:
    """(inode, uid) of the client's end of the connection ``client`` → ``server``, from ``/proc/net/tcp{,6}``."""
    try:
        local, remote = _proc_address(*client), _proc_address(*server)
    except (OSError, ValueError):
        return None, None
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table, encoding="ascii") as f:
                for line in f:
                    fields = line.split()
                    if len(fields) > 9 and fields[1] == local and fields[2] == remote:
                        return int(fields[9]), int(fields[7])
        except (OSError, ValueError):
            continue
    return None, None


def _socket_owner(inode: int | None, uid: int | None) -> int | None:
    """The PID whose descriptors hold socket ``inode`` (only the processes of ``uid`` are looked at)."""
    if not inode:
        return None
    target = f"socket:[{inode}]"
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if uid is not None and os.stat(f"/proc/{name}").st_uid != uid:
                continue
            for fd in os.listdir(f"/proc/{name}/fd"):
                if os.readlink(f"/proc/{name}/fd/{fd}") == target:
                    return int(name)
        except OSError:  # gone, or not ours to read
            continue
    return None


# ----------------------------------------------------------------------------------------------- ASGI layers
def encode_json(payload: Any) -> bytes:
    """JSON bytes that always encode: non-ASCII escaped (a lone surrogate too), NaN/inf refused (ValueError)."""
    return json.dumps(payload, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode()


async def send_json(send: Callable, status: int, payload: Any, headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
    body = encode_json(payload)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


def _header(scope: dict, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


class Budget:
    """A quantity a server holds at once — request bytes (`BodyLimit`), the decoded pixels of queued requests —
    at most ``limit`` in all (None: unbounded) and, with ``share``, at most that much per client (who holds what
    is counted by the ``client`` named in `reserve`); ``peak``: the most it ever held. Thread-safe."""

    def __init__(self, limit: int | None = None, share: int | None = None) -> None:
        self.limit, self.share, self.held, self.peak = limit, share, 0, 0
        self._by_client: dict[str, int] = {}
        self._lock = threading.Lock()

    def reserve(self, amount: int, client: str | None = None) -> bool:
        with self._lock:
            if self.limit is not None and self.held + amount > self.limit:
                return False
            if client is not None and self.share is not None and self._by_client.get(client, 0) + amount > self.share:
                return False
            self.held += amount
            self.peak = max(self.peak, self.held)
            if client is not None:
                self._by_client[client] = self._by_client.get(client, 0) + amount
            return True

    def release(self, amount: int, client: str | None = None) -> None:
        with self._lock:
            self.held -= amount
            if client is not None:
                left = self._by_client.get(client, 0) - amount
                if left > 0:
                    self._by_client[client] = left
                else:
                    self._by_client.pop(client, None)

    def held_by(self, client: str) -> int:
        with self._lock:
            return self._by_client.get(client, 0)


class BodyLimit:
    """Read the whole body before the application runs, answering 413 as soon as it passes ``max_bytes``
    (a ``Content-Length`` over the limit is refused before anything is read), 408 when its first byte has not
    arrived within ``first_byte_timeout`` seconds or the whole of it within ``body_timeout``, and 503 when the bytes
    held for every request at once would pass the ``budget``. Bytes are reserved as they arrive — a declared
    length reserves nothing, so connections that declare 32 MB and send nothing hold nothing — and released when
    the request is answered or its client goes."""

    def __init__(self, app: Any, *, max_bytes: int, setting: str = "max_body_bytes", body_timeout: float | None = None,
                 budget: Budget | None = None, first_byte_timeout: float | None = None) -> None:
        self.app, self.max_bytes, self.setting = app, max_bytes, setting
        self.body_timeout, self.budget = body_timeout, budget or Budget()
        self.first_byte_timeout = first_byte_timeout

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = _header(scope, b"content-length")
        if declared is not None and (not declared.strip().isdigit() or int(declared) > self.max_bytes):
            return await self._refuse(send, declared)
        await self._read_and_run(scope, receive, send, expect_body=declared is None or int(declared) > 0)

    def _wait_limit(self, loop: Any, started: float, size: int, expect_body: bool) -> float | None:
        """Seconds the next body message may take: to the body deadline, or the first byte's while none came."""
        ends = [started + self.body_timeout] if self.body_timeout is not None else []
        if size == 0 and expect_body and self.first_byte_timeout is not None:
            ends.append(started + self.first_byte_timeout)
        return max(0.0, min(ends) - loop.time()) if ends else None

    async def _read_and_run(self, scope: dict, receive: Callable, send: Callable, expect_body: bool) -> None:
        chunks, size, held = [], 0, 0
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            while True:
                wait = self._wait_limit(loop, started, size, expect_body)
                try:
                    message = await (asyncio.wait_for(receive(), wait) if wait is not None else receive())
                except asyncio.TimeoutError:
                    first = size == 0 and expect_body and self.first_byte_timeout is not None and (
                        self.body_timeout is None or self.first_byte_timeout < self.body_timeout)
                    what = (f"the first byte of the request body did not arrive within {self.first_byte_timeout:g} s"
                            if first else f"the request body did not arrive within {self.body_timeout:g} s")
                    return await send_json(send, 408, {"error": what})
                if message["type"] != "http.request":  # http.disconnect: the client left while sending
                    return
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > self.max_bytes:
                    return await self._refuse(send, None)
                if chunk:  # held as it comes
                    if not self.budget.reserve(len(chunk)):
                        return await self._busy(send)
                    held += len(chunk)
                    chunks.append(chunk)
                if not message.get("more_body", False):
                    break
            body, replayed = b"".join(chunks), False
            chunks.clear()

            async def replay() -> dict:
                nonlocal replayed
                if not replayed:
                    replayed = True
                    return {"type": "http.request", "body": body, "more_body": False}
                return await receive()  # then: http.disconnect when the client goes away

            await self.app(scope, replay, send)
        finally:
            self.budget.release(held)

    async def _busy(self, send: Callable) -> None:
        await send_json(send, 503, {"error": f"server busy: request bodies held at once would exceed "
                                             f"{self.budget.limit} bytes"}, [(b"retry-after", b"1")])

    async def _refuse(self, send: Callable, declared: str | None) -> None:
        size = f" of {declared} bytes" if declared is not None else ""
        await send_json(send, 413, {"error": f"request body{size} exceeds the server's limit of {self.max_bytes} bytes "
                                             f"({self.setting})"})


class BearerAuth:
    """Answer 401 to every request without ``Authorization: Bearer <api_key>`` except on ``open_paths``. With
    ``admin_api_key``, the ``admin_paths`` require that key and only it (SGLang's ``--admin-api-key``: the API key
    does not open them); ``api_key`` None leaves the other paths open."""

    def __init__(self, app: Any, *, api_key: str | None, open_paths: Iterable[str] = ("/health",),
                 admin_api_key: str | None = None, admin_paths: Iterable[str] = ()) -> None:
        self.app, self.open_paths = app, frozenset(open_paths)
        self.expected = f"Bearer {api_key}".encode() if api_key is not None else None
        self.admin = f"Bearer {admin_api_key}".encode() if admin_api_key is not None else None
        self.admin_paths = frozenset(admin_paths)

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            admin = self.admin is not None and scope["path"] in self.admin_paths
            expected = self.admin if admin else self.expected
            given = (_header(scope, b"authorization") or "").encode("latin-1")
            if expected is not None and not secrets.compare_digest(given, expected):
                which = "admin key (--admin-api-key)" if admin else "key"
                return await send_json(send, 401, {"error": f"missing or wrong bearer token (Authorization: Bearer "
                                                            f"<{which}>)"})
        await self.app(scope, receive, send)


class ErrorBoundary:
    """An exception escaping the application becomes ``500 {"error": "internal server error (id …)"}``; the
    traceback is logged under that id. Nothing of it (paths, file contents, input) reaches the client."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracking_send(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception:  # noqa: BLE001  (anything: the client gets an id, the log the details)
            error_id = secrets.token_hex(6)
            log.exception("%s %s failed (error id %s)", scope.get("method"), scope.get("path"), error_id)
            if not started:
                await send_json(send, 500, {"error": f"internal server error (id {error_id}); the server log has "
                                                     "the details"})


DEFAULT_INFLIGHT_BYTES = 256 << 20
DEFAULT_BODY_TIMEOUT = 60.0
DEFAULT_FIRST_BYTE_TIMEOUT = 10.0


def protect(app: Any, *, api_key: str | None, max_body_bytes: int, setting: str = "max_body_bytes",
            open_paths: Iterable[str] = ("/health",), admin_api_key: str | None = None, admin_paths: Iterable[str] = (),
            max_inflight_bytes: int | None = DEFAULT_INFLIGHT_BYTES, body_timeout: float | None = DEFAULT_BODY_TIMEOUT,
            first_byte_timeout: float | None = DEFAULT_FIRST_BYTE_TIMEOUT) -> None:
    """Wrap ``app`` in `ErrorBoundary` → `BearerAuth` (unless both keys are None) → `BodyLimit` (its `Budget`:
    ``app.state.body_bytes``). The body bounds' defaults are both servers' (`vlrl serve` sets its own)."""
    app.state.body_bytes = Budget(max_inflight_bytes)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes, setting=setting,  # innermost
                       budget=app.state.body_bytes, body_timeout=body_timeout, first_byte_timeout=first_byte_timeout)
    if api_key is not None or admin_api_key is not None:
        app.add_middleware(BearerAuth, api_key=api_key, open_paths=open_paths, admin_api_key=admin_api_key,
                           admin_paths=admin_paths)
    app.add_middleware(ErrorBoundary)  # outermost


def explain_validation_error(err: Any) -> str:
    """A pydantic ``ValidationError`` (or FastAPI's) as one readable line per problem, naming the field."""
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


# ----------------------------------------------------------------------------------------------- JSON bodies
class BodyError(ValueError):
    """A body that is not acceptable JSON (the message says why; answered 400)."""


_DATA_URL = re.compile(r"^data:[a-zA-Z0-9.+/-]*;base64,")
INLINE_BASE64_CHARS = 4096  # a shorter image string may be a server path: left to the application


def parse_json_body(raw: bytes, *, max_values: int, max_string_chars: int,
                    base64_fields: tuple[str, ...] = ()) -> tuple[Any, str | None]:
    """``(payload, None)`` or ``(None, why)``: ``raw`` parsed as JSON, refused if it holds more than
    ``max_values`` JSON values (numbers, strings, lists, objects — what parsing and validating cost in
    proportion to) or a string longer than ``max_string_chars`` outside ``base64_fields``; every string under a
    top-level key in ``base64_fields`` that is a base64 data URL, or plain base64 longer than
    `INLINE_BASE64_CHARS`, is replaced by its decoded bytes (an invalid one is left as it is: the application
    names it). So what comes back is bounded. Runs in a worker process or thread; never raises."""
    try:
        payload = json.loads(raw)
    except RecursionError:
        return None, "invalid JSON: nested too deeply"
    except (ValueError, UnicodeDecodeError) as err:
        return None, f"invalid JSON: {err}"
    count, stack = 1, [("", payload)]
    while stack:
        field, node = stack.pop()
        if isinstance(node, (list, dict)):
            count += len(node)
            if count > max_values:
                return None, f"the body holds more than {max_values} JSON values (the server's limit for one request)"
            if isinstance(node, list):
                stack.extend((field, item) for item in node)
            else:
                stack.extend((field or str(key), item) for key, item in node.items())
        elif isinstance(node, str) and len(node) > max_string_chars and field not in base64_fields:
            return None, (f"field '{field}': a string of {len(node)} characters; this server takes at most "
                          f"{max_string_chars}")
    if isinstance(payload, dict):
        for key in base64_fields:
            if key in payload:
                payload[key] = _decode_base64(payload[key])
    return payload, None


def _decode_base64(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode_base64(v) for v in value]
    if not isinstance(value, str):
        return value
    match = _DATA_URL.match(value)
    if match is None and len(value) <= INLINE_BASE64_CHARS:
        return value
    try:
        return base64.b64decode(value[match.end():] if match else value, validate=True)
    except (binascii.Error, ValueError):
        return value


def _parser_worker_init() -> None:
    import gc
    import resource

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    gc.disable()  # parsed JSON holds no cycles; the collector tripled json.loads' time on 5M small lists
    limit = 8 << 30  # a body that would take more memory than this to parse is refused (the worker dies)
    try:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    except (ValueError, OSError):
        pass


class BodyParser:
    """`parse_json_body` off the event loop: bodies up to ``inline_bytes`` in a thread (a bounded stall: ≲ 40 ms
    for the worst 256 KiB measured here), larger ones in one worker process (pebble, forkserver; started at the
    first large body) that is killed and replaced after ``timeout`` seconds or when it dies."""

    def __init__(self, *, max_values: int, max_string_chars: int, inline_bytes: int = 256 << 10,
                 timeout: float = 30.0) -> None:
        self.max_values, self.max_string_chars = max_values, max_string_chars
        self.inline_bytes, self.timeout = inline_bytes, timeout
        self._pool = None
        self._lock = threading.Lock()

    async def parse(self, raw: bytes, *, base64_fields: tuple[str, ...] = ()) -> Any:
        """The JSON payload of ``raw``; `BodyError` saying why not."""
        kwargs = {"max_values": self.max_values, "max_string_chars": self.max_string_chars,
                  "base64_fields": base64_fields}
        if len(raw) <= self.inline_bytes:
            payload, error = await asyncio.to_thread(parse_json_body, raw, **kwargs)
        else:
            from pebble import ProcessExpired

            try:
                future = self._ensure_pool().schedule(parse_json_body, args=(raw,), kwargs=kwargs, timeout=self.timeout)
                payload, error = await asyncio.wrap_future(future)
            except TimeoutError:
                error = f"the body could not be parsed within {self.timeout:g} s"
            except ProcessExpired as err:  # the parser died (out of memory): it is replaced
                log.warning("body parser worker died: %s", err)
                error = "the body could not be parsed within the server's memory limit"
            except Exception:  # the pool itself broke: start a new one for the next request, answer 500 (with an id)
                self.close()
                raise
        if error is not None:
            raise BodyError(error)
        return payload

    def _ensure_pool(self):
        with self._lock:
            if self._pool is None:
                from pebble import ProcessPool

                context = multiprocessing.get_context("forkserver")
                self._pool = ProcessPool(max_workers=1, context=context, initializer=_parser_worker_init)
            return self._pool

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.stop()
            pool.join(timeout=10)


def on_close(app: Any, callback: Callable[[], None]) -> None:
    """Run ``callback`` when the server of ``app`` stops (`ServerThread.stop`, `run_server`)."""
    if not hasattr(app.state, "closers"):
        app.state.closers = []
    app.state.closers.append(callback)


def close_app(app: Any) -> None:
    for callback in getattr(app.state, "closers", []):
        try:
            callback()
        except Exception:  # noqa: BLE001  (shutting down: log and go on)
            log.exception("closing the app")


# ----------------------------------------------------------------------------------------------- running
def _uvicorn_server(app: Any, *, drain_seconds: float, on_drain: Callable[[], None] | None):
    """A uvicorn server whose first SIGTERM/SIGINT (or `ServerThread.stop`) calls ``on_drain`` and then stops
    accepting connections; requests in flight get ``drain_seconds`` (the app's ``on_drain`` aborts what is
    left then) plus a 5 s backstop after which uvicorn cancels them."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            if not self.should_exit and on_drain is not None:
                on_drain()
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=drain_seconds + 5)
    return DrainingServer(config)


def run_server(app: Any, sock: socket.socket, *, drain_seconds: float = 30.0,
               on_drain: Callable[[], None] | None = None) -> None:
    """Serve ``app`` on ``sock`` in this thread until SIGTERM/SIGINT, then drain (see `_uvicorn_server`)."""
    server = _uvicorn_server(app, drain_seconds=drain_seconds, on_drain=on_drain)
    if threading.current_thread() is threading.main_thread():
        # uvicorn re-raises the signal it caught once it has shut down: leave through `finally` blocks (workers
        # stopped, temporary files removed) with exit status 0 instead of dying at once
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        server.run(sockets=[sock])
    finally:
        close_app(app)


class ServerThread:
    """Serve an app with uvicorn on a background thread (tests, notebooks, benchmarks)."""

    def __init__(self, app: Any, *, host: str = "127.0.0.1", port: int = 0, drain_seconds: float = 30.0,
                 on_drain: Callable[[], None] | None = None) -> None:
        self.app = app
        self._sock = bind_socket(host, port)
        self.url = f"http://{host}:{self._sock.getsockname()[1]}"
        self.server = _uvicorn_server(app, drain_seconds=drain_seconds, on_drain=on_drain)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]}, daemon=True)
        self._thread.start()
        for _ in range(500):
            if self.server.started:
                break
            threading.Event().wait(0.01)

    def drain(self) -> None:
        """What SIGTERM does to `run_server`: stop accepting, let requests in flight finish within the bound."""
        self.server.handle_exit(signal.SIGTERM, None)

    def join(self, timeout: float | None = None) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=30)
        self._sock.close()
        close_app(self.app)
