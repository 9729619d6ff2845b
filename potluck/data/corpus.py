"""The run's token shards as a machine gets them, and what the run manifest says about them.

``data.source = "shards"``: ``data.path`` is a prepared folder, or a ``file://`` / ``https://`` base
URL downloaded into ``data.cache_dir`` (:func:`potluck.data.fetch.resolve`: resumable, hash-checked,
cached). ``data.source = "hf"``: a Hugging Face ``datasets`` dataset, streamed and tokenized into
``data.cache_dir`` once per machine (:func:`potluck.data.prepare.prepare_dataset`, deterministic, so
every machine prepares byte-identical shards).

Either way the identity of the data is the sha256 of the shards' ``index.json``, which names every
shard's sha256 and the tokenizer's: the coordinator publishes it in the manifest, and a peer whose
shards (or tokenizer) differ refuses to train, in one line that says which and what to do.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from potluck.data import DataError
from potluck.data.shards import ShardSet, check_file
from potluck.protos.config.runconfig import DataConfig, ModelConfig
from potluck.protos.wire.records import DataIdentity

EVAL = "eval"


def cache_root(data: DataConfig) -> Path:
    return Path(data.cache_dir).expanduser()


def hf_folder(data: DataConfig) -> Path:
    """Where this machine keeps the shards of ``data``'s dataset (keyed by everything they depend on)."""
    key = json.dumps([data.hf_dataset, data.hf_config, data.hf_split, data.text_field, data.tokenizer, data.eval_fraction])
    return cache_root(data) / "hf" / hashlib.sha256(key.encode()).hexdigest()[:20]


def locate(data: DataConfig, *, override: str | None = None, expect: DataIdentity | None = None) -> Path:
    """The local folder of the run's shards, fetched or prepared if need be, every file hashed once;
    DataError if they are not ``expect`` (the run's, from its manifest: checked before anything is
    hashed), or a folder cannot be written or read."""
    try:
        return _locate(data, override, expect)
    except OSError as err:  # an unwritable cache, a full disk, a folder gone: one line, not a traceback
        raise DataError(f"the run's shards: {err.strerror or err}{f' ({err.filename})' if err.filename else ''}; "
                        "check data.cache_dir and --data-path") from None


def _locate(data: DataConfig, override: str | None, expect: DataIdentity | None) -> Path:
    expect_sha256 = expect.sha256 if expect is not None else ""
    if data.source == "shards":
        from potluck.data.fetch import resolve

        location = override or data.path
        assert location is not None  # DataConfig's validator
        remote = "://" in location  # a URL: its index is checked before any shard is downloaded
        cache = cache_root(data) / "fetched" / hashlib.sha256(location.encode()).hexdigest()[:16]  # one per URL
        folder = resolve(location, cache, expect_index_sha256=expect_sha256 if remote else "")
    elif data.source == "hf":
        folder = Path(override).expanduser() if override else hf_folder(data)
        if not (folder / "index.json").exists():
            from potluck.data.prepare import prepare_dataset
            from potluck.data.tokenizer import load_tokenizer

            assert data.hf_dataset is not None
            prepare_dataset(data.hf_dataset, load_tokenizer(data.tokenizer), folder, text_field=data.text_field,
                            config=data.hf_config, split=data.hf_split, eval_fraction=data.eval_fraction, progress=True)
    else:
        raise DataError(f"data.source = {data.source!r} has no token shards")
    found = ShardSet.open(folder, "train", verify="size")
    mine = found.tokenizer
    if expect is not None and expect.tokenizer_sha256 and mine.sha256 != expect.tokenizer_sha256:
        raise DataError(f"the shards at {folder} were made with tokenizer {mine.name!r} (sha256 {mine.sha256[:16]}), "
                        f"the run's with {expect.tokenizer!r} (sha256 {expect.tokenizer_sha256[:16]}): prepare them with "
                        "the run's tokenizer, or point --data-path at the run's shards")
    if expect_sha256 and found.index_sha256 != expect_sha256:
        raise DataError(f"the shards at {folder} are not this run's data: index sha256 {found.index_sha256}, the "
                        f"run's is {expect_sha256} (another corpus, tokenizer or prepare settings); point --data-path "
                        "at the run's shards or delete the folder to fetch them again")
    verify_once(folder, cache_root(data) / "verified")
    return folder


