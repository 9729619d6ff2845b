"""The coordinator: one process that hosts a run's DHT, decides its rounds, keeps its journal and serves its status: a map of the rooms.

The process itself, at the top:

- ``app``: The coordinator: hosts a run's DHT, decides its rounds, keeps its journal, serves its status
- ``decisions``: What the coordinator's loop decides, as values: ``decide(state, inputs, now) -> (state, actions)``
- ``bootstrap``: Bringing a coordinator up: its journal, identity, DHT node and the addresses it tells the world
- ``preflight``: What a coordinator checks before it loads anything heavy or writes anything
- ``health``: How the coordinator itself is doing: the cost of its tick and decisions, and its memory

and its rooms, each with a map of its own:

- ``rounds``: The run's outer steps as the coordinator decides them: the round lifecycle and its events, rollback, averaging groups, the data cursor, the end of a run and its history
- ``placement``: Placing stages and replicas on devices from their measured links: DT-FM's cost model and its search, live at each decision and offline (``potluck schedule``)
- ``trust``: Who may take part and whose word counts: admission, probation, roles and audits, the verifier, evictions
- ``store``: What the coordinator keeps on disk: its journal, and the run's checkpoints (fetched, written, served)
- ``swarm``: How the coordinator meets the swarm: what it reads from the DHT, who is there, what it publishes, what it answers and pings over gRPC
- ``status``: The run's status for people and scrapers: the snapshot, the HTTP(S) server and its page, the JSON API, /metrics, and ``potluck status``
- ``trackers``: The run in experiment trackers (TensorBoard, Weights & Biases, MLflow): what the status page shows, logged once per committed outer step, off the coordinator's loop
"""
