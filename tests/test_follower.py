"""A peer's side of the round lifecycle: what the follower does for each plan it can see."""

from __future__ import annotations

from potluck.compression.transfer import Target
from potluck.peer.follower import Finish, Follower, Held, Recover, Switch, Train, Wait
from potluck.peer.outer.recovery import find_sources
from potluck.protos import potluck_pb2 as pb
from potluck.protos.wire.records import Member, Plan, Round

ME = "me"


def rnd(step: int, epoch: int = 0, stage: int = 0, base: str = "", stages: int = 1, members: tuple = (ME, "x")) -> Round:
    ms = [Member(peer_id=p, address=f"{p}:1", stage=stage if p == ME else 0, replica=i) for i, p in enumerate(members)]
    return Round(step=step, members=ms, base_hash=base if stage == 0 else "", stages=stages, epoch=epoch,
                 base_hashes=[base] * stages if stages > 1 else [])


def plan(*rounds: Round, seq: int = 1) -> Plan:
    return Plan(seq=seq, rounds=list(rounds))


def held(version: int, h: str = "", epoch: int = 0, stage: int = 0, at: float = 0.0) -> Held:
    return Held(version, h or f"h{version}", stage, epoch, at)


def follower(pipelined: bool = False) -> Follower:
    return Follower(ME, pipelined=pipelined, plan_wait_s=10.0)


def test_not_admitted_yet_waits_and_the_run_over_finishes() -> None:
    assert isinstance(follower().next(None, held(0), 0), Wait)
    assert isinstance(follower().next(plan(rnd(1, members=("x", "y"))), held(0), 0), Wait)
    assert isinstance(follower().next(plan(rnd(1)), held(0), 0, finished=True), Finish)


def test_the_round_for_the_next_step_from_the_held_state_is_trained() -> None:
    r = rnd(4, base="h3")
    assert follower().next(plan(r), held(3), 0) == Train(r, 4)


def test_behind_or_different_means_recover_exactly_the_rounds_base() -> None:
    assert follower().next(plan(rnd(6, base="h5")), held(3), 0) == Recover(5, "h5", follower().next(
        plan(rnd(6, base="h5")), held(3), 0).reason)
    want = follower().next(plan(rnd(4, base="good")), held(3, "bad"), 0)
    assert isinstance(want, Recover) and (want.version, want.state_hash) == (3, "good") and "differs" in want.reason


def test_a_rollback_overtakes_a_state_of_an_abandoned_epoch() -> None:
    """Round 4 failed after this peer committed it; the coordinator decided it again in epoch 1."""
    want = follower().next(plan(rnd(4, epoch=1, base="h3")), held(4, "h4-old", epoch=0), 0)
    assert isinstance(want, Recover) and (want.version, want.state_hash) == (3, "h3") and "rolled back" in want.reason
    # deeper: the run went back to the checkpoint of v2 while this peer was at v5
    want = follower().next(plan(rnd(3, epoch=2, base="c2")), held(5, epoch=1), 0)
    assert isinstance(want, Recover) and want.version == 2
    # the same epoch, ahead of the last decided round: the coordinator is away, not rolling back
    assert follower().next(plan(rnd(4, epoch=1, base="h3")), held(6, epoch=1), 0) == Train(rnd(4, epoch=1, base="h3"), 7)


def test_a_pipeline_waits_for_the_coordinators_round_but_not_forever() -> None:
    r = rnd(4, stages=2, base="h3")
    f = follower(pipelined=True)
    assert isinstance(f.next(plan(r), held(4, at=100.0), 105.0), Wait)
    assert f.next(plan(r), held(4, at=100.0), 111.0) == Train(r, 5)  # coordinator away: the last grid
    assert follower().next(plan(rnd(4)), held(4), 0) == Train(rnd(4), 5)  # one stage needs nobody to start


def test_moved_to_another_stage_switches_first() -> None:
    assert follower().next(plan(rnd(4, stage=1, stages=2)), held(3, stage=0), 0) == Switch(1)


def test_a_failed_step_is_fetched_from_others_then_run_again() -> None:
    f = follower()
    r = rnd(4, base="h3")
    f.failed(4, now=50.0)
    want = f.next(plan(r), held(3), 55.0)
    assert isinstance(want, Recover) and want.version is None  # anything newer than v3
    assert f.next(plan(r), held(3), 61.0) == Train(r, 4)  # nobody got past it within plan_wait_s


def test_a_step_that_failed_in_an_abandoned_epoch_is_trained_in_the_new_one() -> None:
    """Step 3 of epoch 0 failed here (a rollback to v0 abandoned it); back at step 3 in epoch 1, a second later,
    the peer trains it: nobody committed it in this epoch (it spent plan_wait_s "fetching it from a member that
    committed it" while the others averaged it without it, in every lying owner's run)."""
    f = follower()
    f.failed(3, now=0.0, epoch=0)
    r = rnd(3, epoch=1, base="h2")
    assert f.next(plan(r), held(2, epoch=1), 1.0) == Train(r, 3)
    f.failed(3, now=2.0, epoch=1)  # (and one that failed in this epoch is fetched first, as before)
    assert isinstance(f.next(plan(r), held(2, epoch=1), 3.0), Recover)


