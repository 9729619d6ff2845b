"""A round of the all-reduce is a value: nothing a past round's threads do can change a newer round."""

from __future__ import annotations

import threading
import time

import torch
from test_allreduce import BASE, Member, random_deltas, round_for, run_all

from potluck.protos import potluck_pb2 as pb


class GatedPings(Member):
    """A member whose first ping to one peer hangs until ``gate`` opens, then says that peer is at version 1
    (the later ones are answered as usual: one held probe, not a pool of them)."""

    def __init__(self) -> None:
        super().__init__()
        self.slow, self.gate, self.cond = "", threading.Event(), threading.Condition()
        self.held = self.answered = 0

    def _ping(self, peer_id: str, timeout: float) -> pb.PingReply:
        with self.cond:
            hold = peer_id == self.slow and not self.held
            self.held += hold
            self.cond.notify_all()
        if not hold:
            return super()._ping(peer_id, timeout)
        self.gate.wait(60)
        with self.cond:
            self.answered += 1
            self.cond.notify_all()
        return pb.PingReply(peer_id=peer_id, state="training", version=1)


def test_a_probe_of_a_past_round_answering_late_changes_nothing_in_the_next() -> None:
    """A probe of step 1 that answers while step 2 runs, saying the peer is at version 1 (past step 1, and
    just where it should be for step 2), must not make step 2 stop waiting for that peer (issue 31: it went
    into the newer round's "already past this step" list, and step 2 was reduced without it)."""
    a, b, c = ms = [GatedPings(), Member(), Member()]
    try:
        a.slow = c.id
        deltas = random_deltas(ms, seed=11)
        first: dict[str, object] = {}
        early = threading.Thread(target=lambda: first.update(run_all(ms, deltas, wait_s=30, skip={c.id})))
        early.start()
        with a.cond:  # a waits for c's contribution to its shard and probes c: that probe hangs
            assert a.cond.wait_for(lambda: a.held >= 1, timeout=30)
        mc = c.ar.run(round_for(ms, c), deltas[c.id], wait_s=30, grace_s=1.0)
        early.join(timeout=60)
        assert mc[1].contributors == {0: 3, 1: 3, 2: 3}
        for m in ms:
            m.ar.expect(2, BASE)
            m.version = 1
        second: dict[str, object] = {}
        step2 = threading.Thread(target=lambda: second.update(run_all(ms, deltas, wait_s=30, skip={c.id}, step=2)))
        step2.start()
        deadline = time.monotonic() + 30
        while a.ar.pending_contributions() < 2 and time.monotonic() < deadline:  # a runs step 2, waiting for c
            time.sleep(0.01)
        with a.cond:  # now the probes of step 1 answer
            a.gate.set()
            assert a.cond.wait_for(lambda: a.answered == a.held, timeout=30)
        late = c.ar.run(round_for(ms, c, step=2), deltas[c.id], wait_s=30, grace_s=1.0)
        step2.join(timeout=60)
        assert not any(isinstance(v, Exception) for v in second.values()), second
        assert torch.equal(second[a.id][0], late[0]) and torch.equal(second[b.id][0], late[0])
        assert late[1].contributors == {0: 3, 1: 3, 2: 3} and not second[a.id][1].dropped
    finally:
        a.gate.set()
        for m in ms:
            m.close()
