"""The committed states a peer holds: theta_global and the outer momentum of its stage.

A peer keeps its newest committed snapshot and the one before it, and serves both to peers that
recover (:class:`~potluck.compression.transfer.SnapshotServer`): a member one step ahead of a round
that failed rolls back to its own previous state, and others can fetch it from here. Each snapshot
records the epoch of the round that made it (``meta["epoch"]``), which is how a peer knows a
rollback has overtaken it.
"""

from __future__ import annotations

import threading
import time

from potluck.compression.transfer import Snapshot, SnapshotServer
from potluck.peer.follower import Held
from potluck.peer.outer.spill import Spill


def epoch_of(snap: Snapshot) -> int:
    """The epoch of the round that made ``snap`` (theta_0: 0, in whatever epoch the run is)."""
    return int(snap.meta.get("epoch", 0))


class States:
    """The outer-step thread commits (:meth:`commit`, :meth:`reset`); the heartbeat and RPC threads read.
    ``_lock`` guards ``current`` and ``committed_at`` together: a reader sees one commit, never the
    snapshot of one and the time or epoch of another. (The server has its own lock.)"""

    def __init__(self, run_id: str, chunk_bytes: int, first: Snapshot, spill: Spill | None = None) -> None:
        """``spill``: where committed snapshots' vectors are placed (``--outer-state-dir``), or None: in RAM."""
        self.server = SnapshotServer(run_id, chunk_bytes)
        self._lock = threading.Lock()
        self.spill = spill
        first = self._place(first)
        self._current, self._committed_at = first, time.monotonic()
        self.server.publish(first)

    def _place(self, snap: Snapshot) -> Snapshot:
        return self.spill.place(snap) if self.spill is not None else snap

    @property
    def current(self) -> Snapshot:
        with self._lock:
            return self._current

    @property
    def committed_at(self) -> float:
        with self._lock:
            return self._committed_at

    def commit(self, snap: Snapshot) -> Snapshot:
        """Hold ``snap`` from now on (the one it replaces stays served if older); returns it as held (with
        ``--outer-state-dir``, its vectors in files: the caller uses these, and lets its own go)."""
        snap = self._place(snap)
        with self._lock:
            self._current, self._committed_at = snap, time.monotonic()
            self.server.publish(snap)
        return snap

    def reset(self, snap: Snapshot) -> None:
        """Hold only ``snap`` (a new stage's theta_0: nothing held before belongs to it)."""
        snap = self._place(snap)
        with self._lock:
            self.server.publish(None)
            self._current, self._committed_at = snap, time.monotonic()
            self.server.publish(snap)

    def previous(self, version: int, state_hash: str) -> Snapshot | None:
        """The previous snapshot, if it is ``version`` at ``state_hash`` (a rollback of one step)."""
        prev = self.server.previous
        if prev is not None and prev.version == version and (not state_hash or prev.hash == state_hash):
            return prev
        return None

    @property
    def epoch(self) -> int:
        return epoch_of(self.current)

    def held(self, stage: int) -> Held:
        with self._lock:
            c, at = self._current, self._committed_at
        return Held(c.version, c.digest, stage, epoch_of(c), at)

    def prev_of(self) -> tuple[int, str]:
        prev = self.server.previous
        return (prev.version, prev.hash) if prev is not None else (-1, "")
