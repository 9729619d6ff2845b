"""The gRPC facade of a peer: what every message must satisfy, then the room that owns it.

Each RPC is handed to the part of the peer that owns its state: Ping to telemetry, the all-reduce's
four RPCs to the running :class:`~potluck.peer.reduce.allreduce.AllReduce`'s inbox, state transfers to the
committed :class:`~potluck.peer.outer.states.States`, pipeline messages to the stage's
:class:`~potluck.peer.pipeline.pipeline.Pipeline`. Those rooms are replaced when the peer changes stage, so
the facade asks for the current one on every call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from potluck.compression.transfer import SnapshotServer
from potluck.peer.pipeline.pipeline import Pipeline
from potluck.peer.reduce.allreduce import AllReduce
from potluck.peer.reduce.pacing import paced
from potluck.protos import potluck_pb2 as pb
from potluck.protos.wire.refusals import Rejected


class PeerService:
    def __init__(self, run_id: str, ping: Callable[[pb.PingRequest], pb.PingReply],
                 allreduce: Callable[[], AllReduce], states: Callable[[], SnapshotServer],
                 pipeline: Callable[[], Pipeline | None]) -> None:
        self.run_id = run_id
        self._ping, self._allreduce, self._states, self._pipeline = ping, allreduce, states, pipeline

    def _check(self, header: pb.Header) -> None:
        if header.run_id != self.run_id:
            raise Rejected(pb.UNKNOWN_RUN, f"unknown run id {header.run_id[:64]!r}", header.sender[:64])

    def ping(self, request: pb.PingRequest) -> pb.PingReply:
        self._check(request.header)
        return self._ping(request)

    def push_contribution(self, chunks: Iterator[pb.ShardChunk]) -> pb.Ack:
        return self._allreduce().inbox.on_contribution(chunks)

    def push_result(self, chunks: Iterator[pb.ShardChunk]) -> pb.Ack:
        return self._allreduce().inbox.on_result(chunks)

    def fetch_result(self, request: pb.ResultRequest) -> Iterator[pb.ShardChunk]:
        self._check(request.header)
        return self._allreduce().inbox.on_fetch_result(request)

    def fetch_inputs(self, request: pb.InputsRequest) -> Iterator[pb.ShardChunk]:
        self._check(request.header)
        allreduce = self._allreduce()  # (an audit's evidence, wanted within the next phase: paced as the outer steps are)
        return paced(allreduce.inbox.on_fetch_inputs(request), allreduce.pacing.clock)

    def get_state_info(self, request: pb.StateInfoRequest) -> pb.StateInfo:
        self._check(request.header)
        return self._states().get_state_info(request)

    def fetch_state(self, request: pb.StateRequest) -> Iterator[pb.StateChunk]:
        self._check(request.header)
        return self._states().fetch_state(request)

    def push_pipe(self, chunks: Iterator[pb.PipeChunk]) -> pb.Ack:
        pipeline = self._pipeline()  # (it checks the run id and the sender from the message's head)
        if pipeline is None:
            raise Rejected(pb.UNSUPPORTED, "this peer runs no pipeline stage")
        return pipeline.on_message(chunks)
