"""What a :class:`~potluck.protos.wire.records.Round` looks up often, indexed once per member list: its members by id
and by stage and group, its shares by replica. A coordinator of 1,000 peers asks a round these several times per
report per tick."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from potluck.protos.wire.records import Member, Share


class MemberIndex:
    """A round's members by id (and shares by replica): a cache, not state, so any two compare equal (a
    round's equality is its fields'). It remembers the lists it indexes, so a copy given others rebuilds it."""

    __slots__ = ("source", "count", "by_id", "shares", "share_count", "by_replica", "before", "total", "cells", "read")

    def __init__(self, members: list[Member] | None = None) -> None:
        self.source, self.count = members, len(members or ())
        self.by_id: dict[str, Member] = {}
        for m in members or ():
            self.by_id.setdefault(m.peer_id, m)  # the first, as a scan would find
        self.cells: dict[tuple[int, int | None], list[Member]] | None = None  # (stage, group or None) -> members
        self.shares: list[Share] | None = None
        self.share_count = 0
        self.by_replica: dict[int, Share] = {}
        self.before: dict[int, int] = {}  # samples of the shares of lower replicas
        self.total = 0  # samples of all shares
        self.read: tuple[list[tuple[int, int]], tuple[int, int], list[tuple[int, int]], list[int]] | None = None

    def reads(self, pool: list[tuple[int, int]], last: tuple[int, int]) -> tuple[list[tuple[int, int]], list[int]]:
        """What later steps on the round's plan read: ``pool``'s spans then ``last``, and the offset each begins at;
        made once per pool."""
        if self.read is None or self.read[0] is not pool or self.read[1] != last or len(self.read[2]) != len(pool) + 1:
            segments, starts, at = [*pool, last], [], 0
            for x, y in segments:
                starts.append(at)
                at += y - x
            self.read = (pool, last, segments, starts)
        return self.read[2], self.read[3]

    def grouped(self) -> dict[tuple[int, int | None], list[Member]]:
        """Each stage's members (``(stage, None)``) and each group's (``(stage, group)``), in replica order, sorted
        once per member list (at 1,000 members in 250 groups, a scan of them all per group made judging a step
        O(members x groups))."""
        if self.cells is None:
            self.cells = {}
            for m in sorted(self.source or (), key=lambda m: (m.stage, m.replica)):
                self.cells.setdefault((m.stage, None), []).append(m)
                self.cells.setdefault((m.stage, m.group), []).append(m)
        return self.cells

    def index_shares(self, shares: list[Share]) -> None:
        self.shares, self.share_count, self.by_replica = shares, len(shares), {}
        for s in shares:
            self.by_replica.setdefault(s.replica, s)
        self.before, self.total, at = {}, sum(s.later for s in shares), 0  # (what each later step reads)
        for s in sorted(shares, key=lambda s: s.replica):
            self.before.setdefault(s.replica, at)
            at += s.later

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MemberIndex)

    __hash__ = None  # type: ignore[assignment]
