"""What the coordinator's pinger decides, as values: whom to ping, which answers still count, when to wake the loop.

A round's decision needs every live peer not visibly at work pinged (a live record of a dead process must not
enter a round), and a thousand of them, some over new TLS connections, take seconds: so the pings run off the
coordinator's loop, on the threads of :class:`~potluck.coordinator.swarm.service.Pinger`. This module is what
those threads are told to do, and what the loop is told back; pure: ``now`` (the loop's monotonic clock) is an
argument, and nothing here starts a thread, reads a clock or calls the network.

Two kinds of answers feed a decision:

- **the decision's own pings** (:class:`PingAll`): the answers are kept in one :class:`Kept` until a decision
  takes them (:func:`poll` returns an :class:`Answer`), or they grow older than ``max_age_s``;
- **a newcomer's first ping** (:class:`Prime`, and :meth:`Pinger.prime` when a peer first shows up or comes
  back): its :class:`Heard` answer stands in for the decision's own ping, for the next decision only. With churn,
  nearly all a decision had left to ping were such newcomers, and waiting for them was most of its time (0.16 s
  of a median decision at 1,000 peers, on a machine of its own; a second for the first round after a join
  burst). Only the next decision: a member killed later, whose record then stops short of the committed step, is
  pinged again like before (a test killing one mid-step caught a round decided with it, its join-time answer
  taken as fresh).

The per-peer books (the :class:`Heard` answers, who is being primed) are the executor's, read here as mappings
and sets that the functions do not change: each newcomer's answer comes alone, and copying a thousand of them
per answer would cost what :func:`pruned` saves.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, replace
from enum import Enum

from potluck.protos.wire.records import PeerRecord

PING_TIMEOUT_S = 2.0
# A newcomer's answer to the ping when it showed up stands in for the decision's own ping this long (and only
# for the next decision): the decision's own pings were as old as they took, a second or two.
PRIMED_S = 3.0
# A fresh start waiting for its min_peers' answers is woken by a newcomer's answer at most this often (each answer
# woke it at first: 23 ticks in the 0.35 s the last 86 answers of a 1,000-peer join burst took).
WAKE_S = 0.05
# While a round settles, the proofs of the peers not pinged are looked at again this often, and those that lapsed
# (a member whose heartbeat went stale) pinged: once due, at 1,000 peers on 2 cores, 20-100 such pings were
# 0.05-0.3 s of a decision.
RECHECK_S = 1.0
PRUNE_FLOOR = 64  # newcomers' answers held past this many (or twice those left by the last pruning): the stale go
NEVER = -float("inf")


@dataclass(frozen=True)
class PingRules:
    """The pinger's figures (its tests name their own)."""

    max_age_s: float = 10.0  # a kept answer older than this (from its first pings' end) is dropped: ping again
    primed_s: float = PRIMED_S  # a newcomer's answer counts this long before the decision's pings began (or after)
    recheck_s: float = RECHECK_S
    wake_s: float = WAKE_S
    ping_timeout_s: float = PING_TIMEOUT_S  # a ping's answer may come this late; a short answer pings a silent
    # peer again at most this often (its ping before is over)


@dataclass(frozen=True)
class Heard:
    """A newcomer's answer to its first ping (by the primer)."""

    address: str  # the address that answered; "" if none did
    at: float  # when, on the loop's monotonic clock


@dataclass(frozen=True)
class Kept:
    """The next decision's answer, gathered by its own pings and kept until a decision takes it."""

    began: float  # when its pings began (or would have: nobody left to ping); a decision's cost counts from there
    aged_from: float  # its age counts from its first pings' end (however many pings after): see max_age_s
    answered: frozenset[str] = frozenset()  # peers that answered the decision's pings
    asked: frozenset[str] = frozenset()  # peers the decision's pings asked (a silent one: asked, not answered)
    proven: frozenset[str] | None = None  # proven() when first offered to a due decision (asked once: proofs that
    # lapse while the decision's own pings run cost no more)
    repinged: Mapping[str, float] = field(default_factory=dict)  # peer -> when a short answer had it pinged again
    short: bool = False  # a fresh start waits on newcomers' answers short of min_peers (they wake the loop)


@dataclass(frozen=True)
class PingerState:
    rules: PingRules
    kept: Kept | None = None
    pinging: bool = False  # the decision's pings are in flight: nothing is decided until they are in
    taken: float = NEVER  # when a decision last took its answer: a newcomer's answer before it is spent
    rechecked: float = NEVER  # when the proofs were last looked at while a round settled
    woke: float = NEVER  # when a newcomer's answer last woke the loop
    prune_at: int = PRUNE_FLOOR  # prune the held newcomers' answers past this many


