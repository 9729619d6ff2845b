"""Who answers at a join address, asked in well under a second, before a peer starts its DHT node.

A wrong join address used to cost a new volunteer a DHT start and a generic "check that the
coordinator is running" seconds later. The two mistakes people make most are told apart here:

* nothing listens at ``HOST:PORT`` (the connection is refused, or no route leads there): a coordinator
  that is not running, or an address from before its operator moved it to other ports;
* another node answers: a coordinator of another run (a restarted one with a new key, an address
  from an old run), or a port that is not a DHT node at all (the status page's, say).

To learn *who* answers, this speaks the first half of libp2p's handshake, as any libp2p node would:
multistream-select to ``/noise``, then Noise XX (``Noise_XX_25519_ChaChaPoly_SHA256``) up to the
responder's second message, which carries its identity key in a payload encrypted to our ephemeral
key. Nothing is authenticated or sent after that: the answer only explains an error, and an address
whose node is the one the address names goes on to join exactly as before (where the DHT, the
manifest and admission check everything). A node that is slow to answer, or speaks something this
does not know, makes the answer ``UNKNOWN``, never an error.

Imports only the standard library and ``cryptography`` (already loaded for identities).
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import socket
import time
from dataclasses import dataclass
from enum import Enum

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from potluck.protos.net.identity import peer_id_from_public_key

PROBE_TIMEOUT_S = 1.0
_MULTISTREAM = b"/multistream/1.0.0\n"
_NOISE = b"/noise\n"
_PROTOCOL = b"Noise_XX_25519_ChaChaPoly_SHA256"  # 32 bytes: it is h's first value as it is
_ED25519 = 1  # libp2p's KeyType


class Kind(Enum):
    NOBODY = "nobody"  # connection refused, or no route to the host: nothing listens there
    PEER = "peer"  # a libp2p node answered with its id
    OTHER = "other"  # something answered that does not speak libp2p
    UNKNOWN = "unknown"  # no answer in time, or one this probe could not read


@dataclass(frozen=True)
class Answer:
    kind: Kind
    peer_id: str = ""  # Kind.PEER: the id of the node that answered
    detail: str = ""  # what was seen, for the message


class _Unread(Exception):
    """The answer was not one this probe reads."""


def probe(host: str, port: int, timeout_s: float = PROBE_TIMEOUT_S) -> Answer:
    """Who listens at ``host:port``; returns within about ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    try:
        sock = socket.create_connection((host, port), timeout=timeout_s)
    except ConnectionRefusedError:
        return Answer(Kind.NOBODY, detail="connection refused")
    except TimeoutError:
        return Answer(Kind.UNKNOWN, detail=f"no answer in {timeout_s:.0f} s")
    except OSError as err:
        if err.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
            return Answer(Kind.NOBODY, detail=err.strerror or "no route to the host")
        return Answer(Kind.UNKNOWN, detail=err.strerror or str(err))
    with sock:
        try:
            return Answer(Kind.PEER, peer_id=_handshake(sock, deadline))
        except _Unread as err:
            return Answer(Kind.OTHER, detail=str(err))
        except TimeoutError:
            return Answer(Kind.UNKNOWN, detail=f"no libp2p answer in {timeout_s:.0f} s")
        except (OSError, ValueError) as err:
            return Answer(Kind.UNKNOWN, detail=str(err))


def _handshake(sock: socket.socket, deadline: float) -> str:
    """The responder's libp2p peer id, from the first two messages of a Noise XX handshake."""
    reader = _Reader(sock, deadline)
    sock.sendall(_lp(_MULTISTREAM) + _lp(_NOISE))
    first = reader.lp()
    if first != _MULTISTREAM:
        raise _Unread(f"it does not speak libp2p (it began {first[:24]!r})")
    if reader.lp() != _NOISE:
        raise _Unread("a libp2p node that does not speak Noise")
    state = _Symmetric()
    e = X25519PrivateKey.generate()
    e_pub = e.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    state.mix_hash(e_pub)
    state.mix_hash(b"")  # our payload: empty, as libp2p's initiator sends
    sock.sendall(len(e_pub).to_bytes(2, "big") + e_pub)
    msg = reader.exactly(int.from_bytes(reader.exactly(2), "big"))
    if len(msg) < 32 + 48 + 16:
        raise _Unread("a Noise answer too short to carry an identity")
    re = msg[:32]
    state.mix_hash(re)
    state.mix_key(e.exchange(X25519PublicKey.from_public_bytes(re)))
    rs = state.decrypt_and_hash(msg[32:80])
    state.mix_key(e.exchange(X25519PublicKey.from_public_bytes(rs)))
    payload = state.decrypt_and_hash(msg[80:])
    key = _field(payload, 1)  # NoiseHandshakePayload.identity_key: a protobuf PublicKey
    if _varint_field(key, 1) != _ED25519:
        raise _Unread("a libp2p node whose identity is not an Ed25519 key")
    return peer_id_from_public_key(_field(key, 2))


