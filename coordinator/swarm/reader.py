"""What the coordinator reads from the DHT each tick: the peers' records, incrementally, off its loop.

Three kinds of per-peer record matter to the coordinator: heartbeats (``peers``), admission requests
(``admission``) and link reports (``links``). Each is a :class:`~potluck.protos.swarm.Feed`: its DHT
process does the read, opens only the records that changed since the last answer the loop took (checks
each one's signature and expiry) and sends those over, to be parsed once each; the loop never waits for
the DHT, it takes what has arrived. So a tick costs what changed, not every record of the swarm, and a slow DHT read
delays the news by a read, never the loop.

All three are read from the coordinator's own DHT storage, never through the network: peers store
them straight on the coordinator's node (:meth:`~potluck.protos.swarm.SwarmNode.publish_peer` says
why), whose node id is the peers key's own, so a search for that key ends there too. Heartbeats and
admission requests are read every tick (a step's last report reaches a commit within a tick or two);
link reports, which feed placement and the page's heatmap, every 5 s.
"""

from __future__ import annotations

from typing import Any

from potluck.protos.config.runconfig import RunConfig
from potluck.protos.net.feed import Feed
from potluck.protos.net.swarm import LinkReport, SwarmNode
from potluck.protos.wire.admissions import AdmissionRequest
from potluck.protos.wire.records import PeerRecord

LINKS_EVERY_S = 5.0


class Reader:
    def __init__(self, node: SwarmNode, cfg: RunConfig) -> None:
        every = cfg.coordinator.tick_s  # (a local read of what changed costs the DHT process a pass over its dict)
        self.peers = Feed(node, "peers", PeerRecord, "peer record", every, local=True)  # (its node holds them all)
        self.admissions = Feed(node, "admission", AdmissionRequest, "admission request", every, local=True)
        self.links = Feed(node, "links", LinkReport, "link report", LINKS_EVERY_S, local=True)
        self._warned: set[str] = set()

    def poll(self, now: float) -> list[str]:
        """Take what the reads in flight brought and start the next ones; returns the reasons records were
        refused that were not given before (forged, stale, malformed), each once, in order."""
        refused = [r for feed in (self.peers, self.admissions, self.links) for r in feed.poll(now)[1]]
        new = [r for r in dict.fromkeys(refused) if r not in self._warned]
        if len(self._warned) > 10_000:  # (a flood of forgeries must not grow it without end: say them again)
            self._warned.clear()
        self._warned.update(new)
        return new

    def stats(self) -> dict[str, Any]:
        """For the status page: how many records each kind holds and what the last read brought."""
        return {feed.kind: {"records": len(feed.records), "changed": feed.last_changed,
                            "read_s": None if feed.last_read_s is None else round(feed.last_read_s, 4)}
                for feed in (self.peers, self.admissions, self.links)}
