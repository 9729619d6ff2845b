"""Real training data (#14): tokenizers with an identity, token shards, the memory-mapped reader,
``potluck data prepare`` and shards fetched over HTTP (resumed, verified, cached)."""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import random
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from potluck.data import DataError, sources
from potluck.data.fetch import resolve
from potluck.data.prepare import prepare, prepare_dataset
from potluck.data.shards import ShardSet, token_dtype, write_index, write_split
from potluck.data.tokenizer import BYTES_SHA256, HFTokenizer, Tokenizer, TokenizerInfo, load_tokenizer

WORDS = ["the", "cat", "sat", "on", "a", "mat", "naïve", "café", "東京", "🙂", "data", "shard", "token", "peer",
         "swarm", "gradient", "outer", "step", "of", "and"]


def make_docs(n: int = 120, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 60))) + "." for _ in range(n)]


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


def train_bpe(path: Path, vocab_size: int = 400) -> Path:
    """A small byte-level BPE trained in memory on the test corpus (nothing is downloaded)."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(make_docs(400, seed=1), trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    return path / "tokenizer.json"


@pytest.fixture(scope="module")
def bpe_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_bpe(tmp_path_factory.mktemp("bpe") / "tiny-bpe")


@pytest.fixture(params=["bytes", "bpe"])
def tokenizer(request: pytest.FixtureRequest, bpe_path: Path) -> Tokenizer:
    return load_tokenizer("bytes" if request.param == "bytes" else str(bpe_path))


def stream_of(tok: Tokenizer, docs: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """The expected token stream (each document, then EOS when there is one) and document starts."""
    eos = [] if tok.info.eos_id is None else [tok.info.eos_id]
    parts = [np.concatenate([tok.encode(d), np.array(eos, dtype=np.int64)]) for d in docs]
    starts = np.cumsum([0] + [len(p) for p in parts])[:-1]
    return np.concatenate(parts), starts


def all_starts(shards: ShardSet) -> np.ndarray:
    return np.concatenate([shards.document_starts(i) for i in range(len(shards.shards))])


# ---------------------------------------------------------------------------------------------- tokenizers


def test_tokenizers_have_a_stable_identity(bpe_path: Path, tmp_path: Path) -> None:
    byte = load_tokenizer("bytes")
    assert byte.info == TokenizerInfo("bytes", BYTES_SHA256, 256, None)
    assert byte.decode(byte.encode("naïve 東京 🙂")) == "naïve 東京 🙂"

    bpe = load_tokenizer(str(bpe_path))
    assert bpe.info.sha256 == hashlib.sha256(bpe_path.read_bytes()).hexdigest()
    assert bpe.info == load_tokenizer(str(bpe_path.parent)).info  # the file or its folder: one tokenizer
    assert bpe.info.name == "tiny-bpe" and 256 < bpe.info.vocab_size <= 400
    assert isinstance(bpe, HFTokenizer) and bpe.info.eos_id == bpe.tok.token_to_id("<|endoftext|>")
    text = "the cat sat on the mat, naïve café"
    assert bpe.decode(bpe.encode(text)) == text and len(bpe.encode(text)) < len(text.encode())
    assert [list(a) for a in bpe.encode_batch(["a cat", "the mat"])] == [list(bpe.encode("a cat")),
                                                                         list(bpe.encode("the mat"))]

    other = load_tokenizer(str(train_bpe(tmp_path / "other", vocab_size=300)))
    assert other.info.sha256 != bpe.info.sha256  # other merges: another identity

    assert TokenizerInfo.from_dict({**bpe.info.to_dict(), "future_field": 1}) == bpe.info
    with pytest.raises(DataError, match="lacks sha256"):
        TokenizerInfo.from_dict({"name": "x", "vocab_size": 3})
    with pytest.raises(DataError, match="no tokenizer at"):
        load_tokenizer(str(tmp_path / "missing" / "tokenizer.json"))


# ---------------------------------------------------------------------------------------------- round trip


def test_prepare_round_trip(tokenizer: Tokenizer, tmp_path: Path) -> None:
    docs = make_docs()
    out = prepare([write_jsonl(tmp_path / "c.jsonl", docs)], tokenizer, tmp_path / "shards", workers=1,
                  shard_tokens=97, eval_fraction=0.1, progress=False)
    train, held = ShardSet.open(out, verify="full"), ShardSet.open(out, "eval", verify="full")
    assert train.index_sha256 == held.index_sha256 == hashlib.sha256((out / "index.json").read_bytes()).hexdigest()
    assert train.tokenizer == tokenizer.info and train.dtype == np.uint16

    for shards, part in ((train, docs[:108]), (held, docs[108:])):  # the last 10 % of documents are eval
        expected, starts = stream_of(tokenizer, part)
        assert shards.num_tokens == len(expected) and shards.num_documents == len(part)
        assert np.array_equal(shards.tokens(0, shards.num_tokens), expected)
        assert np.array_equal(all_starts(shards), starts)
        assert len(shards.shards) == -(-len(expected) // 97)
        assert all(s["tokens"] == 97 for s in shards.shards[:-1])
    if tokenizer.info.eos_id is not None:  # EOS ends every document
        assert np.all(expected[starts[1:] - 1] == tokenizer.info.eos_id)

    expected, _ = stream_of(tokenizer, docs[:108])
    assert np.array_equal(train.tokens(90, 300), expected[90:300])  # crosses shards 0 -> 1 -> 2 -> 3
    seq = 64
    assert train.num_windows(seq) == (len(expected) - 1) // seq
    for i in (0, 1, train.num_windows(seq) - 1):
        w = train.window(i, seq)
        assert w.dtype == np.int64 and np.array_equal(w, expected[i * seq:i * seq + seq + 1])
    with pytest.raises(DataError, match="outside"):
        train.window(train.num_windows(seq), seq)
    with pytest.raises(DataError, match="outside"):
        train.tokens(0, train.num_tokens + 1)


def test_workers_do_not_change_the_output(bpe_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sources, "CHUNK_DOCS", 40)  # 23 chunks, finishing out of order in 2 workers
    files = [write_jsonl(tmp_path / f"c{i}.jsonl", make_docs(300, seed=i)) for i in range(3)]
    tok = load_tokenizer(str(bpe_path))
    one = prepare(files, tok, tmp_path / "w1", workers=1, shard_tokens=1000, progress=False)
    two = prepare(files, tok, tmp_path / "w2", workers=2, shard_tokens=1000, progress=False)
    assert (one / "index.json").read_bytes() == (two / "index.json").read_bytes()
    names = sorted(p.relative_to(one) for p in one.rglob("*") if p.is_file())
    assert names == sorted(p.relative_to(two) for p in two.rglob("*") if p.is_file())
    assert all((one / n).read_bytes() == (two / n).read_bytes() for n in names)


class BigVocab(Tokenizer):
    """A stand-in for a tokenizer past 65536 ids: bytes shifted up by 70000."""

    def __init__(self) -> None:
        self.info = TokenizerInfo("big", "0" * 64, 70_256, 70_255)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode(), dtype=np.uint8).astype(np.int64) + 70_000 for t in texts]


def test_uint32_when_the_vocabulary_passes_65536(tmp_path: Path) -> None:
    assert token_dtype(65_536) == np.uint16 and token_dtype(65_537) == np.uint32
    docs = make_docs(20)
    out = prepare([write_jsonl(tmp_path / "c.jsonl", docs)], BigVocab(), tmp_path / "s", workers=1,
                  shard_tokens=50, eval_fraction=0, progress=False)
    shards = ShardSet.open(out, verify="full")
    assert shards.dtype == np.uint32 and json.loads((out / "index.json").read_text())["dtype"] == "uint32"
    expected, _ = stream_of(BigVocab(), docs)
    assert np.array_equal(shards.tokens(0, shards.num_tokens), expected) and expected.max() == 70_255


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    pytest.skip("no /proc/self/status")


def test_reader_memory_does_not_grow_with_the_split(tmp_path: Path) -> None:
    """200 MB of tokens, read end to end and at random: the reader maps a few shards at a time."""
    n, piece = 100 * 2**20, 2**22  # 100 Mi uint16 tokens = 200 MiB, in 25 shards of 8 MiB
    stream = tmp_path / "stream.bin"
    with open(stream, "wb") as f:
        for lo in range(0, n, piece):
            (np.arange(lo, lo + piece, dtype=np.int64) % 65_521).astype("<u2").tofile(f)
    info = TokenizerInfo("fake", "f" * 64, 65_536, None)
    splits = {"train": write_split(tmp_path, "train", stream, np.arange(0, n, 1000), np.dtype("<u2"), piece)}
    write_index(tmp_path, info, piece, splits)

    before = rss_mib()
    shards = ShardSet.open(tmp_path)
    for lo in range(0, n, 2**20):  # the whole split, as an epoch would
        assert shards.tokens(lo, lo + 2**20)[0] == lo % 65_521
    rng = np.random.default_rng(0)
    for i in rng.integers(0, shards.num_windows(256), 5000):
        w = shards.window(int(i), 256)
        assert w[0] == (i * 256) % 65_521 and len(w) == 257
    grew = rss_mib() - before
    assert grew < 200 / 4, f"reading a 200 MiB split grew RSS by {grew:.0f} MiB"
    assert np.array_equal(shards.document_starts(3), np.arange(3 * piece + (-3 * piece) % 1000, 4 * piece, 1000))


# ---------------------------------------------------------------------------------------------- refusals


@pytest.fixture
def prepared(tmp_path: Path) -> Path:
    return prepare([write_jsonl(tmp_path / "c.jsonl", make_docs())], load_tokenizer("bytes"), tmp_path / "shards",
                   workers=1, shard_tokens=512, progress=False)


def test_damaged_shards_are_refused_with_what_to_do(prepared: Path) -> None:
    (prepared / "train/00001.bin").unlink()
    with pytest.raises(DataError, match=r"shard train/00001.bin is missing from .*shards: run potluck data prepare"):
        ShardSet.open(prepared)
    with open(prepared / "train/00002.bin", "r+b") as f:
        f.truncate(100)
    ShardSet.open(prepared, "eval")  # the other split is intact
    ShardSet.open(prepared, verify="none")
    (prepared / "train/00001.bin").write_bytes(b"\0" * 1024)
    with pytest.raises(DataError, match=r"train/00002.bin in .* is 100 bytes, the index says 1024: .*fetch again"):
        ShardSet.open(prepared)
    (prepared / "train/00002.bin").write_bytes(b"\0" * 1024)
    ShardSet.open(prepared)  # sizes are right: only a full check reads the bytes
    with pytest.raises(DataError, match=r"sha256 of train/00001.bin is [0-9a-f]{64}, the index says [0-9a-f]{64}: "
                       "the file is corrupt; delete it and fetch again"):
        ShardSet.open(prepared, verify="full")
    with pytest.raises(DataError, match="not this run's data: index sha256 [0-9a-f]{64}, the run's is 0000"):
        resolve(str(prepared), expect_index_sha256="0" * 64)
    with pytest.raises(DataError, match="no index.json in"):
        ShardSet.open(prepared / "train")


def test_bad_inputs_are_refused(tmp_path: Path) -> None:
    tok = load_tokenizer("bytes")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "one"}\n\n{"text": "two"}\n{"body": "three"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:4: no field 'text' \(this line has: body\); .*--text-field"):
        prepare([bad], tok, tmp_path / "a", workers=1, progress=False)
    bad.write_text('{"text": "one"}\n{"text": "tw\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: not valid JSON"):
        prepare([bad], tok, tmp_path / "a", workers=1, progress=False)
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DataError, match=r"x.csv: unknown input type '.csv'; potluck data prepare reads .txt"):
        prepare([tmp_path / "x.csv"], tok, tmp_path / "a", progress=False)
    (tmp_path / "empty.jsonl").write_text('{"text": ""}\n')
    with pytest.raises(DataError, match="hold no documents"):
        prepare([tmp_path / "empty.jsonl"], tok, tmp_path / "a", workers=1, progress=False)
    with pytest.raises(DataError, match="too few to hold some out for eval"):
        prepare([write_jsonl(tmp_path / "one.jsonl", ["solo"])], tok, tmp_path / "a", workers=1, progress=False)
    with pytest.raises(DataError, match="has no 'eval' split"):
        ShardSet.open(prepare([tmp_path / "one.jsonl"], tok, tmp_path / "a", workers=1, eval_fraction=0,
                              progress=False), "eval")

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(DataError, match=r"mine is not empty and not a previous potluck data prepare \(it holds "
                       r"notes.txt\); choose an empty folder or add --force"):
        prepare([tmp_path / "one.jsonl"], tok, mine, workers=1, eval_fraction=0, progress=False)
    prepare([tmp_path / "one.jsonl"], tok, mine, workers=1, eval_fraction=0, progress=False, force=True)
    assert (mine / "notes.txt").read_text() == "keep me"
    prepare([bad.with_name("one.jsonl")], tok, tmp_path / "a", workers=1, eval_fraction=0, progress=False)  # again


# ---------------------------------------------------------------------------------------------- input kinds


def test_every_input_kind_gives_the_same_data(bpe_path: Path, tmp_path: Path) -> None:
    docs, tok = make_docs(60), load_tokenizer(str(bpe_path))

    def sha(files: list[Path], **kw: Any) -> str:
        out = prepare(files, tok, tmp_path / f"out{len(list(tmp_path.iterdir()))}", workers=1, shard_tokens=256,
                      progress=False, **kw)
        return ShardSet.open(out, verify="full").index_sha256

    reference = sha([write_jsonl(tmp_path / "c.jsonl", docs)])
    with gzip.open(tmp_path / "c.jsonl.gz", "wt") as f:
        f.write((tmp_path / "c.jsonl").read_text())
    assert sha([tmp_path / "c.jsonl.gz"]) == reference
    (tmp_path / "lines.txt").write_text("\n\n".join(docs) + "\n")
    assert sha([tmp_path / "lines.txt"], lines=True) == reference
    folder = tmp_path / "txt"
    folder.mkdir()
    for i, d in enumerate(docs):
        (folder / f"{i:03d}.txt").write_text(d)
    assert sha([folder]) == reference  # a folder: its files in sorted order, one document each
    held_out = [write_jsonl(tmp_path / "b.jsonl", docs[-1:])]  # the one document --eval-fraction holds out
    assert sha([write_jsonl(tmp_path / "a.jsonl", docs[:-1])], eval_files=held_out) == reference
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    pq.write_table(pa.table({"text": docs, "n": list(range(len(docs)))}), tmp_path / "c.parquet", row_group_size=16)
    assert sha([tmp_path / "c.parquet"]) == reference
    with pytest.raises(DataError, match=r"c.parquet: no column 'body' \(it has: text, n\)"):
        sha([tmp_path / "c.parquet"], text_field="body")


def test_a_datasets_dataset_matches_the_same_jsonl(bpe_path: Path, tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    docs, tok = make_docs(80), load_tokenizer(str(bpe_path))
    ref = prepare([write_jsonl(tmp_path / "c.jsonl", docs)], tok, tmp_path / "ref", workers=1, shard_tokens=300,
                  progress=False)
    ds = datasets.Dataset.from_dict({"text": docs, "id": list(range(len(docs)))})
    out = prepare_dataset(ds, tok, tmp_path / "ds", workers=2, shard_tokens=300, progress=False)
    assert (out / "index.json").read_bytes() == (ref / "index.json").read_bytes()
    out = prepare_dataset(ds.to_iterable_dataset(), tok, tmp_path / "it", workers=1, shard_tokens=300, progress=False)
    assert (out / "index.json").read_bytes() == (ref / "index.json").read_bytes()
    with pytest.raises(DataError, match=r"no column 'body' \(it has: text, id\)"):
        prepare_dataset(ds, tok, tmp_path / "bad", text_field="body", progress=False)


# ---------------------------------------------------------------------------------------------- fetching


class ShardServer(ThreadingHTTPServer):
    """Serves a folder with ``Range`` support, logs every request, and cuts the first download of
    ``cut`` after half of its bytes, as a dropped connection would."""

    daemon_threads = True

    def __init__(self, root: Path, cut: str) -> None:
        self.root, self.cut, self.requests = root, cut, []  # type: ignore[var-annotated]
        super().__init__(("127.0.0.1", 0), Handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/"


class Handler(SimpleHTTPRequestHandler):
    server: ShardServer

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, directory=str(args[2].root), **kwargs)

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        rng = self.headers.get("Range")
        self.server.requests.append((self.path, rng))
        path = self.server.root / self.path.lstrip("/")
        if not path.is_file():
            self.send_error(404)
            return
        data = path.read_bytes()
        start = int(rng.removeprefix("bytes=").split("-")[0]) if rng else 0
        if start >= len(data) and data:
            self.send_error(416)
            return
        cut = self.path.lstrip("/") == self.server.cut and sum(p == self.path for p, _ in self.server.requests) == 1
        self.send_response(206 if rng else 200)
        if rng:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.send_header("Content-Length", str(len(data) - start))
        self.end_headers()
        self.wfile.write(data[start:len(data) // 2] if cut else data[start:])
        if cut:
            self.close_connection = True


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ShardServer]:
    root = prepare([write_jsonl(tmp_path / "c.jsonl", make_docs(400))], load_tokenizer("bytes"), tmp_path / "served",
                   workers=1, shard_tokens=4096, progress=False)
    srv = ShardServer(root, cut="train/00001.bin")
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()
        thread.join(timeout=10)


def test_http_shards_resume_verify_and_cache(server: ShardServer, tmp_path: Path) -> None:
    want = ShardSet.open(server.root).index_sha256
    got = resolve(server.url, tmp_path / "cache", expect_index_sha256=want)
    assert ("/train/00001.bin", "bytes=4096-") in server.requests  # cut after half of 8192 bytes, then resumed
    for split in ("train", "eval"):
        assert ShardSet.open(got, split, verify="full").index_sha256 == want
    assert not list(got.rglob("*.part"))

    seen = len(server.requests)
    assert resolve(server.url, tmp_path / "cache", expect_index_sha256=want) == got
    assert len(server.requests) == seen  # all cached and verified: not one request
    resolve(server.url + "index.json", tmp_path / "cache")
    assert server.requests[seen:] == [("/index.json", None)]  # no expected hash: only the index is asked again

    with pytest.raises(DataError, match=r"the shards at http://127.0.0.1:\d+/ are not this run's data: index sha256 "):
        resolve(server.url, tmp_path / "other", expect_index_sha256="1" * 64)
    assert resolve((tmp_path / "served").as_uri()) == tmp_path / "served"


def test_http_refuses_a_corrupt_or_missing_server_file(server: ShardServer, tmp_path: Path) -> None:
    data = bytearray((server.root / "train/00002.bin").read_bytes())
    data[10] ^= 0xFF
    (server.root / "train/00002.bin").write_bytes(bytes(data))
    with pytest.raises(DataError, match=r"sha256 of 00002.bin downloaded from http://.*/train/00002.bin is [0-9a-f]+, "
                       r"the index says [0-9a-f]+: the server's copy is corrupt"):
        resolve(server.url, tmp_path / "cache")
    assert not (tmp_path / "cache/train/00002.bin").exists() and not list((tmp_path / "cache").rglob("*.part"))
    (server.root / "train/00002.bin").unlink()
    with pytest.raises(DataError, match=r"http://.*/train/00002.bin is missing on the server \(404\)"):
        resolve(server.url, tmp_path / "cache")


# ---------------------------------------------------------------------------------------------- the command


def data_command() -> list[str]:
    """``potluck data`` once potluck's parser has it, else this module's own entry point."""
    from potluck.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return [sys.executable, "-m", "potluck", "data"] if "data" in sub.choices else [
        sys.executable, "-m", "potluck.data.cli"]


def test_the_prepare_command(bpe_path: Path, tmp_path: Path) -> None:
    corpus = write_jsonl(tmp_path / "c.jsonl", make_docs())
    done = subprocess.run([*data_command(), "prepare", "--tokenizer", str(bpe_path), "--out", str(tmp_path / "out"),
                           "--shard-tokens", "500", "--workers", "2", str(corpus)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    shards = ShardSet.open(tmp_path / "out", verify="full")
    assert f"index sha256 {shards.index_sha256}" in done.stdout
    assert "prepare: train 119 documents" in done.stderr and "eval 1 documents" in done.stderr and "MB/s" in done.stderr
    ref = prepare([corpus], load_tokenizer(str(bpe_path)), tmp_path / "ref", shard_tokens=500, progress=False,
                  workers=1)
    assert (ref / "index.json").read_bytes() == (tmp_path / "out/index.json").read_bytes()

    done = subprocess.run([*data_command(), "prepare", "--tokenizer", "bytes", "--out", str(tmp_path / "x"),
                           "--text-field", "body", str(corpus)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith("potluck data prepare: error: ")
    assert "c.jsonl:1: no field 'body'" in done.stderr