# What a poll tells its caller: the answer, or why not yet.
@dataclass(frozen=True)
class Answer:
    """The decision may go on: the peers that answered (or are at work, or answered their first ping), in the
    order given, and when the pings began (a decision's cost counts from there)."""

    records: list[PeerRecord]
    began: float


class Why(Enum):
    STARTED = "pings started"  # the decision's pings just went out (off the loop; they wake it when in)
    IN_FLIGHT = "pings in flight"
    NOT_DUE = "kept for the decision: not due yet"  # the round before still settles
    SHORT = "short of min_peers: waiting for the peers it lacks"  # a fresh start; newcomers' answers wake it


@dataclass(frozen=True)
class Waiting:
    why: Why


Polled = Answer | Waiting


# What the executor does.
@dataclass(frozen=True)
class PingAll:
    """Ping these peers all at once, off the loop (:func:`pinged` with the answers, then wake the loop)."""

    records: tuple[PeerRecord, ...]


@dataclass(frozen=True)
class Prime:
    """Ping each of these peers by itself, as a newcomer (busy when pinged, or joined since: their own pings,
    not everyone's again); each answer as it comes, :class:`Heard`."""

    records: tuple[PeerRecord, ...]


Action = PingAll | Prime


@dataclass(frozen=True)
class Sorted:
    """Live records by the kept answer."""

    there: list[PeerRecord]  # answered, at work, or a fresh first answer
    missing: list[PeerRecord]  # pinged (by the decision, or at its join) with no answer
    unasked: list[PeerRecord]  # not pinged: proven when the pings began, not now


def tried(state: PingerState, heard: Mapping[str, Heard], pid: str, since: float) -> bool:
    """Did ``pid``'s first ping end (answered or not) after the last decision took its answer, and since ``since``?"""
    h = heard.get(pid)
    return h is not None and h.at > state.taken and h.at >= since


def fresh(state: PingerState, heard: Mapping[str, Heard], rec: PeerRecord, since: float) -> bool:
    """Does ``rec``'s peer's first answer count: unspent, since ``since``, from the address it still announces (an
    answer at another address proves nothing: the peer restarted elsewhere)?"""
    return tried(state, heard, rec.peer_id, since) and heard[rec.peer_id].address == rec.address


def sort(state: PingerState, kept: Kept, records: list[PeerRecord], at_work: Collection[str],
         heard: Mapping[str, Heard], priming: AbstractSet[str]) -> Sorted:
    since = kept.began - state.rules.primed_s
    out = Sorted([], [], [])
    for r in records:
        pid = r.peer_id
        if pid in kept.answered or pid in at_work or fresh(state, heard, r, since):
            out.there.append(r)
        elif pid in kept.asked or pid in priming or tried(state, heard, pid, since):
            out.missing.append(r)
        else:
            out.unasked.append(r)
    return out


def poll(state: PingerState, records: list[PeerRecord], now: float, heard: Mapping[str, Heard],
         priming: AbstractSet[str], proven: Callable[[], Collection[str]] = frozenset, due: bool = True,
         short: Callable[[int], bool] = lambda answered: False) -> tuple[PingerState, Polled, list[Action]]:
    """One look of the loop at the pings, for a round's decision: an :class:`Answer` when the decision may go on,
    else :class:`Waiting` (why), and the pings to start.

    ``proven()``: peers whose own reports just showed them at work (they averaged or fetched the committed step,
    and heartbeat): they are not pinged again, nor are peers whose answer to their first ping (:class:`Heard`) came
    after the last decision took its answer, within ``primed_s`` of the pings' start, at the address they still
    announce, nor peers whose first ping is on its way (``priming``). With no one left to ping, the answer is at
    once. It is called only when needed (at most once a poll): at 1,000 peers it is not free.

    Only peers in ``records`` are in an answer: one evicted (or gone) while the pings ran is in no round decided
    after that (a lie proven in the tick that decided a rerun: the liar, pinged before, was named a shard owner,
    and every honest peer waited 4.6 s for a shard nobody would reduce).

    Not ``due`` (the decision is not due yet: the round just committed, its members still report it), the pings
    start and their answer is kept for the decision, not taken: at 1,000 peers the newcomers' pings were most
    of a decision's time, and the committed round's settling is time enough for them (up to ``settle_s``).
    Once due, who is in is looked at again: a peer proven then but not now is pinged by the decision (a member
    killed while the round settled: a swarm test caught the round after it decided with the dead member in); a
    newcomer since is in on its own first answer, else in the next round.

    ``short(answered)``: wait on (a fresh start short of ``min_peers``)? The answer is kept, not taken, and the
    peers it lacks are pinged again (each once in ``ping_timeout_s``); each newcomer is in once its own first answer is.
    (Taken and pinged anew, a short answer of the first round after 1,000 joins cost 1.2 s more: it spent every
    newcomer's answer, and all 960 were pinged again.)"""
    if state.pinging:
        return state, Waiting(Why.IN_FLIGHT), []
    kept, rules = state.kept, state.rules
    if kept is not None and now - kept.aged_from > rules.max_age_s:
        kept = None  # (too old to prove anyone alive: pinged again)
    if kept is not None and not due:
        if now - state.rechecked >= rules.recheck_s and records:  # (else it looks at no peer)
            state = replace(state, rechecked=now)  # (proofs that lapse while the round settles: pinged now, not once due)
            if unasked := sort(state, kept, records, set(proven()), heard, priming).unasked:
                return _ping(state, unasked)
        return state, Waiting(Why.NOT_DUE), []
    if kept is None:
        state = replace(state, kept=(kept := Kept(began=now, aged_from=now)))
        since = now - rules.primed_s
        known = set(proven()) | {r.peer_id for r in records if fresh(state, heard, r, since)}
        if todo := [r for r in records if r.peer_id not in known and r.peer_id not in priming]:
            return _ping(state, todo)
        if not due:  # (everyone primed: kept from when the pings would have begun, see test_pinger)
            return state, Waiting(Why.NOT_DUE), []
    return _offer(state, kept, records, now, heard, priming, proven, short)


