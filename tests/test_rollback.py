"""Failing and rolling back as values: :mod:`potluck.coordinator.rounds.rollback`'s functions, on their own.

The lifecycle around them (a Rounds applying what they decide) is tested step by step in ``tests/test_rounds.py``;
here each answer is checked against the values it is made of, and that making it changes none of them."""

from __future__ import annotations

import copy

from potluck.coordinator.rounds import rollback
from potluck.coordinator.rounds.roundevents import Checkpoint, Failed, Report, RolledBack
from potluck.protos.wire.records import Member, Round


def round_of(step: int, epoch: int = 0, *peers: tuple[str, int]) -> Round:
    return Round(step=step, epoch=epoch, stages=max((s for _, s in peers), default=0) + 1,
                 members=[Member(peer_id=p, address=f"{p}:1", stage=s) for p, s in peers])


def test_a_round_fails_when_a_stage_empties_after_its_grace_or_goes_silent_or_runs_past_its_deadline() -> None:
    rnd = round_of(4, 0, ("a", 0), ("b", 1))
    both = [Report("a", 0, 3, "h"), Report("b", 1, 3, "h")]
    a_only = [both[0], Report("b", 1, 3, "h", live=False)]
    moving = {"a": ((1,), 9.0), "b": ((1,), 9.0)}

    def why(reports: list[Report], now: float, restored: bool = False, deadline_s: float | None = None) -> str:
        return rollback.failure(rnd, reports, now, started=0.0, restored=restored, progress=moving, grace_s=5.0,
                                floor_s=30.0, factor=4.0, deadline_s=deadline_s)

    assert why(a_only, 4.0) == "" and why(a_only, 5.0) == "stage 1 lost all its members"
    assert why(a_only, 10.0, restored=True) == ""  # (a journaled round's members get REGATHER graces to show up)
    assert why(both, 38.9) == "" and why(both, 39.0).startswith("no member made progress for 30 s")
    assert why(both, 20.0, deadline_s=20.0).startswith("not committed within 20 s (4x")


def test_the_target_is_the_newest_version_every_stage_has_and_a_checkpoint_or_theta_0_below_it() -> None:
    hashes = {0: {3: "s0v3"}, 1: {3: "s1v3"}}
    reports = [Report("a", 0, 4, "s0v4", prev_version=3, prev_hash="s0v3"), Report("b", 1, 3, "s1v3")]

    def target(reports: list[Report], checkpoint: Checkpoint | None = None, ceiling: int | None = None,
               grouped: bool = False) -> tuple[int, str]:
        return rollback.rollback_target(reports, checkpoint, committed=4, stages=2, hashes=hashes, grouped=grouped,
                                        round_at=lambda v: round_of(v, 1), ceiling=ceiling)

    assert target(reports) == (3, "live peers")
    assert target(reports[:1]) == (0, "theta_0") and target(reports[:1], Checkpoint(2, {})) == (2, "checkpoint")
    assert target(reports, ceiling=2) == (0, "theta_0")  # (a retraction goes below the lie, whoever holds it)
    assert target([reports[0], Report("b", 1, 3, "liar")]) == (0, "theta_0")  # (not the canonical hash)
    # grouped averaging: no hash is canonical, but a state of an abandoned epoch (0; its round's is 1) is no base
    a = Report("a", 0, 4, "any", epoch=1, prev_version=3, prev_hash="other")
    assert target([a, Report("b", 1, 3, "another", epoch=1)], grouped=True) == (3, "live peers")
    assert target([a, Report("b", 1, 3, "s1v3", epoch=0)], grouped=True) == (0, "theta_0")


def test_a_rollback_is_a_value_made_without_touching_the_state_it_is_made_of() -> None:
    rnd = round_of(5, 2, ("a", 0), ("b", 0))
    hashes = {0: {3: "v3", 4: "v4"}}
    before = copy.deepcopy(hashes)
    reports = [Report("a", 0, 3, "v3")]
    rb = rollback.decide_rollback(rnd, "gone", reports, Checkpoint(3, {0: "v3"}), committed=4, epoch=2, stages=1,
                                  hashes=hashes, grouped=False, round_at=lambda v: None)
    assert hashes == before
    assert (rb.from_step, rb.target, rb.source, rb.epoch, rb.regather) == (4, 3, "checkpoint", 3, {"a", "b"})
    assert rb.checkpoint == Checkpoint(3, {0: "v3"})  # (of the target: its hashes and cursor are the run's again)
    assert rb.events() == [Failed(rnd, "gone"), RolledBack(4, 3, "checkpoint", 3)]
    assert (rb.outcome(7.0).step, rb.outcome(7.0).rolled_back_to, rb.outcome(7.0).members) == (5, 3, 2)
    # a retry from the committed step undoes nothing: no RolledBack, and a checkpoint of another version is not kept
    retry = rollback.decide_rollback(rnd, "silent", [Report("a", 0, 4, "v4")], Checkpoint(3, {0: "v3"}),
                                     committed=4, epoch=2, stages=1, hashes=hashes, grouped=False,
                                     round_at=lambda v: None)
    assert (retry.target, retry.checkpoint, retry.events()) == (4, None, [Failed(rnd, "silent")])


def test_a_retraction_fails_the_running_round_else_the_one_that_made_the_step() -> None:
    running, maker = round_of(6), round_of(3)
    assert rollback.retracting(3, 5, running, maker) is running
    assert rollback.retracting(3, 5, None, maker) is maker
    assert rollback.retracting(3, 5, None, None) is None
    # a step not committed yet (a proof that came before the slowest member's report): the round running now fails,
    # so the run never takes it; nothing to fail when no round at or before it runs
    assert rollback.retracting(6, 5, running, maker) is running
    assert rollback.retracting(7, 5, running, maker) is running
    assert rollback.retracting(6, 5, None, maker) is None


def test_a_state_is_on_the_line_when_made_in_its_rounds_epoch_or_theta_0_or_of_a_round_no_longer_kept() -> None:
    assert rollback.on_line(Report("a", 0, 3, "h", epoch=2), round_of(3, 2))
    assert not rollback.on_line(Report("a", 0, 3, "h", epoch=1), round_of(3, 2))
    assert rollback.on_line(Report("a", 0, 0, "", epoch=0), round_of(1, 2))
    assert rollback.on_line(Report("a", 0, 3, "h", epoch=1), None)
