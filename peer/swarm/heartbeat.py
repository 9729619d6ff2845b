"""The peer's heartbeat: a thread that stores the peer's record and watches the plan.

Every ``heartbeat_s`` (or at once when :meth:`Heartbeat.poke`d, e.g. right after an outer step
commits) it stores the peer's signed :class:`PeerRecord`, which expires after
``heartbeat_timeout_s``: a peer that stops refreshing disappears from the swarm by itself. Between
heartbeats it re-reads the coordinator's plan and manifest; records that fail verification are
logged and ignored, and the last good ones stay in force. (The links and admission threads use the same DHT node,
through its pipe lock.)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from potluck.protos.net.swarm import SwarmNode
from potluck.protos.runtime.log import get_logger
from potluck.protos.wire.envelope import RecordError
from potluck.protos.wire.records import Manifest, PeerRecord, Plan

log = get_logger(__name__)


class Heartbeat(threading.Thread):
    def __init__(
        self,
        node: SwarmNode,
        manifest: Manifest,
        record: Callable[[], PeerRecord],
        heartbeat_s: float,
        ttl_s: float,
        poll_s: float = 0.2,
    ) -> None:
        super().__init__(name="heartbeat", daemon=True)
        self.node, self.record, self.heartbeat_s, self.ttl_s, self.poll_s = node, record, heartbeat_s, ttl_s, poll_s
        self.manifest = manifest
        self._plan: Plan | None = None
        self._cond = threading.Condition()
        self._poke = threading.Event()
        self._halt = threading.Event()
        self._warned: set[str] = set()
        self._read_failures = 0  # DHT reads failed in a row (the first of a streak is warned)
        self._coordinator_seen = time.monotonic()  # when the coordinator's manifest was last in the DHT (it refreshes it)
        self.on_plan: Callable[[Plan], None] | None = None  # told of each newer plan (on this thread)

    @property
    def plan(self) -> Plan | None:
        with self._cond:
            return self._plan

    def wait_plan(self, predicate: Callable[[Plan | None], bool], timeout: float) -> Plan | None:
        """Block until ``predicate(plan)`` holds or ``timeout`` passes; returns the latest plan."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate(self._plan) and not self._halt.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(min(left, 0.5))
            return self._plan

    def await_confirmation(self, version: int, stopping: threading.Event, timeout: float = 30.0) -> bool:
        """Keep heartbeating (and serving) the final ``version`` until the coordinator has seen it: the run
        is marked finished and, if it checkpoints, the final checkpoint is written. False after ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not stopping.is_set():
            m = self.manifest
            if m.finished and (not m.checkpoint_every or m.checkpoint_version >= version):
                return True
            self.wait_plan(lambda p: False, timeout=0.2)
        if not stopping.is_set():
            log.warning("the coordinator did not confirm the end of the run (v%d) within %.0f s; leaving anyway",
                        version, timeout)
        return False

    def coordinator_silent_s(self) -> float:
        """Seconds since the coordinator's manifest was last found in the DHT: it refreshes it every few seconds and it
        expires within a minute, so a coordinator that is gone (or moved out of this swarm's DHT) is silent."""
        return time.monotonic() - self._coordinator_seen

    def poke(self) -> None:
        """Publish the record now instead of at the next interval."""
        self._poke.set()

    def stop(self, goodbye: PeerRecord | None = None) -> None:
        self._halt.set()
        self._poke.set()
        self.join(timeout=10)
        if goodbye is not None:
            try:  # a "left" record lets the coordinator evict us at once; it carries the last step reports too
                # (as long-lived as a heartbeat: with a shorter life it would lose to the last heartbeat's expiry)
                if not self.node.publish_peer(goodbye, ttl=self.ttl_s):
                    log.warning("goodbye record not stored in the DHT")
            except Exception as err:
                log.warning("goodbye record not stored (%s): the coordinator finds this peer lost, not finished", err)
        with self._cond:
            self._cond.notify_all()

    def run(self) -> None:
        last_beat = 0.0
        while not self._halt.is_set():
            now = time.monotonic()
            beat = self._poke.is_set() or now - last_beat >= self.heartbeat_s
            if beat:
                self._poke.clear()
                last_beat = now
                self._publish()
            self._refresh(with_manifest=beat)
            self._poke.wait(self.poll_s)

    def _publish(self) -> None:
        try:  # (a record that cannot be made, a bug, must not end the heartbeat: the peer would be lost, silently)
            rec = self.record()
            if not self.node.publish_peer(rec, ttl=self.ttl_s):
                log.warning("heartbeat not stored in the DHT (no DHT node accepted it)")
        except Exception as err:
            log.warning("heartbeat failed: %s", err)

    def _newer_plan(self) -> Plan | None:
        """The plan, read only when its head says it is newer than ours (or there is no head to read: a
        coordinator that publishes none). A 1,000-member plan is ~700 KB; its head a few hundred bytes."""
        mine = self._plan.seq if self._plan else 0
        head = self.node.get_plan_head()
        if head is not None and self._plan is not None and head.seq <= mine:
            return None
        return self.node.get_plan(min_seq=mine)

    def _refresh(self, with_manifest: bool) -> None:
        try:
            plan = self._newer_plan()
            manifest = self.node.get_manifest(min_seq=self.manifest.seq) if with_manifest else None
        except RecordError as err:
            if str(err) not in self._warned:
                self._warned.add(str(err))
                log.warning("ignoring a DHT record: %s", err)
            return
        except Exception as err:  # warned once a streak: the next poll (poll_s) tries again
            self._read_failures += 1
            if self._read_failures == 1:
                log.warning("reading the plan from the DHT failed (%s); this peer keeps the plan it has and "
                            "retries", err)
            return
        if self._read_failures:
            log.info("reading the plan from the DHT works again (after %d failures)", self._read_failures)
            self._read_failures = 0
        if manifest is not None:
            self._coordinator_seen = time.monotonic()
        newer = False
        with self._cond:
            if plan is not None and (self._plan is None or plan.seq > self._plan.seq):
                self._plan, newer = plan, True
                self._cond.notify_all()
            if manifest is not None and manifest.seq >= self.manifest.seq:
                self.manifest = manifest
                self._cond.notify_all()
        if newer and plan is not None and self.on_plan is not None:
            try:
                self.on_plan(plan)
            except Exception as err:  # (a bug there must not stop the heartbeat: the peer would be lost)
                log.warning("acting on the new plan failed: %s", err)
