"""Refusals: how a potluck handler says no, how the caller reads it back, and how the server logs it.

A handler raises :class:`Rejected` with a ``pb.Refusal`` code and a reason for humans; the server
sends it as a gRPC status (``STATUS_OF``) with a :class:`pb.RefusalInfo` in the trailing metadata,
which the caller reads back with :func:`refusal_of`: callers branch on the code, never on the text.
:func:`is_unreachable`, :func:`is_silent` and :func:`rpc_reason` sort out the other ways a call fails.

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

import grpc

from potluck.protos import potluck_pb2 as pb
from potluck.protos.runtime.log import get_logger, short_id

log = get_logger(__name__)

# The gRPC status each refusal travels under: the code gRPC documents for the case, so that a
# status alone still reads right to a generic client. UNAVAILABLE is never used for a refusal: it
# means "the receiver is gone" (connection refused or reset), see :func:`is_unreachable`.
STATUS_OF: dict[int, grpc.StatusCode] = {
    pb.UNKNOWN_RUN: grpc.StatusCode.PERMISSION_DENIED,
    pb.WRONG_STEP: grpc.StatusCode.FAILED_PRECONDITION,
    pb.WRONG_EPOCH: grpc.StatusCode.FAILED_PRECONDITION,
    pb.BASE_MISMATCH: grpc.StatusCode.FAILED_PRECONDITION,
    pb.NOT_A_MEMBER: grpc.StatusCode.PERMISSION_DENIED,
    pb.NOT_OWNER: grpc.StatusCode.INVALID_ARGUMENT,
    pb.ALREADY_REDUCED: grpc.StatusCode.FAILED_PRECONDITION,
    pb.TAKEN_OVER: grpc.StatusCode.ABORTED,
    pb.DUPLICATE: grpc.StatusCode.ALREADY_EXISTS,
    pb.NOT_YET: grpc.StatusCode.FAILED_PRECONDITION,
    pb.BUFFER_MISS: grpc.StatusCode.FAILED_PRECONDITION,
    pb.BAD_MESSAGE: grpc.StatusCode.INVALID_ARGUMENT,
    pb.NO_STATE: grpc.StatusCode.NOT_FOUND,
    pb.UNSUPPORTED: grpc.StatusCode.UNIMPLEMENTED,
    pb.OVERLOADED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    pb.BAD_IDENTITY: grpc.StatusCode.UNAUTHENTICATED,
    pb.OVERCLAIM: grpc.StatusCode.PERMISSION_DENIED,
}
REFUSAL_KEY = "potluck-refusal-bin"


class Rejected(Exception):
    """Raised by a handler to refuse a message: a :class:`pb.Refusal` code and a reason for humans.

    It reaches the sender as a gRPC error whose status is ``STATUS_OF[refusal]`` and whose trailing
    metadata carries a :class:`pb.RefusalInfo` (read it back with :func:`refusal_of`).
    """

    def __init__(self, refusal: int, reason: str, sender: str = "", *, at_step: int = 0, at_epoch: int = 0) -> None:
        super().__init__(reason)
        if refusal not in STATUS_OF:
            raise ValueError(f"unknown refusal {refusal!r}")
        self.refusal, self.reason, self.sender = refusal, reason, sender
        self.at_step, self.at_epoch = at_step, at_epoch

    @property
    def code(self) -> grpc.StatusCode:
        return STATUS_OF[self.refusal]

    def info(self) -> pb.RefusalInfo:
        return pb.RefusalInfo(code=self.refusal, at_step=self.at_step, at_epoch=self.at_epoch)  # type: ignore[arg-type]


def refusal_of(err: grpc.RpcError) -> pb.RefusalInfo | None:
    """The refusal a potluck handler attached to ``err``; None for transport errors (and garbage)."""
    try:
        metadata = err.trailing_metadata() or ()  # type: ignore[attr-defined]
    except Exception:  # not a call error (e.g. a test double)
        return None
    for key, value in metadata:
        if key == REFUSAL_KEY and isinstance(value, bytes):
            info = pb.RefusalInfo()
            try:
                info.ParseFromString(value)
            except Exception:
                return None
            return info if info.code != pb.REFUSAL_UNSPECIFIED else None
    return None


def refused(err: grpc.RpcError, *codes: int) -> bool:
    """True when ``err`` is a refusal with one of ``codes``."""
    info = refusal_of(err)
    return info is not None and info.code in codes


def is_unreachable(err: grpc.RpcError) -> bool:
    """True when the other side is gone (connection refused/reset), not merely slow or refusing."""
    return err.code() == grpc.StatusCode.UNAVAILABLE and refusal_of(err) is None  # type: ignore[attr-defined]


def is_silent(err: grpc.RpcError) -> bool:
    """True when the other side did not answer in time (stopped, overloaded or far away)."""
    return err.code() == grpc.StatusCode.DEADLINE_EXCEEDED  # type: ignore[attr-defined]


def rpc_reason(err: grpc.RpcError) -> str:
    """``STATUS: details`` of an RPC error, for logs (never parsed: see :func:`refusal_of`)."""
    code = err.code()  # type: ignore[attr-defined]
    info = refusal_of(err)
    name = pb.Refusal.Name(info.code) if info is not None else (code.name if code else "UNKNOWN")
    return f"{name}: {err.details()}"  # type: ignore[attr-defined]

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
