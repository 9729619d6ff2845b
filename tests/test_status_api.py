"""The status server over real HTTP on port 0: JSON API and schema, /metrics, SSE, admin auth, static files, CLI."""

from __future__ import annotations

import argparse
import gzip
import http.client
import json
import math
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fake_state import fresh_state, make_state
from prometheus_client.parser import text_string_to_metric_families
from rawhttp import raw_request

from potluck.coordinator.status import status_cli
from potluck.coordinator.status.status import STATIC_DIR, StatusServer

TOKEN = "s3cret-token"


class Box:
    """The snapshot the server renders; tests swap it like the coordinator's loop does."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state

    def __call__(self) -> dict[str, Any]:
        return self.state


@pytest.fixture
def box() -> Box:
    return Box(make_state(12, stages=2, steps=15, hole=True, links=True, waiting_reason="deciding the next round"))


@pytest.fixture
def calls() -> list[dict[str, Any]]:
    return []


@pytest.fixture
def server(box: Box, calls: list[dict[str, Any]]) -> Iterator[StatusServer]:
    def pause(body: dict[str, Any]) -> dict[str, Any]:
        calls.append(body)
        return {"paused": True, "echo": body}

    def picky(body: dict[str, Any]) -> dict[str, Any]:
        raise ValueError("'peer' is required")

    srv = StatusServer("127.0.0.1", 0, box, admin_token=TOKEN, actions={"pause": pause, "picky": picky},
                       stream_interval_s=0.05)
    try:
        yield srv
    finally:
        srv.stop()


def request(srv: StatusServer, method: str, path: str, body: bytes | None = None,
            headers: dict[str, str] | None = None) -> tuple[int, http.client.HTTPMessage, bytes]:
    """A raw request: the path goes on the wire exactly as given (no client-side normalisation)."""
    return raw_request(srv.port, method, path, body, headers)


def get_json(srv: StatusServer, path: str) -> Any:
    code, _, body = request(srv, "GET", path)
    assert code == 200, body
    return json.loads(body)


# ---------------------------------------------------------------------- JSON API


def test_no_snapshot_yet_is_503_and_non_finite_numbers_become_null(box: Box, server: StatusServer) -> None:
    box.state = {}
    code, headers, _ = request(server, "GET", "/api/v1/state")
    assert code == 503 and headers["Retry-After"]
    box.state = make_state(4, steps=3)
    box.state["run"]["loss"] = math.nan
    box.state["peers"][0]["loss"] = math.inf
    doc = get_json(server, "/api/v1/state")  # strict JSON: json.loads would also accept NaN, so check the bytes
    assert doc["run"]["loss"] is None and doc["peers"][0]["loss"] is None
    assert b"NaN" not in request(server, "GET", "/api/v1/state")[2]


def test_state_is_gzipped_when_asked(server: StatusServer, box: Box) -> None:
    code, headers, body = request(server, "GET", "/api/v1/state", headers={"Accept-Encoding": "gzip"})
    assert code == 200 and headers["Content-Encoding"] == "gzip"
    assert json.loads(gzip.decompress(body))["run"]["run_id"] == box.state["run"]["run_id"]


def test_routes_healthz_and_unknown_paths(server: StatusServer) -> None:
    assert request(server, "GET", "/healthz")[0:3:2] == (200, b"ok\n")
    for path in ("/nope", "/api/v2/state", "/api/v1/stat", "/static/", "/static/nope.js"):
        assert request(server, "GET", path)[0] == 404, path
    assert request(server, "POST", "/api/v1/state")[0] == 405
    assert request(server, "POST", "/nope")[0] == 404


# ---------------------------------------------------------------------- /metrics


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_parse_and_carry_the_snapshot(box: Box, server: StatusServer) -> None:
    evil = 'evil "quoted" \\ back\nslash'
    box.state["peers"][1]["name"] = evil
    state = box.state
    code, headers, body = request(server, "GET", "/metrics")
    assert code == 200 and headers["Content-Type"].startswith("text/plain; version=0.0.4")
    m = samples(body.decode())
    run, peers = state["run"], state["peers"]

    assert m[("potluck_outer_step", ())] == run["outer_step"]
    assert m[("potluck_tokens_total", ())] == run["tokens_trained"]
    assert m[("potluck_tokens_per_second", ())] == pytest.approx(run["tokens_per_s"])
    assert m[("potluck_loss", ())] == pytest.approx(run["loss"])
    assert m[("potluck_eval_loss", ())] == pytest.approx(run["eval_loss"])
    assert m[("potluck_compute_utilization", ())] == pytest.approx(run["compute_utilization"])
    assert m[("potluck_last_allreduce_seconds", ())] == pytest.approx(run["last_allreduce_s"])
    assert m[("potluck_waiting", ())] == 1
    for st in ("training", "lost", "syncing", "joining"):
        assert m[("potluck_peers", (("state", st),))] == sum(p["state"] == st for p in peers), st
    assert m[("potluck_grid_cells", (("state", "empty"),))] == 1  # the hole
    assert m[("potluck_bytes_total", (("kind", "outer"),))] == sum(p["bytes_sent"]["outer"] for p in peers)
    last = state["history"][-1]
    assert m[("potluck_outer_step_bytes", (("kind", "outer"),))] == last["bytes"]["outer"]
    assert m[("potluck_outer_step_bytes_fp32", (("kind", "outer"),))] == last["bytes_fp32"]["outer"]
    for p in peers:
        assert m[("potluck_peer_last_seen_seconds", (("peer", p["id"]),))] == pytest.approx(p["last_seen_s"])
        assert m[("potluck_peer_tokens_per_second", (("peer", p["id"]),))] == pytest.approx(p["tokens_per_s"])
    info = [labels for (name, labels) in m if name == "potluck_peer_info" and dict(labels)["peer"] == peers[1]["id"]]
    assert dict(info[0])["name"] == evil  # escaping round-trips through the reference parser

    links = state["links"]
    rtt = {dict(labels)["src"] + ">" + dict(labels)["dst"]: v for (name, labels), v in m.items() if name == "potluck_link_rtt_seconds"}
    measured = sum(v is not None for row in links["rtt_ms"] for v in row)
    assert len(rtt) == measured and links["rtt_ms"][0][2] is None
    assert rtt[f"{links['peers'][0]}>{links['peers'][1]}"] == pytest.approx(links["rtt_ms"][0][1] / 1000)


def test_metrics_of_a_fresh_run_leave_unknowns_out() -> None:
    srv = StatusServer("127.0.0.1", 0, fresh_state)
    try:
        m = samples(request(srv, "GET", "/metrics")[2].decode())
    finally:
        srv.stop()
    assert ("potluck_loss", ()) not in m and ("potluck_compute_utilization", ()) not in m
    assert m[("potluck_outer_step", ())] == 0 and m[("potluck_peers", (("state", "training"),))] == 0


# ---------------------------------------------------------------------- admin


def admin(srv: StatusServer, action: str, body: bytes | None = b"{}", auth: str | None = f"Bearer {TOKEN}") -> tuple[int, Any]:
    headers = {"Content-Type": "application/json"}
    if auth is not None:
        headers["Authorization"] = auth
    code, _, raw = request(srv, "POST", f"/api/v1/admin/{action}", body=body, headers=headers)
    return code, json.loads(raw)


def test_admin_needs_the_token(server: StatusServer, calls: list[dict[str, Any]]) -> None:
    assert admin(server, "pause", auth=None)[0] == 401
    assert admin(server, "pause", auth=f"Basic {TOKEN}")[0] == 401
    assert admin(server, "pause", auth="Bearer ")[0] == 401
    assert admin(server, "pause", auth="Bearer wrong")[0] == 403
    assert admin(server, "pause", auth=f"Bearer {TOKEN}x")[0] == 403
    assert admin(server, "nope", auth="Bearer wrong")[0] == 403  # no action enumeration without the token
    assert calls == []

    code, reply = admin(server, "pause", body=b'{"reason": "maintenance"}')
    assert code == 200 and reply == {"paused": True, "echo": {"reason": "maintenance"}}
    assert calls == [{"reason": "maintenance"}]
    assert admin(server, "pause", body=None)[0] == 200 and calls[-1] == {}

    code, reply = admin(server, "nope")
    assert code == 404 and reply["actions"] == ["pause", "picky"]
    assert admin(server, "pause", body=b"{not json")[0] == 400
    assert admin(server, "pause", body=b"[1, 2]")[0] == 400
    assert admin(server, "picky") == (400, {"error": "'peer' is required"})
    assert request(server, "GET", "/api/v1/admin/pause")[0] == 405
    assert len(calls) == 2


def test_admin_is_refused_on_a_read_only_server(box: Box) -> None:
    called: list[dict[str, Any]] = []

    def pause(body: dict[str, Any]) -> dict[str, Any]:
        called.append(body)
        return {}

    srv = StatusServer("127.0.0.1", 0, box, actions={"pause": pause})
    try:
        code, reply = admin(srv, "pause")
    finally:
        srv.stop()
    assert code == 403 and "read-only" in reply["error"] and not called


# ---------------------------------------------------------------------- page and static files


def test_page_and_static_files(server: StatusServer) -> None:
    code, headers, body = request(server, "GET", "/")
    assert code == 200 and headers["Content-Type"].startswith("text/html")
    assert "default-src 'self'" in headers["Content-Security-Policy"]
    html = body.decode()
    for hook in ('data-testid="peers-table"', 'data-testid="grid"', 'data-testid="loss-chart"', 'data-testid="banner"',
                 'src="static/app.js"', 'href="static/style.css"'):
        assert hook in html
    assert "http://" not in html and "https://" not in html  # no CDN
    for name, ctype in (("app.js", "text/javascript"), ("style.css", "text/css"), ("state.schema.json", "application/json")):
        code, headers, body = request(server, "GET", f"/static/{name}")
        assert code == 200 and headers["Content-Type"].startswith(ctype) and body == (STATIC_DIR / name).read_bytes()


@pytest.mark.parametrize("path", [
    "/static/../status.py", "/static/%2e%2e/status.py", "/static/..%2fstatus.py", "/static/%2e%2e%2fstatus.py",
    "/static/..%5cstatus.py", "/static/%2fetc%2fpasswd", "/static//etc/passwd", "/static/.%2e/app.py",
    "/static/../../../../etc/passwd", "/static/.gitignore",
])
def test_static_refuses_path_traversal(server: StatusServer, path: str) -> None:
    code, _, body = request(server, "GET", path)
    assert code == 404 and b"StatusServer" not in body and b"root:" not in body


# ---------------------------------------------------------------------- SSE


def read_event(resp: http.client.HTTPResponse, deadline: float) -> tuple[str, str]:
    """The next SSE event (name, data); the socket timeout bounds each read, the deadline the whole wait."""
    name, data = "message", list[str]()
    while time.monotonic() < deadline:
        raw = resp.fp.readline()
        if not raw:
            raise EOFError("stream closed")
        line = raw.rstrip(b"\r\n").decode()
        if not line:
            if data:
                return name, "\n".join(data)
            name = "message"
            continue
        field, _, value = line.partition(":")
        if field == "event":
            name = value.strip()
        elif field == "data":
            data.append(value[1:] if value.startswith(" ") else value)
    raise TimeoutError("no event before the deadline")


def open_stream(srv: StatusServer) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
    conn.request("GET", "/api/v1/events")
    resp = conn.getresponse()
    return conn, resp


def test_events_stream_pushes_each_new_snapshot_and_ends_on_stop(box: Box) -> None:
    srv = StatusServer("127.0.0.1", 0, box, stream_interval_s=0.05, ping_s=0.2)
    conn, resp = open_stream(srv)
    try:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
        deadline = time.monotonic() + 10
        name, data = read_event(resp, deadline)
        assert name == "state" and json.loads(data)["generated_at"] == box.state["generated_at"]

        name, _ = read_event(resp, deadline)  # nothing changed: the server only pings
        assert name == "ping"
        box.state = {**box.state, "generated_at": box.state["generated_at"] + 1.0}
        while True:
            name, data = read_event(resp, deadline)
            if name == "state":
                break
        assert json.loads(data)["generated_at"] == box.state["generated_at"]

        srv.stop()
        with pytest.raises(EOFError):
            while True:
                read_event(resp, deadline)
    finally:
        conn.close()
        srv.stop()


def test_streams_are_capped_and_the_rest_are_told_to_poll(box: Box) -> None:
    srv = StatusServer("127.0.0.1", 0, box, stream_interval_s=0.05, max_streams=1)
    conn, resp = open_stream(srv)
    try:
        assert read_event(resp, time.monotonic() + 10)[0] == "state"
        code, _, body = request(srv, "GET", "/api/v1/events")
        assert code == 503 and b"poll" in body
    finally:
        conn.close()
        srv.stop()


# ---------------------------------------------------------------------- potluck status


def cli_args(address: str, **kw: Any) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="potluck")
    status_cli.register(parser.add_subparsers(dest="command"))
    argv = ["status", address] + [a for k, v in kw.items() for a in ([f"--{k}"] if v is True else [f"--{k}", str(v)])]
    return parser.parse_args(argv)


def test_status_cli_prints_the_summary(server: StatusServer, box: Box, capsys: pytest.CaptureFixture[str]) -> None:
    args = cli_args(f"127.0.0.1:{server.port}", peers=5)
    assert args.fn is status_cli.run
    assert status_cli.run(args) == 0
    out = capsys.readouterr().out
    run = box.state["run"]
    assert f"run {run['run_id']}" in out and f"outer step {run['outer_step']}/{run['outer_steps_total']}" in out
    assert "waiting: deciding the next round" in out
    assert "grid: 2 stage(s) x" in out and "  stage 1" in out
    lost = next(p for p in box.state["peers"] if p["state"] == "lost")
    assert out.index(lost["short_id"]) < out.index("training", out.index("PEER"))  # lost peers come first
    assert f"5 of {len(box.state['peers'])}" in out
    assert f"lend a GPU: potluck peer --join {run['join_address']}" in out  # the join address, while it runs

    assert status_cli.run(cli_args(f"http://127.0.0.1:{server.port}/", json=True)) == 0
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(box.state))


def test_status_cli_says_clearly_when_unreachable(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert status_cli.run(cli_args(f"127.0.0.1:{port}", timeout=2)) == 1
    err = capsys.readouterr().err
    assert f"http://127.0.0.1:{port}" in err and "connection refused" in err and "Is the coordinator running" in err
    assert status_cli.run(cli_args("ftp://example.org")) == 1
    assert "not a status page address" in capsys.readouterr().err


def test_status_cli_rejects_something_that_is_not_a_status_page(box: Box, capsys: pytest.CaptureFixture[str]) -> None:
    box.state = {"hello": "world", "generated_at": 1.0}
    srv = StatusServer("127.0.0.1", 0, box)
    try:
        assert status_cli.run(cli_args(f"127.0.0.1:{srv.port}")) == 1
    finally:
        srv.stop()
    assert "potluck.status/v1" in capsys.readouterr().err


def test_state_urls() -> None:
    assert status_cli.state_url("h:1") == "http://h:1/api/v1/state"
    assert status_cli.state_url("http://h:1/") == "http://h:1/api/v1/state"
    assert status_cli.state_url("https://x.org/potluck/") == "https://x.org/potluck/api/v1/state"
    assert status_cli.state_url("http://h:1/api/v1/state") == "http://h:1/api/v1/state"
    assert Path(STATIC_DIR / "index.html").is_file()


def test_throughput_is_per_outer_step_and_the_model_export_is_said() -> None:
    """Issue 27: the throughput chart sampled instantaneous tokens/s, which fell to 0 at every sync; the
    history now carries each step's tokens and its rate since the step before (inner steps and sync)."""
    from potluck.coordinator.status.snapshot import model_export, step_rates
    from potluck.protos.config.files import apply_overrides
    from potluck.protos.config.runconfig import RunConfig

    cfg = apply_overrides(RunConfig(), {"diloco.inner_steps": 10, "train.batch_size": 4, "model.seq_len": 8})
    entries = [{"step": 1, "t": 100.0, "members": 2, "stages": {}}, {"step": 2, "t": 104.0, "members": 2, "stages": {}},
               {"step": 3, "t": 104.0, "members": 2, "stages": {"a": 0}}, {"step": 5, "t": 110.0, "members": 2, "stages": {}}]
    rates = step_rates(entries, cfg)
    assert [r["tokens"] for r in rates] == [640, 640, 320, 640]  # stage-0 members x 10 x 4 x 8
    assert [r["tokens_per_s"] for r in rates] == [None, 160.0, None, None]  # no step before; seen at once; a gap
    assert model_export(cfg, 10) == {"version": 10, "command": "potluck export --journal-dir potluck-run --out model.pt"}
    llama = apply_overrides(cfg, {"model.preset": "llama-20m", "coordinator.journal_dir": "/srv/runs/x"})
    assert model_export(llama, 0) == {"version": None,
                                      "command": "potluck export --journal-dir JOURNAL_DIR --out model-hf"}


def test_status_cli_says_an_https_address_is_a_plain_http_page(box: Box, capsys: pytest.CaptureFixture[str]) -> None:
    """It printed OpenSSL's raw [SSL: WRONG_VERSION_NUMBER]."""
    srv = StatusServer("127.0.0.1", 0, box)
    try:
        https = srv.url.replace("http://", "https://")
        for pinned in ({}, {"fingerprint": ":".join(["AB"] * 32)}):
            assert status_cli.run(cli_args(https, **pinned)) == 1
            err = capsys.readouterr().err.strip()
            assert err == (f"potluck status: {https.rstrip('/')} answers plain HTTP, not HTTPS (its coordinator runs "
                           f"without --status-tls): read it as {srv.url.rstrip('/')} (no --fingerprint)"), err
    finally:
        srv.stop()
