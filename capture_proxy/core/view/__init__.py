"""Page models of the chain viewer (``/captures/ui/``), as plain data. Pure.

Owns what the viewer shows, not how it is served: the rollout listing rows and their filters
(``rollouts``), a rollout's chains laid out as a tree of calls with its marks (``call_tree``),
and a call's tokens as spans with roles, log-prob shading and routed-expert rows, plus the
side-by-side view of a refused link (``tokens``). No aiohttp, no I/O, no templates: the adapter in
``capture_proxy.viewer`` loads records, detokenises, and renders these models with Jinja2.
"""
