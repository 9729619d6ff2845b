"""AC-SGD's per-sample buffer: ``m[sample_id]`` for one side of one stage boundary.

What :mod:`potluck.compression.acsgd` keeps bit-identical on both sides of a boundary. Each entry is
a fixed-shape array with a *version* (the number of updates it has had); a lookup of a sample whose
entry is missing raises :class:`BufferMissError` and changes nothing. The arrays live in pages, each
as big as all before it, in RAM until they would exceed ``memmap_threshold_bytes``, then in numpy
memmaps on disk; a
shard of a buffer travels as a plain dict with a SHA-256 (:meth:`ActivationBuffer.export_state`), so
a replacement peer can take over a stage without first visits.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from potluck.compression.actcodec import CodecError

STATE_VERSION = 1
_NP_DTYPES = {"float32": np.float32, "float16": np.float16}


class BufferMissError(CodecError):
    """A delta for samples whose buffer entry is missing or at another version; nothing was changed.

    ``sample_ids`` lists them; the sender should :meth:`~potluck.compression.acsgd.AcsgdSender.forget` every id of the rejected
    micro-batch (not only these: its buffer advanced for all of them) and send it again.
    """

    def __init__(self, message: str, sample_ids: list[int]) -> None:
        super().__init__(message)
        self.sample_ids = sample_ids


@dataclass(frozen=True)
class Footprint:
    samples: int
    memory_bytes: int  # buffer arrays held in RAM (index dicts aside)
    disk_bytes: int  # size of the memmap file, 0 while in RAM


class ActivationBuffer:
    """``m[sample_id]`` for one side of one boundary: fixed-shape arrays in the slots of a few pages.

    Capacity doubles as samples arrive, by a new page as big as all the others: nothing held is copied to
    grow, and there are as many pages as doublings. (A single array that doubled by copying held its old
    and new storage at once: filled with 141 MB of entries its process peaked 1.73x that over its start,
    the pages 1.02-1.03x, for no more CPU, ``benchmarks/actbuffer_growth.py``.) A put or get within one page
    indexes it at once; across pages, a row at a time, so no temporary is as big as the rows. The pages are in RAM, and move to numpy memmaps (unlinked temporary
    files in ``memmap_dir``, so nothing is left behind), a page at a time, as soon as the capacity would
    exceed ``memmap_threshold_bytes``; later pages are made on disk. Forgotten slots are reused. Not thread-safe: its owner (one
    :class:`~potluck.compression.acsgd.AcsgdSender` or ``AcsgdReceiver``) is driven by one stage worker,
    which holds a lock per side where several threads reach it (see :mod:`potluck.peer.pipeline.pipeline`).
    """

    def __init__(
        self,
        *,
        dtype: Literal["float32", "float16"] = "float32",
        memmap_threshold_bytes: int = 1 << 30,
        memmap_dir: str | None = None,
    ) -> None:
        if dtype not in _NP_DTYPES:
            raise ValueError(f"buffer dtype must be one of {list(_NP_DTYPES)}, got {dtype!r}")
        self.dtype = dtype
        self.memmap_threshold_bytes = memmap_threshold_bytes
        self.memmap_dir = memmap_dir
        self.sample_shape: tuple[int, ...] | None = None
        self._np = np.dtype(_NP_DTYPES[dtype])
        self._pages: list[np.ndarray] = []  # page k holds the slots from _starts[k] on
        self._starts: list[int] = []
        self._slot: dict[int, int] = {}
        self._version: dict[int, int] = {}
        self._free: list[int] = []
        self._high = 0  # slots below this have been handed out
        self._on_disk = False

    def __len__(self) -> int:
        return len(self._slot)

    def __contains__(self, sample_id: int) -> bool:
        return sample_id in self._slot

    def ids(self) -> list[int]:
        return sorted(self._slot)

    def version(self, sample_id: int) -> int:
        """Updates the entry has had (1 after the first visit); 0 when there is none."""
        return self._version.get(sample_id, 0)

    @property
    def on_disk(self) -> bool:
        return self._on_disk

    def footprint(self) -> Footprint:
        nbytes = sum(int(page.nbytes) for page in self._pages)
        return Footprint(len(self._slot), 0 if self._on_disk else nbytes, nbytes if self._on_disk else 0)

    def storage_round(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` as they read back after :meth:`put` (float32)."""
        return values if self.dtype == "float32" else values.to(torch.float16).float()

    def get(self, ids: Sequence[int]) -> torch.Tensor:
        """Entries ``[len(ids), *sample_shape]`` as float32 (a copy)."""
        missing = [i for i in ids if i not in self._slot]
        if missing:
            raise BufferMissError(f"no buffer for sample id {missing[0]} (handover?)", missing)
        assert self.sample_shape is not None
        if not ids:
            return torch.zeros((0, *self.sample_shape))
        rows = self._rows(np.fromiter((self._slot[i] for i in ids), np.int64, len(ids)))
        return torch.from_numpy(rows.astype(np.float32, copy=False))

    def put(self, ids: Sequence[int], values: torch.Tensor, versions: Sequence[int]) -> None:
        """Set entries (float32 values ``[len(ids), *sample_shape]``) and their versions."""
        if len(ids) == 0:
            return
        shape = tuple(values.shape[1:])
        if self.sample_shape is None:
            self.sample_shape = shape
        elif shape != self.sample_shape:
            raise CodecError(f"buffer holds samples of shape {list(self.sample_shape)}, got {list(shape)}")
        new = [i for i in ids if i not in self._slot]
        self._reserve(len(new))
        for i in new:
            self._slot[i] = self._free.pop() if self._free else self._take_slot()
        slots = np.fromiter((self._slot[i] for i in ids), np.int64, len(ids))
        self._write(slots, values.detach().cpu().numpy().astype(self._np, copy=False))
        for i, v in zip(ids, versions, strict=True):
            self._version[i] = int(v)

    def forget(self, ids: Sequence[int] | None = None) -> None:
        """Drop entries (all when ``ids`` is None); their next visit is a first visit."""
        for i in list(self._slot) if ids is None else ids:
            slot = self._slot.pop(int(i), None)
            if slot is not None:
                self._free.append(slot)
                del self._version[int(i)]

    def close(self) -> None:
        """Release the storage (the memmap's disk space goes with it)."""
        self.forget()
        self._pages, self._starts = [], []
        self._free, self._high, self._on_disk = [], 0, False

    def _take_slot(self) -> int:
        self._high += 1
        return self._high - 1

    def _capacity(self) -> int:
        return self._starts[-1] + len(self._pages[-1]) if self._pages else 0

    def _reserve(self, n_new: int) -> None:
        assert self.sample_shape is not None
        need = self._high + max(0, n_new - len(self._free))
        sample_bytes = self._np.itemsize * int(np.prod(self.sample_shape))
        while (capacity := self._capacity()) < need:
            rows = max(capacity, 16)  # (as big as all the pages before it: the capacity doubles)
            shape = (rows, *self.sample_shape)
            if not self._on_disk and (capacity + rows) * sample_bytes > self.memmap_threshold_bytes:
                for k, page in enumerate(self._pages):  # (a page at a time: RAM and disk hold one page twice at most)
                    on_disk = self._memmap(page.shape)
                    on_disk[:] = page
                    self._pages[k] = on_disk
                self._on_disk = True
            self._pages.append(self._memmap(shape) if self._on_disk else np.zeros(shape, self._np))
            self._starts.append(capacity)

    def _where(self, slots: np.ndarray) -> tuple[np.ndarray, int | None]:
        """The page of each slot, and that page when they are all in one (the usual micro-batch), else None."""
        pages = np.searchsorted(np.asarray(self._starts, np.int64), slots, side="right") - 1
        return pages, (int(pages[0]) if len(slots) and (pages == pages[0]).all() else None)

    def _rows(self, slots: np.ndarray) -> np.ndarray:
        """The entries in ``slots``, in that order (a copy)."""
        pages, one = self._where(slots)
        if one is not None:
            return self._pages[one][slots - self._starts[one]]
        out = np.empty((len(slots), *(self.sample_shape or ())), self._np)
        for j, (k, slot) in enumerate(zip(pages.tolist(), slots.tolist(), strict=True)):
            out[j] = self._pages[k][slot - self._starts[k]]  # (a row at a time: no temporary as big as the rows)
        return out

    def _write(self, slots: np.ndarray, rows: np.ndarray) -> None:
        pages, one = self._where(slots)
        if one is not None:
            self._pages[one][slots - self._starts[one]] = rows
            return
        for j, (k, slot) in enumerate(zip(pages.tolist(), slots.tolist(), strict=True)):
            self._pages[k][slot - self._starts[k]] = rows[j]

    def _memmap(self, shape: tuple[int, ...]) -> np.ndarray:
        fd, path = tempfile.mkstemp(prefix="acsgd-", suffix=".buf", dir=self.memmap_dir)
        os.close(fd)
        mm = np.memmap(path, dtype=self._np, mode="w+", shape=shape)
        try:
            os.unlink(path)  # POSIX keeps the mapping; the file vanishes with the process
        except OSError:
            weakref.finalize(mm, _remove, path)
        return mm

    # -- handover -----------------------------------------------------------------------------

    def digest(self, ids: Sequence[int] | None = None) -> str:
        """SHA-256 over dtype, sample shape, ids, versions and bytes of the entries (missing ids skipped)."""
        return str(self.export_state(ids)["sha256"])

    def export_state(self, ids: Sequence[int] | None = None) -> dict[str, Any]:
        """A shard as a plain dict (ints, strings, lists, bytes). Ids without an entry are skipped."""
        ids = self.ids() if ids is None else [int(i) for i in ids if int(i) in self._slot]
        versions = [self.version(i) for i in ids]
        data = self._bytes(ids)
        return {
            "format": STATE_VERSION,
            "dtype": self.dtype,
            "sample_shape": list(self.sample_shape or ()),
            "ids": ids,
            "versions": versions,
            "data": data,
            "sha256": _digest(self.dtype, tuple(self.sample_shape or ()), ids, versions, data),
        }

    def import_state(self, state: Mapping[str, Any]) -> None:
        """Add (or overwrite) the entries of an exported shard; a bad shard changes nothing."""
        ids, versions, values = self._parse_state(state)
        if ids:
            self.put(ids, values, versions)

    def _bytes(self, ids: list[int]) -> bytes:
        if not ids:
            return b""
        rows = self._rows(np.fromiter((self._slot[i] for i in ids), np.int64, len(ids)))
        return np.ascontiguousarray(rows).tobytes()

    def _parse_state(self, state: Mapping[str, Any]) -> tuple[list[int], list[int], torch.Tensor]:
        try:
            fmt, dtype = state["format"], state["dtype"]
            shape = [int(s) for s in state["sample_shape"]]
            ids = [int(i) for i in state["ids"]]
            versions = [int(v) for v in state["versions"]]
            data, sha = bytes(state["data"]), str(state["sha256"])
        except (KeyError, TypeError, ValueError) as e:
            raise CodecError(f"malformed buffer state: {e!r}") from e
        if fmt != STATE_VERSION:
            raise CodecError(f"buffer state format {fmt} is not the supported {STATE_VERSION}")
        if dtype != self.dtype:
            raise CodecError(f"buffer state holds {dtype} entries, this buffer stores {self.dtype}")
        if len(versions) != len(ids) or len(set(ids)) != len(ids) or any(v < 1 for v in versions):
            raise CodecError("buffer state needs one version >= 1 per id and no repeated ids")
        if _digest(dtype, tuple(shape), ids, versions, data) != sha:
            raise CodecError("buffer state hash mismatch: the shard was corrupted or tampered with")
        if not ids:
            return [], [], torch.zeros(0)
        if self.sample_shape is not None and tuple(shape) != self.sample_shape:
            raise CodecError(f"buffer state holds samples of shape {shape}, this buffer {list(self.sample_shape)}")
        expected = len(ids) * int(np.prod(shape)) * self._np.itemsize
        if len(data) != expected:
            raise CodecError(f"buffer state of {len(ids)} samples of shape {shape} needs {expected} bytes")
        arr = np.frombuffer(data, self._np).reshape(len(ids), *shape)
        if not np.isfinite(arr).all():
            raise CodecError("buffer state holds NaN or Inf")
        return ids, versions, torch.from_numpy(arr.astype(np.float32))


def _digest(dtype: str, shape: tuple[int, ...], ids: list[int], versions: list[int], data: bytes) -> str:
    h = hashlib.sha256()
    header = {"format": STATE_VERSION, "dtype": dtype, "sample_shape": list(shape), "n": len(ids)}
    h.update(json.dumps(header, sort_keys=True).encode())
    h.update(np.asarray(ids, np.int64).astype("<i8").tobytes())
    h.update(np.asarray(versions, np.int64).astype("<i8").tobytes())
    h.update(data)
    return h.hexdigest()


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
