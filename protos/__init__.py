"""The protocol and the plumbing under every process: a map of the rooms.

- ``potluck.proto`` and its generated ``potluck_pb2`` / ``potluck_pb2_grpc`` (``generate``: rebuild them):
  every gRPC message and service.
- ``wire``: signed DHT records, refusal codes, size limits, proof of work.
- ``net``: gRPC channels and servers, the relay, the DHT node and its record guard, identities and
  certificates, join addresses.
- ``config``: the run's configuration and the checks it must pass before a run starts.
- ``runtime``: logging, and stopping a process and its children.
- ``testkit``: fault points (``POTLUCK_FAULTS``) and link emulation, for tests and benchmarks.
"""
