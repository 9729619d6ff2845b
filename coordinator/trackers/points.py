"""What the experiment trackers log, read off the status snapshot: one pure function of ``/api/v1/state``.

The trackers show the run as the status page does, so they read the same snapshot
(:func:`potluck.coordinator.status.snapshot.build`) and nothing else. :func:`due` takes a snapshot and the
:class:`Cursor` of what was logged before, and returns the cursor moved on and the points to log: one
:class:`Step` per committed outer step (the step is the trackers' x axis) and one :class:`Event` per rollback,
failed round, eviction or end of the run. It reads no clock (``now`` is its argument), starts no thread and does
no I/O, so its tests need none.

When a step is logged. A history entry fills in from its members' reports, which keep coming after the
commit (a member's eval loss comes a moment after its step), so an entry is logged once it is final: when a
later step is committed (its members have moved on, and the coordinator folded their reports of this one on
that commit), or, for the run's last step, ``SETTLE_S`` after the run finished; a coordinator that stops logs
what it has (``final``). Each step is logged once, except a step a rollback undid and the run trained again:
its new entry (of a newer epoch) is logged at the same step, as a restarted TensorBoard run would be.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from potluck.protos.config.runconfig import RunConfig

SETTLE_S = 5.0  # the run's last step is logged this long after the run finished (its late reports folded in)
KINDS = ("activations", "gradients", "outer")  # the bytes a step sent, by kind (coordinator/rounds/history.py)
# the events the trackers show: what undid work (a failed round, a rollback), who was evicted and why, the end
EVENTS = {"failed": "failed", "rollback": "rollbacks", "evicted": "evictions", "proven": "evictions",
          "finished": "finished", "admin": "finished"}  # event kind -> what it counts as (``events/<that>``)


@dataclass(frozen=True)
class Step:
    """One committed outer step: ``metrics`` by name (``loss/train``...), each a finite number."""

    step: int
    t: float  # unix time the step was recorded (its history entry's)
    metrics: dict[str, float]


@dataclass(frozen=True)
class Event:
    """A rollback, failed round, eviction or the run's end, at the committed step it happened at."""

    step: int
    t: float
    kind: str
    peer: str
    message: str


@dataclass(frozen=True)
class Cursor:
    """What was logged so far: the newest step logged and its epoch, the events seen, their counts."""

    logged: int = 0  # the newest step logged (0: none; a coordinator starts at the step its journal holds)
    epoch: int = 0  # the epoch of the newest entry logged: an older step of a newer epoch was trained again
    events_t: float = 0.0  # the time of the newest event logged
    events_at_t: frozenset[tuple[str, str, str]] = frozenset()  # those of that very time (kind, peer, message)
    counts: dict[str, int] = field(default_factory=dict)  # events/<name> -> how many so far
    finished_at: float | None = None  # ``now`` when a snapshot first said the run finished


def config_values(cfg: RunConfig, run_id: str) -> dict[str, Any]:
    """The run's config as the trackers keep it, once: what every peer trains by (the manifest's sections, not the
    coordinator's own: its addresses and paths are no part of the experiment), flattened to dotted names."""
    flat: dict[str, Any] = {"run_id": run_id}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            flat[prefix] = value

    walk("", cfg.manifest_sections())
    return flat


def due(state: Mapping[str, Any], cursor: Cursor, now: float, final: bool = False,
        ) -> tuple[Cursor, list[Step | Event]]:
    """The points of ``state`` (a snapshot) not logged yet, in order, and the cursor past them. ``final``: the
    coordinator is stopping: every entry is logged as it is."""
    run = state.get("run") or {}
    committed = int(run.get("outer_step") or 0)
    finished_at = cursor.finished_at
    if run.get("finished") and finished_at is None:
        finished_at = now
    settled = final or (finished_at is not None and now - finished_at >= SETTLE_S)
    out: list[Step | Event] = []
    counts = dict(cursor.counts)
    events, events_t, at_t = _new_events(state.get("events") or (), cursor, committed)
    for ev in events:
        name = EVENTS[ev.kind]
        counts[name] = counts.get(name, 0) + 1
    out += events
    logged, epoch = cursor.logged, cursor.epoch
    for h in state.get("history") or ():
        step, h_epoch = int(h["step"]), int(h.get("epoch") or 0)
        if step <= logged and h_epoch <= epoch:
            continue  # (logged; a step of a newer epoch than the newest logged was trained again after a rollback)
        if step >= committed and not settled:
            break  # (the newest entry: its reports may still come)
        out.append(Step(step, float(h.get("t") or 0.0), step_metrics(h, state, counts)))
        logged, epoch = step, max(epoch, h_epoch)
    return replace(cursor, logged=logged, epoch=epoch, events_t=events_t, events_at_t=at_t, counts=counts,
                   finished_at=finished_at), out


def _new_events(events: Sequence[Mapping[str, Any]], cursor: Cursor, committed: int,
                ) -> tuple[list[Event], float, frozenset[tuple[str, str, str]]]:
    """The events of the kinds the trackers show that are newer than the cursor's (the list is in time order)."""
    fresh: list[Event] = []
    newest, at_t = cursor.events_t, set(cursor.events_at_t)
    for e in events:
        t = float(e.get("t") or 0.0)
        key = (str(e.get("kind", "")), str(e.get("peer", "")), str(e.get("message", "")))
        if t < cursor.events_t or t == cursor.events_t and key in cursor.events_at_t:
            continue
        if t > newest:
            newest, at_t = t, set()
        at_t.add(key)
        if key[0] in EVENTS:
            fresh.append(Event(committed, t, *key))
    return fresh, newest, frozenset(at_t)


def step_metrics(h: Mapping[str, Any], state: Mapping[str, Any], counts: Mapping[str, int]) -> dict[str, float]:
    """One history entry's figures, with the run's as the page shows them when it is logged; a figure the run
    does not have (no eval yet, a first step with no rate) is left out rather than logged as 0."""
    run = state.get("run") or {}
    out: dict[str, Any] = {
        "loss/train": h.get("loss"), "loss/eval": h.get("eval_loss"),
        "throughput/tokens_per_s": h.get("tokens_per_s"), "throughput/tokens": h.get("tokens"),
        "throughput/tokens_trained": run.get("tokens_trained"),
        "peers/live": (state.get("peers_summary") or {}).get("live"), "peers/members": h.get("members"),
        "time/outer_step_s": h.get("outer_s"), "time/allreduce_s": h.get("allreduce_s"),
        "time/window_s": h.get("window_s"), "run/epoch": h.get("epoch"),
    }
    outer, allreduce = h.get("outer_s"), h.get("allreduce_s")
    if outer and allreduce is not None:
        out["time/allreduce_share"] = allreduce / outer
    for kind in KINDS:
        out[f"bytes/{kind}"] = (h.get("bytes") or {}).get(kind)
    for kind, n in sent_by_kind(state.get("_peers") or state.get("peers") or ()).items():
        out[f"bytes_total/{kind}"] = n
    for name, n in counts.items():
        out[f"events/{name}"] = n
    return {k: float(v) for k, v in out.items()
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)}


def sent_by_kind(peers: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """Bytes all known peers have sent, by kind (``/metrics``' ``potluck_bytes_total``)."""
    out: dict[str, int] = {}
    for p in peers:
        for kind, n in (p.get("bytes_sent") or {}).items():
            out[kind] = out.get(kind, 0) + int(n)
    return out
