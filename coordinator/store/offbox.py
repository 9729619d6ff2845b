"""Off-box checkpoints: every checkpoint the coordinator keeps, copied to an fsspec store, and read back.

A run outlives its coordinator's disk when ``coordinator.checkpoint_url`` names a place elsewhere
(``s3://bucket/prefix``, ``gs://bucket/prefix``, ``file:///mnt/backup``; credentials and endpoint
from the store's usual environment: ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_ENDPOINT_URL``, or fsspec's ``FSSPEC_S3_...`` variables). The store under that URL holds the
same files, with the same names, as ``journal_dir/checkpoints``.

:class:`Uploader` is a thread of its own: the checkpointer wakes it after each write (:meth:`Uploader.offer`)
and never waits for it, so neither the coordinator's loop nor training does. Each pass copies the
checkpoints kept locally that the store lacks, oldest first, then prunes the store by the same rule
as the local folder (the newest ``keep_checkpoints``). The invariants it keeps:

- **a manifest names only files that are there and verified.** A checkpoint's files go first; each
  is read back from the store and its SHA-256 compared with the one the manifest records (computed
  when the coordinator wrote it); the manifest goes last. A version written again (after a rollback)
  loses its old manifest in the store before any of its new files is sent. Pruning removes a
  manifest before its files.
- **an interrupted upload resumes.** A file the store already holds, verified, is not sent again
  (this process remembers what it verified; after a restart a file of the right size is read back
  and hashed, not re-sent); a pass that fails is tried again whole after a backoff (1 s doubling to
  60 s), and newer checkpoints go out meanwhile on the same passes.
- **a failing store never stops the run.** The error is logged as ``checkpoint upload failing: ...``
  once per change and on the status page's events (:meth:`Uploader.news`); a local checkpoint pruned
  while it was being sent is simply no longer owed.

After each pass it also writes the run's roster, ``swarm.json`` (:func:`roster_of`: the peers' DHT addresses,
their admissions and trust, those evicted; all public), so that a coordinator resumed on a new box rejoins the
peers still training, holds the same trust in them, and keeps the evicted out.

The reader side, :func:`complete` and :func:`download`, lists the store's complete checkpoints
(manifest present, every file it names present) newest first and fetches one into a local folder laid
out as the coordinator's, each file hash-checked, the manifest written last. On a new box,
:func:`resume_journal` (``potluck coordinator --resume-from URL``) starts a fresh journal from the newest,
and :func:`backup_identity` (``--backup-identity PATH``) copies out what makes the run the same run.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from potluck.coordinator.store.journal import write_atomic
from potluck.protos.config.section import ConfigError
from potluck.protos.runtime.log import get_logger

if TYPE_CHECKING:  # (the checkpoint module brings torch: preflight checks a URL before anything heavy loads)
    from potluck.coordinator.store.checkpoint import CheckpointStore

log = get_logger(__name__)

BUCKETED = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "oss"}  # the first part of the path is a bucket
EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}  # potluck's extra that brings the scheme's library
READ_BLOCK = 8 << 20
PART_BYTES = 64 << 20  # multipart upload part size (S3); fewer, larger requests
BACKOFF_S = (1.0, 60.0)
PROBE_S = 10.0  # how long the start waits to hear whether the bucket is there before going on without knowing


ROSTER = "swarm.json"
ROSTER_FIELDS = ("known_peers", "admitted", "trust", "revoked")


def roster_of(journal_dir: Path) -> bytes | None:
    """The roster of the run journaled in ``journal_dir`` (its run id and :data:`ROSTER_FIELDS`), as the store keeps
    it; None before the journal is written. Read from the journal's file, written whole by the coordinator's loop,
    so this thread shares nothing with it."""
    from potluck.coordinator.store.journal import read_journal

    held = read_journal(journal_dir)
    if held is None:
        return None
    return json.dumps({"run_id": held.run_id, **{f: getattr(held, f) for f in ROSTER_FIELDS}}, sort_keys=True).encode()


class UploadFailed(Exception):
    """A file the store holds does not read back as what was sent."""


class ChangedLocally(Exception):
    """The local checkpoint was rewritten (after a rollback) while it was being sent: the next pass takes it."""


def manifest_files(manifest: Any) -> list[tuple[str, str]]:
    from potluck.coordinator.store import checkpoint

    return checkpoint.manifest_files(manifest)


def _stem(name: str) -> str:
    return name.split(".")[0]


class Remote:
    """The store at one URL, as file names under one root. Every listing is fresh (fsspec's caches are
    dropped first): the store is shared with readers and with this process's own earlier passes."""

    def __init__(self, url: str, fs: Any, root: str, part_bytes: int = PART_BYTES) -> None:
        self.url, self.fs, self.root = url, fs, root.rstrip("/")
        self.put_options: dict[str, Any] = {"chunksize": part_bytes} if "s3" in _protocols(fs) else {}

    def prepare(self) -> None:
        """Make the folder a folder URL names (a bucket is the operator's to make)."""
        if not set(_protocols(self.fs)) & BUCKETED:
            self.fs.makedirs(self.root, exist_ok=True)

    def path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def names(self) -> set[str]:
        self.fs.invalidate_cache(self.root)
        try:
            listed = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return set()
        return {str(p).rstrip("/").rsplit("/", 1)[-1] for p in listed}

    def size(self, name: str) -> int | None:
        self.fs.invalidate_cache(self.path(name))
        try:
            return int(self.fs.info(self.path(name))["size"])
        except FileNotFoundError:
            return None

    def sha256(self, name: str) -> str:
        """SHA-256 of the object's bytes as the store serves them, read in blocks."""
        h = hashlib.sha256()
        self.fs.invalidate_cache(self.path(name))  # (a listing cached before it was sent says it is not there)
        with self.fs.open(self.path(name), "rb", block_size=READ_BLOCK, cache_type="none") as f:
            for block in iter(lambda: f.read(READ_BLOCK), b""):
                h.update(block)
        return h.hexdigest()

    def read(self, name: str) -> bytes:
        self.fs.invalidate_cache(self.path(name))
        return bytes(self.fs.cat_file(self.path(name)))

    def put(self, local: Path, name: str, progress: Callable[[int], None] | None = None) -> None:
        from fsspec.callbacks import Callback

        class Progress(Callback):  # type: ignore[misc]
            def call(self, *args: Any, **kwargs: Any) -> None:
                if progress is not None:
                    progress(int(self.value))

        self.fs.put_file(str(local), self.path(name), callback=Progress(), **self.put_options)

    def write(self, name: str, data: bytes) -> None:
        self.fs.pipe_file(self.path(name), data)

    def remove(self, name: str) -> None:
        try:
            self.fs.rm_file(self.path(name))
        except FileNotFoundError:
            pass

    def get(self, name: str, local: Path) -> None:
        self.fs.invalidate_cache(self.path(name))
        self.fs.get_file(self.path(name), str(local))


