"""What the coordinator tells the swarm through the DHT: its signed run manifest and round plan.

Both records expire (``RECORD_TTL_S``) unless refreshed, so a coordinator that is gone stops
speaking for the run by itself; a change (a new round, a checkpoint, the end of the run) is
published at once, and everything is refreshed every ``REFRESH_S``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from potluck.protos.net.swarm import SwarmNode
from potluck.protos.wire.records import Manifest, Plan, Round, next_seq

RECORD_TTL_S, REFRESH_S, PLAN_ROUNDS = 60.0, 15.0, 4


class Publisher:
    def __init__(self, node: SwarmNode, manifest: Manifest, revoked: set[str]) -> None:
        self.node, self.manifest = node, manifest
        self.plan_seq = next_seq()
        self.revoked = revoked  # peers evicted (the admission room's set): on the plan, so every peer refuses them
        self._revoked_published: set[str] = set(revoked)
        self._published_at = 0.0

    def update(self, **fields: Any) -> None:
        """Change the manifest (a new ``seq``, so readers take it) and publish it now."""
        self.manifest = self.manifest.model_copy(update={**fields, "seq": next_seq()})
        self._published_at = 0.0

    def revoked_changed(self) -> None:
        """Republish the plan at once when someone was evicted since it was last published."""
        if self.revoked != self._revoked_published:
            self._revoked_published = set(self.revoked)
            self.new_plan()

    def new_plan(self) -> None:
        """A round was decided: publish the plan now."""
        self.plan_seq = next_seq()
        self._published_at = 0.0

    def publish(self, rounds: Iterable[Round]) -> None:
        """Store manifest and plan if something changed or they are due for a refresh."""
        now = time.monotonic()
        if now - self._published_at < REFRESH_S:
            return
        self._published_at = now
        self.node.publish_manifest(self.manifest, ttl=RECORD_TTL_S)
        recent = sorted(rounds, key=lambda r: r.step)[-PLAN_ROUNDS:]
        if recent:
            self.node.publish_plan(Plan(seq=self.plan_seq, rounds=recent, ts=time.time(), revoked=sorted(self.revoked)),
                                   ttl=RECORD_TTL_S)
