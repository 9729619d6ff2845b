"""A process's life: logging with its context, and stopping it and its children in order.

- ``stopping``: Stopping a potluck process: politely on the first signal, for sure within a bound
- ``log``: One logger for every potluck process
- ``warmup``: Imports that cost seconds, done on a thread while the process waits on the network
- ``heap``: The interpreter's cycle collector on a loop's own schedule, not in the middle of its work
"""
