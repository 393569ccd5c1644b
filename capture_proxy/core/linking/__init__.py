"""Parent resolution and link verification: how a call finds the captured call it continues.

Modules, bottom up (each imports only the ones above it; this package's ``__init__`` imports
nothing, so a module can be imported alone):

- ``digests``: the canonical form of a model-authored turn and the chained digests (a
  request's parent digest, a call's child digest, the request digest of a retry).
- ``prefill``: a call that continues the harness's partial assistant message, and the merged
  turn it offers its children.
- ``verdicts``: ``Verdict`` and the typed ``Reason`` (a kind to decide by, the stored text).
- ``mismatch``: why a child's prompt does not extend its parent's tokens (``MismatchClass``).
- ``resolution``: the request-time answer (``Resolution``, its ``Candidate`` parents).
- ``entries``: what the index keeps of one call (``Entry``).
- ``candidate_order``: the order of a resolution's parent candidates, over the index's maps.
- ``retry_target``: the call an identical request retries, over the index's maps.
- ``index``: the per-rollout ``LinkIndex`` and how stored records enter it.
- ``commands``: the questions the steps ask their driver (read a parent, read a rollout's
  calls, find a prefix ancestor, detokenise) and the step protocol.
- ``parent_lookup``: the request-time step (``resolve_step``).
- ``late_retry``: a retry whose attempt was not known when it arrived, looked for again
  before it is stored (``late_retry_step``; with ``serve --workers`` the attempt may be in
  flight on another worker).
- ``verification``: the response-time step (``verify_step``): the parent taken, the
  diagnostics and the ``linking`` dict of the record.

Pure: no aiohttp, no I/O. The steps are generators: they yield commands and are sent the
replies; ``proxy.linker.Linker`` drives them over the store and the engine.
"""
