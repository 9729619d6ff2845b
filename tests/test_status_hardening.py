"""The status server under abuse, over real sockets on 127.0.0.1: idle floods, slowloris, a full house, HTTPS.

Nothing here sleeps to synchronise: each test waits on a condition (a socket closing, a thread count
falling) with a deadline, and the limits are shrunk so the whole file runs in seconds.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from fake_state import make_state
from rawhttp import raw_request

from potluck.coordinator.status.httpserver import Limits
from potluck.coordinator.status.status import StatusServer
from potluck.coordinator.status.status_tls import status_tls
from potluck.protos.config.files import apply_overrides
from potluck.protos.config.runconfig import RunConfig
from potluck.protos.config.section import ConfigError

TOKEN = "s3cret-token"
STATE = make_state(6, stages=2, steps=5)


def wait_for(cond: Callable[[], bool], timeout: float, what: str) -> float:
    """Poll ``cond`` until it holds; returns the seconds it took, fails the test after ``timeout``."""
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"not within {timeout:g} s: {what}")
        time.sleep(0.01)
    return time.monotonic() - t0


def get(port: int, path: str = "/api/v1/state", *, tls: ssl.SSLContext | None = None, method: str = "GET",
        body: bytes | None = None, headers: dict[str, str] | None = None) -> tuple[int, http.client.HTTPMessage, bytes]:
    return raw_request(port, method, path, body, headers, tls)


def closed_by_peer(sock: socket.socket) -> bool:
    """Whether the other side has closed ``sock`` (it must be readable, i.e. selected, to call this)."""
    try:
        return sock.recv(1024) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True


def closed_within(sock: socket.socket, timeout: float) -> bool:
    with selectors.DefaultSelector() as sel:
        sel.register(sock, selectors.EVENT_READ)
        return bool(sel.select(timeout)) and closed_by_peer(sock)


@pytest.fixture
def serve() -> Iterator[Callable[..., StatusServer]]:
    servers: list[StatusServer] = []

    def start(**kw: Any) -> StatusServer:
        srv = StatusServer("127.0.0.1", 0, lambda: STATE, **kw)
        servers.append(srv)
        return srv

    try:
        yield start
    finally:
        for srv in servers:
            srv.stop()


# ---------------------------------------------------------------------- connections


def test_a_thousand_idle_connections_cost_no_thread_and_delay_no_one(serve: Callable[..., StatusServer]) -> None:
    limits = Limits(idle_s=1.0)
    idle_process = threading.active_count()
    srv = serve(limits=limits)
    assert get(srv.port)[0] == 200  # warm: the first snapshot encoded, the first worker come and gone
    wait_for(lambda: threading.active_count() <= idle_process + 1, 5, "only the accept loop left")
    before = threading.active_count()

    t_open = time.monotonic()
    idle = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(1000)]
    opened = time.monotonic()
    try:
        during = threading.active_count()
        t0 = time.perf_counter()
        code, _, body = get(srv.port)
        took = time.perf_counter() - t0
        assert code == 200 and json.loads(body)["run"]["run_id"] == STATE["run"]["run_id"]
        peak = max(during, threading.active_count())
        assert peak <= before + 2, (before, peak)  # the one worker of the request above, at most

        open_socks = set(idle)
        with selectors.DefaultSelector() as sel:
            for s in idle:
                sel.register(s, selectors.EVENT_READ)
            deadline = opened + limits.idle_s + 3.0
            while open_socks and time.monotonic() < deadline:
                for key, _ in sel.select(0.1):
                    sock = key.fileobj
                    assert isinstance(sock, socket.socket)
                    assert closed_by_peer(sock), "the server sent something to a connection that asked nothing"
                    sel.unregister(sock)
                    open_socks.discard(sock)
        all_closed = time.monotonic() - opened
        assert not open_socks, f"{len(open_socks)} idle connections still open {all_closed:.1f} s later"
        after = threading.active_count()
        wait_for(lambda: threading.active_count() <= before, 5, "worker threads exit")
    finally:
        for s in idle:
            s.close()
    print(f"\nopening 1000 connections took {opened - t_open:.2f} s; threads before {before}, during {during}/{peak} (open/after a request), after {after}; "
          f"a request during the flood took {took * 1000:.1f} ms; all 1000 closed by the server "
          f"{all_closed:.2f} s after the last opened (idle_s {limits.idle_s:g})")
    assert took < 2.0


def test_slowloris_is_cut_off_at_the_request_deadline(serve: Callable[..., StatusServer]) -> None:
    limits = Limits(idle_s=1.0, request_s=1.5)
    srv = serve(limits=limits)
    sock = socket.create_connection(("127.0.0.1", srv.port))
    try:
        t0 = time.monotonic()
        sock.sendall(b"GET /api/v1/state HTTP/1.1\r\nHost: x\r\n")
        cut, sent = None, 0
        while time.monotonic() - t0 < 10:
            try:
                sock.sendall(b"X-Slow: %d\r\n" % sent)  # a header every 0.3 s: each well inside idle_s
                sent += 1
            except (BrokenPipeError, ConnectionResetError):
                cut = time.monotonic() - t0
                break
            if closed_within(sock, 0.3):
                cut = time.monotonic() - t0
                break
        assert cut is not None, "a slowloris client was still connected after 10 s"
        assert limits.idle_s < cut < limits.request_s + limits.idle_s + 1.0, cut  # the deadline, not the idle timeout
        assert sent >= 4
        assert get(srv.port)[0] == 200
    finally:
        sock.close()


def test_a_full_house_is_answered_503_at_once_and_streams_do_not_count(serve: Callable[..., StatusServer]) -> None:
    srv = serve(limits=Limits(max_connections=2, idle_s=5.0, request_s=5.0), stream_interval_s=0.05)
    stream = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
    stream.request("GET", "/api/v1/events")  # a live stream hands its worker slot back
    assert stream.getresponse().status == 200
    slow = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(2)]
    try:
        for s in slow:  # half a request each: both workers now wait for the rest
            s.sendall(b"GET /healthz HTTP/1.1\r\n")

        def refused() -> bool:
            code, headers, _ = get(srv.port)
            return code == 503 and headers["Retry-After"] == "1"

        wait_for(refused, 5, "a third request is refused while two workers are busy")  # once both are dispatched
        busy = threading.active_count()
        t0 = time.perf_counter()
        assert all(refused() for _ in range(20))
        assert time.perf_counter() - t0 < 2.0
        assert threading.active_count() <= busy  # refused on the accept loop: no thread started

        for s in slow:
            s.sendall(b"\r\n")
        wait_for(lambda: get(srv.port)[0] == 200, 5, "the workers free again")
    finally:
        for s in slow:
            s.close()
        stream.close()


def test_live_streams_outlive_the_read_timeouts(serve: Callable[..., StatusServer]) -> None:
    limits = Limits(idle_s=0.3, request_s=0.3)
    srv = serve(limits=limits, stream_interval_s=0.05, ping_s=0.1)
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
    try:
        conn.request("GET", "/api/v1/events")
        resp = conn.getresponse()
        assert resp.status == 200
        t0, events = time.monotonic(), []
        while time.monotonic() - t0 < 2 * (limits.idle_s + limits.request_s):
            line = resp.fp.readline()
            assert line, f"the stream ended after {time.monotonic() - t0:.2f} s"
            if line.startswith(b"event: "):
                events.append(line[7:].strip().decode())
        assert events[0] == "state" and events.count("ping") >= 5
    finally:
        conn.close()


# ---------------------------------------------------------------------- HTTPS


def pinned_client() -> ssl.SSLContext:
    """What a visitor who compares fingerprints does: no CA to trust, the certificate checked by hand."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def fingerprint_of(port: int, ctx: ssl.SSLContext) -> str:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, ctx.wrap_socket(raw) as tls:
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return ":".join(f"{b:02X}" for b in hashlib.sha256(der).digest())


