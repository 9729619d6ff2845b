"""``potluck data prepare``: text, jsonl, parquet or a ``datasets`` dataset -> token shards.

    >>> from potluck.data.prepare import prepare
    >>> from potluck.data.tokenizer import load_tokenizer
    >>> prepare([Path("corpus.jsonl")], load_tokenizer("bytes"), Path("shards"))

How it runs: the parent reads the inputs in order and cuts them into chunks of documents; worker
processes tokenize the chunks; the parent appends the results, in chunk order, to one raw token
stream per split (plus the positions where documents start), then cuts each stream into shards
(:func:`~potluck.data.shards.write_split`) and writes ``index.json`` last. Because results are
appended in input order, the output is byte-identical for any number of workers.

The eval split is the last ``eval_fraction`` of the documents (at least one), or ``eval_files``.
Holding the stream until the end is what lets a streamed dataset of unknown length give up its tail.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import shutil
import sys
import time
from collections import deque
from collections.abc import Generator, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from potluck.data import DataError
from potluck.data.shards import DEFAULT_SHARD_TOKENS, DOCS_DTYPE, INDEX, token_dtype, write_index, write_split
from potluck.data.sources import Chunk, Item, chunks, dataset_items, expand, file_items
from potluck.data.tokenizer import HFTokenizer, Tokenizer

DEFAULT_EVAL_FRACTION = 0.005
# what a folder may hold to count as a previous prepare (it is then replaced without --force)
_SHARD_FILE = re.compile(r"^[0-9]{5,}\.(bin|docs)$")
OURS = {INDEX, INDEX + ".tmp", "train", "eval", ".train.stream", ".train.docs", ".eval.stream", ".eval.docs",
        "tokenizer.json", "tokenizer_config.json"}


def prepare(files: list[Path], tokenizer: Tokenizer, out: Path, *, workers: int = 2,
            shard_tokens: int = DEFAULT_SHARD_TOKENS, text_field: str = "text",
            eval_fraction: float = DEFAULT_EVAL_FRACTION, eval_files: list[Path] | None = None, lines: bool = False,
            progress: bool = True, force: bool = False) -> Path:
    """Tokenize ``files`` (and ``eval_files``) into shards under ``out``; returns ``out``.

    ``lines``: a ``.txt`` file holds one document per non-empty line (else the file is one document).
    ``force``: write into a folder that holds other things (only potluck's own entries are replaced).
    """
    paths = expand(files)
    held_out = expand(eval_files) if eval_files else None

    def items(inputs: list[Path]) -> Iterator[tuple[Item, int]]:
        for path in inputs:
            yield from file_items(path, text_field=text_field, lines=lines)

    total = sum(p.stat().st_size for p in paths + (held_out or []))
    return _prepare(Path(out), tokenizer, items(paths), items(held_out) if held_out else None, total=total,
                    workers=workers, shard_tokens=shard_tokens, text_field=text_field, eval_fraction=eval_fraction,
                    progress=progress, force=force)


def prepare_dataset(dataset: Any, tokenizer: Tokenizer, out: Path, *, text_field: str = "text",
                    config: str | None = None, split: str = "train", eval_fraction: float = DEFAULT_EVAL_FRACTION,
                    workers: int = 2, shard_tokens: int = DEFAULT_SHARD_TOKENS, progress: bool = True,
                    force: bool = False) -> Path:
    """Shards from a ``datasets.Dataset`` / ``IterableDataset``, or from a Hub dataset name (streamed:
    ``load_dataset(name, config, split=split, streaming=True)``, nothing is downloaded whole)."""
    name = str(dataset)
    if isinstance(dataset, str):
        try:
            import datasets
        except ImportError:
            raise DataError("--dataset needs the datasets library: pip install 'potluck[data]'") from None
        name = dataset + (f" ({config})" if config else "")
        try:
            dataset = datasets.load_dataset(dataset, config, split=split, streaming=True)
        except Exception as err:  # offline, unknown name, missing config: datasets raises many kinds
            raise DataError(f"cannot open dataset {name}, split {split!r}: {err}") from None
    else:
        info = getattr(dataset, "info", None)
        name = getattr(info, "dataset_name", None) or type(dataset).__name__
    return _prepare(Path(out), tokenizer, dataset_items(dataset, text_field, name), None, total=None,
                    workers=workers, shard_tokens=shard_tokens, text_field=text_field, eval_fraction=eval_fraction,
                    progress=progress, force=force)


@dataclass
class Encoded:
    """A chunk's tokens (each document followed by EOS when the tokenizer has one) and per-document lengths."""

    tokens: np.ndarray
    lengths: np.ndarray
    text_bytes: int
    input_bytes: int


def encode_chunk(tokenizer: Tokenizer, chunk: Chunk) -> Encoded:
    texts = chunk.documents()
    ids = [a for a in (tokenizer.encode_batch(texts) if texts else []) if len(a)]
    info = tokenizer.info
    parts = [p for a in ids for p in (a, np.array([info.eos_id]))] if info.eos_id is not None else ids
    tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= info.vocab_size):
        raise DataError(f"tokenizer {info.name} produced id {int(tokens.max())}, outside its vocabulary of "
                        f"{info.vocab_size}; its vocab_size is wrong")
    lengths = np.array([len(a) + (info.eos_id is not None) for a in ids], dtype=np.int64)
    return Encoded(tokens.astype(token_dtype(info.vocab_size)), lengths, sum(len(t.encode()) for t in texts),
                   chunk.input_bytes)


