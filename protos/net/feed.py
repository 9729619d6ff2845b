"""Per-peer records read incrementally, and the DHT-process side of the calls that make it cheap.

The coroutines here run inside the DHT process (``DHT.run_coroutine``), next to its storage: a store
straight on one node (:func:`store_at`), many subkeys in one store (:func:`store_many`), and a read that
sends only the records that changed since the reader's last acknowledged answer (:func:`changed_records`).
:class:`Feed` is the reading side, in the process that owns the :class:`~potluck.protos.swarm.SwarmNode`.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, TypeVar

from potluck.protos.runtime.log import get_logger
from potluck.protos.wire.envelope import Record, RecordError, opened, parse, unseal

if TYPE_CHECKING:
    from potluck.protos.net.swarm import SwarmNode

log = get_logger(__name__)

_S = TypeVar("_S", bound=Record)



async def store_at(dht: Any, node: Any, peer: str, key: str, subkey: str, value: Any, expiration: float) -> bool:
    """Runs in the DHT process: store one subkey of ``key`` on the node of ``peer`` (a peer id), and only there.
    A node that does not take it (the coordinator is away: restarting, say) gets it the usual way, on the
    key's nearest live nodes, so a heartbeat or a goodbye still lands while the coordinator is gone."""
    from hivemind.dht import DHTID
    from hivemind.p2p import PeerID

    ok = await node.protocol.call_store(PeerID.from_base58(peer), [DHTID.generate(source=key)],
                                        [node.protocol.serializer.dumps(value)], [expiration], subkeys=[subkey])
    if ok and ok[0]:
        return True
    return bool(await node.store(key, value, expiration, subkey=subkey))


async def store_many(dht: Any, node: Any, key: str, items: list[tuple[str, Any]], expiration: float) -> bool:
    """Runs in the DHT process: store ``items`` (subkey, value) under ``key``, all at once."""
    if not items:
        return True
    ok = await node.store_many([key] * len(items), [v for _, v in items], [expiration] * len(items),
                               subkeys=[s for s, _ in items])
    return all(ok.values())


class Opened(NamedTuple):
    """A record the DHT process opened (:func:`~potluck.protos.wire.envelope.opened`: its envelope, author,
    signature and expiry checked, its body decoded) and, given its type, parsed (``record``), or why it refused
    it (``refused``): the reader parses only a body it was sent (``data``)."""

    data: dict[str, Any] | None
    refused: str = ""
    record: Record | None = None


def open_record(value: bytes, author: str, what: str | type[Record]) -> Opened:
    """Runs in the DHT process: a stored value (msgpack bytes) under ``author``'s subkey, opened (and parsed, when
    ``what`` is the record's type) or refused. A parsed record crosses the pipe as the model, which the reader
    unpickles in 0.14 ms where validating its body took 0.23 ms more than unpickling it (a heartbeat with 16 step
    reports): at 1,000 peers, 200 heartbeats a second, off the coordinator's loop."""
    from hivemind.utils import MSGPackSerializer

    try:
        name = what.__name__ if isinstance(what, type) else what
        body = opened(MSGPackSerializer.loads(value), author=author, what=name)
        return Opened(None, "", parse(what, body)) if isinstance(what, type) else Opened(body)
    except RecordError as err:
        return Opened(None, str(err))
    except Exception as err:  # (bytes that do not decode: msgpack's own errors)
        return Opened(None, f"not a signed record ({type(err).__name__})")


def _token(item: Any) -> Any:
    """What tells one stored record from the next: its expiry and its bytes (hashed once: a stored bytes
    object keeps its hash) or, for a value already decoded, its signature."""
    value = item.value
    if isinstance(value, bytes):
        return item.expiration_time, len(value), hash(value)
    return item.expiration_time, value.get("sig") if isinstance(value, dict) else None


def _stored(node: Any, key: str) -> dict:
    """``key``'s dictionary in this node's own storage: {subkey: ValueWithExpiration(encoded bytes, expiry)}."""
    from hivemind.dht.routing import DHTID
    from hivemind.dht.storage import DictionaryDHTValue

    found = node.protocol.storage.get(DHTID.generate(source=key))
    return dict(found.value.items()) if found is not None and isinstance(found.value, DictionaryDHTValue) else {}


async def changed_records(dht: Any, node: Any, key: str, reader: str, ack: int | None,
                           local: bool = False, what: str | type[Record] = "") -> tuple[int, dict, list, int]:
    """Runs in the DHT process (see :meth:`potluck.protos.swarm.SwarmNode.changes`); what a reader acknowledged is kept
    there. ``what`` (a local read's record type, or its name): each changed record is opened here (and parsed,
    given the type), as :class:`Opened`."""
    from hivemind.utils import MSGPackSerializer, ValueWithExpiration

    readers = dht.__dict__.setdefault("_potluck_readers", {})
    state = readers.setdefault(reader, {"seen": {}, "sent": (0, {})})
    if ack is None:
        state["seen"] = {}
    elif state["sent"][0] == ack:
        state["seen"] = state["sent"][1]
    if local:
        current = _stored(node, key)
    else:
        found = await node.get(key, latest=True)
        current = found.value if found is not None and isinstance(found.value, dict) else {}
    tokens = {sub: _token(item) for sub, item in current.items() if isinstance(sub, str)}
    seen = state["seen"]
    changed = {sub: current[sub] for sub, token in tokens.items() if seen.get(sub) != token}
    changed.update({sub: item for sub, item in current.items() if not isinstance(sub, str)})  # refused by the reader
    if local and what:  # opened here, only what changed: its signature checked off the reader's loop
        changed = {sub: ValueWithExpiration(open_record(item.value, sub, what) if isinstance(sub, str)
                                            else MSGPackSerializer.loads(item.value), item.expiration_time)
                   for sub, item in changed.items()}
    elif local:  # decoded here, only what changed
        changed = {sub: ValueWithExpiration(MSGPackSerializer.loads(item.value), item.expiration_time)
                   for sub, item in changed.items()}
    gone = [sub for sub in seen if sub not in tokens]
    state["sent"] = (state["sent"][0] + 1, tokens)
    return state["sent"][0], changed, gone, len(current)


