"""What the coordinator keeps on disk: its journal, and the run's checkpoints (fetched, written, served).

- ``journal``: The coordinator's on-disk journal: enough to resume a run after a restart
- ``checkpoint``: Checkpoints: per committed version, one safetensors file per pipeline stage plus a JSON manifest
- ``checkpointer``: The coordinator's checkpoints: fetched from members off the tick, written, and served
- ``offbox``: Off-box checkpoints: every checkpoint the coordinator keeps, copied to an fsspec store, and read back
- ``tensorfile``: Float32 tensors in safetensors files, streamed: written, hashed and read in blocks, never whole
"""
