"""DiLoCo's outer step: the pseudo-gradient, Nesterov, streaming fragments, the committed states (in memory or on disk) and fetching a state this peer must hold.

- ``outer``: DiLoCo's outer step for one stage: pseudo-gradient, all-reduce among the stage's replicas, Nesterov
- ``outersteps``: A peer's outer steps, blocking or overlapped: after the inner phase, until the step is committed
- ``diloco``: DiLoCo's outer step on a flat float32 ``theta_global`` kept on the CPU
- ``fragments``: Streaming outer steps (``sync.fragments = F``; Streaming DiLoCo, Douillard et al
- ``states``: The committed states a peer holds: theta_global and the outer momentum of its stage
- ``spill``: The outer state on disk: ``potluck peer --outer-state-dir DIR``, for a volunteer short of RAM
- ``recovery``: Fetching a state this peer must hold: from members of its stage, or the coordinator's checkpoint
"""
