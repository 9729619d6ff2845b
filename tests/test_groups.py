"""Grouped averaging (Moshpit SGD): the coordinator's groups and base states."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from potluck.coordinator.groups import assign, choose_base, group_count, partition
from potluck.protos.records import GroupBase, Member, Round

SIZES = [(n, g) for g in (2, 3, 4, 8) for n in range(1, 70)] + [(1000, 32), (1024, 32), (1024, 8)]


def test_groups_are_balanced_numbered_connected_and_repeat_every_other_step() -> None:
    for n, g in SIZES:
        _check_partitions(n, g)


def _check_partitions(n: int, g: int) -> None:
    k = group_count(n, g)
    for step in (1, 2, 3, 4):
        groups = partition(n, g, step)
        sizes = np.bincount(groups)
        assert len(groups) == n and len(sizes) == k and sizes.min() >= 1
        assert sizes.max() <= g and sizes.max() - sizes.min() <= 1, (n, g, step)
        assert groups == partition(n, g, step + 2), (n, g)  # the group's members all hold its result of 2 steps ago
    rows, diagonals = partition(n, g, 1), partition(n, g, 2)
    parent = list(range(2 * k))  # rows and diagonals sharing a member are linked: one component, or no mixing

    def find(x: int) -> int:
        while parent[x] != x:
            x = parent[x]
        return x

    for r, d in zip(rows, diagonals, strict=True):
        parent[find(r)] = find(k + d)
    assert len({find(x) for x in range(k)}) == 1, (n, g)


def test_grouping_off_is_one_group() -> None:
    assert partition(64, 0, 3) == [0] * 64 and partition(4, 8, 2) == [0] * 4


def moshpit_grid(x: np.ndarray, side: int, steps: int) -> np.ndarray:
    """Moshpit's 2-D grid, written independently: ``side x side`` members, averaged along rows on odd
    steps and along the grid's wrapped diagonals (a Latin square's transversals) on even ones."""
    grid = x.reshape(side, side).astype(np.float64)
    for step in range(1, steps + 1):
        if step % 2 == 1:
            grid = np.repeat(grid.mean(axis=1, keepdims=True), side, axis=1)
        else:
            shifted = np.stack([np.roll(grid[r], r) for r in range(side)])  # diagonal j lands in column j
            means = shifted.mean(axis=0)
            grid = np.stack([np.roll(np.broadcast_to(means, (side,)), -r) for r in range(side)])
    return grid.reshape(-1)


@pytest.mark.parametrize("side", [2, 3, 4, 8])
def test_mixing_matches_the_moshpit_grid_and_reaches_the_mean_in_two_steps(side: int) -> None:
    x = np.random.default_rng(side).normal(size=side * side)
    ours = x.copy()
    for step in range(1, 5):
        groups = np.array(partition(side * side, side, step))
        for j in np.unique(groups):
            ours[groups == j] = ours[groups == j].mean()
        np.testing.assert_allclose(ours, moshpit_grid(x, side, step), rtol=0, atol=1e-12)
    np.testing.assert_allclose(moshpit_grid(x, side, 2), np.full_like(x, x.mean()), atol=1e-12)


def test_base_is_what_most_of_the_group_holds_then_the_newest() -> None:
    holds = {"a": [(4, "x"), (3, "p")], "b": [(4, "y"), (3, "p")], "c": [(4, "x"), (3, "q")], "d": [(2, "old")]}
    assert choose_base(["a", "b"], holds, 5) == (3, "p")  # both hold p (as their previous state)
    assert choose_base(["a", "c"], holds, 5) == (4, "x")  # x and p... x by two, p by one
    assert choose_base(["a", "b", "c"], holds, 5) == (3, "p")  # a tie: the older, the one a peer expects
    assert choose_base(["d"], holds, 5) == (4, "")  # nothing recent: each member's own
    assert choose_base(["a"], {"a": [(4, "")]}, 5) == (4, "")


def test_assign_groups_every_stage_and_names_each_groups_base() -> None:
    cells = [Member(peer_id=f"s{s}r{r}", address="x:1", stage=s, replica=r) for s in range(2) for r in range(4)]
    holds = {m.peer_id: [(3, f"own{m.replica}"), (2, "common")] for m in cells}
    members, bases = assign(cells, 4, 2, holds)
    assert [m.group for m in members if m.stage == 1] == partition(4, 2, 4) == [0, 1, 1, 0]
    assert {(b.stage, b.group, b.version, b.hash) for b in bases} == {(s, g, 2, "common") for s in (0, 1) for g in (0, 1)}
    Round(step=4, members=members, groups=bases)  # a valid round
    assert assign(cells, 4, 0, holds) == (cells, [])


def _round(groups: list[int], bases: list[tuple[int, int]] | None) -> dict:
    members = [{"peer_id": f"p{i}", "address": "x:1", "replica": i, "group": g} for i, g in enumerate(groups)]
    named = [{"stage": s, "group": g, "version": 0, "hash": "h"} for s, g in (bases or [])]
    return {"step": 1, "members": members, "groups": named}


@pytest.mark.parametrize("groups,bases,match", [
    ([0, 2, 2], [(0, 0), (0, 2)], "groups must be numbered 0..k-1"),
    ([0, 1, 1], [(0, 0)], r"missing \[\(0, 1\)\]"),
    ([0, 1, 1], [(0, 0), (0, 1), (0, 2)], r"without members \[\(0, 2\)\]"),
    ([0, 1, 1], [(0, 0), (0, 1), (0, 1)], "twice"),
    ([0, 1, 1], None, "names no group's base"),
    ([0, 0, 0], [(0, 0), (1, 0)], "without members"),
])
def test_a_round_whose_groups_do_not_cover_its_members_is_refused(groups, bases, match) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValidationError, match=match):
        Round.model_validate(_round(groups, bases))


def test_a_groups_base_must_come_before_its_step() -> None:
    data = _round([0, 1], [(0, 0), (0, 1)])
    data["groups"][1]["version"] = 1
    with pytest.raises(ValidationError, match="a version before step 1"):
        Round.model_validate(data)


def test_group_bases_travel_in_the_round_record() -> None:
    r = Round(step=3, members=[Member(peer_id="a", address="x:1", group=0), Member(peer_id="b", address="y:1",
                                                                                 replica=1, group=1)],
              groups=[GroupBase(stage=0, group=0, version=1, hash="h1"), GroupBase(stage=0, group=1, version=2, hash="")])
    back = Round.model_validate_json(r.model_dump_json())
    assert back == r and back.group_base(0, 1) == GroupBase(stage=0, group=1, version=2, hash="")
    assert [m.peer_id for m in back.group_members(0, 1)] == ["b"]
    old = Round.model_validate({"step": 1, "members": [{"peer_id": "a", "address": "x:1"}]})  # an older writer's
    assert old.members[0].group == 0 and old.groups == [] and old.group_base(0, 0) is None
