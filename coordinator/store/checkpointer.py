"""The coordinator's checkpoints: fetched from members off the tick, written, and served.

The :class:`Checkpointer` owns everything about checkpoints: the on-disk store, the worker thread
that fetches a committed version from its members, and the checkpoint it serves to recovering
peers (cut into the run's current stages). The coordinator's loop only *asks* (:meth:`want`) and
*hears back* (:meth:`results`): a newer wanted version supersedes an older one still being
fetched, and the final version of a run is never skipped. With ``coordinator.checkpoint_url`` it also
owns the :class:`~potluck.coordinator.store.offbox.Uploader`, woken after each write and never waited for.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from potluck.compression.transfer import (
    Snapshot,
    SnapshotServer,
    SnapshotUnavailable,
    Target,
    fetch_snapshot,
    probe_sources,
)
from potluck.coordinator.rounds.cursor import Cursor
from potluck.coordinator.rounds.roundevents import Checkpoint
from potluck.coordinator.store.checkpoint import CheckpointStore
from potluck.coordinator.store.offbox import probe
from potluck.coordinator.store.uploadproc import UploadProcess
from potluck.models import stage_bounds
from potluck.protos import potluck_pb2 as pb
from potluck.protos.config.runconfig import RunConfig
from potluck.protos.net.transport import PeerClient
from potluck.protos.runtime.log import get_logger
from potluck.protos.wire.records import Round
from potluck.protos.wire.refusals import Rejected

log = get_logger(__name__)

FETCH_DEADLINE_S = 30.0


class Superseded(Exception):
    """A newer version was asked for while this one was being fetched."""


@dataclass(frozen=True)
class Job:
    """Checkpoint ``version``: members' addresses and the canonical hash, per stage."""

    version: int
    members: dict[int, list[Target]]
    hashes: dict[int, str] = field(default_factory=dict)
    cursor: Cursor | None = None  # the data cursor of ``version``: a run resumed from it reads on from there

    @classmethod
    def of(cls, rnd: Round, version: int, canonical: Callable[[int, int], str], cursor: Cursor | None = None) -> Job:
        """Checkpoint ``version`` from the members of ``rnd`` (the round that produced it)."""
        stages = range(rnd.stages)
        return cls(version, {s: [Target(m.peer_id, m.address) for m in rnd.stage_members(s)] for s in stages},
                   {s: canonical(version, s) for s in stages}, cursor)


@dataclass(frozen=True)
class Written:
    version: int
    path: Path
    checkpoint: Checkpoint  # what is served now: its version and hash per stage


@dataclass(frozen=True)
class NotWritten:
    version: int
    reason: str


@dataclass(frozen=True)
class Served:
    """A checkpoint as recovering peers get it: one server per stage of the run, each serving that
    stage memory-mapped from a file (see :meth:`CheckpointStore.stages`)."""

    version: int
    servers: dict[int, SnapshotServer]
    cursor: Cursor | None = None

    @property
    def hashes(self) -> dict[int, str]:
        return {stage: server.current.hash for stage, server in self.servers.items() if server.current}

    def checkpoint(self) -> Checkpoint:
        return Checkpoint(self.version, self.hashes, self.cursor)


