"""The interpreter's cycle collector on a loop's own schedule, not in the middle of its work.

CPython's full (generation 2) collection walks every container object the process holds. A
coordinator holds about 230,000 of them before its first tick (torch, hivemind, gRPC and their
modules), none of them ever garbage, and a full pass over them cost 150-250 ms of CPU on a 2-core
box: at 300 peers it landed every few seconds in whichever tick happened to allocate, and it was the
whole of that tick's p99 (``benchmarks/swarm_scale.py``). So a long-running loop:

* ``settle()`` once it has started: collects, then freezes what survived (``gc.freeze``: those objects
  are never walked again) and takes full collections off the automatic schedule; the young
  generations still collect as usual, in a few ms;
* ``collect()`` between two iterations when ``due``: one full pass over what is not frozen, so cycles
  made since are still freed, at a time the loop chose and measured.

Nothing is ever unfrozen: what was alive when the loop started lives as long as the process.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass

NEVER = 1 << 30  # a generation-2 threshold that automatic collection never reaches


@dataclass
class Heap:
    every_s: float = 30.0  # a full collection at most this often
    frozen: int = 0  # objects frozen by settle
    collections: int = 0
    last_s: float = 0.0  # CPU seconds the last full collection took
    max_s: float = 0.0
    freed: int = 0  # unreachable objects found by the full collections, in all
    _next: float = float("inf")  # (until settled, the interpreter's own schedule)

    def settle(self, now: float) -> None:
        gc.collect()
        gc.freeze()
        young, middle, _ = gc.get_threshold()
        gc.set_threshold(young, middle, NEVER)
        self.frozen, self._next = gc.get_freeze_count(), now + self.every_s

    def due(self, now: float) -> bool:
        return now >= self._next

    def collect(self, now: float) -> float:
        """One full collection of what is not frozen; its CPU seconds."""
        c0 = time.thread_time()
        self.freed += gc.collect()
        self.last_s = time.thread_time() - c0
        self.max_s, self.collections, self._next = max(self.max_s, self.last_s), self.collections + 1, now + self.every_s
        return self.last_s

    def section(self) -> dict[str, float | int]:
        return {"frozen": self.frozen, "every_s": self.every_s, "collections": self.collections, "last_s": self.last_s,
                "max_s": self.max_s, "freed": self.freed}
