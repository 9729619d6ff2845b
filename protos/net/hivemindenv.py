"""What hivemind reads from the environment when it is imported: set before its first import.

hivemind reads its log level and torch's tensor-sharing strategy once, at import time; p2pd reads
its log level when it starts. potluck sets its defaults here, before any of it is imported, in every
process that imports hivemind (:mod:`~potluck.protos.net.swarm`, and the fork server that preloads it
for the processes it starts). A value already in the environment wins.
"""

from __future__ import annotations

import os

DEFAULTS = {
    "HIVEMIND_LOGLEVEL": "WARNING",
    "GOLOG_LOG_LEVEL": "error",
    # hivemind defaults torch to the "file_system" sharing strategy, which starts a torch_shm_manager
    # daemon in a session of its own: a process our process-group cleanup cannot reach. Nothing we pass
    # between processes needs it.
    "HIVEMIND_MEMORY_SHARING_STRATEGY": "file_descriptor",
}


def apply() -> None:
    for name, value in DEFAULTS.items():
        os.environ.setdefault(name, value)