def test_resolve_picks_the_explicit_round_or_the_last_plans_members() -> None:
    f = follower()
    assert f.resolve(plan(rnd(4, base="h3")), 4, 0, "h3", 0) == rnd(4, base="h3")
    assert f.resolve(plan(rnd(4, base="h3")), 6, 0, "h5", 0) == rnd(4, base="h3")  # coordinator away
    assert f.resolve(plan(rnd(4, base="h3")), 4, 0, "other", 0) is None  # not from the state it holds
    assert f.resolve(plan(rnd(4, members=("x", "y"))), 4, 0, "h3", 0) is None  # not a member


def test_a_rollback_that_lands_while_a_step_trains_is_not_trained_on() -> None:
    """The plan's newest round is the rerun of step 1 in epoch 1 (a proven lie was undone) while this peer,
    still on epoch 0, trained step 4 on the last plan: it must not average step 4 with that round's members
    (two honest peers did, and carried the abandoned epoch's state into the new one, untrained, to the end)."""
    f = follower()
    rerun = rnd(1, epoch=1)
    assert f.resolve(plan(rerun), 4, 0, "h3", 0) is None
    assert isinstance(f.next(plan(rerun), held(3), 0.0), Recover)  # and next it recovers v0
    assert f.resolve(plan(rerun), 1, 0, "h0", 0) == rerun  # the rerun itself, from a state it holds: joins
    assert f.resolve(plan(rerun), 5, 0, "h4", 1) == rerun  # its own epoch's last plan: the coordinator is away


def test_a_step_that_failed_here_is_not_fetched_from_peers_still_on_an_abandoned_epoch() -> None:
    """After a rollback, peers that have not seen it yet serve newer versions of the abandoned epoch: a step that
    failed here is fetched only from states of the plan's epoch (a peer fetched v3 of epoch 0 again and again)."""
    f = follower()
    f.failed(1, now=0.0, epoch=1)
    want = f.next(plan(rnd(1, epoch=1)), held(0, epoch=1), 1.0)
    assert isinstance(want, Recover) and want.version is None and want.epoch == 1
    served = {"old": pb.StateInfo(version=3, state_hash="a", meta_json='{"epoch": 0}'),
              "new": pb.StateInfo(version=1, state_hash="b", meta_json='{"epoch": 1}')}

    class Client:
        def get_state_info(self, address: str, request: pb.StateInfoRequest, timeout: float, peer: str = "") -> pb.StateInfo:
            return served[peer]

    targets = [Target("old", "old:1"), Target("new", "new:1")]
    assert [s.target.peer_id for s in find_sources(Client(), pb.Header(), targets, 0, want, 0)] == ["new"]  # type: ignore[arg-type]


def test_a_plans_newest_epoch_starts_where_the_run_went_back_to() -> None:
    """What a peer's all-reduce learns of each new plan: an older epoch's round at or past (1, 1) was abandoned."""
    assert plan(rnd(2), rnd(3), rnd(1, epoch=1), rnd(2, epoch=1)).newest_epoch() == (1, 1)
    assert plan(rnd(4), rnd(5)).newest_epoch() == (0, 4) and Plan(seq=1, rounds=[]).newest_epoch() == (0, 0)


def test_a_peer_gives_up_only_after_the_coordinator_was_away_its_timeout() -> None:
    """Without the coordinator a peer trains on the last plan; past ``coordinator_timeout_s`` of silence it stops
    (exit code 3, the reason on its goodbye), and with 0 it never does."""
    from potluck.peer.follower import GiveUp

    f = Follower("me", pipelined=False, plan_wait_s=1.0, coordinator_timeout_s=600.0)
    plan = Plan(seq=1, rounds=[Round(step=1, members=[Member(peer_id="me", address="a:1")])])
    held = Held(version=3, digest="h", stage=0, epoch=0, committed_at=0.0)
    assert isinstance(f.next(plan, held, 100.0, silent_s=599.0), Train)
    gave_up = f.next(plan, held, 100.0, silent_s=601.0)
    assert isinstance(gave_up, GiveUp) and "601 s" in gave_up.reason and "coordinator_timeout_s" in gave_up.reason
    forever = Follower("me", pipelined=False, plan_wait_s=1.0, coordinator_timeout_s=0.0)
    assert isinstance(forever.next(plan, held, 100.0, silent_s=1e9), Train)


def test_a_restarted_process_sits_out_the_step_its_key_was_in_and_trains_the_next() -> None:
    """A key restarted while a member of the round running (decided before this process started) may have receipted
    contributions in its previous process: this one sits that step out and trains from the next. A round decided
    after the start, a rollback's new epoch of the same step, or a process whose start is unknown, trains."""
    before = rnd(7, base="h6").model_copy(update={"decided_at": 100.0})
    f = Follower(ME, pipelined=False, plan_wait_s=10.0, started_at=150.0)
    sat = f.next(plan(before), held(6), 0)
    assert isinstance(sat, Wait) and "restarted during step 7" in sat.reason
    assert isinstance(f.next(plan(before), held(6), 0), Wait), "still sat out"
    after = rnd(8, base="h7").model_copy(update={"decided_at": 160.0})
    assert f.next(plan(after), held(7), 0) == Train(after, 8)
    rolled = rnd(7, epoch=1, base="h6").model_copy(update={"decided_at": 100.0})
    assert f.next(plan(rolled), held(6, epoch=1), 0) == Train(rolled, 7), "another epoch: receipts name the epoch"
    fresh = Follower(ME, pipelined=False, plan_wait_s=10.0, started_at=50.0)
    assert fresh.next(plan(before), held(6), 0) == Train(before, 7), "decided after the start"
    assert follower().next(plan(before), held(6), 0) == Train(before, 7), "start unknown"
