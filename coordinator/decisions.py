"""What the coordinator's loop decides, as values: ``decide(state, inputs, now) -> (state, actions)``.

A tick of :class:`~potluck.coordinator.app.Coordinator` has three parts:

1. **gather**: read what happened since the tick before into one :class:`Inputs` (the round lifecycle's
   events, checkpoints written, the run's end, a round just placed, which journal save is durable, whether
   the tick has run long);
2. **decide**: :func:`decide`, pure: no clock (``now`` is an argument), no threads, no I/O; it returns the
   loop's next :class:`LoopState` and the :data:`Action` values to carry out, in order;
3. **carry out**: the executor (``Coordinator._carry_out``) does each action: a journal save handed to the
   writer thread, a plan put in the DHT, a checkpoint asked of the checkpointer, a line in the log.

The round lifecycle's own decisions (a step committed, a round failed, a rollback and to where) are made by
:class:`~potluck.coordinator.rounds.rounds.Rounds`, a state machine given the reports and the time; they reach
:func:`decide` as its events (:mod:`potluck.coordinator.rounds.roundevents`). Where to place the members is the
placement room's, who audits whom the trust room's; this module decides what the loop does with all of it.

The journal's rule: a round decided is journaled before anyone can act on it, so its plan is published only once
the save that holds it is durable (:attr:`LoopState.publish_after`); a failure, a rollback and the run's end
are journaled in the tick that saw them (:attr:`Urgency.NOW`); a commit, a newcomer's address, a history entry
and admissions may wait while the tick runs long (a coordinator that stops before it journals a commit learns
the step again from its peers' reports).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import IntEnum

from potluck.coordinator.rounds.roundevents import Committed, Failed, RolledBack
from potluck.protos.wire.records import Round

MAX_JOURNAL_WAITS = 3  # ticks a save that may wait is put off, running long, before it is made anyway


class Urgency(IntEnum):
    """How soon the journal must be saved."""

    CLEAN = 0  # nothing new to keep
    DUE = 1  # when the tick has time: a commit, a newcomer's address, a history entry
    NOW = 2  # in this tick: a failure, a rollback, the run's end (a restart must not redo them)


@dataclass(frozen=True)
class Rules:
    """What of the run's config the loop's decisions read."""

    outer_steps: int
    checkpoint_every: int  # 0: no periodic checkpoints


@dataclass(frozen=True)
class Decided:
    """A round the placement and :meth:`Rounds.decide` just made: journaled, then put on the plan."""

    round: Round
    before: dict[str, tuple[int, int]]  # each member's (stage, replica) in the round before (for the log line)
    began: float  # when the decision began (its round due, or its pings), on the loop's monotonic clock


@dataclass(frozen=True)
class Written:
    """A checkpoint the checkpointer wrote."""

    version: int
    name: str  # the file's name, for the log


@dataclass(frozen=True)
class LoopState:
    rules: Rules
    journal: Urgency = Urgency.CLEAN
    waited: int = 0  # ticks the pending save has waited, the ticks running long
    saves: int = 0  # the journal saves asked for so far: the number of the newest (the writer's ticket)
    decided: Decided | None = None  # a round waiting for save number ``publish_after`` to be durable
    publish_after: int = 0

    @property
    def holding(self) -> bool:
        """A round is decided and not yet on the plan: nothing may publish the rounds, and no round is decided."""
        return self.decided is not None

    @property
    def hurried(self) -> bool:
        """A save is owed in this very tick's stead: the loop's next tick starts at once."""
        return self.journal == Urgency.NOW


RoundEvent = Committed | Failed | RolledBack


@dataclass(frozen=True)
class Inputs:
    """What one tick gathered. Everything :func:`decide` reads that is not its own state is here."""

    committed: int = 0  # the committed step, as the round lifecycle has it after this tick's events
    finished: bool = False  # the run had ended before this tick
    events: tuple[RoundEvent, ...] = ()  # the round lifecycle's, in order (auditors' retractions first)
    checkpoints: tuple[Written, ...] = ()
    peers_met: bool = False  # a peer joined or came back: its address is kept for a restart to rejoin through
    history_added: bool = False  # the history has a new entry
    admissions_due: bool = False  # the admissions' journal is due (the gatekeeper's rule)
    over: bool = False  # the run is over now (every step committed and settled, or the admin said so)
    admin: str | None = None  # the admin's request to end the run, with its reason (": ..." or "")
    decided: Decided | None = None  # a round placed and decided this tick
    durable: int = 0  # the newest journal save the writer has made durable
    long: bool = False  # this tick has run long: what may wait, waits


# The actions, each carried out by the executor as named.
@dataclass(frozen=True)
class Note:
    """An event for the page's list and the log (``warn``: at WARN)."""

    kind: str
    peer: str
    message: str
    warn: bool = False