class _Symmetric:
    """Noise's SymmetricState, as far as a responder's second message needs it."""

    def __init__(self) -> None:
        self.h = self.ck = _PROTOCOL
        self.k: bytes | None = None
        self.n = 0
        self.mix_hash(b"")  # the prologue: empty

    def mix_hash(self, data: bytes) -> None:
        self.h = hashlib.sha256(self.h + data).digest()

    def mix_key(self, ikm: bytes) -> None:
        temp = hmac.new(self.ck, ikm, hashlib.sha256).digest()
        self.ck = hmac.new(temp, b"\x01", hashlib.sha256).digest()
        self.k, self.n = hmac.new(temp, self.ck + b"\x02", hashlib.sha256).digest(), 0

    def decrypt_and_hash(self, data: bytes) -> bytes:
        assert self.k is not None
        try:
            plain = ChaCha20Poly1305(self.k).decrypt(b"\0\0\0\0" + self.n.to_bytes(8, "little"), data, self.h)
        except Exception as err:  # (cryptography's InvalidTag): not a Noise XX answer to our message
            raise _Unread("a Noise answer this probe cannot read") from err
        self.n += 1
        self.mix_hash(data)
        return plain


class _Reader:
    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock, self.deadline, self.buf = sock, deadline, b""

    def exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            self.sock.settimeout(left)
            chunk = self.sock.recv(65536)
            if not chunk:
                raise _Unread("it closed the connection")
            self.buf += chunk
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def lp(self) -> bytes:
        """One uvarint-length-prefixed multistream message."""
        n, shift = 0, 0
        for _ in range(3):
            b = self.exactly(1)[0]
            n |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                break
        else:
            raise _Unread("it does not speak libp2p")
        if n > 1024:
            raise _Unread("it does not speak libp2p")
        return self.exactly(n)


def _lp(msg: bytes) -> bytes:
    return bytes([len(msg)]) + msg  # (every message here is under 128 bytes)


def _fields(data: bytes) -> dict[int, bytes | int]:
    """A protobuf message's top-level fields (varints and length-delimited ones; the last of each wins)."""
    out: dict[int, bytes | int] = {}
    i = 0
    while i < len(data):
        tag, i = _varint(data, i)
        number, wire = tag >> 3, tag & 7
        if wire == 0:
            out[number], i = _varint(data, i)
        elif wire == 2:
            n, i = _varint(data, i)
            if i + n > len(data):
                raise _Unread("a truncated handshake payload")
            out[number], i = data[i : i + n], i + n
        else:
            raise _Unread("a handshake payload this probe cannot read")
    return out


def _varint(data: bytes, i: int) -> tuple[int, int]:
    n, shift = 0, 0
    while i < len(data):
        b = data[i]
        i += 1
        n |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return n, i
    raise _Unread("a truncated handshake payload")


def _field(data: bytes, number: int) -> bytes:
    value = _fields(data).get(number)
    if not isinstance(value, bytes):
        raise _Unread("a handshake payload without an identity key")
    return value


def _varint_field(data: bytes, number: int) -> int:
    value = _fields(data).get(number, 0)  # (0 is protobuf's default, and libp2p's RSA)
    return value if isinstance(value, int) else -1


def explain(address: str, host: str, port: int, coordinator: str, answer: Answer) -> str:
    """What is wrong with the join ``address``, given who answered there ('' if nothing is known to be)."""
    if answer.kind is Kind.NOBODY:
        return (f"nothing listens at {host}:{port}, the join address's ({answer.detail}): the coordinator is not running "
                "there, or it listens on other ports now; copy the join address it printed when it started (its "
                "status page shows it too)")
    if answer.kind is Kind.PEER and answer.peer_id != coordinator:
        return (f"another node answers at {host}:{port}: {answer.peer_id}, not the coordinator the join address "
                f"names ({coordinator}); it is another run's (or this run's coordinator started again without its "
                "journal, with a new id): copy the join address the coordinator printed when it started")
    if answer.kind is Kind.OTHER:
        return (f"{host}:{port} is not a potluck node ({answer.detail}): the join address names the coordinator's "
                "DHT port, which the coordinator prints in its join address (not its status page's or gRPC port)")
    return ""
