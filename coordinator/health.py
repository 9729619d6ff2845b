"""How the coordinator itself is doing: the cost of its tick and decisions, and its memory.

At a thousand peers these are the figures that say whether the coordinator's machine keeps up
(``benchmarks/swarm_scale.py`` reads them from the status API): a tick that takes longer than
``tick_s`` delays every commit it sees, and a coordinator whose memory grows with the run's length
would not last a long run.
"""

from __future__ import annotations

import math
import os
import time
from collections import deque
from typing import Any

from potluck.protos.runtime.heap import Heap

KEEP_TICKS = 1000
# a tick that has used this much CPU already leaves the status snapshot to the next one ... (at 1,000 peers an
# ordinary tick takes 12-20 ms, and each of a snapshot's build, an entry's totals, a journal write and a new plan's
# publish 7-20 ms more: the heaviest tick is about this much plus the heaviest of them; it was 30 ms, and 50 before)
LONG_TICK_S = 0.02
STALE_S = 2.0  # ... unless the snapshot is this old
MAX_WAITS = 3  # ... and what else can wait waits this many long ticks running at most
# building the status snapshot takes at most this share of the loop's time: at 1,000 peers a build is ~20 ms, and a
# tenth had one every 0.2-0.3 s, in half of all ticks: with the decisions they were the heaviest ticks, the p99
SNAPSHOT_SHARE = 1 / 20


class Health:
    def __init__(self, settle: bool = False) -> None:
        self.ticks: deque[float] = deque(maxlen=KEEP_TICKS)  # seconds each of the latest ticks took
        self.tick_cpu: deque[float] = deque(maxlen=KEEP_TICKS)  # ... of the loop thread's CPU
        self.decisions: deque[float] = deque(maxlen=16)  # seconds each of the latest decisions took
        self.decided_count = 0  # (every decision since the coordinator started)
        self.count = 0
        self.heap, self._settle = Heap(), settle  # (settle: full collections between ticks, from the first one on)
        self._built = (-float("inf"), 0.0, 0.0)  # (when the snapshot was last built, how long it took, began)
        self._owed = False  # a commit's snapshot, left to a shorter tick
        self._waited: dict[str, int] = {}  # what waited for this tick, and for how many ticks running (see waits)
        self._due_at: float | None = None  # when the round to decide became due (see due)

    def long(self, began: float) -> bool:
        """Has the tick that began at ``began`` (its thread's CPU clock) used ``LONG_TICK_S`` already? Then what
        can wait a tick waits (at 1,000 peers a commit's tick judged the step, folded every member's report of
        it, journaled it and built the snapshot: 130-200 ms of CPU in one tick)."""
        return time.thread_time() - began >= LONG_TICK_S

    def waits(self, what: str, began: float, most: int = MAX_WAITS) -> bool:
        """Should ``what`` wait for the next tick? While this one is :meth:`long`, for ``most`` ticks running
        at most. (A commit's journal write: peers act on a commit without it, and a coordinator that stops before
        it learns the step again from their reports.) Waiting once only, a commit's fold and the new plan's
        publish, each put off by a long tick, both came due in the same next one: 46 + 30 ms of CPU at 1,000
        peers, the tick's max."""
        waited = self._waited.pop(what, 0)
        if self.long(began) and waited < most:
            self._waited[what] = waited + 1
            return True
        return False

    def snapshot_due(self, now: float, changed: bool, every_s: float, long: bool = False) -> bool:
        """Build the status snapshot now? At most every ``every_s``, and rarely enough that building it takes at
        most ``SNAPSHOT_SHARE`` of the loop (a big swarm's costs more); at once when ``changed`` (a step was committed),
        or on the next tick when this one is ``long``, unless the snapshot is ``STALE_S`` old."""
        self._owed = self._owed or changed
        due = self._owed or now - self._built[0] >= max(every_s, self._built[1] / SNAPSHOT_SHARE)
        if due and long and now - self._built[0] < STALE_S:
            return False
        if due:
            self._built, self._owed = (self._built[0], self._built[1], time.monotonic()), False
        return due

    def snapshot_built(self, now: float) -> None:
        self._built = (now, time.monotonic() - self._built[2], 0.0)

    def ticked(self, seconds: float, cpu_seconds: float) -> None:
        """A tick took ``seconds`` of wall time, ``cpu_seconds`` of the loop thread's CPU (what it costs the
        machine; the wall time adds whatever else the machine runs). With ``settle``, the heap is settled after
        the first tick, and a full collection, when due, runs now, before the next tick."""
        self.ticks.append(seconds)
        self.tick_cpu.append(cpu_seconds)
        self.count += 1
        if self._settle and self.count == 1:  # (after the first tick: its status snapshot is up first)
            self.heap.settle(time.monotonic())
        elif self.heap.due(now := time.monotonic()):  # between two ticks, not in one: see potluck.protos.runtime.heap
            self.heap.collect(now)

    def due(self, due: bool, now: float) -> bool:
        """Note whether a round is due to be decided, as ``now``: a decision's time counts from when it first was (its
        pings may start before, while the round before settles). Returns ``due``."""
        self._due_at = (now if self._due_at is None else self._due_at) if due else None
        return due

    def decision_began(self, pinged: float) -> float:
        """When the decision about to be made began: when its round became due, or when its pings began if later."""
        return pinged if self._due_at is None else max(pinged, self._due_at)

    def decided(self, seconds: float) -> None:
        self.decisions.append(seconds)
        self.decided_count += 1

    def section(self, reads: dict[str, Any], peers_held: int) -> dict[str, Any]:
        """The status snapshot's ``coordinator`` object (documented in docs/status-api.md)."""
        return {
            "ticks": self.count,
            "tick_s": _spread(self.ticks),
            "tick_cpu_s": _spread(self.tick_cpu),
            "decide_s": {"last": self.decisions[-1] if self.decisions else None,
                         "max": max(self.decisions) if self.decisions else None, "window": len(self.decisions),
                         "count": self.decided_count},
            "rss_bytes": rss_bytes(),
            "gc": self.heap.section(),
            "peers_held": peers_held,
            "reads": reads,
        }


def _spread(values: deque[float]) -> dict[str, Any]:
    ordered = sorted(values)
    return {"p50": _quantile(ordered, 0.5), "p99": _quantile(ordered, 0.99), "max": ordered[-1] if ordered else None,
            "window": len(ordered)}


def _quantile(ordered: list[float], q: float) -> float | None:
    """The ``q`` quantile of sorted values, nearest rank (None when there are none)."""
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def rss_bytes() -> int | None:
    """This process's resident memory now (Linux; None elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None
