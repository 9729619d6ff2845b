"""Pipeline tasklets: a stage's micro-batches in and out over gRPC, compressed, in pieces of bounded size.

- ``pipeline``: Pipeline tasklets: one stage of the model, micro-batches in and out over gRPC
- ``piperound``: One round of a stage's pipeline and its incoming store
- ``pipesend``: Sending a stage's micro-batches: encode off the compute thread, push several at once, fail loudly
- ``pipewire``: A pipeline message on the wire: a head, then its body in pieces of bounded size
"""