def verify_once(folder: Path, record_dir: Path) -> None:
    """Hash every file of the shards at ``folder`` against their index, once per machine: a file whose
    size and mtime are as recorded after its last check is not read again (a 100 GB corpus is hashed
    at about 1 GB/s). A corrupt shard is a DataError naming it, never a silent fallback."""
    index = (folder / "index.json").read_bytes()
    record = record_dir / f"{hashlib.sha256(index).hexdigest()[:32]}.json"
    try:
        seen = json.loads(record.read_text())
    except (OSError, ValueError):
        seen = {}
    checked = {}
    for split in json.loads(index).get("splits", {}):
        shards = ShardSet.open(folder, split, verify="size")
        for s in shards.shards:
            for name, sha in ((s["file"], s["sha256"]), (s["docs_file"], s["docs_sha256"])):
                st = (folder / name).stat()
                stamp = [str((folder / name).resolve()), st.st_size, st.st_mtime_ns]
                if seen.get(name) != stamp:
                    check_file(folder, name, st.st_size, sha, "full")
                checked[name] = stamp
    if checked != seen:
        try:
            record_dir.mkdir(parents=True, exist_ok=True)
            record.write_text(json.dumps(checked))
        except OSError:  # a read-only cache: hash again next time, nothing worse
            pass


def tokenizer_folder(data: DataConfig) -> Path | None:
    """The folder holding the tokenizer the run's shards were made with (``potluck data prepare`` saves a
    Hugging Face one beside them), if this machine has them; None for byte-level shards."""
    try:
        folder = locate(data)
    except DataError:
        return None
    return folder if (folder / "tokenizer.json").is_file() else None


@dataclass
class ShardCorpus:
    """Training samples (windows of the train split) and held-out ones (of the eval split) by id."""

    train: ShardSet
    held_out: ShardSet
    seq_len: int
    num_samples: int
    eval_samples: int

    @classmethod
    def open(cls, folder: Path, data: DataConfig, model: ModelConfig) -> ShardCorpus:
        train = ShardSet.open(folder, "train", verify="size")
        try:
            held_out = ShardSet.open(folder, EVAL, verify="size")
        except DataError as err:
            raise DataError(f"{err} (the run evaluates on the shards' held-out split: prepare them with an eval "
                            "split, --eval-fraction or --eval FILES)") from None
        vocab = train.tokenizer.vocab_size
        if vocab > model.vocab_size:
            raise DataError(f"the shards' tokenizer {train.tokenizer.name!r} has {vocab} tokens, more than "
                            f"model.vocab_size = {model.vocab_size}: set model.vocab_size = {vocab} (or more)")
        windows, held = train.num_windows(model.seq_len), held_out.num_windows(model.seq_len)
        if windows < 1 or held < 1:
            raise DataError(f"the shards at {folder} hold {train.num_tokens} training and {held_out.num_tokens} "
                            f"held-out tokens: too few for one window of model.seq_len + 1 = {model.seq_len + 1}")
        return cls(train, held_out, model.seq_len, min(data.num_samples, windows), min(data.eval_samples, held))

    def sample(self, sample_id: int, eval_offset: int) -> np.ndarray:
        if sample_id >= eval_offset:
            return self.held_out.window(sample_id - eval_offset, self.seq_len).astype(np.int64)
        return self.train.window(sample_id, self.seq_len).astype(np.int64)

    def identity(self, source: str) -> DataIdentity:
        t = self.train.tokenizer
        return DataIdentity(source=source, sha256=self.train.index_sha256, size=self.train.num_tokens,
                            samples=self.num_samples, tokenizer=t.name, tokenizer_sha256=t.sha256)
