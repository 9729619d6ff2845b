"""The run's status for people and scrapers: the snapshot, the HTTP(S) server and its page, the JSON API, /metrics, and ``potluck status``.

- ``status``: The coordinator's HTTP server: the run's status page, its JSON API, a live stream and /metrics
- ``snapshot``: The status page's data: one pure fold of the coordinator's state into ``/api/v1/state``
- ``httpserver``: The status page's HTTP server itself, hardened for a public page (the routes are in :mod:`potluck.coordinator.status.status`)
- ``peerpage``: ``GET /api/v1/peers``: every peer's row, a page at a time, filtered and sorted on the server
- ``metrics``: The run's status snapshot in the Prometheus text exposition format (version 0.0.4)
- ``status_tls``: HTTPS for the status page: the operator's certificate files, or a self-signed certificate kept in the journal directory, whose fingerprint the coordinator prints for visitors to compare
- ``status_cli``: ``potluck status ADDRESS``: the status page's summary in a terminal
- ``horizons``: How long until: the next outer step, the run's end, a waiting peer's place, from the steps measured so far

``static/`` holds the page itself (plain HTML, JS and CSS, no build step) and ``state.schema.json``, the
JSON schema of ``/api/v1/state``; :mod:`~potluck.coordinator.status.status` serves them.
"""
