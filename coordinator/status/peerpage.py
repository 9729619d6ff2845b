"""``GET /api/v1/peers``: every peer's row, a page at a time, filtered and sorted on the server.

The snapshot holds the most telling 200 rows of a bigger swarm (:func:`potluck.coordinator.status.snapshot.inline_peers`);
a client reads the rest through this route. :func:`peer_query` checks a request's parameters (a bad one is a
ValueError naming it), :func:`peer_page_rows` selects and orders the rows of one snapshot, as the page's
table sorts them (docs/status-api.md lists the keys).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs

from potluck.coordinator.status.metrics import PEER_STATES
from potluck.protos.wire.states import ABSENT

PAGE_MAX = 500
_INF = float("inf")
# sort keys, as the page's table columns sort (docs/status-api.md); "first_seen" is the order of first appearance
SORTS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "first_seen": lambda p: 0,  # (the rows' own order)
    "short_id": lambda p: p["short_id"],
    "name": lambda p: p["name"],
    "device": lambda p: p["memory_gb"],
    "tasklet": lambda p: p["tasklet"]["stage"] * 1e6 + p["tasklet"]["replica"] if p["tasklet"] else _INF,
    "state": lambda p: p["state"],
    "last_seen_s": lambda p: p["last_seen_s"],
    "version": lambda p: p["version"] * 1e6 + p["inner_step"],
    "tokens_per_s": lambda p: p["tokens_per_s"],
    "loss": lambda p: _INF if p["loss"] is None else p["loss"],
    "bytes": lambda p: sum(p["bytes_sent"].values()),
    "relayed": lambda p: p["bytes_sent"].get("relay", 0) + p["bytes_received"].get("relay", 0) if p["relayed"] else -1,
    "software": lambda p: p["software"],
}
_FILTERED = ("id", "name", "state", "device", "device_name", "address", "software")


def peer_query(query: str) -> dict[str, Any]:
    """The parameters of a ``/api/v1/peers`` request, checked; ValueError says what is wrong with them."""
    try:
        params = parse_qs(query, keep_blank_values=True, strict_parsing=bool(query), max_num_fields=8)
    except ValueError as err:
        raise ValueError(f"malformed query string: {err}") from None
    unknown = sorted(set(params) - {"offset", "limit", "sort", "state", "q"})
    if unknown:
        raise ValueError(f"unknown parameter {unknown[0]!r}; known: offset, limit, sort, state, q")
    repeated = sorted(k for k, v in params.items() if len(v) > 1)
    if repeated:
        raise ValueError(f"parameter {repeated[0]!r} given more than once")
    one = {k: v[0] for k, v in params.items()}

    def number(name: str, default: int, lo: int, hi: int) -> int:
        raw = one.get(name)
        if raw is None:
            return default
        if not raw.isdigit() or not lo <= int(raw) <= hi:
            raise ValueError(f"{name} must be a whole number from {lo} to {hi}, not {raw[:32]!r}")
        return int(raw)

    sort = one.get("sort", "first_seen")
    if sort.lstrip("-") not in SORTS:
        raise ValueError(f"sort must be one of {', '.join(SORTS)} (a leading '-' reverses it), not {sort[:32]!r}")
    state = one.get("state", "")
    if state not in ("", "live", "gone", *PEER_STATES):
        raise ValueError(f"state must be live, gone or one of {', '.join(PEER_STATES)}, not {state[:32]!r}")
    q = one.get("q", "")
    if len(q) > 128:
        raise ValueError("q (the text filter) must be at most 128 characters")
    return {"offset": number("offset", 0, 0, 10**9), "limit": number("limit", 50, 1, PAGE_MAX), "sort": sort,
            "state": state, "q": q}


def peer_page_rows(peers: list[dict[str, Any]], sort: str, state: str, q: str) -> list[dict[str, Any]]:
    """The rows ``state`` and ``q`` select, sorted as the page sorts (ties keep the order of first appearance)."""
    text = q.strip().lower()

    def selected(p: dict[str, Any]) -> bool:
        if state in ("live", "gone") and (p["state"] in ABSENT) != (state == "gone"):
            return False
        if state not in ("", "live", "gone") and p["state"] != state:
            return False
        return not text or any(text in str(p.get(k) or "").lower() for k in _FILTERED)

    rows = [p for p in peers if selected(p)]
    key = sort.lstrip("-")
    if key == "first_seen":
        return rows[::-1] if sort.startswith("-") else rows
    rows.sort(key=SORTS[key], reverse=sort.startswith("-"))  # stable either way: ties stay in order of appearance
    return rows
