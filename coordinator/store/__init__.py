"""What the coordinator keeps on disk: its journal, and the run's checkpoints (fetched, written, served).

- ``journal``: The coordinator's on-disk journal: enough to resume a run after a restart
- ``checkpoint``: Checkpoints: per committed version, one safetensors file per pipeline stage plus a JSON manifest
- ``checkpointer``: The coordinator's checkpoints: fetched from members off the tick, written, and served
- ``offbox``: Off-box checkpoints: every checkpoint the coordinator keeps, copied to an fsspec store, and read back
- ``uploadproc``: The checkpoint uploader in a process of its own, so that its sends and read-back hashing never share the
  coordinator's interpreter lock
- ``tensorfile``: Float32 tensors in safetensors files, streamed: written, hashed and read in blocks, never whole
"""
