"""``potluck status ADDRESS``: the status page's summary in a terminal.

It reads the same ``/api/v1/state`` the page reads, so it works against any coordinator whose
status port you can reach (locally, over an SSH tunnel, behind a reverse proxy with a path prefix):

    potluck status 127.0.0.1:8080            header, waiting reason, grid, peers
    potluck status http://host:8080/ --json  the raw snapshot, for jq and scripts
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any
from urllib.parse import urlsplit

from potluck.coordinator.status.horizons import clock

GRID_CHARS = {"training": "T", "syncing": "S", "recovering": "R", "joining": "J", "waiting": "W",
              "finished": "F", "left": "L", "failed": "E", "refused": "N", "lost": "X", "empty": "."}
_ORDER = {"failed": 0, "lost": 0, "refused": 0, "recovering": 1, "joining": 1, "waiting": 1, "syncing": 1, "training": 1,
          "finished": 2, "left": 2}
_RED, _YELLOW, _DIM, _RESET = "\x1b[31m", "\x1b[33m", "\x1b[2m", "\x1b[0m"


class StatusUnavailable(Exception):
    """The status server could not be read; the message says what was tried and what to check."""


DESCRIPTION = """\
Show a run's status in the terminal: outer and inner step, loss, tokens per
second, why the run waits (if it does), the stage x replica grid and the peers,
lost ones first. It reads the status page the coordinator serves (it prints
that address at start-up), so it works locally, over an SSH tunnel or behind a
reverse proxy with a path prefix."""

EXAMPLES = """\
examples:
  potluck status 127.0.0.1:8080                      the summary
  potluck status http://host:8080/ --peers 0         every peer, not only 20
  potluck status http://host:8080/ --json | jq .run  the raw snapshot"""


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``status`` subcommand to ``potluck``'s subparsers."""
    p = subparsers.add_parser("status", help="show a run's status in the terminal (reads its status page)",
                              description=DESCRIPTION, epilog=EXAMPLES,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("address", metavar="ADDRESS",
                   help="the coordinator's status page: http://host:port or host:port (it prints it at start-up)")
    p.add_argument("--json", action="store_true", help="print the raw /api/v1/state snapshot as JSON")
    p.add_argument("--peers", type=int, default=20, metavar="N", help="peer rows to show (default 20, 0 = all)")
    p.add_argument("--timeout", type=float, default=5.0, metavar="SECONDS", help="HTTP timeout (default 5)")
    p.add_argument("--fingerprint", metavar="SHA256", help="an https:// page's certificate fingerprint, as the "
                   "coordinator printed it ('status TLS: SHA-256 AB:CD:...'): trust that certificate, self-signed or not")
    p.set_defaults(fn=run)
    return p


def run(args: argparse.Namespace) -> int:
    try:
        url = state_url(args.address)
        body = fetch(url, getattr(args, "timeout", 5.0), getattr(args, "fingerprint", None))
        state = parse(body, url)
    except StatusUnavailable as err:
        print(f"potluck status: {err}", file=sys.stderr)
        return 1
    if getattr(args, "json", False):
        print(json.dumps(state, indent=2))
        return 0
    want = getattr(args, "peers", 20)
    if (state.get("peers_summary") or {}).get("truncated") and (want <= 0 or want > len(state.get("peers") or [])):
        try:  # the snapshot holds the most telling 200 of a bigger swarm: the rest come a page at a time
            state["peers"] = all_peers(url, getattr(args, "timeout", 5.0), getattr(args, "fingerprint", None))
        except StatusUnavailable as err:
            print(f"potluck status: {err}; showing the snapshot's {len(state['peers'])} peers", file=sys.stderr)
    colour = sys.stdout.isatty() and not os.environ.get("NO_COLOR")
    print(summary(state, peers=want, colour=colour))
    return 0


def all_peers(url: str, timeout: float, fingerprint: str | None = None) -> list[dict[str, Any]]:
    """Every peer's row from ``/api/v1/peers``, a page of 500 at a time, in order of first appearance."""
    rows: list[dict[str, Any]] = []
    base = url.removesuffix("/api/v1/state") + "/api/v1/peers"
    while True:
        page = parse(fetch(f"{base}?offset={len(rows)}&limit=500", timeout, fingerprint), base)
        if not isinstance(page.get("peers"), list) or not isinstance(page.get("total"), int):
            raise StatusUnavailable(f"{base} did not return a page of peers")
        rows += page["peers"]
        if not page["peers"] or len(rows) >= page["total"]:
            return rows


# ---------------------------------------------------------------------- fetching


def state_url(address: str) -> str:
    """``host:port``, ``http://host:port`` or a page URL with a path prefix -> its /api/v1/state URL."""
    address = address.strip()
    if "://" not in address:
        address = "http://" + address
    parts = urlsplit(address)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise StatusUnavailable(f"{address!r} is not a status page address; expected http://host:port or host:port")
    try:
        parts.port  # noqa: B018 - validates the port
    except ValueError as err:
        raise StatusUnavailable(f"{address!r}: {err}") from None
    path = parts.path.rstrip("/")
    for suffix in ("/api/v1/state", "/index.html"):
        path = path.removesuffix(suffix)
    return f"{parts.scheme}://{parts.netloc}{path}/api/v1/state"


def fetch(url: str, timeout: float, fingerprint: str | None = None) -> bytes:
    import socket  # with urllib.request, here rather than at import: `potluck --help` builds this parser
    import urllib.error
    import urllib.request

    if fingerprint:
        return _fetch_pinned(url, timeout, fingerprint)
    base = url.removesuffix("/api/v1/state")
    hint = (f"Is the coordinator running, and is {base} its status page? "
            "The coordinator prints it at start-up ('status page: http://...').")
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers={"Accept": "application/json"}),
                                    timeout=timeout) as resp:
            return resp.read()
    except urllib.error.HTTPError as err:
        if err.code == 503:
            raise StatusUnavailable(_BUSY.format(base=base)) from None
        raise StatusUnavailable(f"{url} answered HTTP {err.code} {err.reason}. {hint}") from None
    except urllib.error.URLError as err:
        reason = err.reason
        if isinstance(reason, ConnectionRefusedError):
            what = "connection refused (nothing listens on that port)"
        elif isinstance(reason, socket.gaierror):
            what = f"cannot resolve the host name ({reason.strerror})"
        elif isinstance(reason, TimeoutError):
            what = f"no answer within {timeout:g} s"
        elif _plain_http(reason):
            raise StatusUnavailable(_PLAIN.format(base=base, http="http" + base.removeprefix("https"))) from None
        else:
            what = str(reason)
        raise StatusUnavailable(f"cannot reach the status server at {base}: {what}. {hint}") from None
    except TimeoutError:
        raise StatusUnavailable(f"cannot reach the status server at {base}: no answer within {timeout:g} s. {hint}") from None
    except OSError as err:
        raise StatusUnavailable(f"cannot reach the status server at {base}: {err}. {hint}") from None