def _protocols(fs: Any) -> tuple[str, ...]:
    p = fs.protocol
    return (p,) if isinstance(p, str) else tuple(p)


def open_store(url: str, part_bytes: int = PART_BYTES, where: str = "coordinator.checkpoint_url",
               **options: Any) -> Remote:
    """The store at ``url``; raises ConfigError naming what is wrong with the URL (not a URL, an unknown
    scheme, a scheme whose library is not installed, no bucket), as the setting ``where`` gave it. Contacts
    nothing: see :func:`probe`."""
    from fsspec.registry import get_filesystem_class, known_implementations, registry

    if "://" not in url:
        raise ConfigError(f"{where} {url!r} is not a URL: give s3://BUCKET/PREFIX, gs://BUCKET/PREFIX or file:///PATH")
    scheme, rest = url.split("://", 1)
    if scheme not in known_implementations and scheme not in registry:
        raise ConfigError(f"{where} {url!r}: unknown scheme {scheme!r} (s3, gs, file, ... : fsspec's)")
    try:
        cls = get_filesystem_class(scheme)
    except (ImportError, ValueError) as err:
        extra = EXTRAS.get(scheme)
        fix = f"pip install 'potluck[{extra}]'" if extra else "install the library fsspec names"
        raise ConfigError(f"{where} {url!r} needs a library not installed here ({err}): {fix}") from None
    if scheme in BUCKETED and not rest.split("/", 1)[0]:
        raise ConfigError(f"{where} {url!r} names no bucket: {scheme}://BUCKET/PREFIX")
    if scheme == "file" and not rest.strip("/"):
        raise ConfigError(f"{where} {url!r} names no folder: file:///PATH")
    fs = cls(skip_instance_cache=True, **options)
    return Remote(url, fs, str(cls._strip_protocol(url)), part_bytes)


