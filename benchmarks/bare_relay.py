"""A bare aiohttp relay: the floor under the proxy's CPU per call (``floor.py``).

One catch-all handler on aiohttp's server, on the same event loop as ``capture-proxy serve``
(uvloop when installed), that sends each request's method, path, query, body and content type
to ``--backend`` with one shared ``aiohttp.ClientSession`` and relays the answer: whole, or
chunk by chunk as it arrives when the engine streams (``text/event-stream``). No middlewares,
no access log, no parsing, no capture, no store: what any aiohttp reverse proxy costs per call.

``--per-event``: the relay writes the engine's stream one SSE event at a time (each event that
arrived in a read written alone), as a relay that looks at each event must; without it, each
read is one write, whatever it holds. ``--lag``: the event loop's lag sampled as the proxy
samples it (``proxy.loop_lag``), in the proxy's metric at ``GET /_relay/metrics``.

Run: ``python benchmarks/bare_relay.py --backend URL --port N [--per-event] [--lag]``.
"""

from __future__ import annotations

import argparse
import asyncio

from aiohttp import ClientSession, ClientTimeout, TCPConnector, web

#: The answer's headers the relay copies (the rest are aiohttp's own).
_COPIED = ("Content-Type",)


def make_app(backend: str, *, per_event: bool = False, lag: bool = False) -> web.Application:
    app = web.Application()
    sessions: list[ClientSession] = []

    async def on_startup(app: web.Application) -> None:
        connector = TCPConnector(limit=0)
        sessions.append(ClientSession(connector=connector, timeout=ClientTimeout(total=600)))

    async def on_cleanup(app: web.Application) -> None:
        await sessions[0].close()

    async def relay(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
        url = backend + request.rel_url.path_qs
        async with sessions[0].request(request.method, url, data=body, headers=headers) as up:
            copied = {k: up.headers[k] for k in _COPIED if k in up.headers}
            if not up.headers.get("Content-Type", "").startswith("text/event-stream"):
                return web.Response(status=up.status, body=await up.read(), headers=copied)
            resp = web.StreamResponse(status=up.status, headers=copied)
            await resp.prepare(request)
            if per_event:
                tail = b""
                async for chunk in up.content.iter_any():
                    *events, tail = (tail + chunk).split(b"\n\n")
                    for event in events:
                        await resp.write(event + b"\n\n")
                if tail:
                    await resp.write(tail)
            else:
                async for chunk in up.content.iter_any():
                    await resp.write(chunk)
            await resp.write_eof()
            return resp

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    if lag:
        _add_lag(app)
    app.router.add_route("*", "/{tail:.*}", relay)
    return app


def _add_lag(app: web.Application) -> None:
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from capture_proxy.proxy.loop_lag import sample_lag
    from capture_proxy.proxy.metrics import _LAG_BUCKETS_S

    registry = CollectorRegistry()
    histogram = Histogram(
        "capture_proxy_event_loop_lag_seconds", "lag", buckets=_LAG_BUCKETS_S, registry=registry
    )
    tasks: list[asyncio.Task[None]] = []

    async def start(app: web.Application) -> None:
        tasks.append(asyncio.create_task(sample_lag(histogram.observe)))

    async def stop(app: web.Application) -> None:
        tasks[0].cancel()

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), content_type="text/plain")

    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    app.router.add_get("/_relay/metrics", metrics)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--per-event", action="store_true", help="one write per SSE event")
    ap.add_argument("--lag", action="store_true", help="sample the loop lag: /_relay/metrics")
    args = ap.parse_args()
    serve(make_app(args.backend.rstrip("/"), per_event=args.per_event, lag=args.lag), args.port)


def serve(app: web.Application, port: int) -> None:
    """Serve ``app`` on 127.0.0.1:``port`` as ``capture-proxy serve`` does (uvloop when
    installed), no access log, until interrupted."""
    try:
        import uvloop

        loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    except ImportError:
        loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None, loop=loop)


if __name__ == "__main__":
    main()
