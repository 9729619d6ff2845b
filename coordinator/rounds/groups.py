"""Grouped averaging (Moshpit SGD, Ryabinin et al. 2021): which members of a stage average together.

An all-reduce of all ``R`` replicas of a stage is ``R x (R - 1)`` streams a step, and its slowest
member holds up everyone's shard. With ``sync.group_size = G`` the coordinator splits each stage's
members into ``k = ceil(R / G)`` groups of at most ``G`` (as equal as they come), and each group runs
the ordinary all-reduce on its own. Two partitions take turns, by the parity of the step, over the
members in replica order laid out row by row on a ``k``-row grid::

    odd steps:   rows       group = row                    (contiguous blocks of replicas)
    even steps:  diagonals  group = (row + column) mod k   (one member of each row, for R <= G^2)

A diagonal holds one member of every row when the rows are at most ``k`` long (``R <= G^2``), so
two steps average every member's state into every other's, exactly as Moshpit's 2-D grid. Past
``G^2`` a diagonal spans ``G`` consecutive rows: every member still reaches every other, over more
steps.

**Why two partitions, and the group's base state.** Members of different groups hold different
``theta_global`` after a step, and a group averages *states* (see :mod:`potluck.peer.outer.outer`): to
send small int8 differences rather than whole parameters, its members need one state they all hold
bit for bit to take the differences from. With two partitions taking turns, a group of step ``t``
is a group of step ``t - 2`` too, so its members all hold that step's common result as their
*previous* state, which every peer keeps anyway. The coordinator names that base per group
(:class:`~potluck.protos.wire.records.GroupBase`), chosen from what the members report holding: the
(version, hash) most of the group holds, then the newest; a member that lacks it (a joiner, a
member whose group changed with the membership) fetches it from one that has it.

Nothing here does I/O: :func:`assign` is a function of the placed members, the step and the
members' holdings.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

from potluck.protos.wire.records import GroupBase, Member

Holding = tuple[int, str]  # (version, state hash)


def group_count(members: int, group_size: int) -> int:
    """How many groups ``members`` form, each of at most ``group_size``; 1 when grouping is off (0)."""
    if group_size <= 0 or members <= group_size:
        return 1
    return -(-members // group_size)


def partition(members: int, group_size: int, step: int) -> list[int]:
    """The group of each of ``members`` positions (replica order) in ``step``: rows on odd steps,
    diagonals on even ones (see the module). Groups are numbered 0..k-1, sizes differ by one at most."""
    k = group_count(members, group_size)
    if k == 1:
        return [0] * members
    per, extra = divmod(members, k)
    cells = [(row, col) for row in range(k) for col in range(per + (1 if row < extra else 0))]
    return [row if step % 2 == 1 else (row + col) % k for row, col in cells]


def choose_base(group: Sequence[str], holdings: Mapping[str, Sequence[Holding]], step: int) -> Holding:
    """The state a group starts ``step`` from: among the versions ``step - 2`` and ``step - 1`` its
    members hold (current or previous state), the one most of them hold, then the older (what a peer
    expects before the round arrives: a group of two steps before holds both, and a group that is the
    whole stage too). With no report of any (a coordinator just restarted, say): ``(step - 1, '')``,
    each member's own state."""
    votes: Counter[Holding] = Counter()
    for pid in group:
        for held in set(holdings.get(pid, ())):
            if held[1] and step - 2 <= held[0] <= step - 1:
                votes[held] += 1
    if not votes:
        return max(step - 1, 0), ""
    return max(votes, key=lambda h: (votes[h], -h[0], h[1]))


def assign(members: Sequence[Member], step: int, group_size: int,
           holdings: Mapping[str, Sequence[Holding]]) -> tuple[list[Member], list[GroupBase]]:
    """``members`` with their group for ``step``, and each group's base state. With ``group_size`` 0 the
    members are returned as they are (all in group 0) and no base is named: today's one-group round."""
    if group_size <= 0:
        return list(members), []
    out: list[Member] = []
    bases: list[GroupBase] = []
    for stage in sorted({m.stage for m in members}):
        cells = sorted((m for m in members if m.stage == stage), key=lambda m: m.replica)
        groups = partition(len(cells), group_size, step)
        out += [m.model_copy(update={"group": g}) for m, g in zip(cells, groups, strict=True)]
        for g in range(max(groups) + 1):
            version, hash_ = choose_base([m.peer_id for m, mg in zip(cells, groups, strict=True) if mg == g],
                                        holdings, step)
            bases.append(GroupBase(stage=stage, group=g, version=version, hash=hash_))
    return out, bases