def probe(remote: Remote, timeout: float = PROBE_S) -> None:
    """Refuse (ConfigError) a store that answers that its bucket does not exist; a store that does not
    answer within ``timeout`` is left to the uploader, which retries it."""
    if not set(_protocols(remote.fs)) & BUCKETED:
        return
    bucket = remote.root.split("/", 1)[0]
    answer: list[bool | BaseException] = []

    def ask() -> None:
        try:
            answer.append(bool(remote.fs.exists(bucket)))
        except BaseException as err:  # (its own thread: whatever it was, the caller decides)
            answer.append(err)

    t = threading.Thread(target=ask, name="checkpoint-store-probe", daemon=True)
    t.start()
    t.join(timeout)
    if not answer:
        log.warning("checkpoint store %s did not answer in %.0f s; uploads will retry", remote.url, timeout)
    elif answer[0] is False:
        raise ConfigError(f"coordinator.checkpoint_url {remote.url!r}: bucket {bucket!r} does not exist "
                          "(or these credentials cannot see it): create it first")
    elif isinstance(answer[0], BaseException):
        log.warning("checkpoint store %s: %s; uploads will retry", remote.url, answer[0])


# ---------------------------------------------------------------------------------------------- uploading


class Uploader:
    """Copies the checkpoints of ``store`` to ``remote`` on a thread of its own (module docstring).
    ``progress(name, sent_bytes)`` is called as a file goes out (tests wait on it)."""

    def __init__(self, remote: Remote, store: CheckpointStore, keep: int,
                 progress: Callable[[str, int], None] | None = None, backoff_s: tuple[float, float] = BACKOFF_S,
                 roster: Callable[[], bytes | None] | None = None) -> None:
        self.remote, self.store, self.keep, self.progress, self.backoff_s = remote, store, keep, progress, backoff_s
        self.roster = roster  # the run's roster, written after each pass when it changed (:func:`roster_of`)
        self._roster_sent: bytes | None = None
        self.failing: str | None = None  # the last pass's error, None once a pass succeeds
        self.sent_bytes = 0  # bytes of files sent (not those found already there)
        self.uploaded: list[str] = []  # manifest names, in the order they went out
        self._verified: dict[str, str] = {}  # file name -> SHA-256 the store holds, read back
        self._lock = threading.Lock()
        self._owed = True  # a pass is owed (set by offer, cleared as a pass starts)
        self._passing = False  # a pass is running (what it sends is owed until it ends)
        self._news: list[tuple[str, bool]] = []
        self._wake, self._stopping = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._loop, name="checkpoint-upload", daemon=True)

    def start(self) -> None:
        self._wake.set()  # (what is kept locally and not in the store yet, from before a restart)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def offer(self) -> None:
        """A checkpoint was written (or pruned): a pass is owed. Never waits."""
        with self._lock:
            self._owed = True
        self._wake.set()

    def pending(self) -> bool:
        """Whether a pass is owed and the store is not failing (a failing store never holds the run's end)."""
        with self._lock:
            return (self._owed or self._passing) and self.failing is None and not self._stopping.is_set()

    def news(self) -> list[tuple[str, bool]]:
        """(message, is a warning) of each change between failing and working since the last call."""
        with self._lock:
            out, self._news = self._news, []
        return out

    def _loop(self) -> None:
        delay = 0.0
        while not self._stopping.is_set():
            self._wake.wait(delay if delay else None)
            self._wake.clear()
            if self._stopping.is_set():
                return
            with self._lock:
                self._owed, self._passing = False, True
            try:
                self.sync()
            except Exception as err:  # the store's, whatever its library raises: logged, retried, never the run's end
                delay = min(self.backoff_s[1], delay * 2 if delay else self.backoff_s[0])
                message = f"checkpoint upload failing: {type(err).__name__}: {err}"
                with self._lock:
                    self._owed, self._passing = True, False
                    changed, self.failing = self.failing != message, message
                    if changed:
                        self._news.append((message, True))
                # (said once per change as a warning by whoever reads news(): the coordinator's events)
                log.info("%s (to %s; retrying in %.0f s)", message, self.remote.url, delay)
                continue
            with self._lock:
                self._passing = False
                back, self.failing = self.failing is not None, None
                if back:
                    self._news.append((f"checkpoint uploads to {self.remote.url} work again", False))
            if back:
                log.info("checkpoint uploads to %s work again", self.remote.url)
            delay = 0.0

    def sync(self) -> None:
        """One pass: every checkpoint kept locally and not complete in the store, oldest first; then prune."""
        local = self.store.manifests()[: self.keep]
        self.remote.prepare()
        there = self.remote.names()
        for manifest in reversed(local):
            if self._stopping.is_set():
                return
            try:
                self._upload(manifest, there)
            except ChangedLocally:
                log.info("checkpoint %s was written again while uploading; the next pass takes it", manifest.stem)
                self.offer()
            except FileNotFoundError:
                if manifest.exists():  # (a stage file gone under its manifest, or the store's: a failure)
                    raise
                log.info("checkpoint %s was pruned locally while uploading: no longer owed", manifest.stem)
        self._prune({_stem(p.name) for p in local})
        roster = self.roster() if self.roster is not None else None
        if roster is not None and roster != self._roster_sent:
            self.remote.write(ROSTER, roster)
            self._roster_sent = roster

    def _upload(self, manifest_path: Path, there: set[str]) -> None:
        raw = manifest_path.read_bytes()
        name = manifest_path.name
        if name in there and self._verified.get(name) == _sha(raw):
            return
        if name in there and self.remote.read(name) == raw:
            self._verified[name] = _sha(raw)
            return
        if name in there:  # a version written again: its old manifest goes before any new file
            self.remote.remove(name)
            self._verified.pop(name, None)
        for file, sha in manifest_files(json.loads(raw)):
            local = self.store.dir / file
            if self._verified.get(file) == sha:
                continue
            if file in there and self.remote.size(file) == local.stat().st_size and self.remote.sha256(file) == sha:
                self._verified[file] = sha  # (sent before this process started, or before an interruption)
                continue
            self._verified.pop(file, None)
            before = local.stat().st_size
            self.remote.put(local, file, partial(self.progress, file) if self.progress else None)
            got = self.remote.sha256(file)
            if got != sha:
                if _changed(manifest_path, raw):
                    raise ChangedLocally
                raise UploadFailed(f"{file} reads back from the store as sha256 {got[:12]}, sent {sha[:12]}")
            self._verified[file] = sha
            self.sent_bytes += before
        if _changed(manifest_path, raw):
            raise ChangedLocally
        self.remote.write(name, raw)
        if self.remote.read(name) != raw:
            raise UploadFailed(f"{name} reads back from the store changed")
        self._verified[name] = _sha(raw)
        self.uploaded.append(name)
        log.info("checkpoint %s uploaded to %s", manifest_path.stem, self.remote.url)

    def _prune(self, owed: set[str]) -> None:
        """The store's newest ``keep`` checkpoints stay, with what is still owed; manifests go before files."""
        there = self.remote.names()
        manifests = sorted((n for n in there if n.startswith("ckpt-") and n.endswith(".json")), reverse=True)
        for old in manifests[self.keep :]:
            self.remote.remove(old)
            self._verified.pop(old, None)
        keep = {_stem(n) for n in manifests[: self.keep]} | owed
        for n in there:
            if n.startswith("ckpt-") and not n.endswith(".json") and _stem(n) not in keep:
                self.remote.remove(n)
                self._verified.pop(n, None)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _changed(manifest_path: Path, raw: bytes) -> bool:
    try:
        return manifest_path.read_bytes() != raw
    except FileNotFoundError:
        return True


