"""The aiohttp adapter: routes, parses, executes the call's flow, persists. Thin over the core.

The way of a request, by module:

- ``server``, ``policy``, ``auth``: the HTTP server, request hygiene (size, media type, host,
  cross-site), the proxy's credential.
- ``app``: ``dispatch`` routes a path (``core.routing``): a capture path goes to
  ``call_handler``, count-tokens to its handler, anything else to ``passthrough``.
- ``call_handler``: parses the body with the call's front codec, picks the back end and drives
  the call's flow (``core.flow``) on its executor.
- ``executor``: performs the flow's commands with aiohttp (engine request and stream, client
  writes, resolve / verify / remember through ``linker``, persist through ``recorder``) and
  feeds the replies back; ``exact``: exact-token mode's family machinery and executor.
- ``calls``: what the executors share (dependencies, engine headers, ``ClientWriter``).
- ``errors``: the error classes, the one table of core errors -> client errors
  (``CORE_ERRORS``), the middleware that shapes every error for the call's API.
- ``linker``: parent resolution and verification over the store; ``recorder``: persists records
  and counts them (``metrics``); ``traffic_tap``: records harness traffic for replay.
- ``upstream``: the engine session, header hygiene, client-error translation;
  ``engine_render``: the engine's ``/tokenize`` as a renderer; ``engine_probe``, ``status``:
  ``/health`` and ``/metrics``; ``recent``: recently stored calls in memory; ``keys``: app state.

No decision about a captured call lives here: ``core.flow`` owns them.
"""
