"""Who is in the swarm: peers as seen through their signed DHT records.

A peer is *live* while its record is fresher than ``heartbeat_timeout_s`` (by our monotonic clock,
when a record with a higher ``seq`` last arrived) and it has not said goodbye (state ``left`` or
``finished``) since its last heartbeat: a volunteer restarts a peer with the same key (its
``~/.potluck/peer.key``), and the restarted process is the same peer, back.
:meth:`PeerTable.update` folds fresh records in and returns what changed (joined, left, lost, back)
for the event log. What the peers *do* -- the rounds they run -- is
:mod:`potluck.coordinator.rounds.rounds`' business; this table only knows who is there.

What it costs each tick is a few comparisons per peer: a peer's :class:`Report` is rebuilt only when
its record changes, :attr:`PeerTable.changed` names the views an update changed (for folds that need
only those), and a swarm that churns does not grow it without end: past ``keep_gone`` departed
peers, those gone longest are forgotten (one that comes back is a newcomer again).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from potluck.coordinator.rounds.roundevents import Report
from potluck.models import sizecheck
from potluck.protos.config.runconfig import RunConfig
from potluck.protos.runtime.log import short_id
from potluck.protos.wire.records import PeerRecord, Round
from potluck.protos.wire.states import GONE, PeerState

WORK_KINDS = ("outer", "state", "pipeline")  # bytes that show a peer is working (probes do not)
KEEP_GONE = 1000  # departed peers remembered (for the page's table) at most
BLIND_S = 1.0  # records this much older than the last ones read: the reads stalled, and the time between is no one's


@dataclass
class PeerView:
    record: PeerRecord
    first_seen: float
    last_seen: float  # our monotonic clock when a newer record (higher seq) last arrived
    lost: bool = False
    left: bool = False
    evicted: bool = False  # its key was revoked (a proven lie, a vote): gone for good
    _report: tuple[PeerRecord, bool, bool, bool, Report] | None = None  # the report, and what it was made of
    page_row: Any = field(default=None, repr=False, compare=False)  # (its status page row, kept by snapshot.peer_rows)

    @property
    def live(self) -> bool:
        return not self.lost and not self.left

    def report(self) -> Report:
        """The record as the round lifecycle sees it (made again only when the record or liveness changed)."""
        cached = self._report
        if cached is None or cached[0] is not self.record or cached[1:4] != (self.lost, self.left, self.evicted):
            self._report = cached = (self.record, self.lost, self.left, self.evicted, self._make_report())
        return cached[4]

    def _make_report(self) -> Report:
        r = self.record
        moved = sum(int(r.bytes_sent.get(k, 0)) + int(r.bytes_received.get(k, 0)) for k in WORK_KINDS)
        # a peer that finished the run still holds (and serves) the final state until it stops heartbeating:
        # for the round it made, it is there -- its stage has not lost it, and its version counts
        present = not self.lost and (not self.left or r.state == "finished")
        return Report(peer_id=r.peer_id, stage=r.stage, version=r.version, state_hash=r.state_hash, epoch=r.epoch,
                      prev_version=r.prev_version, prev_hash=r.prev_hash, live=present, gone=self.left or self.evicted,
                      progress=(r.state, r.version, r.inner_step, moved), step_s=r.step_s,
                      included=tuple((x.step, x.epoch, tuple(x.included), tuple(x.samples))
                                     for x in r.recent if x.stage == 0))


class PeerTable:
    """Peers by id; all times are ``time.monotonic()``."""

    def __init__(self, heartbeat_timeout_s: float, keep_gone: int = KEEP_GONE, fresh_s: float = 0.0) -> None:
        self.timeout, self.keep_gone = heartbeat_timeout_s, keep_gone
        self.fresh_s = fresh_s  # a heartbeat this recent is fresh (see at_work)
        self.peers: dict[str, PeerView] = {}
        self.changed: list[PeerView] = []  # the views whose record the last update changed
        self._read_at: float | None = None  # the ``read_at`` of the last update that had one
        self.on_lost: Callable[[str], None] = lambda peer_id: None  # (the coordinator closes its channels to it)
        self.on_seen: Callable[[PeerRecord], None] = lambda rec: None  # (joined or back: the coordinator pings it)
        self._reports: list[Report] | None = None  # (every view's report, in the views' order: see reports)
        self._at: dict[str, int] = {}  # peer id -> where its report is in ``_reports``
        self._stale: set[str] = set()  # peers whose view changed since (their reports are made again, or added)
        self._moved: set[str] | None = set()  # ... since take_changed last asked (None: some were forgotten)

    @classmethod
    def for_run(cls, cfg: RunConfig) -> PeerTable:
        return cls(cfg.membership.heartbeat_timeout_s, fresh_s=2 * cfg.membership.heartbeat_s)

    def update(self, records: dict[str, PeerRecord], now: float | None = None,
               read_at: float | None = None) -> list[tuple[str, str]]:
        """Merge fresh records; returns events ``(kind, peer_id)``: joined, left, lost, back.

        Only a record newer than the one held (a higher ``seq``) changes anything: a DHT replica still
        holding an old goodbye cannot send away a peer that came back. A peer that said goodbye and
        heartbeats again (restarted with its key) is back, like one that was lost; so is one whose record comes
        from a later process (``started_at``) although its goodbye was never read: the new process's first
        heartbeat can overwrite the goodbye in the DHT before a tick reads it.

        ``read_at``: when the read that brought ``records`` began (the coordinator's
        :attr:`~potluck.protos.net.feed.Feed.as_of`); silence is then measured on that clock, not ``now``.
        A read that stalls (the DHT process swamped by a burst of joiners, say) makes nobody lost: no
        time passes while no read is answered, and once one is, the time since the one before (past
        ``BLIND_S``) is credited to every peer: heartbeats sent while the coordinator could not read them
        are not the peers' silence."""
        now = time.monotonic() if now is None else now
        if read_at is not None:
            if self._read_at is not None and read_at - self._read_at > BLIND_S:
                for seen in self.peers.values():
                    seen.last_seen += read_at - self._read_at
            self._read_at = now = read_at
        events: list[tuple[str, str]] = []
        self.changed = []
        for pid, rec in records.items():
            view = self.peers.get(pid)
            if view is None:
                self.peers[pid] = view = PeerView(rec, now, now)
                events.append(("joined", pid))
                self.on_seen(rec)
            elif view.record is rec:
                continue  # the same record as last time (an incremental reader hands the whole view every tick)
            elif rec.seq > view.record.seq:
                restarted = rec.started_at > view.record.started_at > 0  # a new process (its goodbye maybe unread)
                view.record, view.last_seen = rec, now
                if (view.lost or view.left or restarted) and rec.state not in GONE:
                    view.lost = view.left = False
                    events.append(("back", pid))
                    self.on_seen(rec)
            else:
                continue
            self.changed.append(view)
            if rec.state in GONE and not view.left:
                view.left = True
                events.append((rec.state.value if rec.state in (PeerState.FAILED, PeerState.REFUSED) else "left", pid))
        self._views_changed([v.record.peer_id for v in self.changed])
        gone = 0
        for pid, view in self.peers.items():
            if not view.lost and now - view.last_seen > self.timeout:
                view.lost = True  # (one that said goodbye is not reported lost, but no longer there)
                self._views_changed((pid,))
                self.on_lost(pid)
                if not view.left:
                    events.append(("lost", pid))
            gone += not view.live
        if gone > self.keep_gone:
            self._forget(gone - self.keep_gone)
        return events

    def evict(self, peer_id: str) -> None:
        """An evicted peer no longer counts as there, from now: not at its last heartbeat's timeout (a round
        decided in between would name it; its heartbeats are not read again), and it is gone for good: a run
        regathering after a failure does not wait for it."""
        view = self.peers.get(peer_id)
        if view is not None:
            view.lost = view.evicted = True
            self._views_changed((peer_id,))
            self.on_lost(peer_id)

    def _forget(self, n: int) -> None:
        """Forget the ``n`` peers gone longest (their records stopped first)."""
        oldest = sorted((v.last_seen, pid) for pid, v in self.peers.items() if not v.live)[:n]
        for _, pid in oldest:
            del self.peers[pid]
        self._reports, self._moved = None, None

    def _views_changed(self, pids: Iterable[str]) -> None:
        """These peers' views changed: their reports are made again (:meth:`reports`) and told (:meth:`take_changed`)."""
        self._stale.update(pids)
        if self._moved is not None:
            self._moved.update(pids)

    def take_changed(self) -> list[Report] | None:
        """The reports of the peers whose view changed since the last call (joined, heartbeat, lost, gone, back,
        evicted); None when some peer was forgotten meanwhile (a consumer then looks at every report)."""
        moved, self._moved = self._moved, set()
        return None if moved is None else [self.peers[p].report() for p in sorted(moved) if p in self.peers]

    def live(self) -> list[PeerView]:
        return [v for v in self.peers.values() if v.live]

    def at_work(self, version: int, epoch: int, made: Round | None = None, now: float | None = None) -> set[str]:
        """Live peers whose record says they hold ``version`` made in ``epoch`` (they just averaged or fetched
        it with their peers), and the members of ``made`` (the round that made it) whose last heartbeat came
        within ``fresh_s`` (their peers reached them in that all-reduce; a busy peer's record lags its work):
        proof enough that they answer, without a ping of the coordinator's own."""
        now = time.monotonic() if now is None else now
        members = made.member_ids() if made is not None else ()
        return {pid for pid, v in self.peers.items() if v.live and version > 0 and (
            (v.record.version == version and v.record.epoch == epoch)
            or (pid in members and now - v.last_seen <= self.fresh_s))}

    def records(self, changed: bool = False) -> list[PeerRecord]:
        """Every peer's record, or only those the last update changed."""
        return [v.record for v in (self.changed if changed else self.peers.values())]

    def reports(self) -> list[Report]:
        """Every peer's report; the same list until a view changes (a tick asked for it four times, and at 1,000
        peers and as many gone, making it was 9 % of the coordinator's loop)."""
        if self._reports is None:
            self._reports, self._stale = [v.report() for v in self.peers.values()], set()
            self._at = {pid: i for i, pid in enumerate(self.peers)}
        for pid in self._stale:  # (only the views that changed: at 1,000 peers and as many gone, a list made anew of
            if (i := self._at.get(pid)) is not None:  # every view's report was 1-2 ms of every tick)
                self._reports[i] = self.peers[pid].report()
        self._stale.clear()
        if len(self._reports) < len(self.peers):  # newcomers: the newest views, last in the views' order (a view is
            for pid in list(self.peers)[len(self._reports):]:  # only ever deleted by _forget, which makes all anew)
                self._at[pid] = len(self._reports)
                self._reports.append(self.peers[pid].report())
        return list(self._reports)


