"""Faults injected at named points of a real process, for tests (like torchft's FailureInjector).

Tests drive the failure they fear at an exact step instead of polling for a random moment. A process
started with ``POTLUCK_FAULTS`` set acts on it when it reaches a named point::

    POTLUCK_FAULTS="allreduce.reduced@3:stop"            freeze (SIGSTOP) after reducing its shard of step 3
    POTLUCK_FAULTS="inner.mid@4:kill,outer.committed@6:exit"

A peer can also be made Byzantine at ``outer.delta`` (its pseudo-gradient, before it is sent):
``outer.delta@*:scale=1000``, ``:flip`` (sign-flipped) or ``:nan``; these act at every matching
step (:func:`tamper`), for the attack tests and ``benchmarks/poisoning.py``. The same mechanism makes a
peer slow from a step on, as a weaker or shared device is: ``inner.step@5+:slow=8`` makes each of its inner
steps take 8 times as long (it sleeps the difference: its CPU is free meanwhile, as a GPU-bound host's is).

Each entry is ``point@step:action``; ``step`` may be ``*`` (any) or ``N+`` (step N or the first
after it the process reaches: a peer that was recovering during step N does not miss it). Actions: ``kill`` (SIGKILL this
process and, if it leads its process group, the whole group: its DHT child and p2pd, like a machine
losing power), ``stop`` (SIGSTOP likewise: a frozen machine, until someone sends SIGCONT), ``exit``
(exit at once, status 3), ``hang`` (block this thread forever), ``sleep=SECONDS``, ``spin=SECONDS``
(keep this thread busy in Python bytecode for SECONDS of its own CPU time, holding the GIL as a CPU-bound search
does). Every entry fires
once. The points are listed in ``POINTS``; code calls :func:`fault` at each of them. A few points take an
action that changes what the code there does instead (:data:`BEHAVIOURS`, read with :func:`injected`):
``pipe.send@N:oversize`` sends one pipeline message of step N with a piece over gRPC's size cap, a send that
can never succeed.

Without the variable this module does nothing but one dictionary lookup per call.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

from potluck.protos.runtime.log import get_logger

log = get_logger(__name__)

ENV = "POTLUCK_FAULTS"
POINTS = {
    "inner.start": "a peer starts the inner steps of an outer step",
    "inner.mid": "a peer is half way through the inner steps",
    "outer.start": "a peer enters the outer step (before the all-reduce)",
    "allreduce.reduced": "an owner has averaged its shard, before handing the result to anyone",
    "outer.committed": "a peer has committed the outer step",
    "recover.fetched": "a peer has fetched a state it recovers, before adopting it",
    "coordinator.decided": "the coordinator has decided (and journaled) a round",
    "coordinator.committed": "the coordinator has seen a step committed",
    "outer.delta": "a peer's pseudo-gradient before it is sent (tamper actions only)",
    "placement.search": "the coordinator's placement worker starts a search (on its own thread)",
    "shutdown.start": "a peer or the coordinator begins its orderly shutdown (on the main thread)",
    "dht.start": "a DHT process starts (its step: the process's DHT start count, 1 for the first)",
    "pipe.send": "a stage sends a pipeline message of an outer step (the oversize action only)",
    "owner.mean": "an owner's average of its shard, before it is encoded and signed (tamper actions only)",
    "owner.weight": "the weight an owner gives its own contribution in its average (tamper actions only)",
    "outer.samples": "the samples a member claims its contribution was trained on (tamper actions only)",
    "inner.step": "each inner step of a peer (slow=F: the step takes F times as long, as on a slower device)",
    "owner.flags": "an owner's signed outcome: whom it says it clipped (the flag action only)",
    "owner.refuse": "the contributions an owner is sent (all: each refused, OVERLOADED, but its own), in tests",
    "audit.verdict": "an auditor's verdict (ok: it says ok whatever it found, colluding with the owner), in tests",
    "owner.drop": "the contributions an owner averages, after it receipted them (others: all but its own; one: the "
                  "first other), in tests of omission proofs",
    "outer.report": "a member's step report to the coordinator (the flag action only)",
}
# tamper actions each point takes: they change a value as a Byzantine peer would send it (see tamper)
TAMPERS = {"outer.delta": ("flip", "nan", "scale="), "owner.mean": ("shift=", "scale=", "flip", "spike"),
           "owner.flags": ("flag",), "outer.report": ("flag",), "owner.weight": ("scale=",),
           "outer.samples": ("scale=",), "inner.step": ("slow=",), "owner.drop": ("others", "one"), "audit.verdict": ("ok",), "owner.refuse": ("all",)}
TAMPER = ("flip", "nan", "spike", "flag", "others", "one", "ok", "all")
# actions that change what the code at a point does, once, instead of acting on the process (see injected)
BEHAVIOURS = {"pipe.send": ("oversize",)}


class FaultSpecError(ValueError):
    """A ``POTLUCK_FAULTS`` value that cannot be parsed."""


Fault = tuple[str, int | None, bool, str]  # point, step (None: any), or-later, action


def parse(spec: str) -> list[Fault]:
    out = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        try:
            where, action = item.split(":", 1)
            point, step = where.split("@", 1)
        except ValueError:
            raise FaultSpecError(f"{ENV} entry {item!r} is not point@step:action") from None
        if point not in POINTS:
            raise FaultSpecError(f"{ENV}: unknown point {point!r} (known: {', '.join(sorted(POINTS))})")
        tampers = action in TAMPER or action.startswith(("scale=", "shift=", "slow="))
        if point in BEHAVIOURS or action in {a for acts in BEHAVIOURS.values() for a in acts}:
            if action not in BEHAVIOURS.get(point, ()):
                raise FaultSpecError(f"{ENV}: {point!r} takes {' or '.join(BEHAVIOURS.get(point, ('no',)))}, "
                                     f"not {action!r}")
        elif not (tampers or action in ("kill", "stop", "exit", "hang") or action.startswith(("sleep=", "spin="))):
            raise FaultSpecError(f"{ENV}: unknown action {action!r}")
        if tampers != (point in TAMPERS) or (tampers and not any(
                action == t or (t.endswith("=") and action.startswith(t)) for t in TAMPERS[point])):
            takes = "; ".join(f"{p} takes {', '.join(a + ('X' if a.endswith('=') else '') for a in acts)}"
                              for p, acts in TAMPERS.items())
            raise FaultSpecError(f"{ENV}: {action!r} cannot act at {point!r} ({takes}; the other points kill, stop, "
                                 "exit, hang, sleep=S or spin=S)")
        try:
            float(action.split("=", 1)[1]) if "=" in action else None
        except ValueError:
            raise FaultSpecError(f"{ENV}: {action!r} needs a number after '='") from None
        try:
            first = None if step == "*" else int(step.rstrip("+"))
        except ValueError:
            raise FaultSpecError(f"{ENV}: step {step!r} is not a number, N+ or *") from None
        out.append((point, first, step.endswith("+"), action))
    return out


_lock = threading.Lock()
_pending = parse(os.environ.get(ENV, ""))


def matches(f: Fault, point: str, step: int | None) -> bool:
    return f[0] == point and (f[1] is None or f[1] == step or (f[2] and step is not None and step >= f[1]))


def fault(point: str, step: int | None = None) -> None:
    """Act on the first pending fault for ``point`` (and ``step``), if any."""
    if not _pending:
        return
    with _lock:
        hit = next((f for f in _pending if matches(f, point, step)), None)
        if hit is None:
            return
        _pending.remove(hit)
    action = hit[3]
    log.warning("fault injected at %s (step %s): %s", point, step, action)
    if action in ("kill", "stop"):
        sig = signal.SIGKILL if action == "kill" else signal.SIGSTOP
        if os.getpgrp() == os.getpid():
            os.killpg(os.getpid(), sig)
        else:
            os.kill(os.getpid(), sig)
    elif action == "exit":
        os._exit(3)
    elif action == "hang":
        threading.Event().wait()
    elif action.startswith("spin="):  # (its own CPU time, not the clock's: on a loaded box it runs longer, never less)
        end = time.thread_time() + float(action.split("=", 1)[1])
        while time.thread_time() < end:
            sum(i * i for i in range(1000))
    else:
        time.sleep(float(action.split("=", 1)[1]))


def injected(point: str, step: int | None, action: str) -> bool:
    """Whether a pending fault asks the code at ``point`` to do ``action`` now (each entry once)."""
    if not _pending:
        return False
    with _lock:
        hit = next((f for f in _pending if f[3] == action and matches(f, point, step)), None)
        if hit is None:
            return False
        _pending.remove(hit)
    log.warning("fault injected at %s (step %s): %s", point, step, action)
    return True


def tamper(point: str, step: int, x: Any, offset: int = 0, pending: list[Fault] | None = None) -> Any:
    """``x`` as a Byzantine peer would send it, if ``POTLUCK_FAULTS`` makes this one (else ``x``); acts at every
    matching step. ``offset``: where a piece of a vector starts (``spike`` sets the vector's first element to 1e6;
    ``flag`` returns True, for the caller to name its honest peers). ``pending``: faults of one object instead of
    the process's (a test's one Byzantine member among honest ones in one process)."""
    for f in _pending if pending is None else pending:
        if matches(f, point, step):
            action = f[3]
            if action == "flip":
                return -x
            if action == "nan":
                return x * float("nan")
            if action.startswith("scale="):
                return x * float(action.split("=", 1)[1])
            if action.startswith("shift="):
                return x + float(action.split("=", 1)[1])
            if action == "spike":
                if offset == 0 and len(x):
                    x = x.clone()
                    x[0] = 1e6
                return x
            if action in ("flag", "ok", "all"):
                return True
            if action in ("others", "one"):
                return action
            if action.startswith("slow="):
                return float(action.split("=", 1)[1])
    return x
