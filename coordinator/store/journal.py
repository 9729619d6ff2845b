"""The coordinator's on-disk journal: enough to resume a run after a restart.

``<journal_dir>/journal.json`` holds the run id and config, the committed outer step, the recent
rounds and canonical hashes, the loss history and the checkpoints written. It is rewritten
atomically (temporary file, fsync, rename), so a crash leaves either the old or the new journal,
never half of one.
"""

from __future__ import annotations

import os
import secrets
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from potluck.coordinator.rounds.history import journaled
from potluck.coordinator.rounds.perround import PerRound
from potluck.protos.config.files import known_fields_only, parse_config
from potluck.protos.config.runconfig import RunConfig
from potluck.protos.config.section import ConfigError
from potluck.protos.wire.records import Round

JOURNAL_VERSION = 2
KEEP_ROUNDS = 16
KEEP_MEMBERS = 4096
# What a resumed run may change: how the model is laid out and how peers are managed, not what is
# trained (model, data, optimizers, codec) -- a universal checkpoint re-splits into any stage count.
RESUMABLE_SECTIONS = {"pipeline", "membership", "links", "diloco"}


class JournalError(RuntimeError):
    """A journal that cannot be read or does not belong to this run."""


class JournalState(BaseModel):
    model_config = ConfigDict(extra="ignore")

    v: int = JOURNAL_VERSION
    run_id: str
    config: dict[str, Any]
    created_at: float
    committed: int = 0
    epoch: int = Field(0, description="grows with every failed round (see potluck.coordinator.rounds.rounds)")
    hashes: dict[int, dict[int, str]] = Field(default_factory=dict, description="stage -> version -> canonical hash")
    rounds: list[Round] = Field(default_factory=list)
    cursors: dict[str, Any] = Field(default_factory=dict, description="committed version -> data cursor "
                                    "(potluck.coordinator.rounds.cursor): the samples that version has not trained on")
    outcomes: list[dict[str, Any]] = Field(default_factory=list, description="rounds that failed, newest last")
    history: list[dict[str, Any]] = Field(default_factory=list, description="one entry per committed step")
    rolled_back: list[dict[str, Any]] = Field(default_factory=list, description="history entries of steps "
                                              "undone by a rollback, marked with the epoch that ran them")
    checkpoints: list[str] = Field(default_factory=list)
    finished: bool = False
    revoked: list[str] = Field(default_factory=list, description="peers evicted from the run")
    trust: dict[str, Any] = Field(default_factory=dict, description="verified work per peer (coordinator/trust/trust.py)")
    known_peers: list[str] = Field(default_factory=list, description="DHT addresses of recent peers: "
                                   "a restarted coordinator rejoins the swarm through them")
    admitted: dict[str, dict[str, Any]] = Field(default_factory=dict, description="peer -> its admission "
                                                "(TLS key fingerprint, not_after, issued_at): a restarted "
                                                "coordinator takes its peers' heartbeats at once")
    ports: dict[str, int] = Field(default_factory=dict, description="the ports it listened on (dht, grpc, status): a "
                                  "restart given none listens there again, so its join address survives")

    def carried(self, fresh: JournalState) -> JournalState:
        """``fresh`` (a run started over in this folder) with what belongs to the coordinator, not to the run's
        steps: where it listened, the peers it knew and admitted, those it evicted (a restart before the first
        committed step finds the same swarm at the same address)."""
        return fresh.model_copy(update={"ports": dict(self.ports), "known_peers": list(self.known_peers),
                                        "admitted": dict(self.admitted), "revoked": list(self.revoked)})

    @field_validator("hashes", mode="before")
    @classmethod
    def _stage_zero_of_v1(cls, value: Any) -> Any:
        """Version 1 journals kept {version: hash} of stage 0 only."""
        if isinstance(value, dict) and value and all(isinstance(v, str) for v in value.values()):
            return {0: value}
        return value

    def committed_run(self) -> bool:
        """Did this run ever commit a step? A journal that never did pins no config."""
        return self.committed > 0 or bool(self.history)


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old or the new content, never a mix."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def kept_secret(path: Path, env: str) -> str:
    """A token the operator hands out: ``$env`` if set, else the one kept in ``path`` (made once, 0600)."""
    token = os.environ.get(env, "")
    if token:
        return token
    if path.exists():
        return path.read_text().strip()
    token = secrets.token_hex(24)  # (not urlsafe: 1 in 64 began with "-", and `potluck peer --token -x...` is an error)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


def changed_sections(path: Path, state: JournalState, cfg: RunConfig) -> list[str]:
    """The config sections ``cfg`` changes in the run a journal holds; JournalError, in one line naming both
    ways out, when the journal committed steps of another run or of another model, data or optimizer."""
    if not state.committed_run():
        return []  # a journal that never committed a step pins no config
    folder = path.parent
    fresh = f"start a new run with another --journal-dir, or remove {folder} to start this one over"
    if cfg.run_id and cfg.run_id != state.run_id:
        raise JournalError(f"{folder} holds run {state.run_id!r}, not {cfg.run_id!r}: {fresh}")
    stored, sections = _with_defaults(state.config), cfg.manifest_sections()
    changed = sorted(k for k in set(stored) | set(sections) if stored.get(k) != sections.get(k))
    fixed = [k for k in changed if k not in RESUMABLE_SECTIONS]
    if fixed:
        raise JournalError(
            f"{folder} holds run {state.run_id!r} (at outer step {state.committed}), written with a different config "
            f"(sections differ: {', '.join(fixed)}): resume it with the same values there (only "
            f"{', '.join(sorted(RESUMABLE_SECTIONS))} may change), {fresh}")
    return changed


