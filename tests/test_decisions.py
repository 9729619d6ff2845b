"""The coordinator loop's decisions (potluck.coordinator.decisions): a pure function of a state and one tick's inputs.
No clock, no threads, no network: each test is values in, values out."""

from __future__ import annotations

import dataclasses

import pytest

from potluck.coordinator.decisions import (
    MAX_JOURNAL_WAITS,
    AdoptCheckpoint,
    Commit,
    Decided,
    Inputs,
    LoopState,
    MarkFinished,
    Note,
    PrintExport,
    Publish,
    RememberPeers,
    RollBack,
    Rules,
    Save,
    Urgency,
    WantCheckpoint,
    Written,
    decide,
)
from potluck.coordinator.rounds.roundevents import Committed, Failed, RolledBack
from potluck.protos.wire.records import Round

RULES = Rules(outer_steps=10, checkpoint_every=4)


def fresh(**kw: object) -> LoopState:
    return dataclasses.replace(LoopState(RULES), **kw)  # type: ignore[arg-type]


def a_round(step: int = 3) -> Round:
    return Round(step=step, members=[])


def kinds(actions: list) -> list[str]:
    return [type(a).__name__ for a in actions]


def test_a_quiet_tick_does_nothing_and_is_called_again_unchanged() -> None:
    state = fresh()
    after, actions = decide(state, Inputs(), now=100.0)
    assert (after, actions) == (state, [])
    assert decide(after, Inputs(), now=1e9) == (state, [])  # (the time alone decides nothing)


def test_the_same_inputs_give_the_same_decision() -> None:
    inputs = Inputs(committed=4, events=(Committed(4, 3, 1.0), Failed(a_round(5), "deadline")), peers_met=True)
    assert decide(fresh(), inputs, 5.0) == decide(fresh(), inputs, 7.0)


def test_a_commit_is_journaled_in_its_tick_and_asks_for_a_checkpoint_at_the_boundary() -> None:
    after, actions = decide(fresh(), Inputs(committed=4, events=(Committed(4, 3, 1.2),)), 0.0)
    assert actions == [Commit(4), WantCheckpoint(4), Save(1)]
    assert (after.saves, after.journal) == (1, Urgency.CLEAN)
    _, actions = decide(fresh(), Inputs(committed=3, events=(Committed(3, 2, 1.2),)), 0.0)
    assert actions == [Commit(3), Save(1)], "no checkpoint between the boundaries"


def test_steps_committed_at_once_across_a_boundary_and_the_last_step_want_a_checkpoint() -> None:
    _, actions = decide(fresh(), Inputs(events=(Committed(9, 2, None),)), 0.0)
    assert WantCheckpoint(9) in actions, "steps 3..9 crossed 4 and 8"
    _, actions = decide(fresh(), Inputs(events=(Committed(10, 9, None),)), 0.0)
    assert WantCheckpoint(10) in actions, "the run's last step"
    _, actions = decide(fresh(rules=Rules(10, 0)), Inputs(events=(Committed(8, 7, None),)), 0.0)
    assert not any(isinstance(a, WantCheckpoint) for a in actions), "checkpoint_every = 0: none"


def test_a_commit_waits_while_the_tick_runs_long_but_at_most_max_waits_ticks() -> None:
    state, actions = decide(fresh(), Inputs(events=(Committed(1, 0, None),), long=True), 0.0)
    assert actions == [Commit(1)] and state.journal == Urgency.DUE
    for i in range(MAX_JOURNAL_WAITS - 1):
        state, actions = decide(state, Inputs(long=True), 0.0)
        assert actions == [], f"wait {i + 2}"
    state, actions = decide(state, Inputs(long=True), 0.0)
    assert actions == [Save(1)] and state.journal == Urgency.CLEAN and state.waited == 0


def test_a_failure_a_rollback_and_the_end_are_journaled_at_once_even_in_a_long_tick() -> None:
    for ev in (Failed(a_round(5), "deadline"), RolledBack(6, 4, "live peers", 2)):
        _, actions = decide(fresh(), Inputs(events=(ev,), long=True), 0.0)
        assert actions[-1] == Save(1), ev
    _, actions = decide(fresh(), Inputs(over=True, committed=10, long=True), 0.0)
    assert actions == [MarkFinished(), Note("finished", "", "run ended at outer step 10"), Save(1)]


