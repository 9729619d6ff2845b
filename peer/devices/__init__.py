"""A peer of several devices: ranks that follow rank 0, and one stage sharded over them (FSDP2).

- ``multidevice``: A peer of several devices: ``torchrun --nproc-per-node N -m potluck peer --join ADDRESS``
- ``sharding``: One stage sharded over the processes of a multi-device peer (FSDP2): ``potluck peer --devices shard``
"""
