"""Big records to the DHT process through a file, not its pipe.

A value sent through hivemind's pipe is read by the DHT process only between its own work, a chunk at a time,
each chunk waiting for that process's interpreter lock; the sender waits for all of it. At 1,000 peers a 600 KB
plan held the coordinator's loop 0.25-0.9 s of wall time for 8-19 ms of its CPU (``benchmarks/dht_spill.py``:
0.95 s through the pipe, 1.3 ms spilled, the DHT process busy). So a record over ``SPILL_BYTES`` is written to a
folder only this user can write (in memory, where /dev/shm is), and the DHT process reads and removes it.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import tempfile
from typing import Any

SPILL_BYTES = 1 << 16  # a record body bigger than this goes through a file


class Spill:
    """The caller's side: one private folder per DHT node, made at the first big record, removed by :meth:`close`."""

    def __init__(self) -> None:
        self.dir: str | None = None

    def write(self, value: dict[str, Any]) -> str:
        """``value`` in a new file of the folder; its path, for :func:`store_spilled`."""
        if self.dir is None:
            self.dir = tempfile.mkdtemp(prefix="potluck-dht-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        fd, path = tempfile.mkstemp(dir=self.dir)
        with os.fdopen(fd, "wb") as f:
            pickle.dump(value, f, protocol=pickle.HIGHEST_PROTOCOL)
        return path

    def close(self) -> None:
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)


async def store_spilled(dht: Any, node: Any, key: str, subkey: str | None, path: str, expiration: float) -> bool:
    """Runs in the DHT process: store the value :meth:`Spill.write` wrote to ``path``, then remove the file."""
    try:
        with open(path, "rb") as f:
            value = pickle.load(f)  # (written by the process that forked this one, in a folder only it can write)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
    return bool(await node.store(key, value, expiration, subkey=subkey))
