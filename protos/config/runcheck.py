"""What a run needs from the machines it runs on: its data file, the identity of its data, addresses.

The config's own validators (:mod:`potluck.protos.config.runconfig`) refuse what a config cannot mean,
wherever it is parsed. What is checked here depends on the machine: the coordinator's corpus exists
and is long enough, and the address a process announces can be reached from elsewhere. The
coordinator runs :func:`check_run` before it writes a journal or publishes a manifest, so a refused
run leaves nothing behind; every refusal is one :class:`ConfigError` line that says what to change.

The data's identity travels in the manifest (:class:`~potluck.protos.wire.records.DataIdentity`). Peers
build their data from the manifest's config, but a byte file is read from each peer's own disk, so a
peer hashes its copy and refuses to train on anything but the run's corpus (a swarm averaging
pseudo-gradients of two corpora would train on neither). The synthetic source is hashed from the
parameters that define it and the version of its generator.
"""

from __future__ import annotations

import functools
import hashlib
import ipaddress
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from potluck.protos.config.runconfig import DataConfig, ModelConfig, RunConfig
from potluck.protos.config.section import ConfigError
from potluck.protos.wire.limits import MAX_MESSAGE_BYTES, pipe_head_bound, pipe_max_samples
from potluck.protos.wire.records import DataIdentity

MARKOV_GENERATOR = 1  # bump whenever MarkovSource draws other samples from the same parameters

_DOCUMENTATION = [ipaddress.ip_network(n) for n in ("192.0.2.0/24", "198.51.100.0/24", "203.0.113.0/24", "2001:db8::/32")]


@dataclass
class RunCheck:
    """A run that passed: what the manifest says of its data, and lines for the operator's log."""

    data: DataIdentity
    notes: list[str] = field(default_factory=list)


def check_run(cfg: RunConfig) -> RunCheck:
    """Refuse a run its peers could not train (ConfigError, one line naming the fix), or describe its data.

    A relative ``data.path`` is read from the working directory, as the coordinator does.
    """
    check_wire(cfg)
    if cfg.data.source == "markov":
        return RunCheck(markov_identity(cfg.data, cfg.model))
    if cfg.data.source in ("shards", "hf"):  # fetched or prepared, then checked, by potluck.data.corpus
        return RunCheck(DataIdentity(source=cfg.data.source))
    assert cfg.data.path is not None  # DataConfig's validator
    path = Path(cfg.data.path).expanduser()
    named = f"data.path = {cfg.data.path!r}"
    if not path.exists():
        raise ConfigError(f"{named}: no such file (looked for {path.absolute()}); set data.path to the text file to "
                          "train on (a relative path is read from the coordinator's working directory)")
    data = checked_identity(path, ConfigError, f"{named}: {path.absolute()} is not a file; set data.path to the text file "
                            "to train on", lambda why: f"{named}: cannot read {path.absolute()} ({why})")
    seq_len, held_out = cfg.model.seq_len, cfg.data.eval_samples
    need = min_corpus_bytes(seq_len, held_out)
    if data.size < need:
        raise ConfigError(f"{named}: the file holds {data.size} bytes; the run needs at least {need} for "
                          f"data.eval_samples = {held_out} held-out windows and one training window of "
                          f"model.seq_len = {seq_len} tokens: use a bigger file, or lower data.eval_samples or "
                          "model.seq_len")
    windows = (data.size - 1) // seq_len - held_out
    note = (f"volunteers need this run's corpus: {named} is {path.resolve()} here ({data.size} bytes, "
            f"{windows} training windows, sha256 {data.sha256}); a peer reads data.path relative to its own "
            "working directory, or the file it names with 'potluck peer --data-path FILE'")
    return RunCheck(data, [note])


def check_wire(cfg: RunConfig) -> None:
    """Refuse a run whose messages could not cross the wire. A pipeline message's body travels in bounded pieces
    whatever the model's size; its head holds the sample ids and versions of a whole micro-batch (or eval batch),
    so that is the one part a run's shapes can push past what one gRPC message may carry."""
    if cfg.pipeline.stages < 2:
        return
    samples = pipe_max_samples(cfg.train.batch_size, cfg.pipeline.micro_batches, cfg.data.eval_samples)
    if pipe_head_bound(samples) > MAX_MESSAGE_BYTES:
        raise ConfigError(f"a pipeline message of this run carries up to {samples} samples, whose ids alone may take "
                          f"{pipe_head_bound(samples)} bytes, over the {MAX_MESSAGE_BYTES} a message may hold: raise "
                          "pipeline.micro_batches or lower train.batch_size")


def min_corpus_bytes(seq_len: int, eval_samples: int) -> int:
    """The smallest byte file a run can use: ``eval_samples`` held-out windows and one training window,
    each ``seq_len + 1`` bytes, windows starting every ``seq_len`` bytes."""
    return (eval_samples + 1) * seq_len + 1


def file_identity(path: Path) -> DataIdentity:
    """A byte file's identity (its content hashed once per size and mtime); raises OSError."""
    st = path.stat()
    return DataIdentity(source="bytes", sha256=_sha256(str(path.resolve()), st.st_size, st.st_mtime_ns),
                        size=st.st_size)


def checked_identity(path: Path, error: type[Exception], not_a_file: str, unreadable: Callable[[str], str]) -> DataIdentity:
    """:func:`file_identity` of a file that must be there: else ``error`` saying ``not_a_file``, or what
    ``unreadable`` makes of why it could not be read."""
    if not path.is_file():
        raise error(not_a_file)
    try:
        return file_identity(path)
    except OSError as err:
        raise error(unreadable(str(err.strerror or err))) from None


@functools.lru_cache(maxsize=8)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def markov_identity(data: DataConfig, model: ModelConfig) -> DataIdentity:
    """The synthetic source's identity: every parameter its samples depend on, and its generator's version."""
    params = {"generator": MARKOV_GENERATOR, "vocab_size": model.vocab_size, "order": data.markov_order,
              "concentration": data.markov_concentration, "seed": data.seed, "seq_len": model.seq_len}
    return DataIdentity(source="markov", sha256=hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest(),
                        samples=data.num_samples)


def non_public(host: str) -> str:
    """What keeps other networks from reaching ``host``: 'loopback', 'private', ...; '' for a public
    address or a DNS name (assumed to resolve to one)."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return ""
    if ip.is_loopback:
        return "loopback"
    if ip.is_link_local:
        return "link-local"
    if any(ip in net for net in _DOCUMENTATION):
        return "documentation"
    if ip.is_private:
        return "private"
    return "" if ip.is_global else "non-public"
