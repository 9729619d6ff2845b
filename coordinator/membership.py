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
from collections.abc import Callable
from dataclasses import dataclass, field

from potluck.protos.records import Member, PeerRecord, Round

# (peer ids, stages, replicas, previous tasklet per peer, the table) -> {peer id: (stage, replica)}
Placer = Callable[[list[str], int, int, dict[str, tuple[int, int]], "PeerTable"], dict[str, tuple[int, int]]]

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
        self.stage_hashes: dict[int, dict[int, str]] = {}
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
        """Committed = the highest version every stage of the latest round has reached.

        For a stage, that is the highest version one of its members reports (all-or-nothing per
        stage: a member reports a version only once its stage's all-reduce produced it). Usually it
        is the latest round's step; it is higher when peers went on without a coordinator (on the
        last plan) while it was down.
        """
        if not self.rounds:
            return
        latest = self.rounds[max(self.rounds)]
        reached = []
        for stage in range(latest.stages):
            members = {m.peer_id for m in latest.members if m.stage == stage}
            versions = [v.record.version for pid, v in self.peers.items()
                        if pid in members and v.record.stage == stage and v.record.version >= latest.step]
            if not versions:
                return
            reached.append(max(versions))
        if reached and min(reached) > self.committed:
            self.committed = min(reached)
            self._committed_at = now

    def canonical_hash(self, version: int, stage: int = 0) -> str:
        """The hash most live reporters of ``stage`` hold for ``version`` (recomputed while reports arrive)."""
        exact = [v.record.state_hash for v in self.live()
                 if v.record.version == version and v.record.stage == stage and v.record.state_hash]
        store = self.hash_store(stage)
        if exact:
            store[version] = Counter(exact).most_common(1)[0][0]
        return store.get(version, "")

    def hash_store(self, stage: int) -> dict[int, str]:
        """Canonical hashes of ``stage`` by version. Stage 0's are journaled (they are the S = 1
        run's); other stages' are rebuilt from reports (and checkpoints)."""
        return self.hashes if stage == 0 else self.stage_hashes.setdefault(stage, {})

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
        return bool(self.live()) and self.settled(now)

    def settled(self, now: float | None = None, grace_s: float | None = None) -> bool:
        """Every live member of the committed round has reported it, or ``grace_s`` (default
        ``settle_s``) has passed since the commit."""
        now = time.monotonic() if now is None else now
        grace_s = self.settle_s if grace_s is None else grace_s
        prev = self.rounds.get(self.committed)
        if prev is None:
            return True
        waiting = [
            m.peer_id for m in prev.members
            if (v := self.peers.get(m.peer_id)) is not None and not v.lost and not v.left and v.record.version < self.committed
        ]
        return not waiting or (self._committed_at is not None and now - self._committed_at >= grace_s)

    def decide(self, reachable: set[str] | None = None, decided_at: float = 0.0, stages: int = 1,
               placer: Placer | None = None) -> Decision:
        """Round ``committed + 1``: the live (and reachable) peers placed on an S x R grid.

        R = live peers // S; the rest are spares, admitted when a tasklet frees up. ``placer``
        (the scheduler) may choose the grid; by default peers keep their previous tasklet, and
        newcomers fill the holes (fewest moves, so fewest state transfers and buffer warm-ups).
        """
        step = self.committed + 1
        prev = self.rounds.get(self.committed)
        previous = {m.peer_id for m in prev.members} if prev else set()
        chosen = sorted(
            (v for v in self.live() if reachable is None or v.record.peer_id in reachable),
            key=lambda v: v.record.peer_id,
        )
        replicas = len(chosen) // stages
        grid: dict[str, tuple[int, int]] = {}
        if replicas:
            before = {m.peer_id: (m.stage, m.replica) for m in prev.members} if prev else {}
            ids = [v.record.peer_id for v in chosen]
            grid = (placer or sticky_placement)(ids, stages, replicas, before, self)
        by_id = {v.record.peer_id: v for v in chosen}
        members = sorted(
            (Member(peer_id=pid, address=by_id[pid].record.address, stage=s, replica=r) for pid, (s, r) in grid.items()),
            key=lambda m: (m.stage, m.replica),
        )
        hashes = [self.canonical_hash(step - 1, s) for s in range(stages)]
        rnd = Round(step=step, members=members, base_hash=hashes[0], stages=stages,
                    base_hashes=hashes if stages > 1 else [], decided_at=decided_at)
        self.rounds[step] = rnd
        ids_in = {m.peer_id for m in members}
        return Decision(rnd, joined=sorted(ids_in - previous), dropped=sorted(previous - ids_in))

    def restore(self, committed: int, rounds: list[Round], hashes: dict[int, str]) -> None:
        """Resume from a journal: what was committed and decided before a restart."""
        self.committed = committed
        self.rounds = {r.step: r for r in rounds}
        self.hashes = dict(hashes)


def sticky_placement(ids: list[str], stages: int, replicas: int, before: dict[str, tuple[int, int]],
                     table: PeerTable | None = None) -> dict[str, tuple[int, int]]:
    """Fill an S x R grid with ``ids``, keeping every peer that can on its previous tasklet.

    A peer keeps (stage, replica) if both fit the new grid; then peers that held the stage's state
    (same stage, another replica) take free replicas of that stage; then peers whose state the
    stage records (``record.stage``) do; newcomers and spares fill what is left, in id order.
    """
    grid: dict[str, tuple[int, int]] = {}
    taken: set[tuple[int, int]] = set()
    for pid in ids:
        cell = before.get(pid)
        if cell is not None and cell[0] < stages and cell[1] < replicas and cell not in taken:
            grid[pid] = cell
            taken.add(cell)
    free = [(s, r) for s in range(stages) for r in range(replicas) if (s, r) not in taken]

    def held_stage(pid: str) -> int | None:
        if pid in before:
            return before[pid][0]
        view = table.peers.get(pid) if table else None
        return view.record.stage if view and view.record.version > 0 else None

    for pid in ids:  # same stage as before, another replica: no state transfer needed
        if pid in grid:
            continue
        s = held_stage(pid)
        cell = next((c for c in free if c[0] == s), None)
        if cell is not None:
            grid[pid] = cell
            free.remove(cell)
    for pid in ids:
        if pid not in grid and free:
            grid[pid] = free.pop(0)
    return grid
