"""The outer all-reduce among a stage's replicas: sending and receiving shards, checked and signed, the round as a value, audits, and paced sends.

- ``allreduce``: The outer all-reduce: reduce-scatter + all-gather over gRPC, with deadlines and shard take-over
- ``shardinbox``: The receiving half of the outer all-reduce: contributions and results of the expected step, checked
- ``reduceround``: One run of the outer all-reduce as a value: its phase, whom it stopped waiting for, who went past it
- ``shards``: What one outer step's all-reduce is made of, apart from the procedure (:mod:`potluck.peer.reduce.allreduce`): its members and their shards, how a shard was reduced and who vouches for it, what a member reports of the step, and the shard-sized buffers results are decoded into, kept from one step for the next
- ``audit``: An auditor's work: recompute a shard of an earlier step from the contributions its owner signed for
- ``pacing``: Paced sends: an overlapped outer step's bytes spread over the inner phase it overlaps (``sync.pace``)
"""