_PLAIN = ("{base} answers plain HTTP, not HTTPS (its coordinator runs without --status-tls): read it as {http} "
          "(no --fingerprint)")


def _plain_http(err: object) -> bool:
    """Is ``err`` a TLS handshake that met a plain-HTTP server (OpenSSL's WRONG_VERSION_NUMBER)?"""
    import ssl

    return isinstance(err, ssl.SSLError) and "WRONG_VERSION_NUMBER" in str(err)


_BUSY = ("{base} is up but busy (at its connection limit) or has not built its first snapshot yet; "
         "try again in a second")


def _fetch_pinned(url: str, timeout: float, fingerprint: str) -> bytes:
    """GET ``url`` over HTTPS from the server whose certificate has this SHA-256 ``fingerprint`` only."""
    import hashlib
    import http.client
    import ssl

    parts, base = urlsplit(url), url.removesuffix("/api/v1/state")
    if parts.scheme != "https":
        raise StatusUnavailable(f"--fingerprint pins the certificate of an https:// status page, not {base}")
    want = fingerprint.replace(":", "").strip().upper()
    if len(want) != 64 or any(c not in "0123456789ABCDEF" for c in want):
        raise StatusUnavailable(f"--fingerprint {fingerprint!r} is not a SHA-256 fingerprint (64 hex digits, "
                                "colons allowed)")
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE  # the fingerprint below is the whole check
    conn = http.client.HTTPSConnection(parts.hostname or "", parts.port or 443, timeout=timeout, context=ctx)
    try:
        conn.connect()
        der = conn.sock.getpeercert(binary_form=True) or b""  # type: ignore[union-attr]
        got = hashlib.sha256(der).hexdigest().upper()
        if got != want:
            shown = ":".join(got[i:i + 2] for i in range(0, 64, 2))
            raise StatusUnavailable(f"{base} presented a certificate with fingerprint {shown}, not the one given: "
                                    "another server, or someone in between; nothing was sent to it")
        conn.request("GET", parts.path or "/", headers={"Accept": "application/json"})
        resp = conn.getresponse()
        if resp.status == 503:
            raise StatusUnavailable(_BUSY.format(base=base))
        if resp.status != 200:
            raise StatusUnavailable(f"{url} answered HTTP {resp.status} {resp.reason}")
        return resp.read()
    except (OSError, http.client.HTTPException) as err:
        if _plain_http(err):
            raise StatusUnavailable(_PLAIN.format(base=base, http="http" + base.removeprefix("https"))) from None
        raise StatusUnavailable(f"cannot reach the status server at {base}: {err}") from None
    finally:
        conn.close()


