"""What one outer step's all-reduce is made of, apart from the procedure (:mod:`potluck.peer.reduce.allreduce`):
its members and their shards, how a shard was reduced and who vouches for it, what a member reports
of the step, and the shard-sized buffers results are decoded into, kept from one step for the next."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from potluck.protos import potluck_pb2 as pb


class IncompleteRound(RuntimeError):
    """The step ended without every shard's result: this member must not apply it."""


@dataclass(frozen=True)
class MemberAddr:
    peer_id: str
    address: str


@dataclass(frozen=True)
class RoundInfo:
    """One outer step as this member sees it."""

    step: int
    members: tuple[MemberAddr, ...]
    me: str
    base_hash: str  # hash of the state every member computes its delta from
    epoch: int = 0  # the coordinator's epoch of the round (a failed round's stragglers are refused)
    replicas: tuple[int, ...] = ()  # each member's replica in the round (default: its position)
    owners: tuple[str, ...] = ()  # the members that own a shard, in shard order (default: every member)
    handed: tuple[int, ...] = ()  # each member's samples of the step: its replica's share (empty: not known)
    group: int = 0  # the stage's averaging group this all-reduce is (sync.group_size; 0: the whole stage)

    def handed_to(self, peer_id: str) -> int | None:
        """The samples ``peer_id``'s replica was handed for this step (the most work it may claim); None: unknown."""
        if not self.handed or peer_id not in self.ids:
            return None
        return self.handed[self.ids.index(peer_id)]

    def replica_of(self, peer_id: str) -> int:
        k = self.ids.index(peer_id)
        return self.replicas[k] if k < len(self.replicas) else k

    @property
    def ids(self) -> list[str]:
        return [m.peer_id for m in self.members]

    @property
    def shard_owners(self) -> list[str]:
        """Shard ``j``'s owner is ``shard_owners[j]``: members past probation (all of them by default)."""
        return list(self.owners) if self.owners else self.ids

    @property
    def shards(self) -> int:
        return len(self.shard_owners)

    @property
    def shard(self) -> int | None:
        """The shard this member owns, or None (on probation: it contributes and gathers only)."""
        owners = self.shard_owners
        return owners.index(self.me) if self.me in owners else None

    def address_of(self, peer_id: str) -> MemberAddr:
        return next(m for m in self.members if m.peer_id == peer_id)

    def ring_after(self, shard: int) -> list[MemberAddr]:
        """The owners after shard ``shard``'s, in ring order: its backups (a backup may take the shard over)."""
        owners = self.shard_owners
        return [self.address_of(owners[(shard + k) % len(owners)]) for k in range(1, len(owners))]


def shard_bounds(numel: int, parts: int, align: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, end)`` shards covering ``numel``, near-equal in whole blocks of ``align``."""
    blocks = -(-numel // align)
    per, extra = divmod(blocks, parts)
    bounds, start = [], 0
    for j in range(parts):
        end = min(numel, start + (per + (1 if j < extra else 0)) * align)
        bounds.append((start, end))
        start = end
    return bounds


@dataclass(frozen=True)
class Outcome:
    """How a shard was reduced: what every member applies from it, and who vouches for it."""

    attempt: int
    contributors: list[str]
    clipped: list[str] = field(default_factory=list)
    rejected: list[str] = field(default_factory=list)
    signer: str = ""
    signature: bytes = b""
    inputs: list[str] = field(default_factory=list)  # every contribution weighed (contributors and rejected), sorted
    input_digests: list[bytes] = field(default_factory=list)  # and each one's contribution digest
    weights: list[int] = field(default_factory=list)  # and the samples each one claimed, signed by its sender


@dataclass
class ShardResult:
    values: torch.Tensor
    chunks: list[pb.Tensor]
    outcome: Outcome
    digests: list[bytes] = field(default_factory=list)  # each chunk's tensor_digest (received results)


@dataclass
class AllReduceStats:
    step: int = 0
    seconds: float = 0.0
    wait_seconds: float = 0.0
    bytes_sent: int = 0
    members: int = 0
    dropped: list[str] = field(default_factory=list)
    taken_over: list[int] = field(default_factory=list)
    contributors: dict[int, int] = field(default_factory=dict)
    partial: list[str] = field(default_factory=list)  # contributors counted in some shards but not all
    clipped: list[str] = field(default_factory=list)  # contributors some owner scaled down
    rejected: list[str] = field(default_factory=list)  # contributors some owner left out
    flags: dict[str, list[str]] = field(default_factory=dict)  # each owner's (signer's) clipped and rejected
    included: list[int] = field(default_factory=list)  # replicas whose contributions the result holds (any shard)
    samples: dict[int, int] = field(default_factory=dict)  # included replica -> the samples its contribution claimed
    send_s: float = 0.0  # how long this member's own contributions took to reach their owners
    omitted: list[tuple[int, int, str]] = field(default_factory=list)  # (shard, attempt, owner): receipted, left out
    short: list[int] = field(default_factory=list)  # shards whose owner's result named too few (sync.quorum): taken over
    unreceipted: list[tuple[int, str]] = field(default_factory=list)  # (shard, why): its owner took no contribution
    paced_s: float = 0.0  # seconds this member's sends were held back to their pace (sync.pace), all streams summed
    pace_bps: float = 0.0  # the rate they were paced at (0: not paced)


class Buffers:
    """Shard-sized float32 buffers kept from one step for the next. A fresh vector is paid for in page
    faults the first time it is written (about 70 ms for 80 MB on this project's machines), every
    step, by every member: contributions and results are decoded into these instead."""

    KEEP = 16

    def __init__(self) -> None:
        self._free: dict[int, list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def take(self, numel: int) -> torch.Tensor:
        with self._lock:
            free = self._free.get(numel)
            if free:
                return free.pop()
        return torch.empty(numel, dtype=torch.float32)

    def give(self, tensors: list[torch.Tensor]) -> None:
        with self._lock:
            for t in tensors:
                free = self._free.setdefault(t.numel(), [])
                if len(free) < self.KEEP and t.is_contiguous() and t.storage_offset() == 0:
                    free.append(t)