# ---------------------------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class RemoteCheckpoint:
    """A complete checkpoint in the store: its manifest (``name``) and what it says."""

    version: int
    name: str
    manifest: dict[str, Any]
    raw: bytes  # the manifest as stored: what the reader writes, byte for byte


def complete(remote: Remote) -> list[RemoteCheckpoint]:
    """The store's complete checkpoints, newest first: a manifest that parses, every file it names
    present (the uploader writes a manifest only once each of its files is verified there)."""
    there = remote.names()
    out = []
    for name in sorted((n for n in there if n.startswith("ckpt-") and n.endswith(".json")), reverse=True):
        try:
            raw = remote.read(name)
        except FileNotFoundError:  # (pruned since the listing)
            continue
        try:
            manifest = json.loads(raw)
            files = manifest_files(manifest)
        except (ValueError, KeyError, TypeError) as err:
            log.warning("checkpoint %s in %s is unusable (%s); skipped", name, remote.url, err)
            continue
        if all(f in there for f, _ in files):
            out.append(RemoteCheckpoint(int(manifest["version"]), name, manifest, raw))
    return out


def download(remote: Remote, checkpoint: RemoteCheckpoint, dest: Path) -> Path:
    """Fetch ``checkpoint`` into the folder ``dest``, laid out as ``journal_dir/checkpoints``: each file under a
    temporary name, its SHA-256 checked against the manifest, then renamed; the manifest last. Returns the
    manifest's path; raises ValueError (a file that does not hash to what the manifest says), leaving no
    manifest behind."""
    from potluck.coordinator.store.checkpoint import CheckpointStore
    from potluck.coordinator.store.tensorfile import file_sha256

    dest.mkdir(parents=True, exist_ok=True)
    for file, sha in manifest_files(checkpoint.manifest):
        tmp = dest / f".{file}.tmp-{os.getpid()}"
        try:
            remote.get(file, tmp)
            got = file_sha256(tmp)
            if got != sha:
                raise ValueError(f"{file} from {remote.url} hashes to {got[:12]}, its manifest says {sha[:12]}")
            tmp.replace(dest / file)
        finally:
            tmp.unlink(missing_ok=True)
    path = dest / checkpoint.name
    write_atomic(path, checkpoint.raw)
    try:
        CheckpointStore(dest).verified(path)
    except (ValueError, KeyError):
        path.unlink(missing_ok=True)
        raise
    return path


