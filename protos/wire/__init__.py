"""What crosses the wire beside the protobuf messages: signed DHT records, refusal codes, size limits, proof of work.

- ``records``: DHT record types: what the coordinator and peers publish, and how a reader checks them
- ``refusals``: Refusals: how a potluck handler says no, how the caller reads it back, and how the server logs it
- ``limits``: The sizes the wire holds to, in one place: what a process accepts in one gRPC message, and how a pipeline message is cut so that no model's size ever meets that limit
- ``work``: Proof of work for open admission: a fresh key must cost compute, so a crowd of them costs a crowd's
"""
