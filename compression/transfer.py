"""Moving versioned snapshots of named flat tensors between processes.

A :class:`Snapshot` is what a member commits after an outer step (``theta``, ``momentum``) and what
the coordinator keeps as a checkpoint: named flat float32 tensors, a version (committed outer
steps), a hash over all of them, and JSON metadata (layout, counters). Snapshots are immutable, so
a process can serve one while it computes the next.

A fetcher asks every source what it holds (:func:`probe_sources`), keeps those at the version and
hash it wants, and pulls one contiguous range per source in parallel (:func:`fetch_snapshot`); a
range whose source fails is retried from the next. The assembled snapshot is accepted only if its
hash equals the advertised one.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grpc
import torch

from potluck.compression.int8 import RawCodec
from potluck.compression.statehash import hash_later as hash_in_background
from potluck.compression.statehash import raw_bytes, tensors_hash
from potluck.compression.stream import Assembler, WireError, encode_chunks
from potluck.protos import potluck_pb2 as pb
from potluck.protos.net.transport import PeerClient
from potluck.protos.runtime.log import get_logger
from potluck.protos.wire.refusals import Rejected, rpc_reason

log = get_logger(__name__)


HASH_CHUNK = 16 << 20


class SnapshotUnavailable(RuntimeError):
    """No source could provide the requested snapshot."""


def byte_chunks(t: torch.Tensor, size: int = HASH_CHUNK) -> Iterator[memoryview]:
    """The raw bytes of ``t`` in blocks of at most ``size``, as views: a contiguous CPU tensor is not copied."""
    view = raw_bytes(t)
    for k in range(0, len(view), size):
        yield view[k : k + size]


@dataclass(frozen=True)
class Snapshot:
    """``digest`` is the state hash (:mod:`potluck.compression.statehash`), or its computation still
    under way: read :attr:`hash`, which waits for it."""

    tensors: dict[str, torch.Tensor]
    version: int
    digest: str | Future[str]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def hash(self) -> str:
        d = self.digest
        return d if isinstance(d, str) else d.result()

    @classmethod
    def create(cls, tensors: dict[str, torch.Tensor], version: int, meta: dict[str, Any] | None = None,
               hash_later: bool = False) -> Snapshot:
        """``hash_later``: hash on the state hasher's thread (the tensors are never written again), so the
        caller goes on at once and whoever reads :attr:`hash` first waits for what is left of it."""
        flat = {}
        for name, t in tensors.items():
            if t.dim() != 1:
                raise ValueError(f"snapshot tensor {name!r} must be flat, got shape {tuple(t.shape)}")
            flat[name] = t.detach().to("cpu", torch.float32).contiguous()
        return cls(flat, version, hash_in_background(flat) if hash_later else tensors_hash(flat), dict(meta or {}))


class SnapshotServer:
    """GetStateInfo / FetchState handlers over the latest published :class:`Snapshot`, and the one
    before it: a member one step ahead of a failed round rolls back to it, and its peers fetch it
    from here (see :mod:`potluck.coordinator.rounds.rounds`)."""

    def __init__(self, run_id: str, chunk_bytes: int, keep: int = 1) -> None:
        self.run_id, self.chunk_bytes, self.keep = run_id, chunk_bytes, keep
        self._lock = threading.Lock()
        self._snapshot: Snapshot | None = None
        self._previous: Snapshot | None = None

    def publish(self, snapshot: Snapshot | None) -> None:
        """Serve ``snapshot``; the one it replaces stays available if ``keep`` (and older)."""
        with self._lock:
            old = self._snapshot
            if self.keep and old is not None and snapshot is not None and old.version < snapshot.version:
                self._previous = old
            elif snapshot is None or (self._previous is not None and self._previous.version >= snapshot.version):
                self._previous = None
            self._snapshot = snapshot

    @property
    def current(self) -> Snapshot | None:
        with self._lock:
            return self._snapshot

    @property
    def previous(self) -> Snapshot | None:
        with self._lock:
            return self._previous

    def _for(self, run_id: str, version: int | None = None) -> Snapshot:
        if run_id != self.run_id:
            raise Rejected(pb.UNKNOWN_RUN, f"unknown run id {run_id!r}")
        with self._lock:
            held = [s for s in (self._snapshot, self._previous) if s is not None]
        if not held:
            raise Rejected(pb.NO_STATE, "no committed state yet")
        if version is None:
            return held[0]
        for snap in held:
            if snap.version == version:
                return snap
        raise Rejected(pb.NO_STATE, f"version {version} is not held here (holding {[s.version for s in held]})")

    def get_state_info(self, request: pb.StateInfoRequest) -> pb.StateInfo:
        snap = self._for(request.header.run_id, request.version if request.HasField("version") else None)
        return pb.StateInfo(
            version=snap.version,
            state_hash=snap.hash,
            tensors=[pb.TensorInfo(name=n, dtype="float32", shape=[t.numel()]) for n, t in sorted(snap.tensors.items())],
            meta_json=json.dumps(snap.meta),
        )

    def fetch_state(self, request: pb.StateRequest) -> Iterator[pb.StateChunk]:
        snap = self._for(request.header.run_id, request.version)
        for r in request.ranges:
            t = snap.tensors.get(r.name)
            if t is None:
                raise Rejected(pb.BAD_MESSAGE, f"no tensor named {r.name!r}")
            if r.offset < 0 or r.numel < 0 or r.offset + r.numel > t.numel():
                raise Rejected(pb.BAD_MESSAGE, f"range [{r.offset}, {r.offset + r.numel}) is outside {r.name}")
            for chunk in encode_chunks(r.name, t[r.offset : r.offset + r.numel], RawCodec(), self.chunk_bytes):
                chunk.offset += r.offset
                chunk.shape[:] = [t.numel()]
                yield pb.StateChunk(version=snap.version, tensor=chunk)


def stage_of(info: pb.StateInfo) -> int:
    """The pipeline stage a served state belongs to (its meta says; 0 for single-stage runs, -1 if garbled)."""
    return _meta_int(info, "stage", -1)


def epoch_of(info: pb.StateInfo) -> int:
    """The epoch a served state was made in (its meta says; 0 if it names none, -1 if garbled)."""
    return _meta_int(info, "epoch", -1)


def _meta_int(info: pb.StateInfo, key: str, garbled: int) -> int:
    try:
        return int(json.loads(info.meta_json or "{}").get(key, 0))
    except (ValueError, TypeError, AttributeError):
        return garbled


@dataclass(frozen=True)
class Target:
    """A process that may serve state: its peer id (what TLS checks) and its gRPC address."""

    peer_id: str
    address: str


@dataclass(frozen=True)
class Source:
    target: Target
    info: pb.StateInfo

    @property
    def address(self) -> str:
        return self.target.address


def probe_sources(client: PeerClient, header: pb.Header, targets: Sequence[Target], timeout: float = 2.0,
                  stage: int = 0, version: int | None = None) -> list[Source]:
    """Ask every target at once what it serves of pipeline ``stage`` (at ``version``, or its newest).

    Unreachable, silent or refusing ones, and those serving another stage (a peer serves the stage it
    holds, whatever is asked), are skipped; a frozen source costs ``timeout``, once, not per source.
    """
    request = pb.StateInfoRequest(header=header, stage=stage, version=version)

    def ask(target: Target) -> Source | None:
        try:
            info = client.get_state_info(target.address, request, timeout, peer=target.peer_id)
        except grpc.RpcError as err:
            log.debug("no state from %s: %s", target.address, rpc_reason(err))
            return None
        return Source(target, info) if stage_of(info) == stage else None

    if not targets:
        return []
    with ThreadPoolExecutor(max_workers=min(16, len(targets))) as pool:
        return [s for s in pool.map(ask, targets) if s is not None]


def fetch_snapshot(
    client: PeerClient,
    header: pb.Header,
    sources: Sequence[Source],
    expect: dict[str, int] | None = None,
    timeout: float = 60.0,
    on_progress: Callable[[int], None] | None = None,
    stage: int = 0,
) -> Snapshot:
    """Pull the snapshot that ``sources[0]`` advertises from every source that advertises the same.

    ``expect`` maps tensor names to the element counts the caller can use; a source offering
    anything else is refused before a byte is fetched.
    """
    if not sources:
        raise SnapshotUnavailable("no source serves a snapshot")
    version, want_hash = sources[0].info.version, sources[0].info.state_hash
    sources = [s for s in sources if s.info.version == version and s.info.state_hash == want_hash]
    sizes = {t.name: int(t.shape[0]) if len(t.shape) == 1 else -1 for t in sources[0].info.tensors}
    if any(v < 0 for v in sizes.values()):
        raise SnapshotUnavailable(f"{sources[0].address} serves tensors that are not flat")
    if expect is not None and sizes != expect:
        raise SnapshotUnavailable(f"{sources[0].address} serves {sizes}, expected {expect}")
    t0 = time.monotonic()
    parts: list[tuple[str, int, int]] = []
    for name, numel in sizes.items():
        per = -(-numel // len(sources))
        for k in range(len(sources)):
            lo, hi = k * per, min(numel, (k + 1) * per)
            if lo < hi:
                parts.append((name, lo, hi))
    buffers = {name: torch.empty(numel, dtype=torch.float32) for name, numel in sizes.items()}

    def pull(idx: int) -> None:
        name, lo, hi = parts[idx]
        errors = []
        for attempt in range(len(sources)):
            src = sources[(idx + attempt) % len(sources)]
            req = pb.StateRequest(header=header, version=version, ranges=[pb.Range(name=name, offset=lo, numel=hi - lo)],
                                  stage=stage)
            asm = Assembler(name, sizes[name], RawCodec(), start=lo, stop=hi)
            asm.buffer = buffers[name][lo:hi]  # decoded in place: a fetch holds the snapshot once, not twice
            try:
                for chunk in client.fetch_state(src.address, req, timeout, peer=src.target.peer_id):
                    if chunk.version != version:
                        raise WireError(f"chunk of version {chunk.version}, expected {version}")
                    asm.add(chunk.tensor)
                    if on_progress is not None:
                        on_progress(chunk.tensor.numel)
                asm.result()  # raises unless every element arrived
                return
            except (grpc.RpcError, WireError) as err:
                errors.append(f"{src.address}: {rpc_reason(err) if isinstance(err, grpc.RpcError) else err}")
        raise SnapshotUnavailable(f"range {name}[{lo}:{hi}] failed from every source: {'; '.join(errors)}")

    with ThreadPoolExecutor(max_workers=max(1, min(16, len(parts)))) as pool:
        for f in [pool.submit(pull, i) for i in range(len(parts))]:
            f.result()
    got = tensors_hash(buffers, like=want_hash)
    if got != want_hash:
        raise SnapshotUnavailable(f"fetched snapshot hashes to {got[:12]}, its sources advertised {want_hash[:12]}")
    try:
        meta = json.loads(sources[0].info.meta_json or "{}")
    except json.JSONDecodeError:
        meta = {}
    total = sum(sizes.values()) * 4
    log.info("fetched state v%d (%.1f MB) from %d source(s) in %.2f s", version, total / 1e6, len(sources), time.monotonic() - t0)
    return Snapshot(buffers, version, got, meta if isinstance(meta, dict) else {})
