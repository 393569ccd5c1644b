"""capture-proxy: a token-capture reverse proxy for agentic RL rollouts.

Architecture, bottom to top (lower layers never import upper ones):

- ``capture_proxy.core``: the pure core. Call records and their binary codec, chain
  building, path routing, request augmentation and response stripping, the incremental
  SSE/stream assembler. No aiohttp, no I/O; tested without an event loop.
- ``capture_proxy.families``: one object and one module per model family (how vLLM renders
  its conversations, with vLLM's message normalisation; how its generation parses back; its
  turn tokens). No aiohttp; tokenizer-bound (transformers, openai-harmony) where it renders.
- ``capture_proxy.store``: the embedded store (SQLite in WAL mode, arrays as BLOBs) and the
  shared PostgreSQL store.
- ``capture_proxy.proxy``: the aiohttp adapter. Routes a request, validates it, forwards it
  to the engine (streaming as it arrives), hands the observed call to the core to assemble a
  record, persists it, and finishes the response. One middleware turns exceptions into
  OpenAI-shaped errors.
- ``capture_proxy.rest``: the REST API under ``/captures`` (reads, the trainer's lifecycle
  steps, downloads in training formats); ``capture_proxy.viewer``: its pages.
- ``capture_proxy.readers``: the trainer's side of the read API (``iter_rollouts``, ...).
- ``capture_proxy.config``: the settings (``Settings``, ``load_settings``).
- ``capture_proxy.app``: the composition root. Builds the app from settings: store, upstream
  session, the proxy's dispatch, the read API, the viewer. Nothing below it imports it.
- ``capture_proxy.scripted_engine``: a vLLM-dialect engine with a real tokenizer and a
  scripted policy, for tests, demos and harness CI.
- ``capture_proxy.harnesses``: drivers of sessions through the proxy (OpenCode, Codex, Claude
  Code, and recorded sessions replayed).
- ``capture_proxy.cli``: ``capture-proxy serve | show | scripted-engine | demo | replay |
  export-tokenizer | audit`` (``capture_proxy.audit``: the audit's model side).

The product brief, words and contracts live in the project's DESIGN notes; README.md and
the documentation site under docs/ have the user-facing view.
"""

__version__ = "0.1.0"
