"""Contributions signed as a member signs them (verified reduction): for tests that build their own."""

from __future__ import annotations

from collections.abc import Iterable

from potluck.compression.aggregate import contribution_digest
from potluck.compression.stream import tensor_digest
from potluck.protos import potluck_pb2 as pb
from potluck.protos.net.identity import Identity


def signed(chunks: Iterable[pb.ShardChunk], identity: Identity) -> list[pb.ShardChunk]:
    """``chunks`` of one contribution with ``identity``'s signature on the last, over what its header says."""
    out = list(chunks)
    if not out:
        return out
    first = out[0]
    h = first.header
    digest = contribution_digest(h.run_id, h.step, h.epoch, first.shard, first.num_shards, first.attempt,
                                 first.base_hash, h.sender, [tensor_digest(c.tensor) for c in out])
    out[-1].signer, out[-1].signature = identity.peer_id, identity.sign(digest)
    return out
