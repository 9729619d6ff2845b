"""A run's join address, as the coordinator prints it and a peer passes it to ``--join``.

Checked before anything heavy loads or any DHT node starts, so a mistyped address is one line at once
(``potluck peer`` imports this module, not hivemind, to check it).
"""

from __future__ import annotations

from potluck.protos.net.identity import IdentityError, public_key_from_peer_id


class JoinError(RuntimeError):
    """Could not start a DHT node or reach the swarm; the message says what to check."""


def parse_join_address(address: str) -> tuple[str, str]:
    """Split ``/ip4/HOST/tcp/PORT/p2p/ID`` into (multiaddr, coordinator id); checks the id's key."""
    address = address.strip()
    parts = address.split("/")
    if "p2p" not in parts or parts.index("p2p") + 1 >= len(parts):
        raise JoinError(
            f"join address {address!r} has no /p2p/<coordinator id> part; copy the whole address "
            "the coordinator printed (it looks like /ip4/1.2.3.4/tcp/31337/p2p/12D3KooW...)"
        )
    coordinator = parts[parts.index("p2p") + 1]
    try:
        public_key_from_peer_id(coordinator)
    except IdentityError as err:
        raise JoinError(f"join address {address!r}: {err}") from None
    return address, coordinator


def host_port(address: str) -> tuple[str, int] | None:
    """The host and TCP port a join address names (``None`` for one that names no TCP port)."""
    parts = address.split("/")
    host = next((parts[i + 1] for i, p in enumerate(parts[:-1]) if p in ("ip4", "ip6", "dns", "dns4", "dns6")), None)
    port = parts[parts.index("tcp") + 1] if "tcp" in parts[:-1] else ""
    return (host, int(port)) if host and port.isdigit() else None
