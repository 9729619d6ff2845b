"""One raw HTTP(S) request for the status server's tests: the path goes on the wire exactly as given."""

from __future__ import annotations

import http.client
import ssl


def raw_request(port: int, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None,
                tls: ssl.SSLContext | None = None) -> tuple[int, http.client.HTTPMessage, bytes]:
    """Status, headers and body of ``method path`` on 127.0.0.1:``port`` (over TLS with ``tls``)."""
    conn = (http.client.HTTPConnection("127.0.0.1", port, timeout=10) if tls is None
            else http.client.HTTPSConnection("127.0.0.1", port, timeout=10, context=tls))
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, resp.headers, resp.read()
    finally:
        conn.close()
