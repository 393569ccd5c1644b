"""The chain viewer: HTML pages under ``/captures/ui/`` over the read API's store.

Owns the aiohttp handlers, templates (Jinja2, server-rendered) and static files (small vanilla
JS and CSS, no CDN). Page models are built by ``capture_proxy.core.view`` (pure); records are
read with the store's own methods, and models are built and templates rendered on the REST
thread, so a long page never holds the event loop that relays streams. Auth is the read API's
(``captures_token``; see ``proxy.auth`` for the cookie and ``?token=``).
"""

from capture_proxy.viewer.pages import ViewerConfig, add_viewer_routes

__all__ = ["ViewerConfig", "add_viewer_routes"]
