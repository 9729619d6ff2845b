"""The coordinator's HTTP server: the run's status as JSON (and, later, a page and /metrics).

Every response is rendered from the latest snapshot the coordinator built in its own loop, so a
page load never touches the DHT and a thousand open browsers cost the run nothing.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from potluck.protos.log import get_logger

log = get_logger(__name__)


class StatusServer:
    def __init__(self, host: str, port: int, snapshot: Callable[[], dict[str, Any]]) -> None:
        self.snapshot = snapshot
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/api/v1/state":
                    self._send(200, "application/json", json.dumps(server.snapshot()).encode())
                elif path == "/healthz":
                    self._send(200, "text/plain", b"ok\n")
                else:
                    self._send(404, "text/plain", f"no such page: {path}\n".encode())

            def _send(self, code: int, ctype: str, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                log.debug("http: " + format, *args)

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="status-http", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
