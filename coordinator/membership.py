"""The coordinator's view of the swarm, and its decision of who runs each outer step.

Membership is decided in one place, here, and published as an explicit round per outer step
(LESSONS: groups that never form, split DHTs, silent drop-outs). A round is decided as soon as the
previous one is committed, i.e. at the *start* of the inner phase, so no peer ever waits for a group
to form at the end of it.

Rules, applied by :meth:`PeerTable.decide`:

* A peer is *live* while its signed record is fresher than ``heartbeat_timeout_s`` and it has not
  said goodbye (state ``left``/``finished``); a live peer that also fails a direct ping is skipped.
* Version ``v`` is *committed* once a member of round ``v`` reports it; its canonical hash is the
  one most live peers at ``v`` report.
* Round ``v + 1`` is decided when every live member of round ``v`` has reported ``v`` (or a short
  settle time has passed): all live peers, sorted by id, with ``base_hash`` = canonical hash of
  ``v``. Joiners are thereby admitted at the next outer boundary, and a peer that finds its state
  differs from ``base_hash`` knows to fetch the canonical one before it trains.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from potluck.protos.records import Member, PeerRecord, Round

GONE_STATES = {"left", "finished"}


@dataclass
class PeerView:
    record: PeerRecord
    first_seen: float
    last_seen: float  # our monotonic clock when a newer record (higher seq) last arrived
    lost: bool = False
    left: bool = False


@dataclass
class Decision:
    round: Round
    joined: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)


class PeerTable:
    """Peers as seen through their DHT records; all times are ``time.monotonic()``."""

    def __init__(self, heartbeat_timeout_s: float, settle_s: float = 1.0) -> None:
        self.timeout, self.settle_s = heartbeat_timeout_s, settle_s
        self.peers: dict[str, PeerView] = {}
        self.rounds: dict[int, Round] = {}
        self.committed = 0
        self.hashes: dict[int, str] = {}
        self._committed_at: float | None = None

    # ------------------------------------------------------------- records in

    def update(self, records: dict[str, PeerRecord], now: float | None = None) -> list[tuple[str, str]]:
        """Merge fresh records; returns events ``(kind, peer_id)``: joined, left, lost, back."""
        now = time.monotonic() if now is None else now
        events: list[tuple[str, str]] = []
        for pid, rec in records.items():
            view = self.peers.get(pid)
            if view is None:
                self.peers[pid] = view = PeerView(rec, now, now)
                events.append(("joined", pid))
            elif rec.seq > view.record.seq:
                view.record, view.last_seen = rec, now
                if view.lost and rec.state not in GONE_STATES:
                    view.lost = False
                    events.append(("back", pid))
            if rec.state in GONE_STATES and not view.left:
                view.left = True
                events.append(("left", pid))
        for pid, view in self.peers.items():
            if not view.lost and not view.left and now - view.last_seen > self.timeout:
                view.lost = True
                events.append(("lost", pid))
        self._advance_commit(now)
        return events

    def live(self) -> list[PeerView]:
        return [v for v in self.peers.values() if not v.lost and not v.left]

    def _advance_commit(self, now: float) -> None:
        """Committed = the highest version a member of the latest round reports.

        Usually that is the latest round's step; it is higher when peers went on without a
        coordinator (on the last plan) while it was down.
        """
        if not self.rounds:
            return
        latest = self.rounds[max(self.rounds)]
        members = {m.peer_id for m in latest.members}
        versions = [v.record.version for pid, v in self.peers.items() if pid in members and v.record.version >= latest.step]
        if versions and max(versions) > self.committed:
            self.committed = max(versions)
            self._committed_at = now

    def canonical_hash(self, version: int) -> str:
        """The hash most live reporters hold for ``version`` (recomputed while reports arrive)."""
        exact = [v.record.state_hash for v in self.live() if v.record.version == version and v.record.state_hash]
        if exact:
            self.hashes[version] = Counter(exact).most_common(1)[0][0]
        return self.hashes.get(version, "")

    # ------------------------------------------------------------- decisions out

    def pending_step(self) -> int | None:
        """The step whose round should be decided now, or None if it is not time yet."""
        latest = max(self.rounds, default=self.committed)
        if latest > self.committed:
            return None  # the current round is still running
        return self.committed + 1

    def ready_to_decide(self, min_peers: int, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        step = self.pending_step()
        if step is None:
            return False
        if not self.rounds:
            return len(self.live()) >= min_peers
        prev = self.rounds.get(self.committed)
        if prev is None:
            return bool(self.live())
        waiting = [
            m.peer_id for m in prev.members
            if (v := self.peers.get(m.peer_id)) is not None and not v.lost and not v.left and v.record.version < self.committed
        ]
        settled = self._committed_at is not None and now - self._committed_at >= self.settle_s
        return bool(self.live()) and (not waiting or settled)

    def decide(self, reachable: set[str] | None = None, decided_at: float = 0.0) -> Decision:
        """Round ``committed + 1``: every live (and reachable) peer, sorted by id."""
        step = self.committed + 1
        prev = self.rounds.get(self.committed)
        previous = {m.peer_id for m in prev.members} if prev else set()
        chosen = sorted(
            (v for v in self.live() if reachable is None or v.record.peer_id in reachable),
            key=lambda v: v.record.peer_id,
        )
        members = [Member(peer_id=v.record.peer_id, address=v.record.address) for v in chosen]
        rnd = Round(step=step, members=members, base_hash=self.canonical_hash(step - 1), decided_at=decided_at)
        self.rounds[step] = rnd
        ids = {m.peer_id for m in members}
        return Decision(rnd, joined=sorted(ids - previous), dropped=sorted(previous - ids))

    def restore(self, committed: int, rounds: list[Round], hashes: dict[int, str]) -> None:
        """Resume from a journal: what was committed and decided before a restart."""
        self.committed = committed
        self.rounds = {r.step: r for r in rounds}
        self.hashes = dict(hashes)
