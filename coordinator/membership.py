"""Who is in the swarm: peers as seen through their signed DHT records.

A peer is *live* while its record is fresher than ``heartbeat_timeout_s`` (by our monotonic clock,
when a record with a higher ``seq`` last arrived) and it has not said goodbye (state ``left`` or
``finished``) since its last heartbeat: a volunteer restarts a peer with the same key (its
``~/.potluck/peer.key``), and the restarted process is the same peer, back.
:meth:`PeerTable.update` folds fresh records in and returns what changed (joined, left, lost, back)
for the event log. What the peers *do* -- the rounds they run -- is
:mod:`potluck.coordinator.rounds`' business; this table only knows who is there.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from potluck.coordinator.rounds import Report
from potluck.models import sizecheck
from potluck.protos.config import RunConfig
from potluck.protos.log import get_logger
from potluck.protos.records import PeerRecord

log = get_logger(__name__)

GONE_STATES = {"left", "finished", "failed"}
WORK_KINDS = ("outer", "state", "pipeline")  # bytes that show a peer is working (probes do not)


@dataclass
class PeerView:
    record: PeerRecord
    first_seen: float
    last_seen: float  # our monotonic clock when a newer record (higher seq) last arrived
    lost: bool = False
    left: bool = False

    @property
    def live(self) -> bool:
        return not self.lost and not self.left

    def report(self) -> Report:
        """The record as the round lifecycle sees it."""
        r = self.record
        moved = sum(int(r.bytes_sent.get(k, 0)) + int(r.bytes_received.get(k, 0)) for k in WORK_KINDS)
        # a peer that finished the run still holds (and serves) the final state until it stops heartbeating:
        # for the round it made, it is there -- its stage has not lost it, and its version counts
        present = not self.lost and (not self.left or r.state == "finished")
        return Report(peer_id=r.peer_id, stage=r.stage, version=r.version, state_hash=r.state_hash, epoch=r.epoch,
                      prev_version=r.prev_version, prev_hash=r.prev_hash, live=present,
                      progress=(r.state, r.version, r.inner_step, moved),
                      included=tuple((x.step, x.epoch, tuple(x.included)) for x in r.recent if x.stage == 0))


class PeerTable:
    """Peers by id; all times are ``time.monotonic()``."""

    def __init__(self, heartbeat_timeout_s: float) -> None:
        self.timeout = heartbeat_timeout_s
        self.peers: dict[str, PeerView] = {}

    def update(self, records: dict[str, PeerRecord], now: float | None = None) -> list[tuple[str, str]]:
        """Merge fresh records; returns events ``(kind, peer_id)``: joined, left, lost, back.

        Only a record newer than the one held (a higher ``seq``) changes anything: a DHT replica still
        holding an old goodbye cannot send away a peer that came back. A peer that said goodbye and
        heartbeats again (restarted with its key) is back, like one that was lost."""
        now = time.monotonic() if now is None else now
        events: list[tuple[str, str]] = []
        for pid, rec in records.items():
            view = self.peers.get(pid)
            if view is None:
                self.peers[pid] = view = PeerView(rec, now, now)
                events.append(("joined", pid))
            elif rec.seq > view.record.seq:
                view.record, view.last_seen = rec, now
                if (view.lost or view.left) and rec.state not in GONE_STATES:
                    view.lost = view.left = False
                    events.append(("back", pid))
            else:
                continue
            if rec.state in GONE_STATES and not view.left:
                view.left = True
                events.append(("failed" if rec.state == "failed" else "left", pid))
        for pid, view in self.peers.items():
            if not view.lost and now - view.last_seen > self.timeout:
                view.lost = True  # (one that said goodbye is not reported lost, but no longer counts as there)
                if not view.left:
                    events.append(("lost", pid))
        return events

    def live(self) -> list[PeerView]:
        return [v for v in self.peers.values() if v.live]

    def reports(self) -> list[Report]:
        return [v.report() for v in self.peers.values()]


def describe(kind: str, rec: PeerRecord, timeout_s: float) -> str:
    """The event-log line for a membership change."""
    return {"joined": f"joined from {rec.address} ({rec.device_name or rec.device})", "left": "left the run",
            "failed": f"stopped on an error: {rec.error or 'no reason given'}",
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


def read_records(get: Callable[[], tuple[dict[str, Any], list[str]]], warned: set[str]) -> tuple[dict[str, Any], list[str]]:
    """Records from the DHT (``get``: a SwarmNode reader) and the reasons some were refused (forged, stale,
    malformed) not said before, in order; an unreadable DHT (its process restarting, say) reads as empty."""
    try:
        records, refused = get()
    except Exception as err:  # the next tick tries again
        log.warning("could not read the DHT: %s", err)
        return {}, []
    new = [r for r in dict.fromkeys(refused) if r not in warned]
    warned.update(new)
    return records, new
