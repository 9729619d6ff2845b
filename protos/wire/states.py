"""One vocabulary for what a peer is doing: its records, telemetry and pings, the all-reduce's view of a
member, the coordinator and the page all use :class:`PeerState`."""

from __future__ import annotations

from enum import StrEnum


class PeerState(StrEnum):
    """What a peer is doing: one vocabulary for its records, its telemetry and pings, the all-reduce's view of
    a member, the coordinator and the page (the values are what the JSON and the page show)."""

    JOINING = "joining"  # admitted, loading or fetching its first state
    RECOVERING = "recovering"  # fetching a newer state after it missed or failed a step
    TRAINING = "training"  # inner steps
    SYNCING = "syncing"  # the outer step (all-reduce)
    WAITING = "waiting"  # holding a state, waiting for a round that names it
    LEFT = "left"  # said goodbye
    LOST = "lost"  # the coordinator stopped hearing from it (never in a peer's own record)
    FINISHED = "finished"  # the run ended and this peer saw it
    FAILED = "failed"  # stopped on an error it cannot heal (its record's ``error`` says which)
    REFUSED = "refused"  # admitted, then found it cannot take part (too little memory, say): its ``error`` says why


# ended its part on purpose (a goodbye, or the run's end); with FAILED and REFUSED: this process takes no part again
SAID_GOODBYE = frozenset({PeerState.LEFT, PeerState.FINISHED})
GONE = SAID_GOODBYE | {PeerState.FAILED, PeerState.REFUSED}
# not there as the coordinator sees it: gone, or silent past the heartbeat timeout
ABSENT = GONE | {PeerState.LOST}

# a member that will not contribute to the running step (yet): the all-reduce stops waiting for it, unless
# it is only catching up to the round's base state (then it is waited for within the grace period)
NOT_PARTICIPATING = frozenset({PeerState.JOINING, PeerState.RECOVERING, PeerState.LEFT, PeerState.WAITING})
CATCHING_UP = frozenset({PeerState.JOINING, PeerState.RECOVERING, PeerState.WAITING})
