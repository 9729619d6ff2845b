"""The peer daemon: joins a run, trains its stage, takes part in the outer steps: a map of the rooms.

The process itself, at the top:

- ``daemon``: The peer daemon: join a run, then follow its rounds until it ends
- ``tasklet``: What a peer runs with: the run-wide toolbox, and the tasklet of the stage it holds
- ``service``: The gRPC facade of a peer: what every message must satisfy, then the room that owns it
- ``follower``: A peer's side of the round lifecycle: one pure state machine from the plan to the next action

and its rooms, each with a map of its own:

- ``swarm``: How a peer meets the swarm: joining a run, its key and certificate, its heartbeat record, its links, and what it reports of itself
- ``training``: The inner phase: a stage's layers and how they run, the inner AdamW loop (in the backward or after it, 8-bit moments), how many steps fit a round's window, and the data
- ``pipeline``: Pipeline tasklets: a stage's micro-batches in and out over gRPC, compressed, in pieces of bounded size
- ``reduce``: The outer all-reduce among a stage's replicas: sending and receiving shards, checked and signed, the round as a value, audits, and paced sends
- ``outer``: DiLoCo's outer step: the pseudo-gradient, Nesterov, streaming fragments, the committed states (in memory or on disk) and fetching a state this peer must hold
- ``devices``: A peer of several devices: ranks that follow rank 0, and one stage sharded over them (FSDP2)
"""
