"""How the coordinator meets the swarm: what it reads from the DHT, who is there, what it publishes, what it answers and pings over gRPC.

- ``membership``: Who is in the swarm: peers as seen through their signed DHT records
- ``reader``: What the coordinator reads from the DHT each tick: the peers' records, incrementally, off its loop
- ``publisher``: What the coordinator tells the swarm through the DHT: its signed run manifest and round plan
- ``pings``: What the coordinator's pinger decides, as values: whom to ping, which answers still count, when to
  wake the loop
- ``service``: The coordinator's side of the wire: what its PeerService answers, and the pings it sends
"""
