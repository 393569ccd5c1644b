"""The call as a sans-io state machine: events in, commands out (mitmproxy's layers).

Owns every decision about one captured call after its front's parse: harness notes, parent
resolution, the back end's prompt path (``prompt``), the engine request, the relay of the
answer (whole or streamed), the record with its diagnostics, verify-persist-remember, and the
errors that end a call (``errors``). A flow is a generator: it yields a command
(``commands``), is sent the executor's reply (``events``) and returns the ``Outcome``::

    flow = captured_call(start)        # captured.py
    reply = None
    while True:
        command = flow.send(reply)     # StopIteration(value=Outcome) at the end
        reply = perform(command)       # the executor: proxy.executor and one per back end

Modules: ``captured`` (entry), ``template_mode`` (the engine renders), ``exact_mode`` and
``prompt`` (the proxy sends exact tokens), ``call`` (shared sub-flows). Must not import
aiohttp or asyncio, read a clock of its own or do any I/O; tested in ``tests/core/flow``
without a loop.
"""