_WORKER_TOKENIZER: Tokenizer | None = None


def _init_worker(tokenizer: Tokenizer) -> None:
    global _WORKER_TOKENIZER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker: the processes are the parallelism
    _WORKER_TOKENIZER = tokenizer


def _encode_in_worker(chunk: Chunk) -> Encoded:
    assert _WORKER_TOKENIZER is not None
    return encode_chunk(_WORKER_TOKENIZER, chunk)


def encoded(tokenizer: Tokenizer, stream: Iterable[Chunk], workers: int) -> Generator[Encoded, None, None]:
    """The chunks tokenized, in input order; at most ``2 * workers`` chunks in flight, so a corpus of
    any size streams through in bounded memory. Workers are spawned, not forked: the caller may hold
    threads, and the tokenizers library disables itself in a child forked after it ran."""
    if workers <= 1:
        yield from (encode_chunk(tokenizer, c) for c in stream)
        return
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_init_worker, initargs=(tokenizer,)) as pool:
        pending: deque[Future[Encoded]] = deque()
        try:
            for chunk in stream:
                pending.append(pool.submit(_encode_in_worker, chunk))
                if len(pending) >= 2 * workers:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        except BrokenProcessPool:
            raise DataError("the tokenizer worker processes died (see their error above); a script that calls "
                            "prepare() with workers > 1 must do so under if __name__ == '__main__' (or use "
                            "workers=1)") from None
        finally:
            for future in pending:
                future.cancel()


