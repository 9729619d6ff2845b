"""What crosses the wire beside the protobuf messages: signed DHT records, refusal codes, size limits, proof of work.

- ``records``: DHT record types: what the coordinator and peers publish (each in the signed envelope of :mod:`potluck.protos.wire.envelope`, parsed tolerantly like Petals' ``ServerInfo``: unknown fields ignored, missing optional ones defaulted)
- ``roundindex``: What a :class:`~potluck.protos.wire.records.Round` looks up often, indexed once per member list: its members by id and by stage and group, its shares by replica
- ``admissions``: The admission records: what a peer asks under ``potluck/<coordinator>/admission`` and what the coordinator answers under ``.../certs`` (one subkey per peer id; see :mod:`potluck.protos.wire.records`)
- ``envelope``: The signed envelope every DHT value travels in, and the base of every record type
- ``states``: One vocabulary for what a peer is doing: its records, telemetry and pings, the all-reduce's view of a member, the coordinator and the page all use :class:`PeerState`
- ``refusals``: Refusals: how a potluck handler says no, how the caller reads it back, and how the server logs it
- ``limits``: The sizes the wire holds to, in one place: what a process accepts in one gRPC message, and how a pipeline message is cut so that no model's size ever meets that limit
- ``work``: Proof of work for open admission: a fresh key must cost compute, so a crowd of them costs a crowd's
"""
