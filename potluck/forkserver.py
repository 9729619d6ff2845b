"""A fork server for the potluck processes one launcher starts: the imports are paid once.

A potluck process spends about 4 s of CPU importing torch (and ``torch._dynamo``, which torch's
optimizers import on their first step), hivemind, scipy and numpy before it does anything. A
launcher that starts many of them on a small box -- the test suite starts hundreds, 8 at a time --
spends most of its time there. :class:`ForkServer` starts one process that imports those once
(only third-party modules: nothing of potluck's, whose modules read the environment), then forks a
child for each :meth:`~ForkServer.spawn`: the child takes a session of its own, its log as stdout
and stderr, its environment and working directory, and runs ``potluck.cli.main`` with its
arguments, exactly as ``python -P -m potluck ARGS`` would after its imports. It is a real OS
process; only its parent is the server, which reaps it and reports its exit status back. What is set
when a program is executed stays the server's: ``ps`` shows the server's command line for a child, and
``/proc/PID/environ`` the server's environment (the child's own is in ``os.environ``, as set here).
The tests start their coordinators and peers this way; ``potluck demo`` starts fresh interpreters.

The server dies with its launcher (``POTLUCK_DIE_WITH``), and its children with it: each asks
for a parent-death signal from the server, as a child of ``ProcessGroup.spawn`` does from the
launcher. The server forks only from its one thread; the modules it preloads start no thread of
Python's (numpy's BLAS starts its own, which handles ``fork``).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from potluck.protos.runtime.stopping import DIE_WITH_ENV, exit_process

PRELOAD = ("numpy", "scipy.optimize", "torch", "torch._dynamo", "torch.optim", "hivemind.dht", "pydantic",
           "cryptography.x509", "safetensors.torch", "blake3")
DISABLE_ENV = "POTLUCK_FORKSERVER"  # "0": every process is a fresh interpreter


class Forked(subprocess.Popen):
    """A child of the fork server, with the parts of :class:`subprocess.Popen` a launcher uses:
    ``pid``, ``args``, ``returncode``, ``poll``, ``wait``, ``send_signal``, ``terminate``, ``kill``.
    Its exit status comes over its own connection to the server (negative: the signal that ended it)."""

    def __init__(self, args: list[str], pid: int, conn: socket.socket) -> None:  # (Popen's own __init__ is not run)
        self.args, self.pid, self.returncode, self._conn = args, pid, None, conn
        self.stdin = self.stdout = self.stderr = None
        self._child_created = False  # (nothing for Popen's __del__ to reap)

    def poll(self) -> int | None:
        return self._status(0.0)

    def wait(self, timeout: float | None = None) -> int:  # type: ignore[override]
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            code = self._status(1.0 if left is None else min(left, 1.0))
            if code is not None:
                return code
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _status(self, timeout: float) -> int | None:
        if self.returncode is not None:
            return self.returncode
        if self._conn.fileno() < 0:  # the server went before it could say: the kernel sent its children SIGTERM
            if not _running(self.pid):
                self.returncode = -signal.SIGTERM
            elif timeout:
                time.sleep(min(timeout, 0.1))
            return self.returncode
        if not select.select([self._conn], [], [], timeout)[0]:
            return None
        line = _read_line(self._conn)
        self._conn.close()
        if line:
            self.returncode = int(line)
        return self.returncode if line else self._status(0.0)


class ForkServer:
    """The launcher's side: start the server once, then :meth:`spawn` potluck processes from it."""

    def __init__(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="potluck-fork-")
        self.path = os.path.join(self._dir, "sock")
        self._lock = threading.Lock()
        env = {**os.environ, DIE_WITH_ENV: str(os.getpid()), "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([sys.executable, "-P", "-m", "potluck.forkserver", self.path], env=env,
                                     start_new_session=True, stdin=subprocess.DEVNULL)

    def spawn(self, argv: list[str], log_path: str | Path, env: dict[str, str], timeout: float = 120.0) -> Forked:
        """Fork ``potluck ARGV`` with ``env``, its output appended to ``log_path``; waits for the server to be
        ready the first time (its imports)."""
        deadline = time.monotonic() + timeout
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        while True:
            try:
                conn.connect(self.path)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    conn.close()
                    raise OSError(f"the fork server is not serving (exit code {self.proc.poll()})") from None
                time.sleep(0.05)
        request = {"argv": list(argv), "env": env, "cwd": os.getcwd(), "log": str(log_path)}
        conn.sendall(json.dumps(request).encode() + b"\n")
        reply = _read_line(conn, deadline - time.monotonic())
        if not reply.lstrip("-").isdigit():
            conn.close()
            raise OSError(f"the fork server could not start the process: {reply or 'no answer'}")
        return Forked([sys.executable, "-P", "-m", "potluck", *argv], int(reply), conn)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(5)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        with contextlib.suppress(OSError):
            os.unlink(self.path)
            os.rmdir(self._dir)


