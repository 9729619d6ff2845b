"""One logger for every potluck process.

Lines look like ``12:03:04 INFO  [peer 7Hq2xA 0/1 step 12] outer step done in 0.21 s``: the prefix
names the process, its tasklet and its outer step, so interleaved output of a local swarm stays
readable. The level comes from ``POTLUCK_LOG`` (default INFO); colour only on a TTY.
"""

from __future__ import annotations

import logging
import os
import sys

_ROOT = "potluck"
_COLOURS = {"DEBUG": "\x1b[2m", "INFO": "", "WARNING": "\x1b[33m", "ERROR": "\x1b[31m", "CRITICAL": "\x1b[31;1m"}


class _Context(logging.Filter):
    """Puts the process prefix (``[peer 7Hq2xA 0/1 step 12]``) on every record."""

    def __init__(self) -> None:
        super().__init__()
        self.role = "potluck"
        self.short_id = ""
        self.tasklet = ""
        self.step: int | None = None

    def prefix(self) -> str:
        parts = [self.role]
        if self.short_id:
            parts.append(self.short_id)
        if self.tasklet:
            parts.append(self.tasklet)
        if self.step is not None:
            parts.append(f"step {self.step}")
        return "[" + " ".join(parts) + "]"

    def filter(self, record: logging.LogRecord) -> bool:
        record.potluck_prefix = self.prefix()
        return True


class _Formatter(logging.Formatter):
    def __init__(self, colour: bool) -> None:
        super().__init__("%(asctime)s %(levelname)-5s %(potluck_prefix)s %(message)s", "%H:%M:%S")
        self.colour = colour

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        if self.colour and _COLOURS.get(record.levelname):
            return f"{_COLOURS[record.levelname]}{text}\x1b[0m"
        return text


CONTEXT = _Context()


def _configure() -> None:
    root = logging.getLogger(_ROOT)
    if root.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Formatter(colour=sys.stderr.isatty() and not os.environ.get("NO_COLOR")))
    handler.addFilter(CONTEXT)
    root.addHandler(handler)
    root.setLevel(os.environ.get("POTLUCK_LOG", "INFO").upper())
    root.propagate = False


def get_logger(name: str) -> logging.Logger:
    """The logger for a module (``get_logger(__name__)``), under the shared ``potluck`` root."""
    _configure()
    return logging.getLogger(name if name.startswith(_ROOT) else f"{_ROOT}.{name}")


def set_context(
    *, role: str | None = None, peer_id: str | None = None, tasklet: str | None = None, step: int | None = None
) -> None:
    """Update the prefix of this process's log lines."""
    if role is not None:
        CONTEXT.role = role
    if peer_id is not None:
        CONTEXT.short_id = short_id(peer_id)
    if tasklet is not None:
        CONTEXT.tasklet = tasklet
    if step is not None:
        CONTEXT.step = step


def short_id(peer_id: str) -> str:
    """The last 6 characters of a peer id: unique enough to tell a swarm's peers apart on screen."""
    return peer_id[-6:]