class Feed(Generic[_S]):
    """One kind of per-peer record (``peers``, ``admission``, ``links``), read incrementally, off its reader's loop
    (one feed per kind and node: the DHT process keeps what each kind's reader acknowledged).

    :meth:`poll` never waits for the DHT: it takes the answer of the read in flight if it has arrived and
    starts the next one once ``every_s`` has passed since the last began, so a loop that polls every tick
    pays for the records that changed -- parsed once each, and for a local read opened (signature, expiry)
    in the DHT process -- not for every record every tick.
    :attr:`records` holds the current valid record of every peer; a record that is refused (forged,
    expired, malformed) is named in what ``poll`` returns, once, and leaves :attr:`records`.
    """

    def __init__(self, node: SwarmNode, kind: str, model: type[_S], what: str, every_s: float,
                 local: bool = False) -> None:
        self.node, self.kind, self.model, self.what, self.every_s, self.local = node, kind, model, what, every_s, local
        self.records: dict[str, _S] = {}
        self.held = 0  # records the DHT holds under the key (refused ones too)
        self.last_changed = 0  # records the last answer brought
        self.last_read_s: float | None = None  # how long the last answered read took
        self.as_of: float | None = None  # monotonic time the last answered read began: what ``records`` show
        self._ack: int | None = None
        self._future: Any = None
        self._started = -float("inf")
        self._unseen: set[str] | None = None  # ids whose record changed or went since last taken (None: never asked)

    def poll(self, now: float | None = None) -> tuple[list[str], list[str]]:
        """``(ids whose record changed or went, refusal reasons)`` from the answer that arrived, if any."""
        now = time.monotonic() if now is None else now
        out: tuple[list[str], list[str]] = ([], [])
        if self._future is not None:
            if self._future.done():
                future, self._future = self._future, None
                try:
                    out = self._apply(*future.result())
                    self.last_read_s, self.as_of = now - self._started, self._started
                except Exception as err:  # the DHT child is restarting, say: the next read sends it all again
                    log.warning("could not read the %s records: %s", self.what, err)
            elif now - self._started > self.node.call_timeout_s:
                log.warning("reading the %s records: no answer from the DHT process within %.0f s; asking again",
                            self.what, self.node.call_timeout_s)
                self._future.cancel()
                self._future = None
        if self._future is None and now - self._started >= self.every_s:
            self._started, self._future = now, self.node.changes(self.kind, self._ack, self.local, self.model)
        return out

    def read(self) -> tuple[list[str], list[str]]:
        """Read now and wait for the answer (tests, and readers without a loop)."""
        if self._future is not None:
            self._future.cancel()  # never acknowledged: what it would have brought comes again
            self._future = None
        self._started = time.monotonic()
        answer = self.node.answer(self.node.changes(self.kind, self._ack, self.local, self.model),
                                  f"reading the {self.what} records")
        self.last_read_s, self.as_of = time.monotonic() - self._started, self._started
        return self._apply(*answer)

    def _apply(self, read: int, changed: dict, gone: list, held: int) -> tuple[list[str], list[str]]:
        refused: list[str] = []
        for subkey, item in changed.items():
            try:
                if not isinstance(subkey, str):
                    raise RecordError(f"subkey {subkey!r} is not a peer id")
                value = item.value
                if not isinstance(value, Opened):
                    rec = unseal(self.model, value, author=subkey)
                elif value.record is not None:
                    if type(value.record) is not self.model:  # (the DHT process parsed it as another kind)
                        raise RecordError(f"{type(value.record).__name__} where a {self.model.__name__} "
                                          "belongs")
                    rec = value.record  # (parsed in the DHT process)
                elif value.data is not None:
                    rec = parse(self.model, value.data)
                else:
                    raise RecordError(value.refused or "refused by the DHT process")
                if getattr(rec, "peer_id", subkey) != subkey:
                    raise RecordError(f"record for {rec.peer_id[-6:]} stored under {subkey[-6:]}")  # type: ignore[attr-defined]
                self.records[subkey] = rec
            except RecordError as err:
                refused.append(f"{self.what} {str(subkey)[-6:]}: {err}")
                self.records.pop(subkey, None)  # type: ignore[arg-type]
        for subkey in gone:
            self.records.pop(subkey, None)
        self._ack, self.held, self.last_changed = read, held, len(changed)
        ids = [s for s in changed if isinstance(s, str)] + list(gone)
        if self._unseen is not None:  # (kept only for a feed someone takes them from: else it would only grow)
            self._unseen.update(ids)
        return ids, refused

    def take(self) -> set[str]:
        """The ids whose record changed or went since the last call; at the first, every id held (a consumer that
        keeps what it made of ``records`` looks at those only, not at every record each tick; one consumer a feed)."""
        taken, self._unseen = set(self.records) if self._unseen is None else self._unseen, set()
        return taken
