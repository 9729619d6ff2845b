"""The data cursor: which samples each round's replicas train on, so that none repeats before its epoch ends.

Samples are read in the order of *global positions* (:mod:`potluck.data.order`: position ``g`` is a
sample of epoch ``g div n``, through one seeded permutation per epoch). The positions the committed
model has not trained on yet are the *free* set: everything from the ``frontier`` on, plus a
``pool`` of spans handed back. A cursor is that set; the coordinator keeps one per committed
version, because a version *is* a set of samples trained on:

* **deciding** round ``v``: each stage-0 replica gets ``count`` free positions (H inner steps x
  batch), the pool's first, then the frontier's. The spans ride in the signed round record
  (:class:`~potluck.protos.wire.records.Share`); steps after ``v`` that peers run on the same plan while the
  coordinator is away take consecutive spans from the round's ``data_next`` (:meth:`Round.data_spans`);
* **committing** ``v``: the cursor of ``v`` is the cursor of ``v - 1`` without every span step ``v``
  handed out, plus the spans of replicas whose contributions are *not* in version ``v`` (dead,
  stalled, dropped as too slow, rejected as poison): those samples go back to the pool, and the next
  round takes them first. So does the rest of a share its replica did not get to: a round is a window
  (:mod:`potluck.peer.training.window`), and a slower replica trains the first ``samples`` positions of its
  share, in order, and leaves the others. Which replicas are in a version, and on how many samples,
  the members say in their step reports (the contributors every shard of the all-reduce was averaged
  over, and the samples each one signed for); most reporting members win;
* **failing** and rolling back to ``t``: the cursor of ``t`` again (kept, in the journal, or in the
  checkpoint of ``t``; theta_0 is the empty cursor): samples of the steps undone are free again.

So joins, leaves, deaths, re-plans and coordinator restarts never repeat or skip a sample within an
epoch (``tests/test_cursor.py`` drives 200 such rounds). Like :mod:`.rounds`, nothing here does I/O.

One window is not covered: peers that run ahead on an old plan *past* a step the coordinator then
decides late (a decision lagging more than a whole outer step behind the peers, possible only when
outer steps are shorter than the coordinator's tick) read that later step by the old plan while the
cursor folds it by the new one; with no change of membership and an empty pool the two agree.
Peers reporting the plan they read by would close it.
"""

from __future__ import annotations

import bisect
import functools
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from potluck.protos.runtime.log import get_logger
from potluck.protos.wire.records import Round, Share

log = get_logger(__name__)

Span = tuple[int, int]
Say = tuple[tuple[int, int], ...]  # a stage-0 member's vote: (replica, samples of its share trained on), ...
KEEP_CURSORS = 64  # committed versions whose cursor is kept: a rollback goes back at most to the one before the last
POOL_IN_ROUND = 32  # pool spans a round record carries for later steps (a share read from them stays < 64 spans;
                    # the plan record is <= 64 KiB)
MAX_PIECES = 32  # spans of one replica's share (Share.spans holds at most 64)
MAX_POOL = 4096  # spans in the pool; beyond that the smallest neighbours are merged (never happens in practice)


def merge(spans: Iterable[Span]) -> list[Span]:
    """Sorted, non-empty, non-overlapping spans covering the same positions."""
    out: list[list[int]] = []
    for a, b in sorted(s for s in spans if s[1] > s[0]):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def difference(spans: Sequence[Span], cuts: Sequence[Span]) -> list[Span]:
    """The positions of ``spans`` not in ``cuts`` (both sorted and disjoint, as :func:`merge` makes them), in one
    pass over both (a pass over the pool per cut was 7 ms of a decision at 600 replicas and a pool of 200 spans)."""
    out: list[Span] = []
    j = 0
    for x, y in spans:
        while j < len(cuts) and cuts[j][1] <= x:
            j += 1
        k = j
        while x < y and k < len(cuts) and cuts[k][0] < y:
            a, b = cuts[k]
            if a > x:
                out.append((x, a))
            x = max(x, b)
            k += 1
        if x < y:
            out.append((x, y))
    return out