class Progress:
    """A tqdm bar on stderr when tqdm is importable, else a plain line every 10 s; then one summary line."""

    def __init__(self, total: int | None, enabled: bool) -> None:
        self.enabled, self.start, self.last = enabled, time.monotonic(), time.monotonic()
        self.input = self.text = self.docs = self.tokens = 0
        self.total = total
        self.bar: Any = None
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, unit="B", unit_scale=True, desc="prepare", file=sys.stderr)
            except ImportError:
                pass

    def update(self, e: Encoded) -> None:
        self.input, self.text = self.input + e.input_bytes, self.text + e.text_bytes
        self.docs, self.tokens = self.docs + len(e.lengths), self.tokens + len(e.tokens)
        if self.bar is not None:
            self.bar.update(e.input_bytes)
            self.bar.set_postfix(docs=self.docs, tokens=self.tokens, refresh=False)
        elif self.enabled and time.monotonic() - self.last >= 10:
            self.last = time.monotonic()
            of = f" of {self.total / 1e6:.1f}" if self.total else ""
            print(f"prepare: {self.input / 1e6:.1f}{of} MB read, {self.docs} documents, {self.tokens} tokens",
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def summary(self, splits: dict[str, dict[str, Any]]) -> None:
        if self.enabled:
            took = max(time.monotonic() - self.start, 1e-9)
            parts = ", ".join(f"{name} {s['documents']} documents / {s['tokens']} tokens / {len(s['shards'])} shards"
                              for name, s in sorted(splits.items(), reverse=True))  # train, then eval
            print(f"prepare: {parts}; {self.text / 1e6:.1f} MB of text in {took:.1f} s, "
                  f"{self.text / 1e6 / took:.2f} MB/s", file=sys.stderr, flush=True)


def _check_out(out: Path, force: bool) -> None:
    """Refuse an ``out`` that is a file, or a non-empty folder that is not a previous prepare (unless ``force``)."""
    if out.exists() and not out.is_dir():
        raise DataError(f"--out {out} is a file; give a folder")
    foreign = sorted(set(os.listdir(out)) - OURS) if out.exists() else []
    for split in ("train", "eval"):  # a user's own train/ folder is not a previous prepare
        if (out / split).is_dir():
            foreign += [f"{split}/{p.name}" for p in (out / split).iterdir() if not _SHARD_FILE.match(p.name)][:1]
    if foreign and not force:
        raise DataError(f"{out} is not empty and not a previous potluck data prepare (it holds {', '.join(foreign[:3])}"
                        f"{', ...' if len(foreign) > 3 else ''}); choose an empty folder or add --force")


def _install(work: Path, out: Path) -> None:
    """Replace ``out``'s prepared entries with ``work``'s (a finished prepare): a failed one never touched them."""
    out.mkdir(parents=True, exist_ok=True)
    (out / INDEX).unlink(missing_ok=True)  # first: a half-replaced folder must never pass for a finished one
    for name in OURS:
        path = out / name
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    for entry in sorted(work.iterdir(), key=lambda e: e.name == INDEX):  # the index last
        entry.rename(out / entry.name)
    work.rmdir()


def _stream(out: Path, split: str, results: Iterator[Encoded], bar: Progress) -> tuple[Path, np.ndarray]:
    """Append every result to ``out/.SPLIT.stream``; (the stream, the positions where documents start)."""
    stream, docs = out / f".{split}.stream", out / f".{split}.docs"
    pos = 0
    with open(stream, "wb") as s, open(docs, "wb") as d:
        for e in results:
            s.write(e.tokens.tobytes())
            d.write((pos + np.cumsum(e.lengths) - e.lengths).astype(DOCS_DTYPE).tobytes())
            pos += len(e.tokens)
            bar.update(e)
    if not docs.stat().st_size:
        return stream, np.zeros(0, dtype=DOCS_DTYPE)
    return stream, np.memmap(docs, dtype=DOCS_DTYPE, mode="r")  # 8 bytes a document: not held in RAM


def _prepare(out: Path, tokenizer: Tokenizer, train: Iterable[tuple[Item, int]],
             held_out: Iterable[tuple[Item, int]] | None, *, total: int | None, workers: int, shard_tokens: int,
             text_field: str, eval_fraction: float, progress: bool, force: bool) -> Path:
    if not 0 <= eval_fraction < 1:
        raise DataError(f"--eval-fraction must be in [0, 1), got {eval_fraction}")
    if shard_tokens < 1:
        raise DataError(f"--shard-tokens must be at least 1, got {shard_tokens}")
    _check_out(out, force)
    final, out = out, out.parent / f".{out.name}.partial-{os.getpid()}"  # written aside, installed when whole
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    dtype = token_dtype(tokenizer.info.vocab_size)
    bar = Progress(total, progress)
    splits: dict[str, dict[str, Any]] = {}
    try:
        with closing(encoded(tokenizer, chunks(train, text_field), workers)) as results:  # closing: stops the pool
            stream, starts = _stream(out, "train", results, bar)
        if not len(starts):
            raise DataError("the inputs hold no documents (every one is empty or missing): nothing to prepare")
        if held_out is not None:
            with closing(encoded(tokenizer, chunks(held_out, text_field), workers)) as results:
                eval_stream, eval_starts = _stream(out, "eval", results, bar)
            if not len(eval_starts):
                raise DataError("the --eval inputs hold no documents")
            splits["eval"] = write_split(out, "eval", eval_stream, eval_starts, dtype, shard_tokens)
        elif eval_fraction > 0:
            keep = len(starts) - max(1, int(len(starts) * eval_fraction))
            if keep < 1:
                raise DataError(f"only {len(starts)} document(s): too few to hold some out for eval; add documents, "
                                "or give --eval-fraction 0 or --eval FILES")
            splits["eval"] = write_split(out, "eval", stream, starts, dtype, shard_tokens, start=int(starts[keep]))
            starts = starts[:keep]
        splits["train"] = write_split(out, "train", stream, starts, dtype, shard_tokens)
        for name in (".train.stream", ".train.docs", ".eval.stream", ".eval.docs"):
            (out / name).unlink(missing_ok=True)
        write_index(out, tokenizer.info, shard_tokens, splits)
        if isinstance(tokenizer, HFTokenizer):  # the tokenizer travels with its shards (export, generate)
            tokenizer.save(out)
    except BaseException:  # bad input, Ctrl-C: the previous prepare (if any) stays as it was
        shutil.rmtree(out, ignore_errors=True)
        raise
    finally:
        bar.close()
    _install(out, final)
    bar.summary(splits)
    return final