# ---------------------------------------------------------------------------------------------- a run on a new box

SECRETS = ("identity.key", "ca.key", "join.token", "admin.token", "status-tls.key", "status-tls.pem")
"""What in a journal directory makes a run the same run elsewhere: the coordinator's identity (its id is in the join
address and names every DHT key of the run), the run's CA key (peers' certificates chain to it), the join and admin
tokens, and the status page's own certificate (visitors compared its fingerprint)."""


def backup_identity(journal_dir: Path, dest: Path) -> list[str]:
    """Copy the run's secret material (:data:`SECRETS`, those present) from ``journal_dir`` into the new folder
    ``dest`` (0700, each file 0600); returns the names copied. Raises ConfigError when there is no identity to copy
    or ``dest`` exists (never over another run's keys)."""
    if not (journal_dir / "identity.key").exists():
        raise ConfigError(f"{journal_dir} holds no run (no identity.key): give the run's --journal-dir")
    if dest.exists():
        raise ConfigError(f"{dest} exists: --backup-identity writes a new folder")
    dest.mkdir(parents=True, mode=0o700)
    copied = []
    for name in SECRETS:
        if (journal_dir / name).exists():
            fd = os.open(dest / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write((journal_dir / name).read_bytes())
            copied.append(name)
    return copied


def resume_journal(cfg: Any, url: str) -> str:
    """Start ``cfg``'s fresh journal directory from the newest complete checkpoint at ``url``: the checkpoint
    downloaded (hash-checked) into its ``checkpoints/``, and a journal committed at its version, with its stages'
    hashes and data cursor, so the coordinator goes on from the step after it (peers recover the checkpoint from it).
    Secret material put there beforehand (:func:`backup_identity`'s files) makes it the same run. Raises ConfigError
    (a journal that already holds a run, no complete checkpoint, another model or stage count). Returns a line for
    the log."""
    from potluck.coordinator.store.journal import Journal, JournalState, read_journal

    journal_dir = Path(cfg.coordinator.journal_dir)
    held = read_journal(journal_dir)
    if held is not None and held.committed_run():
        raise ConfigError(f"--resume-from starts a fresh journal, and {journal_dir} holds run {held.run_id!r} at "
                          f"outer step {held.committed}: give another --journal-dir")
    remote = open_store(url)
    found = complete(remote)
    if not found:
        raise ConfigError(f"--resume-from {url}: no complete checkpoint there")
    newest = found[0]
    m = newest.manifest
    if m.get("model") is not None and m["model"] != cfg.model.model_dump(mode="json"):
        raise ConfigError(f"--resume-from {url}: its checkpoint v{newest.version} is of another model; resume with the "
                          "run's [model] section")
    stages = m.get("stages") or []
    if len(stages) != cfg.pipeline.stages:
        raise ConfigError(f"--resume-from {url}: its checkpoint has {len(stages)} stages; resume with pipeline.stages = "
                          f"{len(stages)} (and change it at a later restart)")
    download(remote, newest, journal_dir / "checkpoints")
    v = newest.version
    run_id = str(m.get("run_id") or cfg.run_id)
    roster = read_roster(remote, run_id)
    state = JournalState(run_id=run_id, config=cfg.manifest_sections(),
                         created_at=time.time(), committed=v, hashes={int(e["stage"]): {v: e["hash"]} for e in stages},
                         cursors={str(v): m["data_cursor"]} if m.get("data_cursor") is not None else {},
                         checkpoints=[newest.name], finished=v >= cfg.diloco.outer_steps, **roster)
    Journal(journal_dir).save(state)
    peers = len(roster.get("known_peers", []))
    return (f"resuming run {state.run_id} from {url}: checkpoint v{v} downloaded and verified into {journal_dir}"
            + (f"; rejoining the swarm through the {peers} peers its roster names" if peers else
               "; no roster of its peers there: they find this coordinator when they are restarted"))


def read_roster(remote: Remote, run_id: str) -> dict[str, Any]:
    """The roster fields (:data:`ROSTER_FIELDS`) the store holds for ``run_id``; empty when there is none, or it is
    another run's or unreadable (logged: the run resumes without it, its peers find it when restarted)."""
    from potluck.coordinator.store.journal import JournalState

    try:
        raw = json.loads(remote.read(ROSTER))
    except FileNotFoundError:
        return {}
    except ValueError as err:
        log.warning("the roster in %s is unreadable (%s); resuming without it", remote.url, err)
        return {}
    if not isinstance(raw, dict) or raw.get("run_id") != run_id:
        log.warning("the roster in %s is not run %s's; resuming without it", remote.url, run_id)
        return {}
    fields = {f: raw[f] for f in ROSTER_FIELDS if f in raw}
    try:
        JournalState(run_id=run_id, config={}, created_at=0.0, **fields)
    except ValueError as err:
        log.warning("the roster in %s does not read as a journal's (%s); resuming without it", remote.url, err)
        return {}
    return fields
