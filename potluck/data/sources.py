"""Documents from input files and ``datasets`` datasets, grouped in chunks a worker tokenizes alone.

Inputs, by extension:

* ``.txt``: the whole file is one document, or with ``lines=True`` every non-empty line is one;
* ``.jsonl`` / ``.jsonl.gz``: one JSON object per line, the document in its ``text_field``;
* ``.parquet``: the ``text_field`` column (needs pyarrow: ``pip install 'potluck[data]'``).

A folder stands for the files of these kinds below it, in sorted order. jsonl lines travel to the
workers raw and are parsed there (``json.loads`` is the costliest Python step of a jsonl corpus), each
with its file and line number so a bad line is named exactly.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from potluck.data import DataError

SUFFIXES = (".txt", ".jsonl", ".jsonl.gz", ".parquet")
CHUNK_BYTES = 1 << 20  # text per chunk: big enough to amortise a worker round trip, small enough to stream
CHUNK_DOCS = 4096

JsonLine = tuple[str, int, bytes]  # (file, line number, the raw line)
Item = str | JsonLine


@dataclass
class Chunk:
    """Consecutive documents: ready texts, or raw jsonl lines still to parse (see the module docstring)."""

    items: list[Item] = field(default_factory=list)
    text_field: str = "text"
    input_bytes: int = 0  # input consumed, for the progress bar

    def documents(self) -> list[str]:
        return [item if isinstance(item, str) else _json_text(item, self.text_field) for item in self.items]


def _json_text(item: JsonLine, text_field: str) -> str:
    where = f"{item[0]}:{item[1]}"
    try:
        record = json.loads(item[2])
    except ValueError as err:
        raise DataError(f"{where}: not valid JSON ({err}); each line of a .jsonl file is one JSON object") from None
    if not isinstance(record, dict) or text_field not in record:
        fields = ", ".join(map(str, record)) if isinstance(record, dict) else type(record).__name__
        raise DataError(f"{where}: no field {text_field!r} (this line has: {fields}); name the text field "
                        "with --text-field")
    text = record[text_field]
    if not isinstance(text, str):
        raise DataError(f"{where}: field {text_field!r} is {type(text).__name__}, not a string")
    return text


def suffix(path: Path) -> str:
    return ".jsonl.gz" if path.name.endswith(".jsonl.gz") else path.suffix


def expand(paths: Iterable[Path]) -> list[Path]:
    """The input files: files as given, folders replaced by their supported files in sorted order."""
    out: list[Path] = []
    for path in map(Path, paths):
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and suffix(p) in SUFFIXES)
            if not found:
                raise DataError(f"{path} holds no {', '.join(SUFFIXES)} files")
            out += found
        elif not path.is_file():
            raise DataError(f"input {path} does not exist")
        elif suffix(path) not in SUFFIXES:
            raise DataError(f"{path}: unknown input type {suffix(path) or '(no extension)'!r}; potluck data prepare "
                            f"reads {', '.join(SUFFIXES)}")
        else:
            out.append(path)
    return out


def _decode(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"{where}: not UTF-8 text (byte {err.start}); convert it to UTF-8") from None


def file_items(path: Path, *, text_field: str = "text", lines: bool = False) -> Iterator[tuple[Item, int]]:
    """(document or raw jsonl line, input bytes consumed) for one input file."""
    kind = suffix(path)
    if kind == ".txt" and not lines:
        raw = path.read_bytes()
        yield _decode(raw, str(path)), len(raw)
    elif kind == ".txt":
        with open(path, "rb") as f:
            for n, line in enumerate(f, 1):
                text = _decode(line, f"{path}:{n}").rstrip("\r\n")
                yield (text if text.strip() else ""), len(line)
    elif kind in (".jsonl", ".jsonl.gz"):
        with open(path, "rb") as raw_file:
            stream: Any = gzip.GzipFile(fileobj=raw_file) if kind == ".jsonl.gz" else raw_file
            seen = 0
            for n, line in enumerate(stream, 1):
                pos = raw_file.tell()
                if line.strip():
                    yield (str(path), n, line), pos - seen
                    seen = pos
    else:
        yield from _parquet_items(path, text_field)


def _parquet_items(path: Path, text_field: str) -> Iterator[tuple[Item, int]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading .parquet needs pyarrow: pip install 'potluck[data]'") from None
    pf = pq.ParquetFile(path)
    if text_field not in pf.schema_arrow.names:
        raise DataError(f"{path}: no column {text_field!r} (it has: {', '.join(pf.schema_arrow.names)}); name the "
                        "text column with --text-field")
    rows, size = max(1, pf.metadata.num_rows), path.stat().st_size
    row = 0
    for batch in pf.iter_batches(columns=[text_field], batch_size=1024):
        for text in batch.column(0).to_pylist():
            if not isinstance(text, str):
                raise DataError(f"{path}: row {row} of column {text_field!r} is {type(text).__name__}, not a string")
            row += 1
            yield text, size * row // rows - size * (row - 1) // rows


def dataset_items(dataset: Any, text_field: str, name: str) -> Iterator[tuple[Item, int]]:
    """The documents of a ``datasets.Dataset`` or ``IterableDataset`` (``name`` labels errors)."""
    columns = getattr(dataset, "column_names", None)
    if columns is not None and text_field not in columns:
        raise DataError(f"dataset {name} has no column {text_field!r} (it has: {', '.join(columns)}); name the "
                        "text column with --text-field")
    row = 0
    for batch in dataset.iter(batch_size=1024):
        if text_field not in batch:
            raise DataError(f"dataset {name}: rows from {row} on have no column {text_field!r} (they have: "
                            f"{', '.join(batch)}); name the text column with --text-field")
        for text in batch[text_field]:
            if not isinstance(text, str):
                raise DataError(f"dataset {name}: row {row} of column {text_field!r} is {type(text).__name__}, "
                                "not a string")
            row += 1
            yield text, len(text)


def chunks(items: Iterable[tuple[Item, int]], text_field: str) -> Iterator[Chunk]:
    """Group items into chunks of about :data:`CHUNK_BYTES` or :data:`CHUNK_DOCS`, in order."""
    chunk, size = Chunk(text_field=text_field), 0
    for item, consumed in items:
        chunk.input_bytes += consumed
        if item == "":
            continue  # an empty document adds no tokens and, byte-level, not even an EOS
        chunk.items.append(item)
        size += len(item) if isinstance(item, str) else len(item[2])
        if size >= CHUNK_BYTES or len(chunk.items) >= CHUNK_DOCS:
            yield chunk
            chunk, size = Chunk(text_field=text_field), 0
    if chunk.items or chunk.input_bytes:
        yield chunk