def parse(body: bytes, url: str) -> dict[str, Any]:
    from potluck.coordinator.status.status import API

    try:
        state = json.loads(body)
    except ValueError:
        raise StatusUnavailable(f"{url} did not return JSON: is this a potluck status page?") from None
    if not isinstance(state, dict) or state.get("api") != API:
        api = state.get("api") if isinstance(state, dict) else None
        raise StatusUnavailable(f"{url} speaks {api!r}, this potluck understands {API!r}")
    return state


# ---------------------------------------------------------------------- formatting


def si(n: float | None, digits: int = 2) -> str:
    if n is None:
        return "-"
    for scale, unit in ((1e12, " T"), (1e9, " G"), (1e6, " M"), (1e3, " k")):
        if abs(n) >= scale:
            return f"{n / scale:.{digits}f}{unit}"
    return f"{n:.0f}" if float(n).is_integer() or abs(n) >= 100 else f"{n:.1f}"


def human_bytes(n: float) -> str:
    units = ["B", "kB", "MB", "GB", "TB", "PB"]
    i = 0
    while abs(n) >= 1000 and i < len(units) - 1:
        n /= 1000
        i += 1
    return f"{n:.0f} {units[i]}" if i == 0 else f"{n:.1f} {units[i]}"


def ago(s: float | None) -> str:
    if s is None:
        return "-"
    s = max(0.0, s)
    if s < 90:
        return f"{s:.0f} s ago"
    if s < 5400:
        return f"{s / 60:.0f} min ago"
    return f"{s / 3600:.1f} h ago"


def _num(x: float | None, digits: int) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def join_notes(run: dict[str, Any]) -> list[str]:
    """What a volunteer adds to the join command for this run, said before they find out from an error."""
    notes = []
    if run.get("admission") == "private":
        notes.append("a private run: potluck peer also needs --token, with the token its operator hands out")
    if (run.get("data") or {}).get("source") == "bytes":
        notes.append("a run on a text file: potluck peer also needs --data-path, with your copy of it (the run checks its sha256)")
    return notes


def summary(state: dict[str, Any], peers: int = 20, colour: bool = False) -> str:
    """The terminal view of a snapshot: header, waiting reason, grid, a compact peers table."""
    run = state["run"]
    model = run.get("model") or {}
    table = state.get("peers") or []
    timeout = (state.get("config") or {}).get("heartbeat_timeout_s") or float("inf")
    gen = state.get("generated_at") or time.time()

    def paint(text: str, code: str) -> str:
        return f"{code}{text}{_RESET}" if colour and code else text

    counted = state.get("peers_summary") or {}  # (the whole table, when the snapshot holds only part of it)
    live = counted.get("live", sum(1 for p in table if p["state"] not in ("lost", "left", "finished", "failed", "refused")))
    lost = (counted.get("by_state") or {}).get("lost", sum(1 for p in table if p["state"] == "lost"))
    known = counted.get("total", len(table))
    badge = "  " + paint("FINISHED", "\x1b[35;1m") if run.get("finished") else ""
    lines = [
        f"run {run['run_id']} · outer step {run['outer_step']}/{run['outer_steps_total']} · "
        f"inner step {run['inner_step']}/{run['inner_steps_per_outer']}{badge}",
        f"model {si(model.get('parameters'))} params · grid {run['stages']} stage(s) x {run['replicas']} replica(s) · "
        f"{live} live peers" + (f", {lost} lost" if lost else "") + f", {known} known",
    ]
    loss = f"loss {_num(run.get('loss'), 3)} · eval {_num(run.get('eval_loss'), 3)}"
    if run.get("loss_floor") is not None:
        gap = f", +{run['eval_loss'] - run['loss_floor']:.2f}" if run.get("eval_loss") is not None else ""
        loss += f" (floor {run['loss_floor']:.2f}{gap})"
    lines.append(f"tokens {si(run.get('tokens_trained'))} trained · {si(run.get('tokens_per_s'))} tokens/s · {loss}")
    util = run.get("compute_utilization")
    last = run.get("last_outer_at")
    allreduce = run.get("last_allreduce_s")
    lines.append(
        f"compute utilization {'-' if util is None else f'{100 * util:.1f} %'} · "
        f"last outer step {ago(gen - last) if last else 'none yet'}"
        + (f" · all-reduce {allreduce:.2f} s" if allreduce is not None else "")
    )
    h = run.get("horizon") or {}
    if not run.get("finished") and h.get("next_step_in_s") is not None:
        late = h.get("overdue_s") or 0.0
        lines.append((f"next outer step {clock(late)} late" if late > 0 else f"next outer step in ~{clock(h['next_step_in_s'])}")
                     + f" · run ends in ~{clock(h.get('end_in_s'))} (an outer step takes ~{clock(h.get('outer_step_s'))})")
    if run.get("waiting_reason"):
        lines.append(paint(f"waiting: {run['waiting_reason']}", _YELLOW))
    export = run.get("model_export") or {}
    if run.get("finished") and export.get("version"):
        lines.append(f"the model (v{export['version']}), on the coordinator's machine: {export['command']}")
    elif not run.get("finished") and run.get("join_address"):
        lines.append(f"lend a GPU: potluck peer --join {run['join_address']}")
        lines += [f"  ({note})" for note in join_notes(run)]
    lines.append(f"snapshot {time.strftime('%H:%M:%S', time.localtime(gen))} (coordinator clock)")

    lines.append("")
    lines.extend(_grid_lines(state.get("grid") or {}, paint))
    lines.append("")
    lines.extend(_peer_lines(table, peers, timeout, paint))
    return "\n".join(lines)