def untrained(spans: Sequence[Span], samples: int | None) -> list[Span]:
    """What a replica handed ``spans`` did not train on: all of them if it is not in the version (None), none if it
    trained its whole share (0), else everything after its first ``samples`` positions (read in order)."""
    if samples is None:
        return list(spans)
    out: list[Span] = []
    left = samples
    for a, b in spans:
        if left <= 0 and samples:
            out.append((a, b))
        elif samples and left < b - a:
            out.append((a + left, b))
        left -= b - a
    return out


@dataclass(frozen=True)
class Cursor:
    """The positions a version has not trained on: ``frontier`` onwards, and the spans of ``pool``."""

    frontier: int = 0
    pool: tuple[Span, ...] = ()

    def free(self, span: Span) -> bool:
        """Is every position of ``span`` still free?"""
        a, b = span
        if a >= self.frontier:
            return True
        inside = min(b, self.frontier)
        need = inside - a
        pool = self.pool
        if self._ordered:  # (sorted, disjoint: only the spans that can overlap it; a commit at 1,000 replicas asked
            ends = self._ends  # this of each of their shares, and a pass over a pool of 200 spans each was 0.1 s)
            pool = pool[bisect.bisect_right(ends, a):bisect.bisect_left(ends, inside) + 1]
        return sum(max(0, min(y, inside) - max(x, a)) for x, y in pool) == need and b >= a

    @functools.cached_property
    def _ordered(self) -> bool:
        return all(x < y <= z for (x, y), (z, _) in zip(self.pool, self.pool[1:], strict=False))

    @functools.cached_property
    def _ends(self) -> list[int]:
        return [y for _, y in self.pool]

    def take(self, counts: Sequence[int]) -> tuple[list[list[Span]], int]:
        """``counts[i]`` free positions for each replica, in order: the pool's first (lowest first),
        then the frontier's. Returns each replica's spans and the frontier after them."""
        sources = list(self.pool)
        frontier, out = self.frontier, []
        for count in counts:
            mine: list[Span] = []
            while count > 0:
                if sources and len(mine) < MAX_PIECES - 1:  # a fragmented pool: the rest comes from the frontier
                    a, b = sources[0]
                    n = min(count, b - a)
                    mine.append((a, a + n))
                    sources[0] = (a + n, b)
                    if a + n == b:
                        sources.pop(0)
                else:
                    n = count
                    mine.append((frontier, frontier + n))
                    frontier += n
                count -= n
            out.append(merge(mine))
        return out, frontier

    def without(self, spans: Iterable[Span]) -> Cursor:
        """This cursor once ``spans`` were trained on (positions not free are ignored: see :meth:`free`)."""
        pool, frontier, cuts = list(self.pool), self.frontier, merge(spans)
        for a, b in cuts:
            if b > frontier:
                if a > frontier:
                    pool.append((frontier, a))  # never happens with spans from take(); nothing is lost if it does
                frontier = b
        return Cursor(frontier, tuple(difference(merge(pool), cuts)))

    def with_back(self, spans: Iterable[Span]) -> Cursor:
        """This cursor with ``spans`` free again (the samples were handed out but not trained into the version)."""
        pool = merge([*self.pool, *(s for s in spans if s[0] < self.frontier)])
        pool = [(a, min(b, self.frontier)) for a, b in pool]
        while len(pool) > MAX_POOL:  # bound the journal; merging two neighbours frees what lies between: a repeat
            i = min(range(len(pool) - 1), key=lambda j: pool[j + 1][0] - pool[j][1])
            pool[i:i + 2] = [(pool[i][0], pool[i + 1][1])]
        return Cursor(self.frontier, tuple(pool))

    def to_json(self) -> dict[str, Any]:
        return {"frontier": self.frontier, "pool": [list(s) for s in self.pool]}

    @classmethod
    def from_json(cls, value: dict[str, Any] | None) -> Cursor:
        if not value:
            return cls()
        return cls(int(value.get("frontier", 0)), tuple(merge((int(a), int(b)) for a, b in value.get("pool", []))))


