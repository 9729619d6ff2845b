"""The coordinator's HTTP server: the run's status page, its JSON API, a live stream and /metrics.

Every response is rendered from the latest snapshot the coordinator built in its own loop, so a
page load never touches the DHT and a thousand open browsers cost the run nothing but bytes: the
JSON is encoded once per snapshot and shared by every request, live streams are capped (the page
falls back to polling), and nothing here can block the coordinator's loop.

Routes (documented for users in docs/status-api.md)::

    GET  /                        the status page (static/index.html; plain JS, no CDN, no build step)
    GET  /static/<file>           the page's files, from this package's static/ folder only
    GET  /api/v1/state            the snapshot as JSON (schema: static/state.schema.json)
    GET  /api/v1/peers            every peer's row, a page at a time, filtered and sorted (the snapshot
                                  holds the most telling 200 of a bigger swarm)
    GET  /api/v1/events           Server-Sent Events: "state" whenever the snapshot changes, "ping" otherwise
    GET  /metrics                 Prometheus text format (coordinator/status/metrics.py)
    GET  /healthz                 "ok"
    POST /api/v1/admin/<action>   runs ``actions[action](body)``; needs ``Authorization: Bearer <admin_token>``

Anything that changes the run needs the admin token (a page anyone can open must not carry a "kill
replica" button that works for anyone); without one the server is read-only. Admin calls need a header a browser never sends
cross-site without a CORS preflight, which this server does not answer, so a page elsewhere cannot
trigger them with a visitor's browser.

What a client can hold is bounded: see :mod:`potluck.coordinator.status.httpserver`.

With ``tls`` the server speaks HTTPS only, so the admin token never crosses the network in clear;
:func:`potluck.coordinator.status.status_tls.status_tls` builds the context from the operator's files or a self-signed certificate kept
in the journal directory, whose fingerprint the coordinator prints for visitors to pin.
"""

from __future__ import annotations

import gzip
import hmac
import io
import json
import math
import re
import socket
import ssl
import threading
import time
import zlib
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from potluck.coordinator.status.httpserver import MAX_BODY, GuardedHTTPServer, Limits, RequestReader, Slot
from potluck.coordinator.status.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from potluck.coordinator.status.metrics import render as render_metrics
from potluck.coordinator.status.peerpage import peer_page_rows, peer_query
from potluck.protos.net.errors import bind_error
from potluck.protos.runtime.log import get_logger

log = get_logger(__name__)

API = "potluck.status/v1"
STATIC_DIR = Path(__file__).resolve().with_name("static")
_STATIC_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_ACTION_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]*$")
_TYPES = {
    ".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8",
    ".json": "application/json", ".svg": "image/svg+xml", ".png": "image/png", ".ico": "image/x-icon",
    ".txt": "text/plain; charset=utf-8",
}
# The page uses no inline script or style markup and no third-party origin; peer names are text, never HTML.
_CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")

Action = Callable[[dict[str, Any]], dict[str, Any]]


def dumps(obj: Any) -> bytes:
    """Strict JSON (browsers reject NaN/Infinity): non-finite numbers become null."""
    try:
        return json.dumps(obj, allow_nan=False, separators=(",", ":")).encode()
    except ValueError:
        return json.dumps(_finite(obj), allow_nan=False, separators=(",", ":")).encode()


