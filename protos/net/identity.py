"""Identities and signatures: who wrote a record, and proof that they did.

Every process (coordinator or peer) owns an Ed25519 key. Its id is the libp2p peer id of that key
(``12D3KooW...``): an identity multihash that *contains* the public key, so anyone holding an id can
check a signature without asking anyone else. The coordinator uses the same key as the identity of
its hivemind DHT node, which makes the join address (``/ip4/.../p2p/<coordinator id>``) also the
key peers verify the run manifest and plans against: a record the coordinator did not sign is
rejected, whatever DHT node served it.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

_B58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
# libp2p: multihash(identity, len=36) of the protobuf PublicKey{key_type=Ed25519(1), data=<32 bytes>}
_ID_PREFIX = bytes([0x00, 0x24, 0x08, 0x01, 0x12, 0x20])
# libp2p: protobuf PrivateKey{key_type=Ed25519(1), data=<seed(32) || public(32)>}
_PRIVATE_PREFIX = bytes([0x08, 0x01, 0x12, 0x40])


class IdentityError(ValueError):
    """An id, key file or signature that is not what it claims to be."""


def b58encode(data: bytes) -> str:
    n = int.from_bytes(data, "big")
    out = ""
    while n:
        n, r = divmod(n, 58)
        out = _B58[r] + out
    pad = len(data) - len(data.lstrip(b"\0"))
    return "1" * pad + out


def b58decode(text: str) -> bytes:
    n = 0
    for ch in text:
        idx = _B58.find(ch)
        if idx < 0:
            raise IdentityError(f"invalid base58 character {ch!r} in {text!r}")
        n = n * 58 + idx
    body = n.to_bytes((n.bit_length() + 7) // 8, "big") if n else b""
    pad = len(text) - len(text.lstrip("1"))
    return b"\0" * pad + body


def peer_id_from_public_key(public: bytes) -> str:
    if len(public) != 32:
        raise IdentityError(f"an Ed25519 public key has 32 bytes, got {len(public)}")
    return b58encode(_ID_PREFIX + public)


def public_key_from_peer_id(peer_id: str) -> bytes:
    """The Ed25519 public key inside a ``12D3KooW...`` peer id (raises IdentityError otherwise)."""
    raw = b58decode(peer_id)
    if len(raw) != len(_ID_PREFIX) + 32 or not raw.startswith(_ID_PREFIX):
        if not peer_id.startswith("12D3KooW"):
            raise IdentityError(f"{peer_id!r} is not an Ed25519 peer id (those start with 12D3KooW)")
        if len(peer_id) != 52:  # every Ed25519 peer id is 52 base58 characters
            raise IdentityError(f"{peer_id!r} has {len(peer_id)} characters, an Ed25519 peer id has 52: "
                                "copy the whole id")
        raise IdentityError(f"{peer_id!r} starts like an Ed25519 peer id but does not decode to one: "
                            "check it for typos")
    return raw[len(_ID_PREFIX) :]


def verify(peer_id: str, data: bytes, signature: bytes) -> bool:
    """True when ``signature`` over ``data`` was made by the key of ``peer_id``."""
    try:
        _public_key(peer_id).verify(signature, data)
        return True
    except (InvalidSignature, IdentityError, ValueError):
        return False


@functools.lru_cache(maxsize=1 << 14)
def _public_key(peer_id: str) -> Ed25519PublicKey:
    """(Decoded once per peer: a coordinator verifies each of a thousand peers' heartbeats every few seconds, and
    the base58 decoding cost an eighth of each check. A peer id that does not decode raises, and is not kept.)"""
    return Ed25519PublicKey.from_public_bytes(public_key_from_peer_id(peer_id))


@dataclass(frozen=True)
class Identity:
    """An Ed25519 key pair and the peer id derived from it."""

    key: Ed25519PrivateKey

    @classmethod
    def generate(cls) -> Identity:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def load_or_create(cls, path: str | Path) -> Identity:
        """Load a libp2p-format key file, or create one (mode 0600) if it does not exist."""
        path = Path(path)
        if path.exists():
            raw = path.read_bytes()
            if len(raw) != len(_PRIVATE_PREFIX) + 64 or not raw.startswith(_PRIVATE_PREFIX):
                raise IdentityError(f"{path} is not an Ed25519 libp2p private key file")
            ident = cls(Ed25519PrivateKey.from_private_bytes(raw[len(_PRIVATE_PREFIX) : len(_PRIVATE_PREFIX) + 32]))
            if ident.public_bytes != raw[len(_PRIVATE_PREFIX) + 32 :]:
                raise IdentityError(f"{path}: the public half does not match the private key")
            return ident
        ident = cls.generate()
        ident.save(path)
        return ident

    def save(self, path: str | Path) -> None:
        """Write the key in libp2p's protobuf format, which hivemind's p2pd reads as its identity."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(_PRIVATE_PREFIX + self.private_seed + self.public_bytes)

    @property
    def private_seed(self) -> bytes:
        return self.key.private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
        )

    @property
    def public_bytes(self) -> bytes:
        return self.key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)

    @property
    def peer_id(self) -> str:
        return peer_id_from_public_key(self.public_bytes)

    def sign(self, data: bytes) -> bytes:
        return self.key.sign(data)