def _with_defaults(sections: dict) -> dict:
    """A journal's config with the fields added since it was written at their defaults."""
    try:
        known, _ = known_fields_only(RunConfig, dict(sections))
        return parse_config(known, source="the journal's config").manifest_sections()
    except ConfigError:
        return sections


def read_journal(directory: str | Path) -> JournalState | None:
    """The journal in ``directory``, or None; reads only (creates nothing)."""
    path = Path(directory) / "journal.json"
    if not path.exists():
        return None
    try:
        return JournalState.model_validate_json(path.read_bytes())
    except (ValidationError, ValueError) as err:
        raise JournalError(f"{path} is not a readable potluck journal: {err}") from None


class Journal:
    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "journal.json"
        # (each round's JSON, kept between saves: at 1,000 members the rounds were 70 % of the journal and 8 of
        # a save's 11 ms, at every commit and decision)
        self._dumped = PerRound(lambda r: r.model_dump_json())

    def load(self) -> JournalState | None:
        return read_journal(self.dir)

    def save(self, state: JournalState) -> None:
        write_atomic(self.path, self.encode(state))

    def encode(self, state: JournalState) -> bytes:
        """The journal's bytes for ``state`` (its rounds cut to those kept). Made on the thread that owns the state;
        written by :meth:`save` or, off the coordinator's loop, by a :class:`JournalWriter`."""
        state.rounds = kept_rounds(state.rounds)
        state.v = JOURNAL_VERSION
        # (a big step's members' reports stay in memory; pydantic's own serializer: at 1,000 members the json
        # module's indenting encoder, written in Python, took ~0.1 s of the coordinator's loop, this ~10 ms)
        kept = state.model_copy(update={"history": [journaled(h) for h in state.history]})
        body = kept.model_dump_json(indent=1, exclude={"rounds"})
        return f'{body[:-2]},\n "rounds": [{",".join(self._dumped(state.rounds))}]\n}}'.encode()


class JournalWriter:
    """Writes the journal off the coordinator's loop: the loop encodes a save (:meth:`Journal.encode`, on the thread
    that owns the state) and hands the bytes over with a ticket; a thread of its own writes them (temporary file,
    fsync, rename) and calls ``done``. A save handed over while another waits replaces it: the newer holds all the
    older did. :attr:`durable` is the newest ticket on disk (a decided round's plan waits for its save's ticket);
    :attr:`error` the write that failed (the loop stops on it: a coordinator that cannot keep its journal cannot
    resume its run)."""

    def __init__(self, journal: Journal, done: Callable[[], None] = lambda: None) -> None:
        self.journal, self._done = journal, done
        self.durable = 0
        self.error: OSError | None = None
        self._cv = threading.Condition()
        self._pending: tuple[int, bytes] | None = None
        self._writing = self._closed = False
        self._thread = threading.Thread(target=self._run, name="journal-writer", daemon=True)
        self._thread.start()

    def submit(self, body: bytes, ticket: int) -> None:
        with self._cv:
            if self._closed:
                raise RuntimeError("the journal writer is stopped")
            self._pending = (ticket, body)
            self._cv.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every save handed over is on disk (or failed); False if ``timeout`` ran out first."""
        with self._cv:
            return self._cv.wait_for(lambda: self._pending is None and not self._writing, timeout)

    def stop(self, timeout: float = 10.0) -> None:
        """Write what was handed over, then end the thread."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._pending is not None or self._closed)
                if self._pending is None:
                    return  # (closed, nothing left to write)
                (ticket, body), self._pending, self._writing = self._pending, None, True
            try:
                write_atomic(self.journal.path, body)
            except OSError as err:
                with self._cv:
                    self.error = err
            else:
                with self._cv:
                    self.durable, self.error = max(self.durable, ticket), None  # (a failure the disk healed from)
            finally:
                with self._cv:
                    self._writing = False
                    self._cv.notify_all()
                self._done()


def kept_rounds(rounds: list[Round]) -> list[Round]:
    """The newest ``KEEP_ROUNDS`` rounds, fewer when they are big: at most ``KEEP_MEMBERS`` members in all (a
    round of 1,000 members is ~170 KB of journal, rewritten at every commit), never fewer than 2 (the pending
    round and the one before it, which a resumed run needs)."""
    kept: list[Round] = []
    for r in sorted(rounds, key=lambda r: r.step, reverse=True)[:KEEP_ROUNDS]:
        if len(kept) >= 2 and sum(len(k.members) for k in kept) + len(r.members) > KEEP_MEMBERS:
            break
        kept.append(r)
    return kept[::-1]
