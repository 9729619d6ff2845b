"""What the coordinator tells the swarm through the DHT: its signed run manifest and round plan.

Both records expire (``RECORD_TTL_S``) unless refreshed, so a coordinator that is gone stops
speaking for the run by itself; a change (a new round, a checkpoint, the end of the run) is
published at once, and everything is refreshed every ``REFRESH_S``.

Peers poll the plan's head (its ``seq``, a few hundred bytes) and read the plan itself only when the head
is newer than theirs. The plan carries the newest ``PLAN_ROUNDS`` rounds that fit in one record (``MAX_PLAN_BYTES``):
each round lists all its members, so a big swarm's plan holds fewer of them (at 1,000 members one
round is ~170 KB), and a round too big to publish at all is said in the log, once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from potluck.coordinator.rounds.perround import PerRound
from potluck.protos.net.dhtguard import MAX_PLAN_BYTES
from potluck.protos.net.swarm import SwarmNode
from potluck.protos.runtime.log import get_logger
from potluck.protos.wire.envelope import canonical, next_seq
from potluck.protos.wire.records import Manifest, Plan, PlanHead, Round

log = get_logger(__name__)

RECORD_TTL_S, REFRESH_S, PLAN_ROUNDS = 60.0, 15.0, 4


class Publisher:
    def __init__(self, node: SwarmNode, manifest: Manifest, revoked: set[str]) -> None:
        self.node, self.manifest = node, manifest
        self.plan_seq = next_seq()
        self.revoked = revoked  # peers evicted (the admission room's set): on the plan, so every peer refuses them
        self._revoked_published: set[str] = set(revoked)
        self._published_at = 0.0
        self._too_big = 0  # the step of the round last said to be too big to publish
        self._pending: list[tuple[str, Any]] = []  # (record, future) of stores the loop did not wait for
        self._sealed: tuple[Plan | None, Any] = (None, None)  # the plan ``fitting`` last chose, as it sealed it
        # (each round's canonical JSON, kept between publishes: a plan of 4 rounds of 1,000 members took 30 ms to
        # dump at each publish)
        self._dumped = PerRound(lambda r: canonical(r.model_dump(mode="json")).decode())

    def update(self, **fields: Any) -> None:
        """Change the manifest (a new ``seq``, so readers take it) and publish it now."""
        self.manifest = self.manifest.model_copy(update={**fields, "seq": next_seq()})
        self._published_at = 0.0

    def revoked_changed(self) -> None:
        """Republish the plan at once when someone was evicted since it was last published."""
        if self.revoked != self._revoked_published:
            self._revoked_published = set(self.revoked)
            self.new_plan()

    def new_plan(self, rounds: Iterable[Round] = ()) -> None:
        """A round was decided (or someone evicted): publish the plan now. ``rounds`` (given): the plan's newest rounds'
        JSON is made now, and the publish is left to the next tick if this one is long already (see publish): at
        1,000 members the new round's JSON, its seal and its store made that tick one of the heaviest (~20 ms)."""
        self.plan_seq = next_seq()
        self._published_at = 0.0
        if rounds:
            self._dumped(sorted(rounds, key=lambda r: r.step)[-PLAN_ROUNDS:])

    def publish(self, rounds: Iterable[Round], later: Callable[[], bool] = lambda: False) -> bool:
        """Store manifest and plan if something changed or they are due for a refresh. True: they were due, but
        ``later()`` said this tick has run long already (it decided a round of 1,000 members): the caller runs
        the next tick at once, and that one publishes them (sealing and storing such a plan is ~10 ms more)."""
        self._check()
        now = time.monotonic()
        if now - self._published_at < REFRESH_S:
            return False
        if later():
            return True
        self._published_at = now
        wait = self.manifest.finished  # (a finished run's last word is out before it may exit; else the loop goes on)
        self._pending.append(("manifest", self.node.publish_manifest(self.manifest, ttl=RECORD_TTL_S, wait=wait)))
        recent = sorted(rounds, key=lambda r: r.step)[-PLAN_ROUNDS:]
        plan = self.fitting(recent)
        if plan is not None:  # the plan, then its head: a peer that reads a head before its plan reads the plan again
            sealed = self._sealed[1] if self._sealed[0] is plan else None  # (sealed once: 1,000 members, ~30 ms)
            self._pending.append(("plan", self.node.publish_plan(plan, ttl=RECORD_TTL_S, wait=wait, sealed=sealed)))
            newest = plan.rounds[-1]
            head = PlanHead(seq=plan.seq, step=newest.step, epoch=newest.epoch)
            self._pending.append(("plan head", self.node.publish_plan_head(head, ttl=RECORD_TTL_S, wait=wait)))
        return False

    def _check(self) -> None:
        """A store that failed is published again at once (the next tick)."""
        pending, self._pending = self._pending, []
        for what, answer in pending:
            if hasattr(answer, "done") and not answer.done():
                self._pending.append((what, answer))
                continue
            try:
                stored = bool(answer.result() if hasattr(answer, "result") else answer)
            except Exception as err:  # (a DHT call that timed out, say)
                log.warning("the %s record was not stored (%s); publishing again", what, err)
                stored = False
            if not stored:
                self._published_at = 0.0

    def fitting(self, recent: list[Round]) -> Plan | None:
        """The plan of the newest of ``recent`` that fit in one record; None (said once) when the newest alone
        does not: peers then keep the plan they have."""
        for k in range(len(recent), 0, -1):
            plan = Plan(seq=self.plan_seq, rounds=recent[-k:], ts=time.time(), revoked=sorted(self.revoked))
            sealed = self.node.seal(plan.model_dump(mode="json", exclude={"rounds"}), RECORD_TTL_S,
                                    raw={"rounds": self._rounds_json(plan)})
            size = self.node.sealed_size(sealed, RECORD_TTL_S)
            if size <= MAX_PLAN_BYTES:
                self._sealed = (plan, sealed)
                return plan
        if recent and self._too_big != recent[-1].step:
            self._too_big = recent[-1].step
            log.error("the round of step %d (%d members) makes a plan of %d bytes, more than a DHT record may hold "
                      "(%d): it is not published", recent[-1].step, len(recent[-1].members), size, MAX_PLAN_BYTES)
        return None

    def _rounds_json(self, plan: Plan) -> str:
        """``plan.rounds`` in canonical JSON, each round's part kept from the publish before."""
        return "[" + ",".join(self._dumped(plan.rounds)) + "]"