def _grid_lines(grid: dict[str, Any], paint: Any) -> list[str]:
    stages, replicas = int(grid.get("stages") or 0), int(grid.get("replicas") or 0)
    if not stages or not replicas:
        return ["grid: no round decided yet"]
    legend = ", ".join(f"{c} {s if s != 'empty' else 'hole'}" for s, c in GRID_CHARS.items())
    out = [f"grid: {stages} stage(s) x {replicas} replica(s)   [{legend}]"]
    cells = {(c["stage"], c["replica"]): c for c in grid.get("cells") or []}
    width = 64
    for s in range(stages):
        row = []
        for r in range(replicas):
            c = cells.get((s, r))
            state = c["state"] if c and c.get("peer") else "empty"
            ch = GRID_CHARS.get(state, "?")
            row.append(paint(ch, _RED) if state in ("lost", "empty") else ch)
        for k in range(0, replicas, width):
            label = f"  stage {s:<3}" if k == 0 else " " * 12
            out.append(f"{label} {''.join(row[k:k + width])}")
    return out


def _peer_lines(table: list[dict[str, Any]], limit: int, timeout: float, paint: Any) -> list[str]:
    if not table:
        return ["peers: none yet"]
    ordered = sorted(table, key=lambda p: _ORDER.get(p["state"], 1))  # stable: lost first, then in order of arrival
    shown = ordered if limit <= 0 else ordered[:limit]
    head = ("PEER", "NAME", "STATE", "TASKLET", "STEP", "TOK/S", "LOSS", "SENT/RECV", "LAST SEEN", "DEVICE", "VERSION")
    rows = []
    for p in shown:
        t = p.get("tasklet")
        rows.append((
            p["short_id"], (p.get("name") or "-")[:16],
            p["state"] + (f" (place in ~{clock(p['place_in_s'])})" if p.get("place_in_s") is not None else ""),
            f"{t['stage']}/{t['replica']}" if t else "-",
            f"v{p['version']}" + (f"·{p['inner_step']}" if p["state"] == "training" else ""),
            si(p.get("tokens_per_s")) if p.get("tokens_per_s") else "-", _num(p.get("loss"), 3),
            f"{human_bytes(sum((p.get('bytes_sent') or {}).values()))}/{human_bytes(sum((p.get('bytes_received') or {}).values()))}",
            ago(p.get("last_seen_s")),
            ((p.get("device_name") or p.get("device") or "") + (f" {p['memory_gb']:.0f}GiB" if p.get("memory_gb") else ""))[:32],
            p.get("software") or "-",
        ))
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    more = f"; {len(table) - len(shown)} more, --peers 0 shows all" if len(shown) < len(table) else ""
    header = "  " + "  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True))
    out = [f"peers: {len(shown)} of {len(table)} (lost first{more})", header.rstrip()]
    for p, r in zip(shown, rows, strict=True):
        line = "  " + "  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True))
        stale = (p.get("last_seen_s") or 0) > timeout and p["state"] not in ("left", "finished", "failed", "refused")
        out.append(paint(line.rstrip(), _RED if p["state"] in ("lost", "failed") or stale else _YELLOW if p["state"] == "refused"
                         else _DIM if p["state"] in ("left", "finished") else ""))
    for p in shown:  # why a peer stopped or could not take part, in its own words
        if p.get("error") and p["state"] in ("failed", "refused"):
            out.append(paint(f"  {p['short_id']} {p['state']}: {p['error']}", _RED if p["state"] == "failed" else _YELLOW))
    return out
