"""The REST API under ``/captures``: thin aiohttp handlers over the store and the core.

- ``reads``: rollouts, chains and calls as JSON (and npz); the REST thread that serialises
  them off the proxy's event loop; the read-only app's refusals.
- ``lifecycle``: the trainer's hand-off steps (freeze, metadata, retire).
- ``downloads``: a rollout in a training format (the bulk Arrow export, the token tree, ATIF).
- ``deadline``: every read under ``/captures`` starts its answer within ``read_api_timeout_s``,
  else a 503 (``read_timeout``).
- ``sending``: a started answer of such a read whose client takes no bytes for
  ``read_send_timeout_s`` is cut (its connection closed).

Must not: build chains, trees or samples itself (the core does), or touch the proxy's call flow.
"""
