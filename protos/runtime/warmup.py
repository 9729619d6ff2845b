"""Imports that cost seconds, done on a thread while the process waits on the network.

torch's optimizers import ``torch._dynamo`` on their first use: seconds of CPU that a peer can spend
while it dials the swarm instead. The import runs on a daemon thread, and the process waits for it
before the interpreter tears down (an ``atexit`` join): a peer that exits in its first seconds (refused
at admission, a bad flag, Ctrl-C) would otherwise finalize torch under the half-done import, which
printed a traceback after the peer's own last word (``operator _c10d_functional::_wrap_tensor_autograd
does not exist``) or aborted the process (nanobind's GIL check, exit code 134 instead of 2).
"""

from __future__ import annotations

import atexit
import importlib
import threading

from potluck.protos.runtime.log import get_logger

log = get_logger(__name__)

EXIT_WAIT_S = 60.0  # the most an exit waits for the imports (they take seconds; a hung one must not hold it)


def warm_up(*modules: str) -> threading.Thread:
    """Import ``modules`` on a daemon thread now; the process's exit waits for them (at most ``EXIT_WAIT_S``)."""

    def load() -> None:
        for name in modules:
            try:
                importlib.import_module(name)
            except Exception as err:  # (best effort: whoever needs the module imports it again and is told)
                log.debug("warm-up import of %s failed: %s", name, err)

    thread = threading.Thread(target=load, name="warm-up", daemon=True)
    thread.start()
    atexit.register(thread.join, EXIT_WAIT_S)
    return thread
