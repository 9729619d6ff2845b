"""How long storing a big record holds its caller while the DHT process is busy: through hivemind's pipe, or
spilled to a file the DHT process reads (``protos/net/spill.py``, records over ``SPILL_BYTES``).

At 1,000 peers the coordinator's DHT process serves ~200 heartbeat stores a second, and the coordinator's loop
publishes a plan of ~600 KB at every decision and every 15 s. A value sent through the pipe is read a chunk at
a time by a thread of the DHT process, each chunk waiting for that process's interpreter lock; the sender
waits for all of it. Here one real DHT node is kept busy by a coroutine that runs Python code on its event loop
(as handling stores does), and the plan is stored without waiting for the answer (as the coordinator does):
the figure is how long that call took, the baseline the same call with spilling off, in the same run.

    python benchmarks/dht_spill.py [--members 1000] [--rounds 4] [--repeat 5] [--busy-s 1.0]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from functools import partial
from typing import Any


async def busy(dht: Any, node: Any, seconds: float) -> int:
    """Runs in the DHT process: Python work on its event loop for ``seconds`` (the GIL held but for switches)."""
    end, n = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        n += sum(range(200))
    return n


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--members", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--busy-s", type=float, default=1.0)
    a = p.parse_args()
    from potluck.protos.net import spill, swarm
    from potluck.protos.net.dhtguard import run_key
    from potluck.protos.net.identity import Identity
    from potluck.protos.wire.envelope import canonical
    from potluck.protos.wire.records import Member, Plan, Round

    me = Identity.generate()
    node = swarm.SwarmNode(me, coordinator=me.peer_id, host="127.0.0.1", node_id_source=run_key(me.peer_id, "peers"))
    members = [Member(peer_id=f"12D3KooW{i:044d}", address=f"10.0.{i // 250}.{i % 250}:{1000 + i}", replica=i)
               for i in range(a.members)]
    plan = Plan(seq=1, rounds=[Round(step=s, members=members) for s in range(1, a.rounds + 1)], ts=time.time())
    size = len(canonical(plan.model_dump(mode="json")))
    held: dict[str, list[float]] = {"pipe": [], "spilled": []}
    spill_bytes = spill.SPILL_BYTES
    try:
        for _ in range(a.repeat):
            for how, limit in (("pipe", 1 << 40), ("spilled", spill_bytes)):
                spill.SPILL_BYTES = limit
                sealed = node.seal(plan, 60.0)  # (sealed anew: a record expires when its signature says)
                load = node.dht.run_coroutine(partial(busy, seconds=a.busy_s), return_future=True)
                time.sleep(0.05)  # (the DHT process is inside it)
                t0 = time.perf_counter()
                stored = node.publish_plan(plan, ttl=60.0, wait=False, sealed=sealed)
                held[how].append(time.perf_counter() - t0)
                load.result(timeout=60)
                assert stored.result(timeout=60), "the plan was not stored"
    finally:
        node.shutdown()
    pipe, spilled = statistics.median(held["pipe"]), statistics.median(held["spilled"])
    print(json.dumps({"benchmark": "dht_spill", "plan_bytes": size, "members": a.members, "rounds": a.rounds,
                      "busy_s": a.busy_s, "repeat": a.repeat,
                      "held_s_median": {"spilled": round(spilled, 4), "pipe_baseline": round(pipe, 4)},
                      "held_s_all": {k: [round(x, 4) for x in v] for k, v in held.items()},
                      "ratio": round(spilled / pipe, 4) if pipe > 0 else None}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
