"""Measuring the links from this peer to the others, for the scheduler's cost model.

A :class:`LinkProber` keeps, per other peer, a round-trip time and an achievable bandwidth:

* **Probes** go over the same gRPC path as training traffic: a few small Pings (the RTT is their
  median), then one Ping carrying ``probe_bytes`` of padding, whose bandwidth is
  ``probe_bytes / (elapsed - rtt)``. The padding travels in the request, so the figure is the rate
  *from* this peer *to* the other, the direction the cost model's ``beta(d, d')`` needs.
* **Observations** of real transfers (all-reduce pushes, pipeline messages) refresh the bandwidth
  for free: the caller reports ``observe(peer, bytes, seconds)`` after a push. A transfer can
  only be as fast as the link, so it is a fair (if pessimistic) sample when it is large enough
  that latency does not dominate.

Probing is bounded, so that hundreds of peers joining at once do not start an all-pairs storm:
each round probes at most ``max_probes_per_period`` peers, picked among those never measured
(in random order, so joiners do not all pick the same victim) and then the stalest; and every
peer gets at most ``budget_bytes_per_min`` of probe bytes (both directions, as
:class:`~potluck.protos.net.transport.Traffic` counts them) in any minute. A bandwidth that an
observation keeps fresh is not probed at all; only its RTT is.

Figures are merged as an exponentially weighted moving average, so one noisy sample moves them
by ``ewma`` of the way.
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import grpc
from pydantic import BaseModel, ConfigDict, Field

from potluck.protos import potluck_pb2 as pb
from potluck.protos.net.swarm import LinkReport, LinkStat
from potluck.protos.net.transport import PeerClient
from potluck.protos.runtime.log import get_logger, short_id
from potluck.protos.wire.envelope import next_seq
from potluck.protos.wire.refusals import rpc_reason

log = get_logger(__name__)

__all__ = ["LinkConfig", "LinkProber", "LinkReport", "LinkStat"]

_REPLY_ALLOWANCE = 256  # bytes a Ping reply may take besides its padding, for budget checks


class LinkConfig(BaseModel):
    """How a peer measures its links; the defaults cost at most ~1 MiB per peer per minute."""

    model_config = ConfigDict(extra="forbid")

    period_s: float = Field(default=10.0, gt=0, description="seconds between probing rounds")
    max_probes_per_period: int = Field(default=4, ge=0, description="k: peers probed per round at most")
    pings: int = Field(default=3, ge=1, le=16, description="small Pings per probe; the RTT is their median")
    probe_bytes: int = Field(default=512 << 10, ge=1 << 10, le=4 << 20, description="payload of the bandwidth probe")
    budget_bytes_per_min: int = Field(
        default=1 << 20, ge=0,
        description="probe bytes (sent + received) per peer in any 60 s; a probe that would exceed it is cut short",
    )
    stale_s: float = Field(default=120.0, gt=0, description="a figure older than this is measured again")
    retry_s: float = Field(default=30.0, gt=0, description="wait before probing again a peer whose probe failed")
    ewma: float = Field(default=0.3, gt=0, le=1, description="weight of a new sample in the moving average")
    min_observe_bytes: int = Field(default=64 << 10, ge=0, description="smaller observed transfers are latency-bound: ignored")
    timeout_s: float = Field(default=10.0, gt=0, description="timeout of one probe RPC")
    max_report_links: int = Field(default=256, ge=1, description="a report lists at most this many links, the newest")
    forget_s: float = Field(default=600.0, gt=0, description="links not refreshed for this long leave the report")


@dataclass
class _Link:
    rtt_ms: float | None = None
    bandwidth_mbps: float | None = None
    samples: int = 0
    rtt_at: float = float("-inf")  # clock() of the newest RTT sample
    bw_at: float = float("-inf")
    tried_at: float = float("-inf")  # clock() of the newest probe attempt, successful or not
    ts: float = 0.0  # wall clock of the newest sample
    spent: deque[tuple[float, int]] = field(default_factory=deque)  # (clock(), probe bytes)


def _merge(old: float | None, new: float, weight: float) -> float:
    return new if old is None else (1 - weight) * old + weight * new


class LinkProber:
    """Measures and remembers this peer's links; thread-safe (probes run outside the lock)."""

    def __init__(self, client: PeerClient, peer_id: str, run_id: str, config: LinkConfig | None = None,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        self.client, self.peer_id, self.run_id = client, peer_id, run_id
        self.cfg = config or LinkConfig()
        self.clock, self.wall = clock, wall
        self._lock = threading.Lock()
        self._links: dict[str, _Link] = {}
        self._rounds: deque[tuple[float, int]] = deque()  # (clock(), probes) of recent rounds
        self._rng = random.Random()

    # -- figures --------------------------------------------------------------------------------

    def observe(self, peer_id: str, nbytes: int, seconds: float) -> None:
        """A real transfer of ``nbytes`` to ``peer_id`` took ``seconds`` (call start to reply)."""
        if peer_id == self.peer_id or nbytes < self.cfg.min_observe_bytes or seconds <= 0:
            return
        with self._lock:
            link = self._link(peer_id)
            rtt_s = (link.rtt_ms or 0.0) / 1e3
            mbps = nbytes * 8 / max(seconds - rtt_s, seconds * 0.2) / 1e6
            link.bandwidth_mbps = _merge(link.bandwidth_mbps, mbps, self.cfg.ewma)
            link.bw_at, link.ts = self.clock(), self.wall()
            link.samples += 1

    def get(self, peer_id: str) -> LinkStat | None:
        with self._lock:
            link = self._links.get(peer_id)
            return None if link is None else _stat(link)

    def forget(self, peer_id: str) -> None:
        with self._lock:
            self._links.pop(peer_id, None)

    def report(self) -> LinkReport:
        """This peer's links as a record for the DHT (see ``SwarmNode.publish_links``)."""
        now = self.wall()
        with self._lock:
            fresh = [(p, link) for p, link in self._links.items() if link.samples and now - link.ts <= self.cfg.forget_s]
        fresh.sort(key=lambda item: item[1].ts, reverse=True)
        links = {p: _stat(link) for p, link in fresh[: self.cfg.max_report_links]}
        return LinkReport(peer_id=self.peer_id, ts=now, seq=next_seq(), links=links)

    # -- probing --------------------------------------------------------------------------------

    def due(self, peers: Mapping[str, str]) -> list[str]:
        """Peers that need a probe now, most needed first: never tried, failed, then stalest."""
        now = self.clock()
        ranked: list[tuple[int, float, float, str]] = []
        with self._lock:
            for p in peers:
                if p == self.peer_id:
                    continue
                link = self._links.get(p)
                if link is None or link.tried_at == float("-inf"):
                    ranked.append((0, 0.0, self._rng.random(), p))
                elif link.samples == 0 or link.rtt_ms is None:
                    if now - link.tried_at >= self.cfg.retry_s:
                        ranked.append((1, link.tried_at, self._rng.random(), p))
                else:
                    measured = min(link.rtt_at, link.bw_at)
                    if now - measured >= self.cfg.stale_s and now - link.tried_at >= self.cfg.retry_s:
                        ranked.append((2, measured, self._rng.random(), p))
        ranked.sort()
        return [p for *_, p in ranked]

    def probe_round(self, peers: Mapping[str, str]) -> list[str]:
        """Probe up to ``max_probes_per_period`` due peers (``peers``: id -> gRPC address).

        Rounds closer together than ``period_s`` share one allowance, so calling this often does
        not probe more. Returns the peers probed.
        """
        now = self.clock()
        with self._lock:
            while self._rounds and now - self._rounds[0][0] >= self.cfg.period_s:
                self._rounds.popleft()
            allowance = self.cfg.max_probes_per_period - sum(n for _, n in self._rounds)
        chosen = self.due(peers)[: max(0, allowance)]
        with self._lock:
            self._rounds.append((now, len(chosen)))
        for p in chosen:
            self.probe(p, peers[p])
        return chosen

    def probe(self, peer_id: str, address: str) -> LinkStat | None:
        """Measure one link now, within its byte budget; None if the peer did not answer."""
        with self._lock:
            link = self._link(peer_id)
            link.tried_at = self.clock()
            bw_fresh = self.clock() - link.bw_at < self.cfg.stale_s
        rtts = []
        for _ in range(self.cfg.pings):
            elapsed = self._ping(peer_id, address, 0)
            if elapsed is None:
                break
            rtts.append(elapsed)
        if not rtts:
            return None
        rtt_s = statistics.median(rtts)
        with self._lock:
            link.rtt_ms = _merge(link.rtt_ms, rtt_s * 1e3, self.cfg.ewma)
            link.rtt_at, link.ts = self.clock(), self.wall()
            link.samples += 1
        if not bw_fresh:
            elapsed = self._ping(peer_id, address, self.cfg.probe_bytes)
            if elapsed is not None:
                mbps = self.cfg.probe_bytes * 8 / max(elapsed - rtt_s, elapsed * 0.2) / 1e6
                with self._lock:
                    link.bandwidth_mbps = _merge(link.bandwidth_mbps, mbps, self.cfg.ewma)
                    link.bw_at, link.ts = self.clock(), self.wall()
        return self.get(peer_id)

    def _ping(self, peer_id: str, address: str, padding: int) -> float | None:
        """One Ping carrying ``padding`` bytes; its round-trip seconds, or None (failed or over budget)."""
        request = pb.PingRequest(header=pb.Header(run_id=self.run_id, sender=self.peer_id),
                                 sent_at=self.wall(), padding=b"\0" * padding)
        size = request.ByteSize()
        if not self._spend(peer_id, size + _REPLY_ALLOWANCE, commit=False):
            log.debug("probe of %s skipped: over its budget of %d B/min", short_id(peer_id), self.cfg.budget_bytes_per_min)
            return None
        start = time.perf_counter()
        try:
            reply = self.client.ping(address, request, timeout=self.cfg.timeout_s, peer=peer_id)
        except grpc.RpcError as err:
            self._spend(peer_id, size, commit=True)
            log.debug("probe of %s at %s failed: %s", short_id(peer_id), address, rpc_reason(err))
            return None
        elapsed = time.perf_counter() - start
        self._spend(peer_id, size + reply.ByteSize(), commit=True)
        return elapsed

    def _spend(self, peer_id: str, nbytes: int, commit: bool) -> bool:
        """Check (``commit=False``) or record probe bytes against the peer's sliding-minute budget."""
        now = self.clock()
        with self._lock:
            spent = self._link(peer_id).spent
            while spent and now - spent[0][0] >= 60.0:
                spent.popleft()
            if commit:
                spent.append((now, nbytes))
                return True
            return sum(n for _, n in spent) + nbytes <= self.cfg.budget_bytes_per_min

    def _link(self, peer_id: str) -> _Link:
        link = self._links.get(peer_id)
        if link is None:
            link = self._links[peer_id] = _Link()
        return link


@dataclass
class _Burst:
    in_flight: int = 0
    nbytes: int = 0
    started: float = 0.0
    held_s: float = 0.0


class Bursts:
    """Passive link figures from transfers that overlap.

    Concurrent transfers to one peer share its link, so each one's own time would read the bandwidth
    k times too low. A *burst* lasts from the first transfer's start until none is in flight; it is
    observed once, as all its bytes over its span, less the longest time a receiver held a message
    before handling it (its wait for a round is not network time). A lone transfer is a burst of one.
    """

    def __init__(self, observe: Callable[[str, int, float], None], clock: Callable[[], float] = time.perf_counter) -> None:
        self._observe, self._clock = observe, clock
        self._lock = threading.Lock()
        self._bursts: dict[str, _Burst] = {}

    def start(self, peer_id: str) -> None:
        with self._lock:
            b = self._bursts.setdefault(peer_id, _Burst())
            if b.in_flight == 0:
                b.nbytes, b.started, b.held_s = 0, self._clock(), 0.0
            b.in_flight += 1

    def end(self, peer_id: str, nbytes: int = 0, held_s: float = 0.0) -> None:
        """A transfer ended: delivered ``nbytes`` (0 if it failed), held ``held_s`` by the receiver."""
        with self._lock:
            b = self._bursts[peer_id]
            b.in_flight -= 1
            b.nbytes += nbytes
            b.held_s = max(b.held_s, held_s)
            if b.in_flight > 0 or b.nbytes == 0:
                return
            nbytes, seconds = b.nbytes, self._clock() - b.started - b.held_s
        self._observe(peer_id, nbytes, seconds)


def _stat(link: _Link) -> LinkStat:
    return LinkStat(rtt_ms=link.rtt_ms, bandwidth_mbps=link.bandwidth_mbps, samples=link.samples, ts=link.ts)