@dataclass
class DataCursor:
    """One :class:`Cursor` per committed version, and what the members say each version holds."""

    per_replica: int  # samples a replica trains on in one outer step: inner_steps x batch_size
    at: dict[int, Cursor] = field(default_factory=lambda: {0: Cursor()})
    _votes: dict[tuple[int, int], dict[str, Say]] = field(default_factory=dict)  # (step, epoch) -> peer -> say
    _says: dict[tuple[int, int], dict[Say, Say]] = field(default_factory=dict)  # ... -> say -> itself
    repeats: int = 0  # positions a step was handed that were not free (a bug if ever > 0; counted, logged)
    returned: int = 0  # positions handed back to the pool since this process started (dead, stalled, rejected)
    _kept: Any = field(default=None, compare=False, repr=False)  # (key, (base, round), what _held made of them)

    # ------------------------------------------------------------------ views

    def cursor(self, version: int) -> Cursor | None:
        return self.at.get(version)

    def newest(self) -> Cursor:
        return self.at[max(self.at)] if self.at else Cursor()

    # ------------------------------------------------------------------ transitions

    def assign(self, committed: int, stage0: Sequence[tuple[str, int]], prev: Round | None = None,
               epoch: int = 0, sizes: Mapping[str, int] | None = None) -> tuple[list[Share], int, list[tuple[int, int]]]:
        """The shares of round ``committed + 1`` for its stage-0 members (``(peer, replica)``), the
        frontier after them, and the pool left (which later steps on the round's plan read first). ``sizes``:
        the samples each member's speed fits in a round's window (default, and at most: ``per_replica``), what a
        newcomer's share holds and what each later step on this plan reads (:attr:`Share.next`).

        Peers of one stage do not wait for this round: they start the step at once on the plan they
        hold (``prev``, in the same epoch), reading ``prev.data_spans(committed + 1, their old replica)``.
        So a member that was in ``prev``'s stage 0 keeps exactly those spans, whatever replica it gets
        now, and whichever plan it trains the step on, it reads the same samples. The spans of ``prev``'s
        replicas nobody continues go back to the pool, and newcomers take the pool's first, then fresh ones.
        """
        base = self.at.get(committed)
        if base is None:
            log.warning("no data cursor of v%d: handing out samples from the newest one kept", committed)
            base = self.newest()
        step, carried = committed + 1, {}
        if prev is not None and prev.shares and prev.epoch == epoch and prev.step <= step:
            old, block, rest = self._held(base, step, prev)
            carried = {peer: block[old[peer]] for peer, _ in stage0 if old.get(peer) in block}
            if rest is not None:
                kept = {old[peer] for peer in carried}
                base = rest.with_back([x for r, spans in block.items() if r not in kept for x in spans])
            else:  # not where the cursor stands (a journal from before, a bug): hand out fresh samples
                carried = {}
        size = {peer: max(1, min(self.per_replica, (sizes or {}).get(peer, self.per_replica))) for peer, _ in stage0}
        fresh = [(peer, replica) for peer, replica in stage0 if peer not in carried]
        spans, data_next = base.take([size[peer] for peer, _ in fresh])
        given = {replica: s for (_, replica), s in zip(fresh, spans, strict=True)}
        shares = []
        for peer, replica in sorted(stage0, key=lambda pr: pr[1]):
            mine = carried[peer] if peer in carried else given[replica]
            shares.append(Share.made(replica, sum(b - a for a, b in mine), mine,
                                     next=size[peer] if size[peer] != self.per_replica else 0))
        after = base.without([(a, b) for share in shares for a, b in share.spans])
        return shares, after.frontier, list(after.pool[:POOL_IN_ROUND])

    def warm(self, committed: int, prev: Round | None, epoch: int) -> None:
        """Make now what :meth:`assign` of round ``committed + 1`` will need of the round before and the cursor (while
        that round settles: at 1,000 replicas, each one's spans were a third of a decision's tick)."""
        base = self.at.get(committed)
        if base is not None and prev is not None and prev.shares and prev.epoch == epoch and prev.step <= committed + 1:
            self._held(base, committed + 1, prev)

    def _held(self, base: Cursor, step: int, prev: Round) -> tuple[dict[str, int], dict[int, list[Span]], Cursor | None]:
        """What ``prev``'s stage-0 replicas read at ``step`` on its plan: (peer -> its replica in ``prev``, replica ->
        its spans, ``base`` less all of them, or None when they are not all free there); kept for the same arguments."""
        key = (id(base), step, id(prev))
        if self._kept is None or self._kept[0] != key or self._kept[1][0] is not base or self._kept[1][1] is not prev:
            old = {m.peer_id: m.replica for m in prev.members if m.stage == 0}
            block = {s.replica: prev.data_spans(step, s.replica) for s in prev.shares}
            handed = merge(x for spans in block.values() for x in spans)  # (asked of the few spans they merge into,
            rest = base.without(handed) if all(base.free(span) for span in handed) else None  # not of each replica's)
            self._kept = (key, (base, prev), (old, block, rest))
        return self._kept[2]

    def vote(self, step: int, epoch: int, peer: str, included: Sequence[int], samples: Sequence[int] = ()) -> None:
        """Stage-0 member ``peer`` of ``step`` (made in ``epoch``) says which replicas the version holds, and on how
        many samples each (in the order of ``included``; 0 or none: its whole share)."""
        counts = dict(zip(included, samples, strict=False)) if len(samples) == len(included) else {}
        say = tuple(sorted((int(r), max(0, int(counts.get(r, 0)))) for r in set(included)))[:4096]
        # one object for the same say (the honest members of a step all say the same replicas): kept once, not
        # once per voter (a thousand tuples of a thousand replicas a step), and counted once in included()
        says, votes = self._says.setdefault((step, epoch), {}), self._votes.setdefault((step, epoch), {})
        votes[peer] = say = says.setdefault(say, say)
        if len(says) > 2 * len(votes) + 16:  # (a voter that changes its say at every heartbeat: only the current ones)
            self._says[(step, epoch)] = {v: v for v in votes.values()}

    def included(self, rnd: Round, step: int, round_at: Callable[[int], Round | None]) -> set[int]:
        """The replicas of ``rnd`` whose samples version ``step`` holds: all but those a strict majority
        of the round's voting stage-0 members leave out (a tie keeps a replica: its samples count as
        trained, so one liar cannot make honest samples repeat). With grouped averaging only the members
        of a replica's own group vote on it (the others' versions never held it). With no vote for the
        step (peers ran ahead more steps than their reports remember), the nearest step run on the same
        round answers."""
        return set(self.tally(rnd, step, round_at))

    def tally(self, rnd: Round, step: int, round_at: Callable[[int], Round | None]) -> dict[int, int]:
        """:meth:`included`, each with the samples of its share it trained on: what most of its voters say (the
        larger of a tie: a sample counted as trained is never handed out twice); 0: its whole share."""
        replicas = [s.replica for s in rnd.shares]
        group_of = {m.peer_id: m.group for m in rnd.members if m.stage == 0}
        replica_group = {m.replica: m.group for m in rnd.members if m.stage == 0}
        probes = [v for v in range(max(rnd.step, step - KEEP_CURSORS), step + KEEP_CURSORS) if round_at(v) is rnd]
        for probe in sorted(probes, key=lambda v: (abs(v - step), -v)):
            votes = self._votes.get((probe, rnd.epoch), {})
            if votes:  # (counted once per group: a thousand votes of a thousand replicas each, scanned per replica, took minutes)
                counts: dict[int, Counter[int]] = {}
                worked: dict[int, Counter[int]] = {}  # replica -> samples said -> voters saying it
                voters: Counter[int] = Counter()
                same: dict[tuple[int, int], list[Any]] = {}  # (group, the say's object) -> [say, voters saying it]
                for p, v in votes.items():
                    g = group_of.get(p, 0)
                    voters[g] += 1
                    if (seen := same.get((g, id(v)))) is None:
                        same[(g, id(v))] = [v, 1]
                    else:
                        seen[1] += 1
                for (g, _), (v, n) in same.items():  # (each say once: a thousand of a thousand replicas was 1M counts)
                    counts.setdefault(g, Counter()).update(dict.fromkeys((r for r, _ in v), n))
                    for r, samples in v:
                        worked.setdefault(r, Counter())[samples] += n
                kept = [r for r in replicas
                        if 2 * counts.get(replica_group.get(r, 0), Counter())[r] >= voters[replica_group.get(r, 0)]]
                return {r: max(worked[r].items(), key=lambda kv: (kv[1], kv[0]))[0] if r in worked else 0 for r in kept}
        return dict.fromkeys(replicas, 0)

    def commit(self, since: int, step: int, round_at: Callable[[int], Round | None]) -> None:
        """Versions ``since + 1 .. step`` were committed: fold each one's samples in, in order (at most
        the last ``KEEP_CURSORS`` of them: before those, the newest cursor carries over)."""
        for v in range(max(since + 1, step - KEEP_CURSORS), step + 1):
            base = self.at.get(v - 1)
            rnd = round_at(v)
            if base is None or rnd is None or not rnd.shares:
                log.warning("data cursor of v%d unknown (no cursor of v%d or no round): it carries the newest one",
                            v, v - 1)
                self.at[v] = self.newest()
                continue
            trained = self.tally(rnd, v, round_at)
            handed = [span for s in rnd.shares for span in rnd.data_spans(v, s.replica)]
            missed = 0 if all(base.free(x) for x in merge(handed)) else sum(  # (asked of the few spans they merge
                b - a for a, b in handed if not base.free((a, b)))  # into, not of each of 1,000 replicas' spans)
            if missed:
                self.repeats += missed
                log.error("step %d was handed %d positions already trained on", v, missed)
            back = [span for s in rnd.shares for span in untrained(rnd.data_spans(v, s.replica), trained.get(s.replica))]
            self.at[v] = base.without(handed).with_back(back)
            self.returned += sum(b - a for a, b in back)
        self.prune(step)

    def roll_back(self, version: int, checkpoint: Cursor | None) -> None:
        """The run goes on from ``version``: its cursor is the kept one, the checkpoint's, or (theta_0) empty."""
        cursor = self.at.get(version)
        if cursor is None:
            cursor = checkpoint if checkpoint is not None else Cursor() if version == 0 else None
        if cursor is None:
            log.error("no data cursor of v%d kept: samples since the newest kept one may repeat", version)
            cursor = self.at[max((v for v in self.at if v <= version), default=min(self.at, default=0))] \
                if self.at else Cursor()
        self.at = {v: c for v, c in self.at.items() if v < version}
        self.at[version] = cursor
        self._votes = {k: c for k, c in self._votes.items() if k[0] <= version}
        self._says = {k: c for k, c in self._says.items() if k[0] <= version}

    def prune(self, committed: int) -> None:
        for v in [v for v in self.at if v < committed - KEEP_CURSORS]:
            del self.at[v]
        for k in [k for k in self._votes if k[0] < committed - KEEP_CURSORS]:
            del self._votes[k]
            self._says.pop(k, None)

    def summary(self, committed: int, samples: int | None) -> dict[str, Any]:
        """For the status page: where the committed version stands in the sample order."""
        c = self.at.get(committed) or self.newest()
        pool = sum(b - a for a, b in c.pool)
        return {"samples": samples, "frontier": c.frontier, "pool": pool, "trained": c.frontier - pool,
                "returned": self.returned, "repeats": self.repeats,
                "epoch": (c.frontier - pool) / samples if samples else None}

    # ------------------------------------------------------------------ the journal

    def to_json(self) -> dict[str, Any]:
        return {str(v): c.to_json() for v, c in sorted(self.at.items())}

    def restore(self, value: dict[str, Any] | None, committed: int) -> None:
        """The cursors of a journal; one from before cursors existed starts the order over at ``committed``."""
        self.at = {int(v): Cursor.from_json(c) for v, c in (value or {}).items()}
        if committed not in self.at:
            if committed:
                log.warning("the journal has no data cursor of v%d: the sample order starts over", committed)
            self.at[committed] = Cursor()