class Checkpointer:
    def __init__(self, directory: Path, keep: int, client: PeerClient, *, run_id: str, me: str,
                 bounds: list[tuple[int, int]], chunk_bytes: int, rpc_timeout_s: float, meta: dict[str, Any],
                 upload_url: str = "", journal_dir: Path | None = None) -> None:
        self.store = CheckpointStore(directory, keep=keep)
        # (copies each checkpoint kept to coordinator.checkpoint_url, and the run's roster of ``journal_dir``, in a
        # process of its own)
        self.uploader = UploadProcess(upload_url, directory, keep, journal_dir) if upload_url else None
        self.client, self.run_id, self.me, self.bounds = client, run_id, me, bounds
        self.chunk_bytes, self.rpc_timeout_s, self.meta = chunk_bytes, rpc_timeout_s, meta
        self.served: Served | None = None  # replaced whole, never changed in place: handlers read it lock-free
        self._cond = threading.Condition()
        self._job: Job | None = None
        self._busy = False
        self._results: queue.SimpleQueue[Written | NotWritten] = queue.SimpleQueue()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="checkpointer", daemon=True)

    @classmethod
    def for_run(cls, cfg: RunConfig, client: PeerClient, run_id: str, me: str) -> Checkpointer:
        c = cfg.coordinator
        return cls(Path(c.journal_dir) / "checkpoints", c.keep_checkpoints, client, run_id=run_id, me=me,
                   bounds=stage_bounds(cfg.model, cfg.pipeline), chunk_bytes=cfg.sync.chunk_bytes,
                   rpc_timeout_s=cfg.sync.rpc_timeout_s, meta={"model": cfg.model.model_dump(mode="json")},
                   upload_url=c.checkpoint_url, journal_dir=Path(c.journal_dir))

    def start(self) -> None:
        """Serve the newest checkpoint whose files verify (skipping, with a log line, those that do not),
        then start the worker, and the uploader once its store's bucket is not known to be missing (ConfigError)."""
        if self.uploader is not None:
            probe(self.uploader.remote)
        for path in self.store.manifests():
            try:
                self.store.verified(path)
                self.serve(path)
                break
            except (ValueError, KeyError, OSError) as err:
                log.error("checkpoint %s is unusable (%s); trying the previous one", path.stem, err)
        self._thread.start()
        if self.uploader is not None:
            self.uploader.start()

    def stop(self, timeout: float = 2.0) -> None:
        self._stopping.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self.uploader is not None:
            self.uploader.stop(timeout)

    # ------------------------------------------------------------------ the loop's side

    def want(self, job: Job) -> None:
        """Checkpoint ``job.version`` (replacing an older version not started yet)."""
        with self._cond:
            if self._job is None or job.version >= self._job.version:
                self._job = job
            self._cond.notify_all()

    def checkpoint(self) -> Checkpoint | None:
        """The served checkpoint's version and hashes (for rollbacks), if there is one."""
        served = self.served
        return served.checkpoint() if served is not None else None

    def busy(self) -> bool:
        """A checkpoint being fetched or written, or one still owed to a store that is not failing."""
        with self._cond:
            if self._busy or self._job is not None:
                return True
        return self.uploader is not None and self.uploader.pending()

    def upload_news(self) -> list[tuple[str, bool]]:
        """(message, is a warning) of each time the checkpoint store started failing or worked again."""
        return self.uploader.news() if self.uploader is not None else []

    def written(self) -> list[Written]:
        """The checkpoints written since the last call (one that could not be is said in the log)."""
        out: list[Written] = []
        while True:
            try:
                done = self._results.get_nowait()
            except queue.Empty:
                return out
            if isinstance(done, Written):
                out.append(done)
            else:
                log.warning("checkpoint of v%d not written: %s", done.version, done.reason)

    def serve(self, path: Path, bounds: list[tuple[int, int]] | None = None) -> None:
        """Serve the checkpoint of manifest ``path`` (its files checked) cut into ``bounds`` (default: the
        run's current stages), each stage from a file, memory-mapped: the checkpoint's own stage files
        when they match, files re-split from them otherwise (a run resumed with other stages)."""
        self.bounds = bounds or self.bounds
        parts = self.store.stages(path, self.bounds)
        servers = {}
        for stage, part in enumerate(parts):
            server = SnapshotServer(self.run_id, self.chunk_bytes)
            server.publish(part)
            servers[stage] = server
        cursor = json.loads(path.read_text()).get("data_cursor")
        self.served = Served(parts[0].version, servers, Cursor.from_json(cursor) if cursor is not None else None)

    # ------------------------------------------------------------------ the worker

    def _loop(self) -> None:
        while not self._stopping.is_set():
            with self._cond:
                while self._job is None and not self._stopping.is_set():
                    self._cond.wait(0.5)
                job, self._job = self._job, None
                self._busy = job is not None
            if job is None:
                return
            try:
                self._results.put(self._checkpoint(job))
            except Exception as err:  # a bug here must not end the run: report and go on
                log.exception("checkpoint of v%d failed", job.version)
                self._results.put(NotWritten(job.version, str(err)))
            finally:
                with self._cond:
                    self._busy = False

    def _superseded(self, version: int) -> bool:
        with self._cond:
            return self._job is not None and self._job.version > version

    def _checkpoint(self, job: Job) -> Written | NotWritten:
        """Fetch every stage's state at ``job.version`` from its members, one stage at a time, each
        written to its file before the next is fetched; then serve the files."""
        header = pb.Header(run_id=self.run_id, sender=self.me)
        deadline = time.monotonic() + FETCH_DEADLINE_S

        def fetched(stage: int) -> Snapshot:
            targets, want = job.members[stage], job.hashes.get(stage, "")
            while time.monotonic() < deadline and not self._stopping.is_set():
                if self._superseded(job.version):
                    raise Superseded
                sources = [s for s in probe_sources(self.client, header, targets, stage=stage, version=job.version)
                           if not want or s.info.state_hash == want]
                if sources:
                    try:
                        return fetch_snapshot(self.client, header, sources, timeout=self.rpc_timeout_s, stage=stage)
                    except SnapshotUnavailable as err:
                        log.info("stage %d of v%d not fetched yet: %s", stage, job.version, err)
                self._stopping.wait(0.2)
            raise SnapshotUnavailable("stopping" if self._stopping.is_set() else f"no member served stage {stage}")

        stages = len(job.members)
        try:
            extra = {"run_id": self.run_id, **self.meta}
            if job.cursor is not None:
                extra["data_cursor"] = job.cursor.to_json()
            path = self.store.write_stages(job.version, (fetched(i) for i in range(stages)), extra)
            if self.uploader is not None:
                self.uploader.offer()
            self.serve(path)
        except Superseded:
            return NotWritten(job.version, "superseded by a newer version")
        except (SnapshotUnavailable, OSError, ValueError) as err:
            return NotWritten(job.version, str(err))
        assert self.served is not None
        return Written(job.version, path, self.served.checkpoint())

    # ------------------------------------------------------------------ gRPC (recovering peers)

    def _server(self, stage: int) -> SnapshotServer:
        served = self.served
        if served is None or stage not in served.servers:
            raise Rejected(pb.NO_STATE, f"no checkpoint of stage {stage}")
        return served.servers[stage]

    def get_state_info(self, request: pb.StateInfoRequest) -> pb.StateInfo:
        return self._server(request.stage).get_state_info(request)

    def fetch_state(self, request: pb.StateRequest) -> Iterator[pb.StateChunk]:
        return self._server(request.stage).fetch_state(request)
