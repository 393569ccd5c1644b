"""Generations continued after an abort: a prompt that is an earlier prompt followed by the
first tokens of that prompt's generation gets the rest of the same generation.

A model continues such a prompt by itself; the scripted engine, which replays a script, finds
it among the generations it made lately (``GENERATIONS``, the last ``KEPT`` of them), so a
proxy that continues an aborted generation tokens in gets the tokens and log probs an
uninterrupted generation would have had. Must not: do I/O.
"""

from __future__ import annotations

from aiohttp import web

from capture_proxy.scripted_engine.generation import Generation
from capture_proxy.scripted_engine.state import GENERATIONS

#: generations kept to be continued (tests make a few hundred at most)
KEPT = 512


def continued_generation(app: web.Application, prompt: list[int]) -> Generation | None:
    """The rest of a remembered generation that ``prompt`` continues, else None."""
    kept: list[tuple[list[int], Generation]] = app[GENERATIONS]
    for earlier, gen in reversed(kept):
        n = len(earlier)
        k = len(prompt) - n
        if 0 < k < len(gen.token_ids) and prompt[:n] == earlier and prompt[n:] == gen.token_ids[:k]:
            return gen.after(k)
    return None


def remember_generation(app: web.Application, prompt: list[int], gen: Generation) -> None:
    """Keep ``gen`` (untruncated) as the generation of ``prompt``."""
    kept = app[GENERATIONS]
    kept.append((list(prompt), gen))
    del kept[:-KEPT]