def _finite(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


class _Encoded:
    """One snapshot encoded once, shared by every request until the coordinator builds the next.

    Top-level keys starting with ``_`` are the coordinator's, not the API's (``_peers``: every peer's row,
    which ``/api/v1/peers`` pages through and ``/metrics`` reports)."""

    def __init__(self, key: tuple[int, Any], snap: dict[str, Any]) -> None:
        self.key, self.snap = key, snap
        self.body = dumps({k: v for k, v in snap.items() if not k.startswith("_")})
        self._gz: bytes | None = None
        self._metrics: bytes | None = None
        self._orders: dict[tuple[str, str, str], list[dict[str, Any]]] = {}  # (sort, state, q) -> rows
        self._lock = threading.Lock()

    def peers(self, sort: str, state: str, q: str) -> list[dict[str, Any]]:
        """Every peer's row that ``state`` and ``q`` select, in ``sort`` order (kept for the next page's request)."""
        key = (sort, state, q)
        with self._lock:
            rows = self._orders.get(key)
        if rows is None:
            rows = peer_page_rows(self.snap.get("_peers", self.snap.get("peers") or []), sort, state, q)
            with self._lock:
                if len(self._orders) >= 16:
                    self._orders.clear()
                self._orders[key] = rows
        return rows

    @property
    def gz(self) -> bytes:
        if self._gz is None:
            self._gz = gzip.compress(self.body, compresslevel=5)
        return self._gz

    @property
    def metrics(self) -> bytes:
        """The snapshot in the Prometheus text format, rendered on the first scrape."""
        if self._metrics is None:
            self._metrics = render_metrics(self.snap).encode()
        return self._metrics


class StatusServer:
    """Serves ``snapshot()`` (a JSON-able dict, ``{}`` until the first one is built) over HTTP, or HTTPS with ``tls``.

    ``actions`` maps an admin action name to a callable taking the request's JSON object and
    returning a JSON-able dict; a ``ValueError`` it raises becomes a 400 with its message.
    ``stream_interval_s`` bounds how often one live stream pushes a state (the coordinator rebuilds
    its snapshot every tick, far more often than anyone reads it); ``max_streams`` caps concurrent
    live streams, each holding one thread; ``limits`` bounds everything else a client can hold.
    """

    def __init__(
        self,
        host: str,
        port: int,
        snapshot: Callable[[], dict[str, Any]],
        *,
        admin_token: str | None = None,
        actions: dict[str, Action] | None = None,
        stream_interval_s: float = 1.0,
        ping_s: float = 5.0,
        max_streams: int = 64,
        tls: ssl.SSLContext | None = None,
        limits: Limits = Limits(),
    ) -> None:
        self.snapshot = snapshot
        self.admin_token = admin_token or None
        self.actions: dict[str, Action] = dict(actions or {})
        bad = [a for a in self.actions if not _ACTION_NAME.match(a)]
        if bad:
            raise ValueError(f"admin action names must match {_ACTION_NAME.pattern}: {bad}")
        self.stream_interval_s, self.ping_s = stream_interval_s, ping_s
        self._streams = threading.BoundedSemaphore(max_streams)
        self._stopping = threading.Event()
        self._cache_lock = threading.Lock()
        self._cache: _Encoded | None = None

        try:
            self.httpd = GuardedHTTPServer((host, port), _handler(self), limits, tls)
        except OSError as err:
            raise bind_error(err, "status port", host, port, "--status-port", "coordinator.status_port") from None
        self.host, self.tls = host, tls
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve, name="status-http", daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("", "0.0.0.0") else self.host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}/"

    def encoded(self) -> _Encoded | None:
        """The current snapshot as JSON bytes, or None while the coordinator has not built one."""
        snap = self.snapshot()
        if not snap:
            return None
        key = (id(snap), snap.get("generated_at"))
        with self._cache_lock:
            if self._cache is None or self._cache.key != key:
                self._cache = _Encoded(key, snap)
            return self._cache

    def stop(self) -> None:
        """Stop serving; open live streams end within one stream interval. Safe to call twice."""
        self._stopping.set()
        self.httpd.wake()
        self.thread.join(timeout=5.0)
        self.httpd.server_close()


