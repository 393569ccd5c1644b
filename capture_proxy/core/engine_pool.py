"""Which engine serves a rollout: rendezvous hashing with a load cap, over healthy engines.

Owns the choice of one backend among several (``--backend`` repeated) for one engine request,
given the routing key (the rollout id by default), each backend's requests in flight and its
health. Pure: no I/O, no clock, no aiohttp; the adapter (``proxy.engines``) counts the
requests in flight, probes health and sends.

The rule (consistent hashing with bounded loads, Mirrokni, Thorup and Zadimoghaddam 2018,
over rendezvous hashing as HAProxy's ``hash-balance-factor`` does it over its ring): each key
ranks the backends by ``blake2b(key, backend)``; the request goes to the first healthy
backend in that order whose requests in flight are under the cap
``ceil(balance_factor * (in_flight_total + 1) / healthy)``. So a rollout's calls all go to
one engine (its prefix cache) unless that engine is down or over ``balance_factor`` times the
mean load; then to the key's next engine, the same one each time. When every backend is
unhealthy the key's first one that still takes connections is chosen anyway (a busy engine
whose probes time out, not one whose port refuses: under load every probe may be late), else
the key's first: its error reaches the harness as it would with one engine.

Cost per choice: the ranking is computed once per key and kept (a bounded LRU of
``max_keys``), then a walk that stops at the first backend under the cap: O(1) amortised.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections import OrderedDict
from dataclasses import dataclass

#: An attempt suffix of a rollout id (DESIGN.md, "Words": a retried episode is ``<id>-a<n>``).
_ATTEMPT_SUFFIX = re.compile(r"-a\d+$")


def routing_key(rollout_id: str, kind: str) -> str | None:
    """The routing key of a call of ``rollout_id``: ``rollout``: the id itself; ``episode``:
    the id without its attempt suffix ``-a<n>`` (retries of a rollout share an engine and its
    prefix cache); ``none``: None (no key sent). Raises ValueError for another ``kind``."""
    if kind == "rollout":
        return rollout_id
    if kind == "episode":
        return _ATTEMPT_SUFFIX.sub("", rollout_id)
    if kind == "none":
        return None
    raise ValueError(f"unknown routing key kind {kind!r}")


@dataclass
class Backend:
    """One engine: its base URL (no trailing slash, no credential), requests in flight,
    health (None: not probed yet, taken as healthy), whether it takes connections (False while
    its last failure was a connection that could not be made: nothing listens) and how many
    requests it was chosen for."""

    url: str
    in_flight: int = 0
    healthy: bool | None = None
    chosen: int = 0
    reachable: bool = True

    @property
    def up(self) -> bool:
        return self.healthy is not False


class BackendPool:
    """The backends and the choice among them (module docstring). Not thread-safe: one
    event loop owns it."""

    def __init__(
        self, urls: list[str], *, balance_factor: float = 1.25, max_keys: int = 65536
    ) -> None:
        if not urls:
            raise ValueError("a backend pool needs at least one backend")
        if len(set(urls)) != len(urls):
            raise ValueError(f"backend URLs repeat: {urls}")
        if balance_factor < 1.0:
            raise ValueError("balance_factor must be >= 1.0")
        self.backends = [Backend(url) for url in urls]
        self.by_url = {b.url: b for b in self.backends}
        self.balance_factor = balance_factor
        self.max_keys = max_keys
        self._rankings: OrderedDict[str, tuple[Backend, ...]] = OrderedDict()
        #: the backend each key went to last, to count the keys that moved (``moves``)
        self._last: dict[str, str] = {}
        #: how many times a key's request went to another backend than its previous one
        self.moves = 0
        #: running totals, so the cap costs O(1): requests in flight, backends up
        self._in_flight = 0
        self._up = len(self.backends)

    @property
    def primary(self) -> Backend:
        return self.backends[0]

    def ranking(self, key: str) -> tuple[Backend, ...]:
        """The backends in ``key``'s rendezvous order (highest hash weight first)."""
        ranked = self._rankings.get(key)
        if ranked is not None:
            self._rankings.move_to_end(key)
            return ranked
        ranked = tuple(sorted(self.backends, key=lambda b: _weight(key, b.url), reverse=True))
        self._rankings[key] = ranked
        if len(self._rankings) > self.max_keys:
            old, _ = self._rankings.popitem(last=False)
            self._last.pop(old, None)
        return ranked

    def cap(self) -> int:
        """Most requests in flight a backend may hold before a key's request goes past it."""
        healthy = self._up or len(self.backends)
        return math.ceil(self.balance_factor * (self._in_flight + 1) / healthy)

    def choose(self, key: str | None) -> Backend:
        """The backend for one request with routing key ``key`` (None: the least loaded
        healthy one). Does not count the request in flight (``acquire`` does)."""
        if len(self.backends) == 1:
            return self.primary
        if key is None:
            up = [b for b in self.backends if b.up] or self.backends
            return min(up, key=lambda b: b.in_flight)
        ranked = self.ranking(key)
        cap = self.cap()
        chosen = None
        for backend in ranked:
            if backend.up and backend.in_flight < cap:
                chosen = backend
                break
        if chosen is None:
            # all down or at the cap: the key's first live one, else its first that takes
            # connections (slow, not dead), else its first
            chosen = next((b for b in ranked if b.up), None) or next(
                (b for b in ranked if b.reachable), ranked[0]
            )
        last = self._last.get(key)
        if last != chosen.url:
            if last is not None:
                self.moves += 1
            self._last[key] = chosen.url
        return chosen

    def acquire(self, key: str | None) -> Backend:
        """``choose`` and count the request in flight on the backend (``release`` it)."""
        backend = self.choose(key)
        backend.in_flight += 1
        backend.chosen += 1
        self._in_flight += 1
        return backend

    def release(self, backend: Backend) -> None:
        backend.in_flight -= 1
        self._in_flight -= 1

    def mark(self, url: str, healthy: bool, *, reachable: bool = True) -> bool:
        """Record a verdict on ``url``: ``healthy``, and ``reachable`` False when a connection
        to it could not be made. True when its health changed."""
        backend = self.by_url[url]
        changed = backend.healthy is not healthy
        self._up += int(healthy) - int(backend.up)
        backend.healthy = healthy
        backend.reachable = reachable
        return changed


def _weight(key: str, url: str) -> int:
    digest = hashlib.blake2b(f"{key}\x00{url}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")
