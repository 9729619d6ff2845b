"""Who may take part and whose word counts: admission, probation, roles and audits, the verifier, evictions.

- ``admission``: Who may take part: the coordinator admits peers explicitly and certifies their TLS keys
- ``trust``: Fresh keys earn trust: who may own a shard, audit one, or count in an eviction
- ``integrity``: Roles and proofs: who may own a shard, who audits which, what an accusation is worth
- ``verifier``: The coordinator's own check of an accusation, on a thread of its own, before anyone is evicted
- ``evictions``: Evicting a peer whose updates the owners that averaged them clipped or left out, in most of its recent steps
"""