def _handler(server: StatusServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "potluck-status"
        sys_version = ""

        def __init__(self, request: socket.socket, client_address: Any, httpd: GuardedHTTPServer, slot: Slot,
                     deadline: float) -> None:
            self.slot, self.deadline, self.limits = slot, deadline, httpd.limits
            super().__init__(request, client_address, httpd)  # serves the request

        def setup(self) -> None:
            super().setup()
            self.connection.settimeout(self.limits.write_s)
            self.rfile.close()  # the plain socket file: reads go through the request's deadline instead
            self.rfile = io.BufferedReader(RequestReader(self.connection, self.deadline, self.limits))

        # ---------------------------------------------------------------- routing

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path in ("/", "/index.html"):
                self._static("index.html")
            elif path.startswith("/static/"):
                self._static(path[len("/static/"):])
            elif path == "/favicon.ico":  # browsers ask for it on every page, the JSON and /metrics included
                self._static("favicon.svg")
            elif path == "/api/v1/state":
                self._state()
            elif path == "/api/v1/peers":
                self._peers()
            elif path == "/api/v1/events":
                self._stream()
            elif path == "/metrics":
                self._metrics()
            elif path == "/healthz":
                self._send(200, "text/plain; charset=utf-8", b"ok\n")
            elif path.startswith("/api/v1/admin/"):
                self._json(405, {"error": "admin actions are POST requests"}, extra={"Allow": "POST"})
            else:
                self._send(404, "text/plain; charset=utf-8", f"no such page: {path}\n".encode())

        def do_POST(self) -> None:
            path = self.path.split("?", 1)[0]
            if path.startswith("/api/v1/admin/"):
                self._admin(path[len("/api/v1/admin/"):])
            elif path in ("/", "/api/v1/state", "/api/v1/peers", "/api/v1/events", "/metrics", "/healthz"):
                self._json(405, {"error": f"{path} is read with GET"}, extra={"Allow": "GET"})
            else:
                self._json(404, {"error": f"no such endpoint: {path}"})

        # ---------------------------------------------------------------- read-only routes

        def _static(self, name: str) -> None:
            name = unquote(name)
            path = STATIC_DIR / name
            # One plain file name, directly inside static/: no separators, no dot-files, no "..".
            if not _STATIC_NAME.match(name) or ".." in name or path.resolve().parent != STATIC_DIR or not path.is_file():
                self._send(404, "text/plain; charset=utf-8", b"no such file\n")
                return
            ctype = _TYPES.get(path.suffix, "application/octet-stream")
            extra = {"Content-Security-Policy": _CSP} if path.suffix == ".html" else {}
            self._send(200, ctype, path.read_bytes(), extra=extra, cache="no-cache")

        def _state(self) -> None:
            enc = server.encoded()
            if enc is None:
                self._json(503, {"error": "the coordinator has not built its first snapshot yet"},
                           extra={"Retry-After": "1"})
            elif self._accepts_gzip():
                self._send(200, "application/json", enc.gz, extra={"Content-Encoding": "gzip", "Vary": "Accept-Encoding"})
            else:
                self._send(200, "application/json", enc.body, extra={"Vary": "Accept-Encoding"})

        def _peers(self) -> None:
            """A page of every peer's row: ``?offset=0&limit=50&sort=-tokens_per_s&state=live&q=text``."""
            try:
                query = peer_query(self.path.split("?", 1)[1] if "?" in self.path else "")
            except ValueError as err:
                self._json(400, {"error": str(err)})
                return
            enc = server.encoded()
            if enc is None:
                self._json(503, {"error": "the coordinator has not built its first snapshot yet"},
                           extra={"Retry-After": "1"})
                return
            rows = enc.peers(query["sort"], query["state"], query["q"])
            offset, limit = query["offset"], query["limit"]
            body = dumps({"api": API, "generated_at": enc.snap.get("generated_at"), "total": len(rows),
                          "known": len(enc.snap.get("_peers", enc.snap.get("peers") or [])), "offset": offset,
                          "limit": limit, "sort": query["sort"], "state": query["state"], "q": query["q"],
                          "peers": rows[offset:offset + limit]})
            if self._accepts_gzip():
                self._send(200, "application/json", gzip.compress(body, compresslevel=5),
                           extra={"Content-Encoding": "gzip", "Vary": "Accept-Encoding"})
            else:
                self._send(200, "application/json", body, extra={"Vary": "Accept-Encoding"})

        def _metrics(self) -> None:
            enc = server.encoded()
            if enc is None:
                self._send(503, "text/plain; charset=utf-8", b"no snapshot yet\n", extra={"Retry-After": "1"})
                return
            self._send(200, METRICS_CONTENT_TYPE, enc.metrics)

        def _stream(self) -> None:
            """Server-Sent Events: the state when it changes (at most once per interval), pings between."""
            if not server._streams.acquire(blocking=False):
                self._json(503, {"error": "too many live viewers; poll /api/v1/state instead"},
                           extra={"Retry-After": "5"})
                return
            self.slot.release()  # a stream holds a stream slot, not one of the workers that read requests
            try:
                # level 1: each viewer pays its own compression, and 1 already shrinks the JSON ~3.5x
                squeeze = zlib.compressobj(1, zlib.DEFLATED, 31) if self._accepts_gzip() else None
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream; charset=utf-8")
                self.send_header("Cache-Control", "no-store")
                self.send_header("X-Accel-Buffering", "no")  # tell nginx-like proxies not to buffer the stream
                if squeeze is not None:
                    self.send_header("Content-Encoding", "gzip")
                self.end_headers()

                def emit(text: bytes) -> None:
                    if squeeze is not None:
                        text = squeeze.compress(text) + squeeze.flush(zlib.Z_SYNC_FLUSH)
                    self.wfile.write(text)
                    self.wfile.flush()

                emit(b"retry: 2000\n\n")
                sent_key: Any = None
                pinged = time.monotonic()
                while not server._stopping.is_set():
                    enc = server.encoded()
                    now = time.monotonic()
                    if enc is not None and enc.key != sent_key:
                        emit(b"event: state\ndata: " + enc.body + b"\n\n")
                        sent_key, pinged = enc.key, now
                    elif now - pinged >= server.ping_s:
                        emit(b"event: ping\ndata: {}\n\n")
                        pinged = now
                    server._stopping.wait(server.stream_interval_s)
            except OSError:
                pass  # the viewer went away
            finally:
                server._streams.release()

        # ---------------------------------------------------------------- admin

        def _admin(self, action: str) -> None:
            if server.admin_token is None:
                self._json(403, {"error": "read-only: this coordinator was started without an admin token, "
                                          "so no admin action is available"})
                return
            scheme, _, token = self.headers.get("Authorization", "").strip().partition(" ")
            if scheme.lower() != "bearer" or not token.strip():
                self._json(401, {"error": "admin actions need the header 'Authorization: Bearer <admin token>'"},
                           extra={"WWW-Authenticate": 'Bearer realm="potluck"'})
                return
            if not hmac.compare_digest(token.strip().encode(), server.admin_token.encode()):
                log.warning("admin %s refused: wrong token from %s", action[:40], self.client_address[0])
                self._json(403, {"error": "wrong admin token"})
                return
            fn = server.actions.get(action)
            if fn is None:
                self._json(404, {"error": f"unknown admin action {action!r}", "actions": sorted(server.actions)})
                return
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                length = -1
            if length < 0 or length > MAX_BODY:
                self._json(413 if length > MAX_BODY else 400, {"error": f"body must be a JSON object of at most {MAX_BODY} bytes"})
                return
            raw = self.rfile.read(length) if length else b""
            try:
                body = json.loads(raw) if raw.strip() else {}
            except (ValueError, UnicodeDecodeError) as err:
                self._json(400, {"error": f"body is not valid JSON: {err}"})
                return
            if not isinstance(body, dict):
                self._json(400, {"error": "body must be a JSON object"})
                return
            log.info("admin action %s from %s", action, self.client_address[0])
            try:
                result = fn(body)
            except ValueError as err:
                self._json(400, {"error": str(err)})
                return
            except Exception as err:
                log.exception("admin action %s failed", action)
                self._json(500, {"error": f"{action} failed: {err}"})
                return
            self._json(200, result if isinstance(result, dict) else {"result": result})

        # ---------------------------------------------------------------- plumbing

        def _accepts_gzip(self) -> bool:
            return "gzip" in self.headers.get("Accept-Encoding", "")

        def _json(self, code: int, obj: Any, extra: dict[str, str] | None = None) -> None:
            self._send(code, "application/json", dumps(obj), extra=extra)

        def _send(self, code: int, ctype: str, body: bytes, extra: dict[str, str] | None = None,
                  cache: str = "no-store") -> None:
            try:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", cache)
                self.send_header("X-Content-Type-Options", "nosniff")
                for k, v in (extra or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(body)
            except OSError:
                pass  # the client went away

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("http: " + format, *args)

    return Handler

