"""Why a server could not bind its port, said the way a user fixes it.

Every listening socket of a coordinator or a peer (the DHT, the gRPC server, the status page) is
bound from a flag or a config field the user chose. When the bind fails, the error names the port,
what it was for and the flag that changes it, instead of an ``OSError`` traceback::

    status port 8080 on 127.0.0.1 is in use by another program; choose another with --status-port
    (or coordinator.status_port), or 0 for any free port

Both are ``ValueError``: bad input, not a bug. The entry points print them as one line.

Imports only the standard library: every layer may raise these.
"""

from __future__ import annotations

import errno
import socket


class CannotBind(ValueError):
    """A server could not listen on ``host:port``; ``flag`` (and ``setting``, a config field) choose it."""

    def __init__(self, what: str, host: str, port: int, flag: str, setting: str | None = None,
                 reason: str = "") -> None:
        self.what, self.host, self.port, self.flag, self.setting, self.reason = what, host, port, flag, setting, reason
        super().__init__(str(self))

    def __reduce__(self) -> tuple[type, tuple]:  # picklable (e.g. across multiprocessing) despite its signature
        return type(self), (self.what, self.host, self.port, self.flag, self.setting, self.reason)

    def _choose(self) -> str:
        also = f" (or {self.setting})" if self.setting else ""
        return f"choose another with {self.flag}{also}, or 0 for any free port"

    def __str__(self) -> str:
        return f"cannot listen on {self.host}:{self.port} for the {self.what}: {self.reason}; {self._choose()}"


class PortInUse(CannotBind):
    """Another program (or another potluck process) already listens on the port."""

    def __str__(self) -> str:
        return f"{self.what} {self.port} on {self.host} is in use by another program; {self._choose()}"


def bind_error(err: OSError, what: str, host: str, port: int, flag: str, setting: str | None = None) -> CannotBind:
    """The :class:`CannotBind` (a :class:`PortInUse` for ``EADDRINUSE``) that explains ``err``."""
    if err.errno == errno.EADDRINUSE:
        return PortInUse(what, host, port, flag, setting)
    if err.errno == errno.EACCES and 0 < port < 1024:
        reason = "ports below 1024 need root"
    elif err.errno == errno.EADDRNOTAVAIL:
        reason = f"{host} is not an address of this machine (check --host)"
    elif isinstance(err, socket.gaierror):
        reason = f"{host} is not a known host name (check --host)"
    else:
        reason = err.strerror or str(err)
    return CannotBind(what, host, port, flag, setting, reason)


def check_port_free(what: str, host: str, port: int, flag: str, setting: str | None = None) -> None:
    """Raise :class:`CannotBind` unless a plain TCP socket can bind ``host:port`` right now.

    For servers that would not notice on their own: libp2p's daemon and gRPC set ``SO_REUSEPORT``,
    so two of them share a port silently and the kernel splits connections between them. The probe
    sets ``SO_REUSEADDR`` but not ``SO_REUSEPORT``: connections left in TIME_WAIT by a previous run
    do not block it, a listener does. Port 0 (any free port) is never checked.
    """
    if port:
        try:
            _probe(host, port)
        except OSError as err:
            raise bind_error(err, what, host, port, flag, setting) from None


def explain_bind_failure(what: str, host: str, port: int, flag: str, setting: str | None = None) -> CannotBind:
    """After a server that says only "could not bind" failed: probe ``host:port`` again to say why."""
    try:
        _probe(host, port)
    except OSError as err:
        return bind_error(err, what, host, port, flag, setting)
    return CannotBind(what, host, port, flag, setting, reason="the server could not bind it")


def _probe(host: str, port: int) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host, port))
