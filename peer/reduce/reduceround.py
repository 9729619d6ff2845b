"""One run of the outer all-reduce as a value: its phase, whom it stopped waiting for, who went past it.

:meth:`~potluck.peer.reduce.allreduce.AllReduce.run` makes one per round and hands it to every thread that acts
for the round, so a thread of a past round (a probe answering late, a send that failed late) can only
touch its own, finished round (in the style of hivemind's ``AveragingStage`` and torch elastic's
rendezvous state objects).
"""

from __future__ import annotations

import enum
import threading
from concurrent.futures import Future

from potluck.peer.reduce.shards import RoundInfo
from potluck.protos.runtime.log import get_logger, short_id

log = get_logger(__name__)


class Phase(enum.Enum):
    """Where one all-reduce round is."""

    REDUCING = "reducing"  # slices go to their owners; this member collects the shard it owns
    GATHERING = "gathering"  # waiting for the other owners' results
    TAKING_OVER = "taking over"  # the shards of owners that died are reduced again by their backups
    DONE = "done"  # run() returned or raised: nothing may change the round any more


class ReduceRound:
    """One run of the all-reduce: made by :meth:`AllReduce.run` and handed to every thread acting for it
    (senders, probes, the owner's collection, the result's distribution), never reached through the
    :class:`AllReduce`. A probe or send of an older round that answers late holds that round's object:
    whatever it marks is dropped once that round is DONE, and a newer round cannot see it.

    ``dead``, ``ahead`` and ``phase`` are guarded by ``cond`` (the all-reduce's condition, which the
    procedure waits on and also gives its inbox); every change notifies it. ``pending`` is the procedure
    thread's own.
    """

    def __init__(self, info: RoundInfo, cond: threading.Condition, catch_up_until: float, backup_timeout: float,
                 deadline: float = float("inf"), samples: int = 1) -> None:
        self.info, self.cond, self.deadline = info, cond, deadline  # (deadline: for the members' contributions)
        self.samples = samples  # this member's claimed work, signed with each slice it sends (its weight)
        self.catch_up_until = catch_up_until  # until then, a member still fetching the round's base is waited for
        self.backup_timeout = backup_timeout  # seconds a result may take to reach a backup
        self.phase = Phase.REDUCING
        self.dead: set[str] = set()  # members not waited for any more (unreachable, gone, or not in this step)
        self.ahead: list[str] = []  # members already past this step (it went on without us)
        self.pending: list[Future] = []  # our result broadcasts, finished before run() returns
        # shards whose owner did not receipt this member's contribution (why), and the backup it went to instead
        self.unreceipted: dict[int, str] = {}
        self.witnessed: dict[int, str] = {}

    def not_receipted(self, shard: int, why: str) -> bool:
        """The owner of ``shard`` neither receipted this member's contribution nor refused it for a reason of the
        round's (its step, epoch or base): said once; False once the round is DONE (nothing acts for it then)."""
        with self.cond:
            if self.phase is Phase.DONE or shard in self.unreceipted:
                return False
            self.unreceipted[shard] = why
            return True

    def sent_to_backup(self, shard: int, backup: str) -> None:
        with self.cond:
            self.witnessed[shard] = backup

    def backup_holds(self, shard: int, backup: str) -> bool:
        """Did this member already send its contribution to ``shard`` to ``backup`` (attempt 1)?"""
        with self.cond:
            return self.witnessed.get(shard) == backup

    def mark_dead(self, peer_id: str, why: str = "") -> None:
        with self.cond:
            if self.phase is Phase.DONE or peer_id in self.dead:
                return
            self.dead.add(peer_id)
            self.cond.notify_all()
        if why:
            log.info("%s: %s", short_id(peer_id), why)

    def mark_ahead(self, peer_id: str) -> None:
        with self.cond:
            if self.phase is Phase.DONE:
                return
            self.ahead.append(peer_id)
            self.cond.notify_all()

    def is_dead(self, peer_id: str) -> bool:
        with self.cond:
            return peer_id in self.dead

    def enter(self, phase: Phase) -> None:
        with self.cond:
            if self.phase is not Phase.DONE:
                self.phase = phase

    def finish(self) -> None:
        with self.cond:
            self.phase = Phase.DONE
            self.cond.notify_all()
