"""Horizons (issue 45): how long until the next outer step, the run's end and a waiting peer's place, from the
steps measured so far; against numpy's median of the commit gaps, on the page's snapshot, in ``potluck status``
and in a waiting peer's own line."""

from __future__ import annotations

import numpy as np
import pytest
from fake_state import make_state

from potluck.coordinator.status.horizons import RECENT, clock, horizon, step_length
from potluck.coordinator.status.status_cli import summary
from potluck.peer.follower import boundary_in
from potluck.protos.wire.records import Member, Plan, Round


def commits(times: list[float], first: int = 1) -> list[dict[str, float]]:
    return [{"step": first + i, "t": t} for i, t in enumerate(times)]


def test_nothing_is_measured_before_the_first_commit() -> None:
    assert step_length([]) is None
    assert horizon([], 0, 10, now=100.0, started_at=50.0) == {"outer_step_s": None, "next_step_in_s": None,
                                                            "overdue_s": None, "end_in_s": None}


def test_the_first_step_is_measured_from_the_runs_start_until_a_second_commit() -> None:
    assert step_length(commits([130.0]), started_at=100.0) == 30.0
    assert step_length(commits([130.0]), started_at=0.0) is None  # (a start not known: nothing to measure from)
    assert step_length(commits([130.0, 140.0]), started_at=100.0) == 10.0  # the joining in step 1 is left out


@pytest.mark.parametrize("seed", range(5))
def test_a_step_is_the_median_of_the_recent_commit_gaps(seed: int) -> None:
    rng = np.random.default_rng(seed)
    times = np.cumsum(rng.uniform(5, 50, size=12)) + 1000.0
    gaps = np.diff(times)[-RECENT:]
    assert step_length(commits(list(times))) == pytest.approx(float(np.median(gaps)))


def test_gaps_across_a_rollback_are_not_steps() -> None:
    """History after a rollback re-runs steps: a gap counts only between consecutive steps."""
    history = [{"step": 1, "t": 10.0}, {"step": 2, "t": 20.0}, {"step": 2, "t": 500.0}, {"step": 3, "t": 510.0}]
    assert step_length(history) == 10.0


def test_next_step_end_and_overdue() -> None:
    history = commits([100.0, 110.0, 120.0])  # steps 1..3, 10 s each
    h = horizon(history, committed=3, total=10, now=124.0)
    assert h == {"outer_step_s": 10.0, "next_step_in_s": pytest.approx(6.0), "overdue_s": 0.0,
                 "end_in_s": pytest.approx(6.0 + 6 * 10.0)}
    late = horizon(history, committed=3, total=10, now=145.0)
    assert late["next_step_in_s"] == 0.0 and late["overdue_s"] == pytest.approx(15.0)
    assert late["end_in_s"] == pytest.approx(60.0)
    done = horizon(history, committed=10, total=10, now=124.0)
    assert done["outer_step_s"] == 10.0 and done["next_step_in_s"] is None and done["end_in_s"] is None
    assert horizon(history, committed=3, total=10, now=124.0, finished=True)["end_in_s"] is None


def test_clock_reads_as_a_person_says_a_wait() -> None:
    assert [clock(s) for s in (None, 4.4, 89, 600, 5 * 3600, 3 * 86400)] == [
        "unknown", "4 s", "89 s", "10 min", "5.0 h", "3.0 days"]


def test_the_snapshot_gives_waiting_peers_their_place_and_status_prints_the_horizon() -> None:
    state = make_state(peers=40, stages=2, replicas=4, steps=12)
    h = state["run"]["horizon"]
    assert h["outer_step_s"] == pytest.approx(5.0) and h["end_in_s"] is not None
    waiting = [p for p in state["peers"] if p["tasklet"] is None and p["state"] in ("waiting", "joining")]
    assert waiting and all(p["place_in_s"] == h["next_step_in_s"] for p in waiting)
    assert all(p["place_in_s"] is None for p in state["peers"] if p not in waiting)
    text = summary(state, peers=0)
    assert "run ends in ~" in text and "(an outer step takes ~5 s)" in text, text
    assert "waiting (place in ~" in text, text


def plan_of(decided: list[tuple[int, float]]) -> Plan:
    member = Member(peer_id="12D3KooW" + "a" * 44, address="127.0.0.1:1", stage=0, replica=0)
    return Plan(seq=1, rounds=[Round(step=s, members=[member], decided_at=t) for s, t in decided])


def test_a_waiting_peer_reads_the_next_boundary_off_the_plan() -> None:
    assert boundary_in(None, 100.0) is None
    assert boundary_in(plan_of([(4, 90.0)]), 100.0) is None  # one round: no step's length yet
    plan = plan_of([(3, 60.0), (4, 80.0), (5, 100.0)])  # a step every 20 s, the newest decided at 100
    assert boundary_in(plan, 105.0) == pytest.approx(15.0)
    assert boundary_in(plan, 150.0) == 0.0  # late: any moment
    assert boundary_in(plan, 50.0) == 20.0  # (a clock behind the coordinator's: never more than a step)