def _read_line(conn: socket.socket, timeout: float | None = None) -> str:
    conn.settimeout(timeout)
    data = b""
    try:
        while not data.endswith(b"\n"):
            chunk = conn.recv(4096)
            if not chunk:
                break
            data += chunk
    except (TimeoutError, OSError):
        pass
    return data.decode(errors="replace").strip()


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


# ------------------------------------------------------------------------------------------ the server


def _serve(path: str) -> None:
    from potluck.protos.net import hivemindenv
    from potluck.protos.runtime.stopping import die_with_launcher

    die_with_launcher()
    hivemindenv.apply()  # (what a child would set before importing hivemind: it is imported here, once)
    for name in PRELOAD:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():  # a forked child could not use CUDA: start none
        print("potluck fork server: CUDA was initialized by the imports; launchers start fresh interpreters",
              file=sys.stderr)
        sys.exit(3)
    waiting: dict[int, socket.socket] = {}  # child pid -> the connection its status goes back on
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path + ".tmp")
    server.listen(64)
    os.rename(path + ".tmp", path)  # (the path appears once the imports are done and it listens)
    watched: list[socket.socket | int] = [server, wake_r]
    while True:
        ready = select.select(watched, [], [], 1.0)[0]
        if wake_r in ready:
            with contextlib.suppress(BlockingIOError):
                os.read(wake_r, 512)
        _reap(waiting)
        if server in ready:
            conn, _ = server.accept()
            try:
                request = json.loads(_read_line(conn, 10.0))
                log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            except Exception as err:  # a malformed request, a log it cannot open: say so, serve the next one
                with contextlib.suppress(OSError):
                    conn.sendall(f"error: {type(err).__name__}: {err}\n".encode())
                conn.close()
                continue
            try:
                pid = os.fork()
            except OSError as err:
                os.close(log)
                conn.sendall(f"error: cannot fork: {err}\n".encode())
                conn.close()
                continue
            if pid == 0:
                _child(request, log, [server, conn, *waiting.values()], (wake_r, wake_w))
            os.close(log)
            waiting[pid] = conn
            conn.sendall(f"{pid}\n".encode())


def _reap(waiting: dict[int, socket.socket]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = waiting.pop(pid, None)
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
            conn.close()


def _child(request: dict[str, Any], log: int, close: list[socket.socket], fds: tuple[int, int]) -> None:
    """In the forked child: become ``python -P -m potluck ARGV`` and never return."""
    code = 1
    try:
        os.setsid()
        signal.set_wakeup_fd(-1)
        for s in close:
            s.close()
        for fd in fds:
            os.close(fd)
        for sig in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        os.environ[DIE_WITH_ENV] = str(os.getppid())  # (the server: it dies with the launcher)
        sys.argv = [str(Path(__file__).with_name("__main__.py")), *request["argv"]]  # (as ``-m potluck`` sets it)
        for name in [m for m in sys.modules if m == "potluck" or m.startswith("potluck.")]:
            del sys.modules[name]  # potluck's own modules read the environment: each is imported anew, here
        own_locks()
        from potluck.cli import main

        code = main(request["argv"])
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        exit_process(code)  # (as the interpreter would, less its teardown)


def own_locks() -> None:
    """Give this process hivemind's process-wide ``multiprocessing`` locks of its own, as a fresh interpreter has.

    hivemind makes them when it is imported, to share with the processes it forks (a peer and its DHT process);
    every child of the server would share the server's with every other child: each process's futures would
    wait on everyone's, and one SIGKILLed while it held one would hang every DHT start after it."""
    import multiprocessing as mp

    mpfuture, aio = sys.modules.get("hivemind.utils.mpfuture"), sys.modules.get("hivemind.utils.asyncio")
    if mpfuture is not None:
        mpfuture.MPFuture.reset_backend()  # (the three locks, anew; no future exists yet here)
    if aio is not None:
        aio._AsyncContextWrapper.EXECUTOR_LOCK = mp.Lock()


if __name__ == "__main__":
    _serve(sys.argv[1])
