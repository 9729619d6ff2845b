"""What the round lifecycle (:mod:`potluck.coordinator.rounds.rounds`) takes in and gives out, as values: a peer's
:class:`Report`, the newest :class:`Checkpoint`, the events a tick can bring (:class:`Committed`,
:class:`Failed`, :class:`RolledBack`) and how a failed round ended (:class:`RoundOutcome`, journaled)."""

from __future__ import annotations

from dataclasses import dataclass

from potluck.coordinator.rounds.cursor import Cursor
from potluck.protos.wire.records import Round


@dataclass(frozen=True)
class Report:
    """What the lifecycle needs of one peer's latest record."""

    peer_id: str
    stage: int
    version: int
    state_hash: str
    epoch: int = 0
    prev_version: int = -1
    prev_hash: str = ""
    live: bool = True
    gone: bool = False  # said goodbye, stopped on an error or was evicted: not coming back to regather
    progress: tuple = ()  # changes whenever the peer makes visible progress (state, inner step, bytes)
    # stage 0: (step, epoch, replicas in that version[, the samples each trained on, in that order])
    included: tuple[tuple, ...] = ()
    step_s: float = 0.0  # seconds one of its inner steps takes (0: not measured): its share of a round's data is sized by it


@dataclass(frozen=True)
class Checkpoint:
    """The newest checkpoint the coordinator serves: a version and its hash per stage (current layout)."""

    version: int
    hashes: dict[int, str]
    cursor: Cursor | None = None  # the data cursor of ``version`` (None: a checkpoint from before cursors)


@dataclass(frozen=True)
class Committed:
    step: int
    since: int  # the committed step before (several steps commit at once after the coordinator was away)
    seconds: float | None  # decided -> committed, when this process saw the decision


@dataclass(frozen=True)
class Failed:
    round: Round
    reason: str


@dataclass(frozen=True)
class RolledBack:
    from_step: int  # the committed step before the rollback
    to_version: int
    source: str  # "live peers", "checkpoint" or "theta_0"
    epoch: int


Event = Committed | Failed | RolledBack


@dataclass
class RoundOutcome:
    """How a round that did not commit ended (journaled, shown on the status page)."""

    step: int
    epoch: int
    reason: str
    members: int
    rolled_back_to: int
    t: float = 0.0
