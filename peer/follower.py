"""A peer's side of the round lifecycle: one pure state machine from the plan to the next action.

The coordinator decides rounds (:mod:`potluck.coordinator.rounds.rounds`); a peer *follows* them. Given the
plan it last read and the state it holds, :meth:`Follower.next` says what to do now, as one of::

    Finish                      the run is over
    Wait(reason)                nothing to do until the plan changes (or a short timeout)
    Switch(stage)               the grid moved this peer to another stage: hold that stage's layers
    Recover(version, hash)      fetch exactly that state (behind, different, or rolled back)
    Train(round, step)          run the inner steps of ``step`` with ``round``'s grid, then its outer step
    GiveUp(reason)              the coordinator has been away longer than ``coordinator_timeout_s``: stop

The rules, for the newest round ``R`` this peer is a member of and the version ``v`` it holds:

* ``v`` was made in an older epoch than ``R`` and is not below ``R.step``: the run was rolled back
  past it (a failed round): recover ``R.step - 1`` at ``R``'s base hash.
* ``R.step > v + 1``: behind the swarm: recover ``R.step - 1`` at ``R``'s base hash.
* ``R.step == v + 1``: if the held hash is not ``R``'s base, recover it; otherwise train ``R``.
* ``R.step <= v``: no decision for ``v + 1`` yet. A pipeline waits ``plan_wait_s`` for it (the
  grid decides who its neighbours are); after that, or at once with one stage, it trains ``v + 1``
  on ``R``'s grid: peers keep training on the last plan while the coordinator is away.
* After a step failed here, first fetch it from members that committed it; if none has within
  ``plan_wait_s``, run it again (the whole round failed; the coordinator may decide it anew).

No I/O and no clock of its own: the daemon passes ``now`` and carries the action out.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

from potluck.protos.runtime.log import get_logger
from potluck.protos.wire.records import Plan, Round

log = get_logger(__name__)


@dataclass(frozen=True)
class Held:
    """The committed state a peer holds (see :class:`potluck.peer.outer.states.States`)."""

    version: int
    digest: str | Future[str]  # its state hash, or the hashing still under way (read state_hash)
    stage: int
    epoch: int
    committed_at: float  # when it was committed or adopted (monotonic seconds)

    @property
    def state_hash(self) -> str:
        """The held state's hash; only a round that names its base asks for it, and such a round exists
        only once members reported the hash of this version, so it is there by then (else: waits)."""
        return self.digest if isinstance(self.digest, str) else self.digest.result()


@dataclass(frozen=True)
class Finish:
    pass


@dataclass(frozen=True)
class Wait:
    reason: str
    seconds: float = 1.0


@dataclass(frozen=True)
class Switch:
    stage: int


@dataclass(frozen=True)
class Recover:
    version: int | None  # None: any version newer than the one held
    state_hash: str  # '' when any hash the sources agree on will do
    reason: str
    epoch: int = 0  # with version None: made in this epoch or a later one (not the state of an abandoned epoch)


@dataclass(frozen=True)
class Train:
    round: Round  # the round whose grid and members apply (an older one when training on the last plan)
    step: int


@dataclass(frozen=True)
class GiveUp:
    reason: str


class CannotGoOn(RuntimeError):
    """A peer that cannot heal on its own: it stops, and its reason is its goodbye's ``error`` (exit code 3)."""


Action = Finish | Wait | Switch | Recover | Train | GiveUp
PLACE = "waiting for a place in the run: the coordinator adds peers at the next outer-step boundary"


