"""What is made of a round once: a decided round is never changed in place (a new object replaces it), so a
dump of it (the journal's JSON, the plan's canonical JSON, the status page's) is kept while the round is among
those asked for, and made again only for a new one. At 1,000 members a round's dump costs milliseconds, and the
journal, the plan and the page each asked for every round's at every save, publish and build."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

from potluck.protos.wire.records import Round

_T = TypeVar("_T")


class PerRound(Generic[_T]):
    """``make`` of each round, kept by the round object's identity."""

    def __init__(self, make: Callable[[Round], _T]) -> None:
        self.make = make
        self._kept: dict[int, tuple[Round, _T]] = {}

    def __call__(self, rounds: Iterable[Round]) -> list[_T]:
        rounds = list(rounds)
        kept = {id(r): hit if (hit := self._kept.get(id(r))) is not None and hit[0] is r else (r, self.make(r))
                for r in rounds}
        self._kept = kept  # (only the rounds asked for now: their objects stay alive, so no id is reused meanwhile)
        return [kept[id(r)][1] for r in rounds]

    def __len__(self) -> int:
        return len(self._kept)
