"""capture-proxy: a token-capture reverse proxy for agentic RL rollouts.

Architecture, bottom to top (lower layers never import upper ones; docs/architecture.md
follows one call through it):

- ``core``: the pure core (no aiohttp, no I/O, tested without an event loop). Front codecs
  (``core.fronts``: each wire API to one canonical conversation and back), linking and
  digests (``core.linking``, whose verification asks for what it needs by command), lineage
  between chains (``core.lineage``), splicing, engine formats, record assembly, records and
  their codec, chains. ``core.flow`` is the call itself as a sans-io state machine: it is fed
  events (resolution, render result, engine status, stream pieces and end, client gone) and
  yields commands (resolve, render, send to the engine, write to the client, verify, persist)
  and returns the record with its diagnostics.
- ``families``: one object per model family (render as vLLM does, with vLLM's message
  normalisation; parse the generation back; name its turn tokens). No aiohttp.
- ``store``: the embedded SQLite store and the shared PostgreSQL store, over one set of
  transaction bodies (``store.transactions``, ``store.sql``).
- ``proxy``: the aiohttp adapter. Routes a request, parses it with its front, runs the call's
  flow on one executor per back end (``proxy.executor``, ``proxy.exact``), maps core errors
  to client errors in one table (``proxy.errors``).
- ``rest``: the REST API under ``/captures`` (reads, the trainer's lifecycle steps, downloads
  in training formats); ``viewer``: its pages; ``readers``: the trainer's side
  (``iter_rollouts``, ...); ``config``: the settings.
- ``app``: the composition root (builds the app from settings; nothing below imports it).
- ``scripted_engine`` (a vLLM-dialect engine for tests and demos), ``harnesses`` (drivers of
  OpenCode, Codex and Claude Code sessions, and recorded sessions replayed), ``cli``
  (``capture-proxy serve | show | scripted-engine | demo | replay | export-tokenizer |
  audit``; ``audit``: the audit's model side).
"""

__version__ = "0.1.0"