def test_self_signed_certificate_is_made_once_and_kept(tmp_path: Path) -> None:
    ctx, fp = status_tls(None, None, True, tmp_path, host="203.0.113.7")
    assert ctx is not None and len(fp.split(":")) == 32
    key, pem = tmp_path / "status-tls.key", tmp_path / "status-tls.pem"
    assert key.stat().st_mode & 0o777 == 0o600
    first = pem.read_bytes(), key.read_bytes()
    ctx2, fp2 = status_tls(None, None, True, tmp_path, host="203.0.113.7")
    assert ctx2 is not None and fp2 == fp and (pem.read_bytes(), key.read_bytes()) == first
    assert status_tls(str(pem), str(key), False, tmp_path / "elsewhere")[1] == fp  # the same files, given by hand
    assert status_tls(None, None, False, tmp_path) == (None, "")

    os.replace(pem, tmp_path / "old.pem")  # a key without its certificate: both made anew
    assert status_tls(None, None, True, tmp_path)[1] != fp
    with pytest.raises(ConfigError, match="cannot serve"):
        status_tls(str(tmp_path / "nope.pem"), str(key), False, tmp_path)
    with pytest.raises(ConfigError, match="cannot serve"):
        status_tls(str(tmp_path / "old.pem"), str(key), False, tmp_path)  # certificate and key do not match
    with pytest.raises(ConfigError, match="both"):
        status_tls(str(pem), None, False, tmp_path)


