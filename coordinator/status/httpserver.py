"""The status page's HTTP server itself, hardened for a public page (the routes are in
:mod:`potluck.coordinator.status.status`).

What a client can hold is bounded (:class:`Limits`), since the page is public: a connection that
has sent nothing waits in a selector, not on a thread, and is closed after ``idle_s`` (the longest
waiting goes first when ``max_waiting`` are open); one that speaks gets a worker thread, at most
``max_connections`` at once (the next is answered 503 and closed), and must deliver its whole
request, TLS handshake included, within ``request_s`` however slowly it trickles in (slowloris).
A live stream gives its worker slot back (streams have their own cap), and from then on only
writes, each bounded by ``write_s``. One request per connection (HTTP/1.0), so no keep-alive
connection idles on a thread either.
"""

from __future__ import annotations

import io
import selectors
import socket
import ssl
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from potluck.protos.runtime.log import get_logger

log = get_logger(__name__)

MAX_BODY = 64 * 1024  # bytes of a request body


@dataclass(frozen=True)
class Limits:
    """What one client may hold of the status server, and for how long.

    ``max_connections`` requests are read and answered at once, each on a worker thread; ``max_waiting``
    connections that have sent nothing yet wait on no thread at all (the longest waiting is closed
    to make room), each closed after ``idle_s``. A request must arrive whole, TLS handshake included,
    within ``request_s`` of getting a worker; one response write (or stream event) may take ``write_s``
    for a client that reads slowly. Live streams are capped by ``StatusServer(max_streams=...)``.
    """

    max_connections: int = 64
    max_waiting: int = 256  # each an open file of the coordinator's process, which needs files for its own work
    idle_s: float = 5.0
    request_s: float = 10.0
    write_s: float = 30.0


# Answered to a connection beyond max_connections, without a thread and without parsing its request.
_BUSY_BODY = b"busy: retry in a second\n"
_BUSY = (b"HTTP/1.0 503 Service Unavailable\r\nRetry-After: 1\r\nContent-Type: text/plain; charset=utf-8\r\n"
         b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(_BUSY_BODY), _BUSY_BODY))


class Slot:
    """One worker slot, given back once: when the connection ends, or earlier when it becomes a stream."""

    def __init__(self, pool: threading.BoundedSemaphore) -> None:
        self._pool, self._held = pool, True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._pool.release()


class RequestReader(io.RawIOBase):
    """The socket as the handler reads it: every read must come before the request's deadline.

    A per-read timeout alone lets a client that sends one byte a second hold a thread forever;
    here each read waits at most ``min(idle_s, time left)``, and none starts after the deadline.
    Writes keep the socket's ``write_s`` timeout, restored after each read.
    """

    def __init__(self, sock: socket.socket, deadline: float, limits: Limits) -> None:
        super().__init__()
        self._sock, self._deadline, self._limits = sock, deadline, limits

    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"the request did not arrive within {self._limits.request_s:g} s")
        self._sock.settimeout(min(self._limits.idle_s, left))
        try:
            return self._sock.recv_into(buf)
        finally:
            self._sock.settimeout(self._limits.write_s)


_Waiting = OrderedDict[socket.socket, tuple[float, Any]]  # connection -> (idle deadline, client address)


