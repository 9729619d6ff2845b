"""The run in experiment trackers (TensorBoard, Weights & Biases, MLflow): what the status page shows, logged once per committed outer step, off the coordinator's loop.

- ``points``: What the experiment trackers log, read off the status snapshot: one pure function of ``/api/v1/state``
- ``feed``: The trackers' own thread: the coordinator's loop hands it each snapshot's new points and never waits for it
- ``backends``: The trackers themselves: TensorBoard, Weights & Biases and MLflow, each behind the same four calls
"""
