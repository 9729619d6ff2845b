"""Float32 tensors in safetensors files, streamed: written, hashed and read in blocks, never whole.

What :mod:`potluck.coordinator.store.checkpoint` stores a stage in. :func:`write_safetensors` writes from
an iterator of byte blocks (fsynced, renamed into place) and returns the file's SHA-256 computed on
the way; :func:`tensor_ranges` and :func:`map_file` let a reader serve byte ranges of a file straight
from a memory map; :func:`ranges_hash` computes a state hash over such ranges.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from potluck.compression.statehash import StateHasher

CHUNK = 16 << 20  # bytes per block read or hashed

Layout = list[tuple[str, list[int]]]


def write_safetensors(path: Path, entries: Layout, blocks: Iterable[bytes | memoryview],
                      metadata: dict[str, str]) -> tuple[str, int]:
    """Write float32 tensors ``entries`` (name, shape), whose bytes are ``blocks`` concatenated, as the
    safetensors file ``path``; returns its SHA-256 and where its data starts.

    Nothing is buffered beyond one block: the header is known from the shapes, then the blocks go
    straight to a temporary file, which is fsynced and renamed over ``path``.
    """
    head: dict[str, Any] = {"__metadata__": metadata}
    size = 0
    for name, shape in entries:
        n = 4 * math.prod(shape)
        head[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [size, size + n]}
        size += n
    raw = json.dumps(head, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data 8-aligned, as safetensors writes it: float32 views map in place
    digest = hashlib.sha256()
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            written = -len(raw) - 8
            for block in itertools.chain([len(raw).to_bytes(8, "little"), raw], blocks):
                digest.update(block)
                f.write(block)
                written += len(block)
            if written != size:
                raise ValueError(f"{path.name}: {written} bytes of tensor data, its header says {size}")
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return digest.hexdigest(), 8 + len(raw)


def tensor_ranges(path: Path) -> dict[str, tuple[int, int]]:
    """The byte range, in the file, of every float32 tensor of the safetensors file ``path``."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        try:
            head = json.loads(f.read(n))
        except ValueError as err:
            raise ValueError(f"{path.name} has no readable safetensors header: {err}") from None
    out = {}
    for name, info in head.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        if info["dtype"] != "F32" or (8 + n + begin) % 4 or end < begin:
            raise ValueError(f"{path.name}: {name} is not float32 data that maps in place")
        out[name] = (8 + n + begin, 8 + n + end)
    return out


def map_file(path: Path) -> torch.Tensor:
    """The file as float32 values, memory-mapped: pages are read when touched, and a write would stay
    private to this process (``MAP_PRIVATE``), never reaching the file."""
    return torch.from_file(str(path), shared=False, size=path.stat().st_size // 4, dtype=torch.float32)


def float_view(flat: torch.Tensor, begin: int, end: int, name: str) -> torch.Tensor:
    if begin % 4 or end % 4 or not 0 <= begin <= end <= 4 * flat.numel():
        raise ValueError(f"byte range [{begin}, {end}) of {name} is not float32 data inside the file")
    return flat[begin // 4 : end // 4]

def read_range(path: Path, begin: int, end: int) -> Iterator[bytes]:
    with open(path, "rb") as f:
        f.seek(begin)
        while begin < end:
            block = f.read(min(CHUNK, end - begin))
            if not block:
                raise ValueError(f"{path.name} ends at byte {begin}, before {end}")
            begin += len(block)
            yield block


def ranges_hash(tensors: dict[str, list[tuple[Path, int, int]]]) -> str:
    """:func:`tensors_hash` of flat tensors each made of byte ranges of files, read in blocks."""
    h = StateHasher()
    for name in sorted(tensors):
        h.tensor(name)
        for path, begin, end in tensors[name]:
            for block in read_range(path, begin, end):
                h.update(block)
    return h.hexdigest()


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