def boundary_in(plan: Plan | None, now: float) -> float | None:
    """Seconds (from unix time ``now``) until the run's next outer-step boundary, from when the plan's consecutive
    rounds were decided (the median gap is a step's length); None while the plan shows fewer than two steps."""
    rounds = sorted((r for r in plan.rounds if r.decided_at), key=lambda r: r.step) if plan else []
    gaps = sorted(b.decided_at - a.decided_at for a, b in zip(rounds, rounds[1:], strict=False)
                  if b.step == a.step + 1 and b.decided_at > a.decided_at)
    if not gaps:
        return None
    step = gaps[len(gaps) // 2]
    return min(step, max(0.0, rounds[-1].decided_at + step - now))


class Follower:
    def __init__(self, me: str, *, pipelined: bool, plan_wait_s: float, coordinator_timeout_s: float = 0.0,
                 started_at: float = 0.0) -> None:
        self.me, self.pipelined, self.plan_wait_s = me, pipelined, plan_wait_s
        self.coordinator_timeout_s = coordinator_timeout_s  # (0: train on the last plan however long it is away)
        self._failed: tuple[int, float, int] | None = None  # (step, when, epoch) of a step that failed here
        self.started_at = started_at  # (unix time this process started: 0, unknown)
        self._sit_out: tuple[int, int] | None = None  # (step, epoch) this process does not train: see _restarted_in

    def _restarted_in(self, latest: Round, step: int) -> bool:
        """Is ``step`` (of ``latest``'s epoch) one this process must sit out? The first step it would train, when
        the round it would train it on was decided before this process started: this key was a member of that
        round in an earlier process (a restart with the same key), which may have receipted contributions to its
        shards before it stopped. Signing this step's results now, without them, would be an owner leaving out
        what it receipted, and proven so. So it sits the step out (its shards go to their backups, as for any
        member gone) and trains from the next step on. Steps of another epoch are not this one's: the run was
        rolled back, and receipts name the epoch."""
        if self._sit_out is None:
            first = bool(self.started_at) and 0.0 < latest.decided_at < self.started_at
            self._sit_out = (step, latest.epoch) if first else (-1, -1)
        return self._sit_out == (step, latest.epoch)

    def failed(self, step: int, now: float, epoch: int = 0) -> None:
        """This peer could not commit ``step`` of ``epoch`` (an incomplete all-reduce, a stalled pipeline). Once
        the run is in a later epoch, that failure says nothing of the step there (a rollback abandoned it)."""
        self._failed = (step, now, epoch)

    def next(self, plan: Plan | None, held: Held, now: float, finished: bool = False, silent_s: float = 0.0) -> Action:
        if finished:
            return Finish()
        if self.coordinator_timeout_s and silent_s > self.coordinator_timeout_s:
            return GiveUp(f"the coordinator has not been heard from for {silent_s:.0f} s (peer.coordinator_timeout_s = "
                          f"{self.coordinator_timeout_s:g}): this peer stops; start it again once the coordinator "
                          "is back (or raise the timeout)")
        mine = [r for r in plan.rounds if r.member(self.me) is not None] if plan else []
        if not mine:
            return Wait(PLACE)
        latest = max(mine, key=lambda r: r.step)
        cell = latest.member(self.me)
        assert cell is not None
        if cell.stage != held.stage:
            return Switch(cell.stage)
        step, base = held.version + 1, latest.base_hash_of(cell.stage)
        if held.epoch < latest.epoch and held.version >= latest.step:
            return Recover(latest.step - 1, base, f"the run was rolled back to v{latest.step - 1} "
                           f"(epoch {latest.epoch}); this peer's v{held.version} is from epoch {held.epoch}")
        if latest.step > step:
            return Recover(latest.step - 1, base, f"behind: the swarm starts step {latest.step} from "
                           f"v{latest.step - 1}, this peer holds v{held.version}")
        if self._failed is not None and self._failed[0] == step and self._failed[2] == latest.epoch:
            if now - self._failed[1] < self.plan_wait_s:
                return Recover(None, "", f"step {step} failed here; fetching it from a member that committed it",
                               latest.epoch)
            self._failed = None  # nobody got past it: run it again
        if latest.step == step:
            if base and base != held.state_hash:
                return Recover(step - 1, base, f"this peer's v{held.version} ({held.state_hash[:12]}) differs "
                               f"from the swarm's ({base[:12]})")
            return self._sat_out(step) if self._restarted_in(latest, step) else Train(latest, step)
        if self.pipelined and now - held.committed_at < self.plan_wait_s:
            return Wait(f"waiting for the coordinator's round for step {step}", 0.5)
        return self._sat_out(step) if self._restarted_in(latest, step) else Train(latest, step)

    @staticmethod
    def _sat_out(step: int) -> Wait:
        return Wait(f"restarted during step {step}: this key's previous process may have receipted contributions to "
                    f"it; training again from step {step + 1}", 0.5)

    def resolve(self, plan: Plan | None, step: int, stage: int, held_hash: str, epoch: int,
                silent_s: float = 0.0) -> Round | None:
        """The round whose members average ``step`` with this peer: the coordinator's round for it if
        decided, else the last plan's (it is away). None if this peer is not in it, or not from the
        state it holds (its delta would not fit: it must recover instead), or if the last plan is of a newer
        ``epoch`` than the state held: the run was rolled back past it while it trained, and training on
        would carry the abandoned epoch's state into the new one."""
        current = plan.round_for(step) if plan else None
        me = current.member(self.me) if current else None
        if current is None or me is None or me.stage != stage:
            return None
        if current.epoch > epoch and current.step != step:
            log.warning("the run was rolled back to v%d (epoch %d) while this peer trained step %d of epoch %d: "
                        "discarding it", current.step - 1, current.epoch, step, epoch)
            return None
        if current.step != step:
            away = f" (the coordinator has not been heard from for {silent_s:.0f} s)" if silent_s >= 10 else ""
            log.warning("no decision from the coordinator for step %d; using the members of step %d%s", step,
                        current.step, away)
        want = current.base_hash_of(stage)
        if current.step == step and want and want != held_hash:
            log.warning("step %d starts from %s, this peer holds %s", step, want[:12], held_hash[:12])
            return None
        return current
