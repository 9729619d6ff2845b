"""The state hash: one string that names the exact bits of a snapshot's tensors.

It has two jobs, and they ask different things of it:

* **Members compare it** (heartbeat records, the coordinator's canonical hash of each version, the
  base hash every all-reduce message carries) to know they hold bit-identical ``theta_global``. A
  member could lie about its own hash whatever the function, so here any hash that changes with
  every bit would do.
* **A recovering peer verifies a download with it**: the state comes from sources that may be
  Byzantine, and the hash it must match is the one the swarm agreed on. Here it must be
  cryptographic: nobody may find other bits with the same hash (second preimages).

So it stays cryptographic, and is made cheap instead: BLAKE3 over the same bytes as before (the
names and raw bytes of the tensors in name order), cut to 128 bits. On one core its SIMD lanes hash
several 1 KiB chunks of its Merkle tree at once: 4-5x the BLAKE2b it replaces. And a peer hashes its
new state off the training loop's path (:func:`hash_later`,
:meth:`potluck.compression.transfer.Snapshot.create`), on a thread of its own, while the next phase
trains. Not on several cores: BLAKE3's thread pool (Rayon) does not survive a ``fork``, and hivemind
forks a process to run its DHT; a process that had hashed on that pool and then started a DHT node
(a coordinator resuming from a checkpoint) hung in the child.

Hashes name their scheme (``b3:`` + 32 hex digits). The BLAKE2b hashes written before (32 hex digits,
no prefix) are still verified as such: a checkpoint written by an older version resumes, and its
stage hashes go on naming the state they named, until the next step makes a new one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from blake3 import blake3

PREFIX = "b3:"
BLOCK = 16 << 20  # bytes per update: either hash lets other threads run between blocks
_later = ThreadPoolExecutor(max_workers=1, thread_name_prefix="state-hash")


def is_legacy(state_hash: str) -> bool:
    """Is ``state_hash`` the BLAKE2b kind written before BLAKE3 (no scheme prefix)?"""
    return bool(state_hash) and not state_hash.startswith(PREFIX)


class StateHasher:
    """Streaming: ``tensor(name)`` then that tensor's bytes in order through ``update``, tensors in name
    order. ``like``: the hash to verify (its scheme is used); new hashes are BLAKE3."""

    def __init__(self, like: str = "") -> None:
        self.legacy = is_legacy(like)
        self._h: Any = hashlib.blake2b(digest_size=16) if self.legacy else blake3()  # (one thread: see above)

    def tensor(self, name: str) -> None:
        self._h.update(name.encode() + b"\0")

    def update(self, block: bytes | memoryview) -> None:
        self._h.update(block)

    def hexdigest(self) -> str:
        if self.legacy:
            return self._h.hexdigest()
        return PREFIX + self._h.hexdigest(length=16)


def raw_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of ``t``, flat; a contiguous CPU tensor is not copied."""
    return t.detach().to("cpu").contiguous().reshape(-1).numpy().data.cast("B")


def tensors_hash(tensors: Mapping[str, torch.Tensor], like: str = "") -> str:
    """The state hash of ``tensors``: with ``like``, of its scheme (to verify it), else BLAKE3."""
    h = StateHasher(like)
    for name in sorted(tensors):
        h.tensor(name)
        view = raw_bytes(tensors[name])
        for k in range(0, len(view), BLOCK):
            h.update(view[k : k + BLOCK])
    return h.hexdigest()


def hash_later(tensors: Mapping[str, torch.Tensor]) -> Future[str]:
    """:func:`tensors_hash` on the state hasher's thread; the caller must not write ``tensors`` meanwhile
    (snapshots never are written). Hashes are computed in the order asked for."""
    return _later.submit(tensors_hash, dict(tensors))
