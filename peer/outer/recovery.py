"""Fetching a state this peer must hold: from members of its stage, or the coordinator's checkpoint.

The follower says which state (:class:`~potluck.peer.follower.Recover`): an exact version and hash
(behind the swarm, holding a different state, or rolled back), or any version newer than the one
held (a step that failed here but others may have committed). Sources are asked what they serve
(their newest or previous state), those serving the wanted one are pulled from in parallel, and the
result is accepted only if it hashes to what they advertised.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from potluck.compression.transfer import (
    Snapshot,
    SnapshotUnavailable,
    Source,
    Target,
    epoch_of,
    fetch_snapshot,
    probe_sources,
)
from potluck.peer.follower import Recover
from potluck.protos import potluck_pb2 as pb
from potluck.protos.net.transport import PeerClient
from potluck.protos.runtime.log import get_logger
from potluck.protos.wire.records import Plan

if TYPE_CHECKING:
    from potluck.peer.tasklet import Toolbox

log = get_logger(__name__)


def find_sources(client: PeerClient, header: pb.Header, targets: Sequence[Target], stage: int, want: Recover,
                 held_version: int) -> list[Source]:
    """The sources serving the wanted state, all at one (version, hash): the newest most agree on."""
    probed = probe_sources(client, header, targets, stage=stage, version=want.version)
    if want.version is None:  # (peers still on an abandoned epoch serve newer versions of it: not those)
        fits = [s for s in probed if s.info.version > held_version and epoch_of(s.info) >= want.epoch]
    else:
        fits = [s for s in probed if s.info.version == want.version
                and (not want.state_hash or s.info.state_hash == want.state_hash)]
    if not fits:
        return []
    best = max(fits, key=lambda s: (s.info.version, sum(t.info.state_hash == s.info.state_hash for t in fits)))
    return [s for s in fits if (s.info.version, s.info.state_hash) == (best.info.version, best.info.state_hash)]


def recover(tools: Toolbox, stage: int, numel: int, want: Recover, held_version: int, plan: Plan | None,
            coordinator: Target | None) -> Snapshot | None:
    """The wanted state of ``stage``, from the members of the plan's rounds or the coordinator's checkpoint."""
    targets = sorted({Target(m.peer_id, m.address) for r in (plan.rounds if plan else []) for m in r.members
                      if m.peer_id != tools.me and m.stage == stage}, key=lambda t: t.peer_id)
    if coordinator:  # its checkpoint, when no member holds what we want
        targets.append(coordinator)
    header = pb.Header(run_id=tools.rc.run_id, sender=tools.me)
    sources = find_sources(tools.client, header, targets, stage, want, held_version)
    return fetch(tools.client, header, sources, stage, numel, tools.rc.sync.rpc_timeout_s) if sources else None


def fetch(client: PeerClient, header: pb.Header, sources: Sequence[Source], stage: int, numel: int,
          timeout_s: float) -> Snapshot | None:
    try:
        return fetch_snapshot(client, header, sources, expect={"momentum": numel, "theta": numel}, timeout=timeout_s,
                              stage=stage)
    except SnapshotUnavailable as err:
        log.warning("state recovery failed: %s", err)
        return None
