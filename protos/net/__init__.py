"""How processes reach each other: gRPC channels and servers, the relay, the DHT node and its record guard, identities and the run's certificates, join addresses and who answers at one, port errors.

- ``transport``: gRPC plumbing of a peer: the PeerService server, a client with channel reuse, byte accounting
- ``servicer``: The server side of PeerService: every call checked before a handler sees it
- ``relay``: NAT traversal: calls to a peer that accepts no connections, relayed over a stream it opened itself
- ``swarm``: A hivemind DHT node with typed, signed access to potluck's records
- ``hivemindenv``: What hivemind reads from the environment when it is imported: set before its first import
- ``dhtprocess``: hivemind's DHT process as potluck runs it: tied to its parent, out of the terminal's signals, its command pipe read whole, and its start counted (the ``dht.start`` fault point)
- ``feed``: Per-peer records read incrementally, and the DHT-process side of the calls that make it cheap
- ``spill``: Big records to the DHT process through a file, not its pipe
- ``dhtguard``: What every DHT node of a run agrees to store: its signed records, under its own keys, briefly
- ``certs``: The run's certificate authority, and the short-lived certificates it issues to admitted peers
- ``identity``: Identities and signatures: who wrote a record, and proof that they did
- ``join``: A run's join address, as the coordinator prints it and a peer passes it to ``--join``
- ``probe``: Who answers at a join address, asked in well under a second, before a peer starts its DHT node
- ``errors``: Why a server could not bind its port, said the way a user fixes it
"""
