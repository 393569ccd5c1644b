"""The bounds of one proxy process's caches, from the MB they may hold in all.

The caches (each bounded by an estimate of what it holds; a miss reads the store or parses
again: time, never correctness) share the budget in fixed proportions, those of their full
sizes (``config/memory_budget.py`` ``FULL_CACHE_MB``, 1,232 MB):

| cache | full size | |
| --- | --- | --- |
| recent records (``proxy/recent.py``) | 512 MB | the parents of the next calls |
| parent-digest indexes (``proxy/rollout_indexes.py``) | 131,072 calls | about 3.5 KB a call |
| message facts (``core/known_messages.py``) | 128 MB | |
| request bodies (``core/known_bodies.py``) | 128 MB | twice their bytes |
| tool lists (``core/known_tools.py``) | 16 MB | |

Must not: do I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from capture_proxy.config.memory_budget import FULL_CACHE_MB
from capture_proxy.core import known_bodies, known_messages, known_tools
from capture_proxy.proxy import recent

#: the parent-digest indexes' calls at the full size
FULL_INDEX_CALLS = 131_072


@dataclass(frozen=True, slots=True)
class CacheBounds:
    """What each cache of one process may hold."""

    recent_bytes: int
    index_calls: int
    message_facts_bytes: int
    request_bodies_bytes: int
    tools_bytes: int

    @classmethod
    def of(cls, cache_mb: int = FULL_CACHE_MB, index_calls: int | None = None) -> CacheBounds:
        """The bounds for ``cache_mb`` MB in all (each cache its share of its full size, at
        least one entry's worth); ``index_calls``, if given, the indexes' calls instead of
        their share (setting ``link_index_max_calls``)."""
        scale = cache_mb / FULL_CACHE_MB

        def share(full: int) -> int:
            return max(1, int(full * scale))

        return cls(
            recent_bytes=share(recent.DEFAULT_MAX_BYTES),
            index_calls=index_calls if index_calls is not None else share(FULL_INDEX_CALLS),
            message_facts_bytes=share(known_messages.DEFAULT_MAX_BYTES),
            request_bodies_bytes=share(known_bodies.DEFAULT_MAX_BYTES),
            tools_bytes=share(known_tools.DEFAULT_MAX_BYTES),
        )
