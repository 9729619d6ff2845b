"""The inner phase: a stage's layers and how they run, the inner AdamW loop (in the backward or after it, 8-bit moments), how many steps fit a round's window, and the data.

- ``stage``: One stage of the model on this peer: its layers, the inner AdamW loop, and evaluation
- ``runner``: How a peer runs its stage's layers: precision, activation checkpointing, torch.compile
- ``phases``: One inner phase of a round, in a swarm of peers of different speeds
- ``window``: How many inner steps a member trains in a round: as many as fit the round's window
- ``inbackward``: The inner update inside the backward pass (``train.step_in_backward``): no stage-sized gradient is ever held
- ``adamw8bit``: AdamW with its two moments kept in 8 bits (``train.optimizer = "adamw8bit"``): 10 bytes a parameter on the device where fp32 AdamW takes 16 (weight 4, gradient 4, moments 2 + a scale per block)
- ``data``: Training data with stable sample ids: a synthetic Markov source, a byte file, or token shards
- ``model``: The model on a peer: the whole model as one module (:class:`TinyGPT`), and re-exports of the model interface (:mod:`potluck.models`) that peers, tests and benchmarks use
"""