def test_a_rollback_is_followed_by_the_auditors_and_said() -> None:
    _, actions = decide(fresh(), Inputs(events=(RolledBack(6, 4, "checkpoint", 3),)), 0.0)
    assert actions == [RollBack(4), Note("rollback", "", "rolled back from step 6 to v4 (checkpoint); epoch 3"), Save(1)]


def test_a_decided_round_is_journaled_then_published_only_once_its_save_is_durable() -> None:
    d = Decided(a_round(3), {"p": (0, 0)}, began=1.0)
    state, actions = decide(fresh(saves=7), Inputs(decided=d), 2.0)
    assert actions == [] and state.holding and state.hurried, "the deciding tick saves nothing; the next at once"
    assert state.publish_after == 8
    state, actions = decide(state, Inputs(durable=7), 2.1)
    assert actions == [Save(8)] and state.holding and not state.hurried
    state, actions = decide(state, Inputs(durable=7), 2.2)
    assert actions == [] and state.holding, "not on the plan before its save is on disk"
    state, actions = decide(state, Inputs(durable=8), 2.3)
    assert actions == [Publish(d)] and not state.holding


def test_a_newer_durable_save_covers_the_decided_round() -> None:
    d = Decided(a_round(3), {}, began=0.0)
    state, _ = decide(fresh(), Inputs(decided=d), 0.0)
    state, _ = decide(state, Inputs(), 0.0)
    state, actions = decide(state, Inputs(events=(Committed(2, 1, None),)), 0.0)
    assert actions[-1] == Save(2)
    state, actions = decide(state, Inputs(durable=2), 0.0)
    assert actions == [Publish(d)]


def test_a_decided_rounds_save_never_waits_for_a_long_tick() -> None:
    state, _ = decide(fresh(), Inputs(decided=Decided(a_round(), {}, 0.0)), 0.0)
    _, actions = decide(state, Inputs(long=True), 0.0)
    assert actions == [Save(1)]


def test_checkpoints_written_are_adopted_and_the_last_prints_the_export_command() -> None:
    _, actions = decide(fresh(), Inputs(checkpoints=(Written(4, "v4.json"),)), 0.0)
    assert actions == [AdoptCheckpoint(4), Note("checkpoint", "", "v4 written to v4.json")]
    _, actions = decide(fresh(), Inputs(checkpoints=(Written(10, "v10.json"),)), 0.0)
    assert kinds(actions) == ["AdoptCheckpoint", "Note", "PrintExport"]
    _, actions = decide(fresh(), Inputs(checkpoints=(Written(6, "v6.json"),), finished=True), 0.0)
    assert PrintExport() in actions, "the admin ended the run: its last checkpoint is the model"


def test_the_end_is_marked_once_and_the_admins_reason_said() -> None:
    _, actions = decide(fresh(), Inputs(over=True, admin=": enough", committed=6), 0.0)
    assert actions[:3] == [Note("admin", "", "run ended by the admin at outer step 6: enough"), MarkFinished(),
                           Note("finished", "", "run ended at outer step 6")]
    _, actions = decide(fresh(), Inputs(over=True, finished=True, committed=6), 0.0)
    assert actions == [], "already finished: nothing again"


def test_newcomers_addresses_history_entries_and_admissions_are_kept_when_the_tick_has_time() -> None:
    _, actions = decide(fresh(), Inputs(peers_met=True), 0.0)
    assert actions == [RememberPeers(), Save(1)]
    assert decide(fresh(), Inputs(history_added=True), 0.0)[1] == [Save(1)]
    assert decide(fresh(), Inputs(admissions_due=True), 0.0)[1] == [Save(1)]
    state, actions = decide(fresh(), Inputs(admissions_due=True, long=True), 0.0)
    assert actions == [] and state.waited == 1


@pytest.mark.parametrize("ev", [Committed(2, 1, None), Failed(a_round(2), "x"), RolledBack(3, 1, "theta_0", 1)])
def test_save_tickets_grow_by_one_per_save(ev: object) -> None:
    state = fresh(saves=41)
    state, actions = decide(state, Inputs(events=(ev,)), 0.0)  # type: ignore[arg-type]
    assert actions[-1] == Save(42) and state.saves == 42
    state, actions = decide(state, Inputs(events=(ev,)), 0.0)  # type: ignore[arg-type]
    assert actions[-1] == Save(43)