def test_https_serves_pinned_clients_and_admin(tmp_path: Path, serve: Callable[..., StatusServer]) -> None:
    tls, fp = status_tls(None, None, True, tmp_path, host="127.0.0.1")
    calls: list[dict[str, Any]] = []

    def pause(body: dict[str, Any]) -> dict[str, Any]:
        calls.append(body)
        return {"paused": True}

    srv = serve(tls=tls, admin_token=TOKEN, actions={"pause": pause}, limits=Limits(idle_s=1.0, request_s=1.0))
    assert srv.url.startswith("https://")
    client = pinned_client()
    assert fingerprint_of(srv.port, client) == fp

    code, headers, body = get(srv.port, tls=client)
    assert code == 200 and json.loads(body)["run"]["run_id"] == STATE["run"]["run_id"]
    verified = ssl.create_default_context(cafile=str(tmp_path / "status-tls.pem"))  # its SAN names 127.0.0.1
    assert get(srv.port, "/healthz", tls=verified)[0] == 200

    with ThreadPoolExecutor(8) as pool:  # a crowd of legitimate visitors: nobody refused
        assert set(pool.map(lambda _: get(srv.port, tls=client)[0], range(24))) == {200}

    admin = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    code, _, body = get(srv.port, "/api/v1/admin/pause", tls=client, method="POST", body=b'{"why": "x"}', headers=admin)
    assert code == 200 and json.loads(body) == {"paused": True} and calls == [{"why": "x"}]
    wrong = {**admin, "Authorization": "Bearer nope"}
    assert get(srv.port, "/api/v1/admin/pause", tls=client, method="POST", body=b"{}", headers=wrong)[0] == 403

    with pytest.raises((http.client.HTTPException, ConnectionError)):  # plain HTTP gets no answer, only a close
        get(srv.port, "/healthz")
    assert get(srv.port, "/healthz", tls=client)[0] == 200


def test_a_stalled_handshake_blocks_no_one(tmp_path: Path, serve: Callable[..., StatusServer]) -> None:
    tls, _ = status_tls(None, None, True, tmp_path)
    limits = Limits(idle_s=1.0, request_s=1.5)
    srv = serve(tls=tls, limits=limits)
    stalled = socket.create_connection(("127.0.0.1", srv.port))
    try:
        stalled.sendall(b"\x16\x03\x01")  # the first bytes of a ClientHello, then nothing: a worker waits on it
        t0 = time.monotonic()
        assert get(srv.port, tls=pinned_client())[0] == 200
        assert time.monotonic() - t0 < 1.0
        assert closed_within(stalled, limits.request_s + 2.0)
        assert time.monotonic() - t0 < limits.request_s + 1.5
    finally:
        stalled.close()


# ---------------------------------------------------------------------- config


def test_status_tls_config_is_validated() -> None:
    def coordinator(**kw: str) -> Any:
        return apply_overrides(RunConfig(), {f"coordinator.{k}": v for k, v in kw.items()}).coordinator

    assert coordinator().status_tls == "off"
    assert coordinator(status_tls="self-signed").status_tls == "self-signed"
    c = coordinator(status_tls="files", status_tls_cert="/etc/tls/c.pem", status_tls_key="k.pem")
    assert (c.status_tls_cert, c.status_tls_key) == ("/etc/tls/c.pem", "k.pem")
    with pytest.raises(ConfigError, match="needs both"):
        coordinator(status_tls="files", status_tls_cert="c.pem")
    with pytest.raises(ConfigError, match="only with status_tls = 'files'"):
        coordinator(status_tls_key="k.pem")
    with pytest.raises(ConfigError, match="status_tls"):
        coordinator(status_tls="on")


def test_potluck_status_reads_a_self_signed_page_only_with_its_fingerprint(
        tmp_path: Path, serve: Callable[..., StatusServer]) -> None:
    from potluck.coordinator.status.status_cli import StatusUnavailable, fetch, state_url

    tls, fp = status_tls(None, None, True, tmp_path, host="127.0.0.1")
    srv = serve(tls=tls)
    url = state_url(srv.url)
    assert json.loads(fetch(url, 5, fp))["run"]["run_id"] == STATE["run"]["run_id"]
    assert json.loads(fetch(url, 5, fp.replace(":", "").lower()))  # as copied without colons, any case
    with pytest.raises(StatusUnavailable, match="certificate verify failed"):  # unpinned: an unknown issuer
        fetch(url, 5)
    other = ":".join(["AB"] * 32)
    with pytest.raises(StatusUnavailable, match="not the one given: another server, or someone in between"):
        fetch(url, 5, other)
    with pytest.raises(StatusUnavailable, match="not a SHA-256 fingerprint"):
        fetch(url, 5, "AB:CD")
    with pytest.raises(StatusUnavailable, match="pins the certificate of an https"):
        fetch(url.replace("https", "http"), 5, fp)
