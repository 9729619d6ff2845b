"""A peer's key file: its identity, made on first start and held by one process at a time.

``potluck peer`` claims it before anything heavy loads or its DHT node starts, so a second peer started
with the same file on this machine is told at once, in one line, to use its own (``--identity FILE``).
A copy of the file on another machine is the coordinator's to notice (:mod:`potluck.coordinator.trust.admission`).
"""

from __future__ import annotations

import fcntl
from pathlib import Path
from typing import IO

from potluck.protos.net.identity import Identity, IdentityError

DEFAULT = "~/.potluck/peer.key"
_held: list[IO[str]] = []  # the locks this process holds, for its whole life


def load_identity(path: str = "") -> Identity:
    """This peer's key: ``path`` or ~/.potluck/peer.key, created (0600) if missing, and locked for the life of
    this process, so two peers never run as one identity; IdentityError if another process holds it."""
    key = Path(path or DEFAULT).expanduser()
    key.parent.mkdir(parents=True, exist_ok=True)
    lock = open(key.with_name(key.name + ".lock"), "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.close()
        raise IdentityError(f"the identity {key} is in use by another peer on this machine; give this one its own "
                            "with --identity FILE") from None
    _held.append(lock)
    return Identity.load_or_create(key)
