"""How a potluck server logs a call it refused (the ``on_reject`` of :class:`~potluck.protos.net.transport.PeerServer`).

A refusal is worth a warning (a malformed or forged message, a stranger, a member that broke the
protocol), except where it is the normal answer of a swarm whose members come and go:

* a recovering or joining peer asks every source it knows (the members of its stage, the coordinator's
  checkpoint) which state it holds (``GetStateInfo``), and a source without that version says
  ``NO_STATE`` (logged at debug; it was a ``WARN rejected GetStateInfo ... NO_STATE`` on the coordinator
  at every normal join);
* a message for another outer step than the receiver's (``WRONG_STEP``): a joiner still fetching its
  state is pushed the contributions of the step it joins, members at a boundary cross, and the sender
  retries or recovers (logged at info, as the sender logs its side).
"""

from __future__ import annotations

import logging

from potluck.protos.runtime.log import get_logger, short_id

log = get_logger(__name__)

LEVELS = {"NO_STATE": {"GetStateInfo": logging.DEBUG}, "WRONG_STEP": {}}  # refusal -> method -> level ({}: all)
NORMAL = logging.INFO  # of a refusal listed with no methods


def log_refusal(method: str, sender: str, reason: str) -> None:
    """Log a refused call; ``reason`` is ``"REFUSAL: text"``."""
    code = reason.split(":", 1)[0]
    methods = LEVELS.get(code)
    if methods is None or methods and method not in methods:
        level = logging.WARNING
    else:
        level = methods.get(method, NORMAL)
    log.log(level, "rejected %s from %s: %s", method, short_id(sender) if sender != "?" else "?", reason)