def _offer(state: PingerState, kept: Kept, records: list[PeerRecord], now: float, heard: Mapping[str, Heard],
           priming: AbstractSet[str], proven: Callable[[], Collection[str]],
           short: Callable[[int], bool]) -> tuple[PingerState, Polled, list[Action]]:
    """A due decision's look at the kept answer: ping whom it lacks, wait on (short), or take it."""
    if kept.proven is None:
        kept = replace(kept, proven=frozenset(proven()))
    assert kept.proven is not None
    state = replace(state, kept=kept)
    got = sort(state, kept, records, kept.proven, heard, priming)
    if got.unasked:
        return _ping(state, got.unasked)
    if short(len(got.there)) and got.missing:
        again = [r for r in got.missing  # (busy when pinged, or joined since: their own pings, not everyone's again)
                 if r.peer_id not in priming and now - kept.repinged.get(r.peer_id, NEVER) > state.rules.ping_timeout_s]
        kept = replace(kept, short=True, repinged={**kept.repinged, **{r.peer_id: now for r in again}})
        return replace(state, kept=kept), Waiting(Why.SHORT), [Prime(tuple(again))] if again else []
    return replace(state, kept=None, taken=now), Answer(got.there, kept.began), []


def _ping(state: PingerState, todo: list[PeerRecord]) -> tuple[PingerState, Polled, list[Action]]:
    return replace(state, pinging=True), Waiting(Why.STARTED), [PingAll(tuple(todo))]


def pinged(state: PingerState, asked: Collection[str], answered: Collection[str], now: float) -> PingerState:
    """The decision's pings are in: ``asked`` were pinged, ``answered`` answered. Its age stays that of its first
    pings, however many after."""
    kept = state.kept
    if kept is not None:
        kept = replace(kept, answered=kept.answered | frozenset(answered), asked=kept.asked | frozenset(asked),
                       aged_from=kept.aged_from if kept.asked else now)
    return replace(state, kept=kept, pinging=False)


def wakes(state: PingerState, now: float) -> tuple[PingerState, bool]:
    """A newcomer's answer just came: wake the loop? Only a fresh start waiting for its min_peers (the answer may
    be the one), and at most each ``wake_s``."""
    if state.kept is None or not state.kept.short or now - state.woke < state.rules.wake_s:
        return state, False
    return replace(state, woke=now), True


def pruned(state: PingerState, heard: Mapping[str, Heard], now: float) -> tuple[PingerState, dict[str, Heard]] | None:
    """The newcomers' answers worth holding, once past ``prune_at`` (else None: hold them all). Spent answers (before
    the last decision took its answer) and stale ones (too old to count for any decision still to come) prove
    nothing. Each answer comes alone: the bound doubles with what is left, so the pass over them is amortised."""
    if len(heard) <= state.prune_at:
        return None
    r = state.rules
    keep_after = max(state.taken, now - r.primed_s - r.max_age_s - r.ping_timeout_s)
    kept = {pid: h for pid, h in heard.items() if h.at > keep_after}
    return replace(state, prune_at=max(PRUNE_FLOOR, 2 * len(kept))), kept
