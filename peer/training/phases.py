"""One inner phase of a round, in a swarm of peers of different speeds.

The stage worker trains; the window (:mod:`potluck.peer.training.window`) says how many steps fit. Around them,
this room does what a member owes the others and its volunteer for that:

* it starts the window's clock and gives it the most steps the member's data share holds;
* a member that trained all H steps says so to the members it averages with at once (a ``finished``
  ping each: gRPC futures, nothing waits on them), so the slower ones end their phases now;
* a member whose single step is longer than the whole window says so, in its log (once) and on the
  page (its record's ``too_slow``), with what would help; it never holds the round back.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from potluck.peer.swarm.telemetry import Telemetry
from potluck.peer.tasklet import Tasklet
from potluck.peer.training.stage import InnerPhase
from potluck.peer.training.window import Pace, Why, too_slow_advice
from potluck.protos import potluck_pb2 as pb
from potluck.protos.config.runconfig import RunConfig
from potluck.protos.runtime.log import get_logger
from potluck.protos.wire.records import Round

log = get_logger(__name__)

FINISHED_PING_S = 2.0


class InnerPhases:
    """A member's inner phases: ``pace`` is its timing across rounds (the outer steps add their send times)."""

    def __init__(self, rc: RunConfig, me: str, telemetry: Telemetry) -> None:
        self.rc, self.me, self.telemetry = rc, me, telemetry
        self.pace = Pace()

    def heard(self, request: pb.PingRequest) -> None:
        """A ping: from a member of this round that says it trained its whole phase, the window ends now."""
        if request.finished:
            self.pace.finished(request.header.step, request.header.sender, request.send_s, time.monotonic(),
                               request.phase_s)

    def run(self, tasklet: Tasklet, rnd: Round, step: int, replica: int, stopping: threading.Event,
            on_step: Callable[[int, float, float], None]) -> InnerPhase:
        """The inner steps of ``step`` on ``replica``'s share of ``rnd``: as many as fit the round's window."""
        worker, spans = tasklet.worker, rnd.data_spans(step, replica)
        cohort = frozenset(m.peer_id for m in rnd.cohort(self.me)) - {self.me}
        self.pace.begin(step, cohort, worker.cap(spans), time.monotonic())
        windowed = self.rc.diloco.rounds == "window"
        phase = worker.inner_phase(spans, stopping, on_step, step, self.pace if windowed else None)
        said = windowed and phase.why is Why.DONE and phase.steps >= self.rc.diloco.inner_steps and bool(cohort)
        ended = self.pace.end(phase.steps, phase.why, phase.seconds if said else None)
        self.telemetry.phase_ended(step, ended, phase.steps * self.rc.train.batch_size, phase.seconds)
        self.telemetry.progress.compute_s += phase.seconds
        if phase.stalled:
            log.warning("replica %d stalled at inner step %d: %s; contributing nothing to outer step %d",
                        replica, phase.steps, phase.stalled, step)
        elif said:
            self._say_finished(tasklet, rnd, step, phase.seconds)
        if phase.steps == 0 and phase.why is Why.WINDOW and not phase.interrupted:
            advice = too_slow_advice(ended.step_s or 0.0, ended.window_s or 0.0, self.rc.train.batch_size,
                                     self.rc.pipeline.stages)
            if not self.telemetry.too_slow:
                log.warning("%s", advice)
            self.telemetry.too_slow = advice
        elif phase.steps > 0:
            self.telemetry.too_slow = ""
        return phase

    def _say_finished(self, tasklet: Tasklet, rnd: Round, step: int, phase_s: float) -> None:
        """Tell the members this one averages with that it trained its whole phase, in ``phase_s`` seconds."""
        request = pb.PingRequest(header=pb.Header(run_id=self.rc.run_id, sender=self.me, step=step, epoch=rnd.epoch),
                                 sent_at=time.time(), finished=True, send_s=self.pace.send_s(), phase_s=phase_s)
        targets = [(m.address, m.peer_id) for m in rnd.cohort(self.me) if m.peer_id != self.me]
        tasklet.tools.client.ping_each(targets, request, FINISHED_PING_S, lambda peer, ok: None)