class GuardedHTTPServer(ThreadingHTTPServer):
    """Accepts in one thread (:meth:`serve`) and gives a worker thread only to a connection that spoke."""

    daemon_threads = True
    request_queue_size = 256  # the listen backlog: a burst of connections waits in the kernel, not refused

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], limits: Limits,
                 tls: ssl.SSLContext | None) -> None:
        self.limits, self.tls = limits, tls
        self._handler: Callable[..., BaseHTTPRequestHandler] = handler  # takes the slot and deadline too
        self._workers = threading.BoundedSemaphore(limits.max_connections)
        self._wake_r, self._wake_w = socket.socketpair()  # before binding: a failed bind calls server_close
        super().__init__(address, handler)

    def serve(self) -> None:
        """The accept loop: parks new connections until they send something, closes the idle ones."""
        self.socket.setblocking(False)
        sel = selectors.DefaultSelector()
        sel.register(self.socket, selectors.EVENT_READ)
        sel.register(self._wake_r, selectors.EVENT_READ)
        waiting: _Waiting = OrderedDict()  # arrival order, so the oldest deadline is first
        try:
            while True:
                timeout = max(0.0, next(iter(waiting.values()))[0] - time.monotonic()) if waiting else None
                for key, _ in sel.select(timeout):
                    if key.fileobj is self._wake_r:
                        return
                    if key.fileobj is self.socket:
                        self._accept(sel, waiting)
                    elif key.data in waiting:  # not dropped by an _accept earlier in this batch
                        sel.unregister(key.data)
                        self._dispatch(key.data, waiting.pop(key.data)[1])
                now = time.monotonic()
                while waiting and next(iter(waiting.values()))[0] <= now:
                    self._drop(sel, waiting, next(iter(waiting)))
        except Exception:
            log.exception("status http: the accept loop failed; the status page is down")
        finally:
            for sock in list(waiting):
                self._drop(sel, waiting, sock)
            sel.close()

    def wake(self) -> None:
        """Ends :meth:`serve` (from any thread)."""
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass  # already stopped

    def server_close(self) -> None:
        super().server_close()
        self._wake_r.close()
        self._wake_w.close()

    def _accept(self, sel: selectors.BaseSelector, waiting: _Waiting) -> None:
        for _ in range(64):  # then back to select: a flood of new connections must not starve those that spoke
            try:
                conn, addr = self.socket.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return
            except OSError as err:  # out of files (EMFILE): free one, or the listener would wake us in a loop
                log.warning("status http: cannot accept a connection: %s", err)
                if waiting:
                    self._drop(sel, waiting, next(iter(waiting)))
                else:
                    time.sleep(0.05)
                return
            waiting[conn] = (time.monotonic() + self.limits.idle_s, addr)
            sel.register(conn, selectors.EVENT_READ, data=conn)
            if len(waiting) > self.limits.max_waiting:
                self._drop(sel, waiting, next(iter(waiting)))

    def _drop(self, sel: selectors.BaseSelector, waiting: _Waiting, sock: socket.socket) -> None:
        del waiting[sock]
        sel.unregister(sock)
        sock.close()

    def _dispatch(self, conn: socket.socket, addr: Any) -> None:
        try:
            if conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"":
                conn.close()  # it connected and left (a port scan, a browser's unused preconnect)
                return
        except BlockingIOError:
            pass
        except OSError:
            conn.close()
            return
        if not self._workers.acquire(blocking=False):
            self._refuse(conn)
            return
        try:
            threading.Thread(target=self._work, args=(conn, addr), name="status-http-conn", daemon=True).start()
        except RuntimeError:  # the process cannot start another thread
            self._workers.release()
            self._refuse(conn)

    def _refuse(self, conn: socket.socket) -> None:
        """503 and close, without blocking: the request is drained first so the close is not a reset."""
        try:
            conn.setblocking(False)
            if self.tls is None:  # a TLS client would take plain bytes for a broken handshake: just close
                conn.recv(MAX_BODY)
                conn.send(_BUSY)
        except OSError:
            pass
        self.shutdown_request(conn)

    def _work(self, conn: socket.socket, addr: Any) -> None:
        slot, deadline = Slot(self._workers), time.monotonic() + self.limits.request_s
        try:
            if self.tls is not None:  # here, not in the accept loop: a handshake that never ends costs its own thread only
                conn.settimeout(self.limits.request_s)  # for the whole handshake, not per read
                conn = self.tls.wrap_socket(conn, server_side=True)
            self._handler(conn, addr, self, slot, deadline)
        except Exception:
            self.handle_error(conn, addr)
        finally:
            self.shutdown_request(conn)
            slot.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.warning("status http: serving %s failed (that request only)", client_address, exc_info=True)
