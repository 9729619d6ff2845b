"""When a run ends: every outer step committed (and the members settled on the last one), or the admin
says so through the status page. The admin's request arrives on a status server thread; the
coordinator's loop takes it at its next tick, so the run's state has one writer."""

from __future__ import annotations

import queue
from collections.abc import Sequence
from typing import Any

from potluck.coordinator.rounds.roundevents import Report
from potluck.coordinator.rounds.rounds import Rounds
from potluck.protos.config.runconfig import RunConfig
from potluck.protos.wire.states import SAID_GOODBYE


class Finish:
    def __init__(self) -> None:
        self._admin: queue.SimpleQueue[str] = queue.SimpleQueue()

    def request(self, body: dict, committed: int) -> dict:
        """Admin action (on a status server thread): the loop ends the run at the committed step."""
        reason = str(body.get("reason", ""))[:200]
        self._admin.put(f": {reason}" if reason else "")
        return {"finishing": True, "outer_step": committed}

    @staticmethod
    def drained(checkpointer: Any, table: Any) -> bool:
        """Nothing left to do after the end: no checkpoint being written, every live peer finished or gone."""
        return not checkpointer.busy() and all(v.record.state in SAID_GOODBYE for v in table.live())

    def due(self, cfg: RunConfig, rounds: Rounds, reports: Sequence[Report], now: float,
            integrity: Any = None) -> tuple[bool, str | None]:
        """Whether the run is over now, and the admin's reason if the admin ended it (None if not). With
        ``integrity`` (the coordinator's), a run is over only once its committed steps are audited too."""
        admin = self._admin.get_nowait() if not self._admin.empty() else None
        done = rounds.committed >= cfg.diloco.outer_steps and rounds.settled(now, cfg.membership.heartbeat_timeout_s,
                                                                            reports)
        over = done or admin is not None
        if over and integrity is not None:
            over = integrity.audited_to_the_end(rounds.round_at, rounds.committed)
        return over, admin
