"""A wrong join address says what is wrong at once (issue 45): who answers there is asked with the first half
of libp2p's handshake (:mod:`potluck.protos.net.probe`), against real hivemind DHT nodes, an HTTP server and a
port nobody listens on; and ``potluck peer`` says it in one line, before torch, hivemind or gRPC load."""

from __future__ import annotations

import http.server
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from potluck.protos.net.identity import Identity
from potluck.protos.net.probe import Answer, Kind, explain, probe


def closed_port() -> int:
    """A port on 127.0.0.1 that was free a moment ago and that nobody listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def dht_node() -> Iterator[tuple[int, str]]:
    """A real hivemind DHT node, as a coordinator runs one: (its port, its peer id)."""
    from potluck.protos.net.swarm import SwarmNode

    me = Identity.generate()
    node = SwarmNode(me, coordinator=me.peer_id, host="127.0.0.1", port=0, announce_host="127.0.0.1")
    try:
        port = next(int(m.split("/")[4]) for m in node.maddrs if "/ip4/127.0.0.1/" in m)
        yield port, me.peer_id
    finally:
        node.shutdown()


def test_a_dht_node_answers_with_its_own_id(dht_node: tuple[int, str]) -> None:
    port, peer_id = dht_node
    answer = probe("127.0.0.1", port)
    assert answer == Answer(Kind.PEER, peer_id=peer_id)
    assert explain("a", "127.0.0.1", port, peer_id, answer) == ""  # the right node: joining goes on as before


def test_another_runs_node_is_named(dht_node: tuple[int, str]) -> None:
    port, peer_id = dht_node
    mine = Identity.generate().peer_id  # the coordinator an old join address names
    said = explain("a", "127.0.0.1", port, mine, probe("127.0.0.1", port))
    assert said.startswith(f"another node answers at 127.0.0.1:{port}: {peer_id}, not the coordinator the join "
                           f"address names ({mine})"), said


def test_nobody_listening_is_said() -> None:
    port = closed_port()
    answer = probe("127.0.0.1", port)
    assert answer.kind is Kind.NOBODY
    said = explain("a", "127.0.0.1", port, Identity.generate().peer_id, answer)
    assert said.startswith(f"nothing listens at 127.0.0.1:{port}, the join address's (connection refused)"), said


def test_a_port_that_is_not_a_dht_node_is_said() -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        port = server.server_address[1]
        answer = probe("127.0.0.1", port)
        assert answer.kind is Kind.OTHER, answer
        said = explain("a", "127.0.0.1", port, Identity.generate().peer_id, answer)
        assert said.startswith(f"127.0.0.1:{port} is not a potluck node"), said
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_a_node_that_never_answers_is_not_an_error() -> None:
    """Accepted and silent (a node swamped, a middlebox): unknown, so the peer joins as before and says more
    only if that fails."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        answer = probe("127.0.0.1", listener.getsockname()[1], timeout_s=0.2)
    assert answer.kind is Kind.UNKNOWN, answer
    assert explain("a", "127.0.0.1", 1, Identity.generate().peer_id, answer) == ""


def test_garbage_after_the_multistream_header_is_not_an_error() -> None:
    """A node that answers libp2p's header and then junk is read as unknown or other, never raised."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()

        def answer_junk() -> None:
            conn, _ = listener.accept()
            with conn:
                conn.recv(64)
                conn.sendall(bytes([19]) + b"/multistream/1.0.0\n" + bytes([7]) + b"/noise\n" + b"\x00\x60" + b"\x01" * 96)
                conn.recv(64)

        thread = threading.Thread(target=answer_junk, daemon=True)
        thread.start()
        answer = probe("127.0.0.1", listener.getsockname()[1])
        thread.join(timeout=30)
    assert answer.kind in (Kind.OTHER, Kind.UNKNOWN), answer


SAYS = """
import sys
from potluck.cli import main
rc = main(sys.argv[1:])
heavy = sorted(m for m in ("torch", "hivemind", "grpc") if m in sys.modules)
print(rc, ",".join(heavy) or "-")
"""


@pytest.mark.parametrize("case", ["nobody", "another"])
def test_potluck_peer_says_what_is_wrong_before_anything_heavy_loads(tmp_path: Path, dht_node: tuple[int, str],
                                                                     case: str) -> None:
    """``potluck peer --join`` an address nobody listens at, or another run's: one line, exit status 2, none
    of torch, hivemind or gRPC loaded (so it is said in well under a second), nothing written."""
    port = closed_port() if case == "nobody" else dht_node[0]
    old = Identity.generate().peer_id
    argv = ["peer", "--join", f"/ip4/127.0.0.1/tcp/{port}/p2p/{old}", "--identity", str(tmp_path / "peer.key")]
    Identity.generate().save(tmp_path / "peer.key")
    before = sorted(tmp_path.rglob("*"))
    done = subprocess.run([sys.executable, "-c", SAYS, *argv], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.stdout == "2 -\n", (done.stdout, done.stderr)
    assert len(done.stderr.splitlines()) == 1, done.stderr
    says = (f"nothing listens at 127.0.0.1:{port}" if case == "nobody"
            else f"another node answers at 127.0.0.1:{port}: {dht_node[1]}")
    assert says in done.stderr, done.stderr
    assert sorted(p for p in tmp_path.rglob("*") if not p.name.endswith(".lock")) == before
