"""What the coordinator tells the swarm through the DHT: its signed run manifest and round plan.

Both records expire (``RECORD_TTL_S``) unless refreshed, so a coordinator that is gone stops
speaking for the run by itself; a change (a new round, a checkpoint, the end of the run) is
published at once, and everything is refreshed every ``REFRESH_S``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from potluck.protos.records import MANIFEST_KEY, Manifest, Plan, Round, next_seq, plan_key
from potluck.protos.swarm import SwarmNode

RECORD_TTL_S, REFRESH_S, PLAN_ROUNDS = 60.0, 15.0, 4


class Publisher:
    def __init__(self, node: SwarmNode, manifest: Manifest) -> None:
        self.node, self.manifest = node, manifest
        self.plan_seq = next_seq()
        self._published_at = 0.0

    def update(self, **fields: Any) -> None:
        """Change the manifest (a new ``seq``, so readers take it) and publish it now."""
        self.manifest = self.manifest.model_copy(update={**fields, "seq": next_seq()})
        self._published_at = 0.0

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
        self.node.store(MANIFEST_KEY, self.manifest, ttl=RECORD_TTL_S)
        recent = sorted(rounds, key=lambda r: r.step)[-PLAN_ROUNDS:]
        if recent:
            self.node.store(plan_key(self.manifest.run_id), Plan(seq=self.plan_seq, rounds=recent, ts=time.time()),
                            ttl=RECORD_TTL_S)
