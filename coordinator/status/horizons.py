"""How long until: the next outer step, the run's end, a waiting peer's place, from the steps measured so far.

An outer step's length is the median gap between recent commits (``RECENT`` of them): it holds the round's
window, its all-reduce and whatever the swarm waited for, as the swarm runs now, and a median lets one slow
step (a peer lost, a rollback) pass without moving the estimate much. The run's first step is measured from
the run's start (it holds the peers' joining too, so it is longer than the steps after it) and used only until
a second commit gives a gap of its own.

The next step is due one step's length after the last commit; a step later than that is ``overdue`` (its
``next_step_in_s`` is 0 and ``overdue_s`` says by how long). The run ends when its remaining steps are done, each
at that length. A peer waiting for a place (joined, or holding a state, and not in the step in training) gets
one at the next outer-step boundary: its estimate is the next step's.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

RECENT = 5  # commit gaps the step length is the median of


def step_length(history: Sequence[dict[str, Any]], started_at: float = 0.0) -> float | None:
    """Seconds one outer step takes, measured (None before the first commit)."""
    recent: list[float] = []  # the newest RECENT gaps between consecutive steps, newest first (the snapshot asks each
    for k in range(len(history) - 1, 0, -1):  # second: walk back from the end, not over the whole history)
        if len(recent) == RECENT:
            break
        a, b = history[k - 1], history[k]
        if b["step"] == a["step"] + 1:
            recent.append(b["t"] - a["t"])
    gaps = [g for g in recent if g > 0]
    if gaps:
        return float(statistics.median(gaps))
    if history and started_at and history[0]["step"] == 1 and history[0]["t"] > started_at:
        return float(history[0]["t"] - started_at)
    return None


def horizon(history: Sequence[dict[str, Any]], committed: int, total: int, now: float, started_at: float = 0.0,
            finished: bool = False) -> dict[str, Any]:
    """The run's horizons: ``outer_step_s`` (measured), ``next_step_in_s``, ``overdue_s`` and ``end_in_s``
    (seconds from ``now``; None while nothing is measured, or once the run is over)."""
    length = step_length(history, started_at)
    out: dict[str, Any] = {"outer_step_s": length, "next_step_in_s": None, "overdue_s": None, "end_in_s": None}
    if length is None or finished or committed >= total:
        return out
    last = history[-1]["t"] if history else started_at
    due = last + length - now
    out["next_step_in_s"] = max(0.0, due)
    out["overdue_s"] = max(0.0, -due)
    out["end_in_s"] = max(0.0, due) + (total - committed - 1) * length
    return out


def clock(seconds: float | None) -> str:
    """``seconds`` as a person reads a wait: ``45 s``, ``12 min``, ``3.5 h``, ``2.1 days``; ``unknown`` for None."""
    if seconds is None:
        return "unknown"
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"
