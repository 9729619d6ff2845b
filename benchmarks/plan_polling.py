"""What a peer's plan polling costs at a thousand members (issue 30), over two real DHT nodes on loopback.

Every peer asks for a new plan every ``poll_s`` (0.2 s) while it runs. The plan lists every member of its
newest rounds (``PLAN_ROUNDS``): at 1,000 members it is hundreds of KB, and each read is verified and parsed.
The coordinator's node publishes a plan of ``--rounds`` rounds of ``--members`` members (and its head); a
peer's node polls it ``--polls`` times, as the peer did before (the whole plan every poll) and as it does now
(:meth:`potluck.peer.swarm.heartbeat.Heartbeat._refresh`: the head every poll, the plan when the head is newer), with
a new plan every ``--new-every`` polls. Printed: bytes read per poll and the peer's CPU seconds per poll, each
way, the ratios, and what that makes per peer per minute and for the whole swarm at ``poll_s``.

    python benchmarks/plan_polling.py [--members 1000] [--rounds 4] [--polls 600] [--new-every 300]
"""

from __future__ import annotations

import json
import time
from typing import Any

from benchargs import bench_parser
from hivemind.utils import MSGPackSerializer

from potluck.coordinator.swarm.publisher import Publisher
from potluck.peer.swarm.heartbeat import Heartbeat
from potluck.protos.net.dhtguard import run_key
from potluck.protos.net.identity import Identity
from potluck.protos.net.swarm import SwarmNode
from potluck.protos.wire.records import Manifest, Member, PeerRecord, Round


def main() -> int:
    p = bench_parser(__doc__)
    p.add_argument("--members", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--polls", type=int, default=600, help="polls measured each way")
    p.add_argument("--new-every", type=int, default=300,
                   help="a new plan every this many polls (300: an outer step a minute at 0.2 s)")
    p.add_argument("--poll-s", type=float, default=0.2, help="a peer's poll period (for the per-minute figures)")
    a = p.parse_args()

    coord = Identity.generate()
    server = SwarmNode(coord, coordinator=coord.peer_id, host="127.0.0.1", node_id_source=run_key(coord.peer_id, "peers"))
    peer = SwarmNode(Identity.generate(), coordinator=coord.peer_id, initial_peers=server.maddrs, host="127.0.0.1")
    manifest = Manifest(run_id="r", coordinator=coord.peer_id, config={})
    pub = Publisher(server, manifest, set())
    members = [Member(peer_id=f"12D3KooW{Identity.generate().peer_id[8:]}", address=f"/ip4/10.0.{i // 250}.{i % 250}/tcp/31337",
                      replica=i) for i in range(a.members)]
    moved = [0]
    get = peer._dht_get

    def counted(kind: str, latest: bool = True) -> Any:
        found = get(kind, latest)
        moved[0] += len(MSGPackSerializer.dumps(found.value)) if found is not None else 0  # (as it crossed)
        return found

    peer._dht_get = counted  # type: ignore[method-assign]
    step = [a.rounds - 1]  # (every plan measured holds --rounds rounds)

    def new_plan() -> None:
        step[0] += 1
        pub.new_plan()
        pub.publish([Round(step=s, members=members) for s in range(max(1, step[0] - a.rounds + 1), step[0] + 1)])
        for _, answer in pub._pending:
            answer.result(timeout=30)

    def measure(poll: Any) -> tuple[float, float]:
        moved[0], cpu, polls = 0, 0.0, 0
        for i in range(a.polls):
            if i % a.new_every == 0:
                new_plan()
            t = time.thread_time()
            poll()
            cpu += time.thread_time() - t
            polls += 1
        return moved[0] / polls, cpu / polls

    try:
        new_plan()
        size = pub.node.sealed_size(pub.fitting([Round(step=s, members=members) for s in range(1, a.rounds + 1)]), 60.0)
        whole_bytes, whole_cpu = measure(lambda: peer.get_plan())
        beat = Heartbeat(peer, manifest, lambda: PeerRecord(peer_id="x", address="x:1"), heartbeat_s=60.0, ttl_s=60.0)
        head_bytes, head_cpu = measure(lambda: beat._refresh(with_manifest=False))
    finally:
        peer.shutdown()
        server.shutdown()
    per_min = 60.0 / a.poll_s
    print(json.dumps({
        "benchmark": "plan_polling", "members": a.members, "rounds": a.rounds, "plan_bytes": size,
        "polls": a.polls, "new_plan_every_polls": a.new_every,
        "baseline_whole_plan": {"bytes_per_poll": round(whole_bytes), "cpu_s_per_poll": round(whole_cpu, 5)},
        "head_first": {"bytes_per_poll": round(head_bytes), "cpu_s_per_poll": round(head_cpu, 5)},
        "bytes_ratio": round(head_bytes / whole_bytes, 4), "cpu_ratio": round(head_cpu / whole_cpu, 4),
        "per_peer_per_min_mb": {"baseline": round(whole_bytes * per_min / 1e6, 1), "head_first": round(head_bytes * per_min / 1e6, 2)},
        "swarm_per_s_mb_at_members": {"baseline": round(whole_bytes * a.members / a.poll_s / 1e6),
                                      "head_first": round(head_bytes * a.members / a.poll_s / 1e6, 1)},
        "peer_cpu_share_polling": {"baseline": round(whole_cpu / a.poll_s, 3), "head_first": round(head_cpu / a.poll_s, 4)},
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
