"""Token shards on disk and the memory-mapped reader the trainer samples from.

A prepared folder::

    index.json            format, tokenizer, dtype, shard size; per split its shards with sha256s
    train/00000.bin       shard_tokens raw little-endian tokens (uint16, or uint32 past 65536 ids)
    train/00000.docs      int64 little-endian offsets, within the shard, where a document starts
    train/00001.bin ...   the last shard of a split holds the remainder
    eval/00000.bin ...

Each split is one token stream: its documents in input order, each followed by the tokenizer's EOS
when it has one (byte-level has none; the ``.docs`` files still mark where documents start). Every
shard but the last holds exactly ``shard_tokens`` tokens, so a global position maps to a shard by one
division.

``index.json`` is written with sorted keys and holds no timestamps or absolute paths: the same
inputs and tokenizer give byte-identical files on any machine and with any number of workers, so
the sha256 of ``index.json`` (:attr:`ShardSet.index_sha256`) names the data set in a run's manifest,
and the sha256 of every file in it lets a peer check what it downloaded.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

from potluck.data import DataError
from potluck.data.tokenizer import TokenizerInfo

FORMAT = 1
INDEX = "index.json"
SPLITS = ("train", "eval")
DEFAULT_SHARD_TOKENS = 1 << 24
DOCS_DTYPE = np.dtype("<i8")
VERIFY_LEVELS = ("none", "size", "full")
# index entries name files inside the folder only: a downloaded index must not write elsewhere
_FILE_NAME = re.compile(r"^(train|eval)/[0-9]{5,}\.(bin|docs)$")


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab_size <= 65536), else uint32; little-endian on every machine."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    """The file's sha256, read in chunks (shards are larger than one wants to hold twice)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def write_split(root: Path, split: str, stream: Path, doc_starts: np.ndarray, dtype: np.dtype,
                shard_tokens: int, start: int = 0) -> dict[str, Any]:
    """Cut the raw token file ``stream`` from token ``start`` on into ``split``'s shards; its index entry.

    ``doc_starts`` are the positions in ``stream`` where documents start (sorted). The stream is
    consumed from its end, each shard written and then truncated away, so the disk never holds the
    tokens twice; ``stream`` is left ``start`` tokens long.
    """
    if shard_tokens < 1:
        raise DataError(f"shard_tokens must be at least 1, got {shard_tokens}")
    dtype = np.dtype(dtype)
    total = stream.stat().st_size // dtype.itemsize
    count = math.ceil((total - start) / shard_tokens)
    starts = np.asarray(doc_starts, dtype=np.int64)
    (root / split).mkdir(parents=True, exist_ok=True)
    entries: list[dict[str, Any]] = [{} for _ in range(count)]
    with open(stream, "r+b") as f:
        for i in reversed(range(count)):
            lo = start + i * shard_tokens
            hi = min(lo + shard_tokens, total)
            f.seek(lo * dtype.itemsize)
            data = f.read((hi - lo) * dtype.itemsize)
            docs = (starts[np.searchsorted(starts, lo):np.searchsorted(starts, hi)] - lo).astype(DOCS_DTYPE).tobytes()
            name = f"{split}/{i:05d}"
            (root / f"{name}.bin").write_bytes(data)
            (root / f"{name}.docs").write_bytes(docs)
            entries[i] = {"file": f"{name}.bin", "sha256": hashlib.sha256(data).hexdigest(), "tokens": hi - lo,
                          "docs_file": f"{name}.docs", "docs_sha256": hashlib.sha256(docs).hexdigest(),
                          "documents": len(docs) // DOCS_DTYPE.itemsize}
            f.truncate(lo * dtype.itemsize)
    return {"tokens": total - start, "documents": sum(e["documents"] for e in entries), "shards": entries}


def write_index(root: Path, tokenizer: TokenizerInfo, shard_tokens: int, splits: dict[str, dict[str, Any]]) -> str:
    """Write ``index.json`` (atomically: a folder with an index is a finished one); its sha256."""
    index = {"format": FORMAT, "tokenizer": tokenizer.to_dict(), "dtype": token_dtype(tokenizer.vocab_size).name,
             "shard_tokens": shard_tokens, "splits": splits}
    raw = (json.dumps(index, sort_keys=True, indent=1) + "\n").encode()
    tmp = root / (INDEX + ".tmp")
    tmp.write_bytes(raw)
    os.replace(tmp, root / INDEX)
    return hashlib.sha256(raw).hexdigest()


def parse_index(raw: bytes, where: str) -> dict[str, Any]:
    """Check an ``index.json``'s structure (``where`` names it in errors); the parsed dict."""
    try:
        index = json.loads(raw)
    except ValueError as err:
        raise DataError(f"{where} is not valid JSON ({err}): prepare the data again") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        found = index.get("format") if isinstance(index, dict) else None
        raise DataError(f"{where} is format {found!r}; this potluck reads format {FORMAT}: prepare the data again "
                        "with this version")
    try:
        TokenizerInfo.from_dict(index.get("tokenizer"))
        if index["dtype"] not in ("uint16", "uint32"):
            raise DataError(f"{where}: unknown dtype {index['dtype']!r}")
        size = int(index["shard_tokens"])
        for name, split in index["splits"].items():
            shards = split["shards"]
            for i, s in enumerate(shards):
                for key in ("file", "docs_file"):
                    if not _FILE_NAME.match(str(s[key])) or not str(s[key]).startswith(name + "/"):
                        raise DataError(f"{where}: {key} {s[key]!r} is not a shard file name of split {name!r}")
                if not all(isinstance(s[k], str) and len(s[k]) == 64 for k in ("sha256", "docs_sha256")) \
                        or int(s["documents"]) < 0:
                    raise DataError(f"{where}: {s['file']} lacks its sha256 or document count")
                if (int(s["tokens"]) != size and i != len(shards) - 1) or not 0 < int(s["tokens"]) <= size:
                    raise DataError(f"{where}: {s['file']} holds {s['tokens']} tokens; every shard but the last "
                                    f"holds {size}")
            if sum(int(s["tokens"]) for s in shards) != int(split["tokens"]):
                raise DataError(f"{where}: the {name} shards do not add up to its {split['tokens']} tokens")
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        if isinstance(err, DataError):
            raise
        raise DataError(f"{where} is malformed ({type(err).__name__}: {err}): prepare the data again") from None
    return index


def check_file(root: Path, name: str, size: int, sha256: str, level: str) -> None:
    """Refuse a missing, wrongly sized or (``level="full"``) wrongly hashed file, saying what to do."""
    path = root / name
    if level == "none":
        return
    if not path.is_file():
        raise DataError(f"shard {name} is missing from {root}: run potluck data prepare again or fetch the shards")
    actual = path.stat().st_size
    if actual != size:
        raise DataError(f"shard {name} in {root} is {actual} bytes, the index says {size}: it is truncated or "
                        "from another preparation; delete it and fetch again")
    if level == "full" and (digest := sha256_file(path)) != sha256:
        raise DataError(f"sha256 of {name} is {digest}, the index says {sha256}: the file is corrupt; "
                        "delete it and fetch again")


class ShardSet:
    """One split of a prepared folder, read by memory map.

    Only the shards being read are mapped, at most ``max_open`` at a time (least recently used ones
    are unmapped), so the reader's memory does not grow with the corpus: a mapped file's pages count
    towards the process's RSS once touched. Every read copies out of the map. Thread-safe and
    picklable (a copy reopens its maps lazily).
    """

    def __init__(self, root: Path, split: str, index: dict[str, Any], index_sha256: str, max_open: int = 4) -> None:
        if split not in index["splits"]:
            raise DataError(f"{root} has no {split!r} split (it has: {', '.join(sorted(index['splits']))}); prepare "
                            "it with --eval-fraction above 0 or --eval FILES" if split == "eval" else
                            f"{root} has no {split!r} split; the splits are {', '.join(SPLITS)}")
        self.root = root
        self.split = split
        self.index_sha256 = index_sha256
        self.tokenizer = TokenizerInfo.from_dict(index["tokenizer"])
        self.dtype = np.dtype("<u2" if index["dtype"] == "uint16" else "<u4")
        self.shard_tokens = int(index["shard_tokens"])
        self.shards: list[dict[str, Any]] = index["splits"][split]["shards"]
        self.num_tokens = int(index["splits"][split]["tokens"])
        self.num_documents = int(index["splits"][split]["documents"])
        self.max_open = max(1, max_open)
        self._maps: OrderedDict[int, np.memmap] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def open(cls, root: str | Path, split: str = "train", verify: str = "size", max_open: int = 4) -> ShardSet:
        """Read ``root/index.json`` and check ``split``'s files: their presence and size (``"size"``), also
        their sha256 (``"full"``, reads every byte), or nothing (``"none"``)."""
        if verify not in VERIFY_LEVELS:
            raise DataError(f"verify must be one of {', '.join(VERIFY_LEVELS)}, got {verify!r}")
        root = Path(root)
        try:
            raw = (root / INDEX).read_bytes()
        except FileNotFoundError:
            raise DataError(f"no {INDEX} in {root}: run potluck data prepare --out {root} first, or give the "
                            "folder that holds the shards") from None
        shards = cls(root, split, parse_index(raw, str(root / INDEX)), hashlib.sha256(raw).hexdigest(), max_open)
        shards.verify(verify)
        return shards

    def verify(self, level: str = "full") -> None:
        for s in self.shards:
            check_file(self.root, s["file"], int(s["tokens"]) * self.dtype.itemsize, s["sha256"], level)
            check_file(self.root, s["docs_file"], int(s["documents"]) * DOCS_DTYPE.itemsize, s["docs_sha256"], level)

    def __repr__(self) -> str:
        return (f"ShardSet({str(self.root)!r}, split={self.split!r}, tokens={self.num_tokens}, "
                f"shards={len(self.shards)}, index_sha256={self.index_sha256[:12]}...)")

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in ("_maps", "_lock")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._maps = OrderedDict()
        self._lock = threading.Lock()

    def _map(self, i: int) -> np.memmap:
        with self._lock:
            mm = self._maps.get(i)
            if mm is None:
                mm = np.memmap(self.root / self.shards[i]["file"], dtype=self.dtype, mode="r",
                               shape=(int(self.shards[i]["tokens"]),))
                self._maps[i] = mm
                while len(self._maps) > self.max_open:
                    self._maps.popitem(last=False)  # a reader still copying from it keeps its own reference
            else:
                self._maps.move_to_end(i)
            return mm

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` of the split (a copy, in the shard dtype), across shard boundaries."""
        if not 0 <= start <= stop <= self.num_tokens:
            raise DataError(f"tokens [{start}, {stop}) are outside the {self.split} split's {self.num_tokens}")
        out = np.empty(stop - start, dtype=self.dtype)
        pos = start
        while pos < stop:
            i, offset = divmod(pos, self.shard_tokens)
            take = min(stop - pos, int(self.shards[i]["tokens"]) - offset)
            out[pos - start:pos - start + take] = self._map(i)[offset:offset + take]
            pos += take
        return out

    def num_windows(self, seq_len: int) -> int:
        """Training samples of ``seq_len + 1`` tokens at stride ``seq_len`` (inputs plus shifted targets)."""
        if seq_len < 1:
            raise DataError(f"seq_len must be at least 1, got {seq_len}")
        return max(0, (self.num_tokens - 1) // seq_len)

    def window(self, i: int, seq_len: int) -> np.ndarray:
        """Sample ``i``: tokens ``[i * seq_len, i * seq_len + seq_len + 1)`` as int64."""
        n = self.num_windows(seq_len)
        if not 0 <= i < n:
            raise DataError(f"window {i} of seq_len {seq_len} is outside the {self.split} split's {n} windows")
        return self.tokens(i * seq_len, i * seq_len + seq_len + 1).astype(np.int64)

    def document_starts(self, shard: int) -> np.ndarray:
        """Split positions (int64) where the documents that start in shard ``shard`` start."""
        if not 0 <= shard < len(self.shards):
            raise DataError(f"shard {shard} is outside the {self.split} split's {len(self.shards)} shards")
        local = np.fromfile(self.root / self.shards[shard]["docs_file"], dtype=DOCS_DTYPE)
        return local.astype(np.int64) + shard * self.shard_tokens
