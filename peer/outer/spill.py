"""The outer state on disk: ``potluck peer --outer-state-dir DIR``, for a volunteer short of RAM.

A peer holds its stage's theta_global and outer momentum, and the version before them, in host
memory: 16 bytes a parameter, a third of a CPU peer's memory with fp32 AdamW. The outer step is
rare, so with this option each committed snapshot's vectors are written to a file in ``DIR`` and
held as a shared memory map of it (``torch.from_file``); the file is unlinked at once, so nothing
is left behind whatever ends the process, and the kernel keeps the pages as a file's cache: clean
ones it may drop under memory pressure and read back when the next outer step, a recovering peer or
an auditor needs them, instead of the process being killed for memory. What it costs: writing 8
bytes a parameter each outer step (two vectors), and reading them back when they are used.

The snapshot is the same bits (its hash is not recomputed); only where its vectors live changes.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import replace
from pathlib import Path

import torch

from potluck.compression.transfer import Snapshot
from potluck.protos.config.section import ConfigError
from potluck.protos.runtime.log import get_logger

log = get_logger(__name__)


class Spill:
    """Places snapshots' vectors in memory-mapped files of ``folder`` (each unlinked once mapped)."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder).expanduser()
        self._names = itertools.count()
        check_folder(self.folder)
        log.info("the outer state lives in memory-mapped files in %s (--outer-state-dir), not in RAM", self.folder)

    def place(self, snap: Snapshot) -> Snapshot:
        """``snap`` with each vector copied into a file and mapped back (the same bits, the same digest)."""
        return replace(snap, tensors={name: self._map(t) for name, t in snap.tensors.items()})

    def _map(self, t: torch.Tensor) -> torch.Tensor:
        if mapped(t):
            return t
        src = t.detach().to("cpu", torch.float32).contiguous().reshape(-1)
        path = self.folder / f"outer-{os.getpid()}-{next(self._names)}.f32"
        try:
            src.numpy().tofile(path)
            out = torch.from_file(str(path), shared=True, size=src.numel(), dtype=torch.float32)
        finally:
            path.unlink(missing_ok=True)  # (the mapping keeps the data; the name goes now)
        return out


def mapped(t: torch.Tensor) -> bool:
    """Whether ``t``'s storage is a memory-mapped file (one :class:`Spill` placed)."""
    return bool(getattr(t.untyped_storage(), "filename", None))


def check_folder(folder: Path) -> None:
    """Create ``folder`` if missing and try writing a file there; ConfigError, in one line, if it cannot."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".potluck-probe-{os.getpid()}"
        probe.write_bytes(b"\0" * 8)
        probe.unlink()
    except OSError as err:
        raise ConfigError(f"--outer-state-dir {folder}: cannot write there ({err.strerror or err}); give a folder "
                          "this user can write on a disk with room for 16 bytes a parameter of the stage") from None