def describe(kind: str, rec: PeerRecord, timeout_s: float) -> str:
    """The event-log line for a membership change."""
    return {"joined": f"joined from {rec.address} ({rec.device_name or rec.device})", "left": "left the run",
            "failed": f"stopped on an error: {rec.error or 'no reason given'}",
            "refused": f"cannot take part: {rec.error or 'no reason given'}",
            "back": "is back", "lost": f"lost: no heartbeat for {timeout_s:.0f} s"}[kind]


def announce(events: list[tuple[str, str]], table: PeerTable, cfg: RunConfig) -> list[tuple[str, str, str, bool]]:
    """The event-log entries ``(kind, peer, message, warn)`` for membership changes: each change, and a
    ``memory`` warning for a joiner whose device holds less than the run needs a peer."""
    out = []
    for kind, pid in events:
        rec = table.peers[pid].record
        out.append((kind, pid, describe(kind, rec, cfg.membership.heartbeat_timeout_s), False))
        small = sizecheck.peer_note(sizecheck.estimate(cfg), rec.device_name or rec.device, rec.memory_gb) \
            if kind == "joined" and rec.memory_gb else ""
        if small:
            out.append(("memory", pid, small, True))
    return out


def describe_round(rnd: Round, before: dict[str, tuple[int, int]]) -> str:
    """The event-log line for a decision: its grid, epoch, and who was admitted or left out."""
    ids = {m.peer_id for m in rnd.members}
    joined, dropped = sorted(ids - set(before)), sorted(set(before) - ids)
    changes = (f"; admitted {', '.join(map(short_id, joined))}" if joined and rnd.step > 1 else "") + (
        f"; without {', '.join(map(short_id, dropped))}" if dropped else "")
    shape = f" ({rnd.stages} stages x {len(rnd.members) // rnd.stages} replicas)" if rnd.stages > 1 else ""
    return f"step {rnd.step}: {len(rnd.members)} members{shape}, epoch {rnd.epoch}{changes}"
