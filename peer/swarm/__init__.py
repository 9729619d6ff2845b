"""How a peer meets the swarm: joining a run, its key and certificate, its heartbeat record, its links, and what it reports of itself.

- ``joining``: Joining a run: a DHT node next to the coordinator's, its signed manifest, the run's config
- ``admission``: A peer's side of admission: ask the coordinator to certify a fresh TLS key, keep it renewed
- ``keyfile``: A peer's key file: its identity, made on first start and held by one process at a time
- ``heartbeat``: The peer's heartbeat: a thread that stores the peer's record and watches the plan
- ``links``: Measuring the links from this peer to the others, for the scheduler's cost model
- ``telemetry``: What a peer reports about itself: its progress, its last outer steps, and its heartbeat record
- ``progress``: Inner-step progress a volunteer can read: where the inner phase is, how fast, and when it ends
"""