@dataclass(frozen=True)
class Commit:
    """A step committed: its fault point, the auditors told, the live peers' addresses kept."""

    step: int


@dataclass(frozen=True)
class WantCheckpoint:
    """Ask the checkpointer for the committed step's checkpoint."""

    step: int


@dataclass(frozen=True)
class RollBack:
    """The auditors and the history follow a rollback to ``to_version``."""

    to_version: int


@dataclass(frozen=True)
class AdoptCheckpoint:
    """A checkpoint written: the rounds may roll back to it, the manifest and the journal name it."""

    version: int


@dataclass(frozen=True)
class PrintExport:
    """The run's final checkpoint is on disk: print the command that exports the model."""


@dataclass(frozen=True)
class MarkFinished:
    """The run has ended: the journal and the manifest say so."""


@dataclass(frozen=True)
class RememberPeers:
    """Keep the live peers' DHT addresses in the journal (a restarted coordinator rejoins through them)."""


@dataclass(frozen=True)
class Save:
    """Hand the journal to the writer as save number ``ticket`` (written off the loop)."""

    ticket: int


@dataclass(frozen=True)
class Publish:
    """Put a decided round on the plan (its save is durable)."""

    decided: Decided


Action = (Note | Commit | WantCheckpoint | RollBack | AdoptCheckpoint | PrintExport | MarkFinished | RememberPeers
          | Save | Publish)


@dataclass
class _Out:
    """The actions of one decision and the urgency they leave the journal at (internal to :func:`decide`)."""

    journal: Urgency
    actions: list[Action] = field(default_factory=list)

    def need(self, level: Urgency) -> None:
        self.journal = max(self.journal, level)


def decide(state: LoopState, inputs: Inputs, now: float) -> tuple[LoopState, list[Action]]:
    """The loop's next state and what to do, from its state and one tick's inputs. Pure: ``now`` (the loop's
    monotonic clock) is only compared with the times it is given."""
    out = _Out(state.journal)
    if state.decided is not None and inputs.durable >= state.publish_after:
        out.actions.append(Publish(state.decided))  # (journaled: now peers may act on it)
        state = replace(state, decided=None)
    if inputs.peers_met:
        out.actions.append(RememberPeers())
        out.need(Urgency.DUE)
    for ev in inputs.events:
        _on_event(state.rules, ev, out)
    for done in inputs.checkpoints:
        out.actions += [AdoptCheckpoint(done.version), Note("checkpoint", "", f"v{done.version} written to {done.name}")]
        if done.version >= state.rules.outer_steps or inputs.finished:
            out.actions.append(PrintExport())
    if inputs.admin is not None:
        out.actions.append(Note("admin", "", f"run ended by the admin at outer step {inputs.committed}{inputs.admin}"))
    if inputs.over and not inputs.finished:
        out.actions += [MarkFinished(), Note("finished", "", f"run ended at outer step {inputs.committed}")]
        out.need(Urgency.NOW)
    if inputs.history_added:
        out.need(Urgency.DUE)
    if inputs.decided is not None:  # (a tick that decides saves nothing: its CPU went to the decision; the next saves)
        return replace(state, journal=Urgency.NOW, decided=inputs.decided, publish_after=state.saves + 1), out.actions
    saves, waited = state.saves, state.waited
    if out.journal == Urgency.NOW or (out.journal == Urgency.DUE or inputs.admissions_due) and not (
            inputs.long and waited < MAX_JOURNAL_WAITS):
        saves += 1
        out.actions.append(Save(saves))
        out.journal, waited = Urgency.CLEAN, 0
    elif out.journal or inputs.admissions_due:
        waited += 1  # (running long: the next tick saves, or the one after, MAX_JOURNAL_WAITS at most)
    return replace(state, journal=out.journal, waited=waited, saves=saves), out.actions


def _on_event(rules: Rules, ev: RoundEvent, out: _Out) -> None:
    if isinstance(ev, Committed):
        out.actions.append(Commit(ev.step))
        every = rules.checkpoint_every
        if every and (ev.step // every > ev.since // every or ev.step >= rules.outer_steps):
            out.actions.append(WantCheckpoint(ev.step))
        out.need(Urgency.DUE)
    elif isinstance(ev, Failed):
        out.actions.append(Note("failed", "", f"round {ev.round.step} (epoch {ev.round.epoch}) failed: {ev.reason}"))
        out.need(Urgency.NOW)
    elif isinstance(ev, RolledBack):
        out.actions += [RollBack(ev.to_version), Note(
            "rollback", "", f"rolled back from step {ev.from_step} to v{ev.to_version} ({ev.source}); epoch {ev.epoch}")]
        out.need(Urgency.NOW)
