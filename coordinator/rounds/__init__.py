"""The run's outer steps as the coordinator decides them: the round lifecycle and its events, rollback, averaging groups, the data cursor, the end of a run and its history.

- ``rounds``: The round lifecycle: one explicit, pure state machine over the run's outer steps
- ``rollback``: How a round fails and what the run rolls back to, as values: pure functions over the state of :class:`~potluck.coordinator.rounds.rounds.Rounds`, which applies what they return to it
- ``roundevents``: What the round lifecycle (:mod:`potluck.coordinator.rounds.rounds`) takes in and gives out, as values: a peer's :class:`Report`, the newest :class:`Checkpoint`, the events a tick can bring (:class:`Committed`, :class:`Failed`, :class:`RolledBack`) and how a failed round ended (:class:`RoundOutcome`, journaled)
- ``perround``: What is made of a round once: a decided round is never changed in place (a new object replaces it), so a dump of it (the journal's JSON, the plan's canonical JSON, the status page's) is kept while the round is among those asked for, and made again only for a new one
- ``finishing``: When a run ends: every outer step committed (and the members settled on the last one), or the admin says so through the status page
- ``groups``: Grouped averaging (Moshpit SGD, Ryabinin et al. 2021): which members of a stage average together
- ``cursor``: The data cursor: which samples each round's replicas train on, so that none repeats before its epoch ends
- ``history``: The run's history: one entry per committed outer step, folded from what the members reported
"""
