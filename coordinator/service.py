"""The coordinator's side of the wire: what its PeerService answers, and the pings it sends.

The coordinator is not on the data path. It answers Ping and serves its checkpoint to recovering
peers (through the :class:`~potluck.coordinator.checkpointer.Checkpointer`); the all-reduce and
pipeline RPCs are refused as ``UNSUPPORTED``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from potluck.coordinator.checkpointer import Checkpointer
from potluck.protos import potluck_pb2 as pb
from potluck.protos.records import PeerRecord
from potluck.protos.transport import PeerClient, Rejected

PING_TIMEOUT_S = 2.0


class CoordinatorService:
    def __init__(self, me: str, committed: Callable[[], int], checkpointer: Checkpointer) -> None:
        self.me, self.committed, self.checkpointer = me, committed, checkpointer

    def ping(self, request: pb.PingRequest) -> pb.PingReply:
        return pb.PingReply(peer_id=self.me, state="coordinator", version=self.committed(), sent_at=request.sent_at)

    def get_state_info(self, request: pb.StateInfoRequest) -> pb.StateInfo:
        return self.checkpointer.get_state_info(request)

    def fetch_state(self, request: pb.StateRequest) -> Iterator[pb.StateChunk]:
        return self.checkpointer.fetch_state(request)

    def _unsupported(self, *_: Any) -> Any:
        raise Rejected(pb.UNSUPPORTED, "the coordinator takes no part in the all-reduce or the pipeline")

    push_contribution = push_result = fetch_result = fetch_inputs = push_pipe = _unsupported


def answers(client: PeerClient, run_id: str, me: str, rec: PeerRecord) -> bool:
    """Does the process that published ``rec`` still answer at its address, as a peer of this run?"""
    request = pb.PingRequest(header=pb.Header(run_id=run_id, sender=me), sent_at=time.time())
    try:
        reply = client.ping(rec.address, request, PING_TIMEOUT_S, peer=rec.peer_id)
    except grpc.RpcError:
        return False
    return reply.peer_id == rec.peer_id and reply.state not in ("left", "finished")


def reachable(client: PeerClient, run_id: str, me: str, records: Iterable[PeerRecord]) -> list[PeerRecord]:
    """The peers that answer a ping (in parallel): a live record of a dead process should not enter a round."""
    records = list(records)

    def ping(rec: PeerRecord) -> str | None:
        request = pb.PingRequest(header=pb.Header(run_id=run_id, sender=me), sent_at=time.time())
        try:
            client.ping(rec.address, request, PING_TIMEOUT_S, peer=rec.peer_id)
            return rec.peer_id
        except grpc.RpcError:
            return None

    if not records:
        return []
    with ThreadPoolExecutor(max_workers=min(32, len(records))) as pool:
        ok = {pid for pid in pool.map(ping, records) if pid}
    return [r for r in records if r.peer_id in ok]
