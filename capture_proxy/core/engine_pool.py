"""Which engine serves a rollout: a pin per routing key, placed by rendezvous hashing with a
load cap over healthy engines.

Owns the choice of one backend among several (``--backend`` repeated) for one engine request,
given the routing key (the rollout id by default), the keys' pins, each engine's requests in
flight and its health. Pure: no I/O, no clock (the caller passes ``now``, whole seconds of a
clock shared by every worker: the adapter's ``time.monotonic``), no aiohttp; the adapter
(``proxy.engines``) maps the board shared by the workers, probes health and sends.

The rule: a key's requests go to the engine it is pinned to while that engine is up. A key
with no live pin (its first request, none for ``pin_idle_s``, or its engine down) is placed
by consistent hashing with bounded loads (Mirrokni, Thorup and Zadimoghaddam 2018) over
rendezvous hashing, as HAProxy's ``hash-balance-factor`` does over its ring: the key ranks
the backends by ``blake2b(key, backend)`` and goes to the first healthy one whose requests in
flight (every worker's) are under the cap ``ceil(balance_factor * (in_flight_total + 1) /
healthy)``, and is pinned there. A pin is live while a request of its key runs and for
``pin_idle_s`` after the last one ended: it is renewed as each request ends, and every probe
round renews the pins of the keys with requests in flight (``renew``), so a call longer than
``pin_idle_s`` keeps its rollout where it is, for every worker.

Why pins: a rollout's prefix cache is on one engine, and a move costs its whole prefix again.
The cap used to be checked at every request; agent traffic is bursty (a rollout's sessions
call together, then run tools), so bursts passed rollouts over and brought them back after
(12% of continuations on another engine at 3 engines with no failure, 38% on a loaded box).
Now the cap shapes only where a rollout starts, and a rollout moves only when its engine goes
down (it stays on its new engine after: its prefix is there now). Requests in flight are the
engines' load as their batches see it, every request counted once (by the worker that sent
it) and gone when it ends: an engine that comes back empty takes new rollouts only until it
carries its share, and a dead engine's load leaves with its failed requests.

Workers (``serve --workers``) share one ``PinBoard`` (a mapped file): the pins, so a rollout
whose sessions reach different workers goes to one engine, and each worker's requests in
flight per engine, summed for the cap. A worker writes its own row only. A placement holds
the board's lock (the adapter's ``flock``) and first looks again for a pin another worker
made meanwhile, so two workers placing one key at once agree; a pin's renewal writes only its
last use, and only while it still names the engine the worker used. A pin is two hash slots
(two-choice hashing) holding a fingerprint of the key: a key whose slots both hold other live
keys takes the one used least lately, and that key is placed again at its next request
(usually to the same engine: its first choice under the cap).

When every backend is unhealthy a key goes to its pinned engine if that one still takes
connections (a busy engine whose probes time out, not one whose port refuses: under load
every probe may be late), else to its first such engine in its order, else to its first: its
error reaches the harness as it would with one engine. That choice pins nothing.

Cost per request: the key's ranking and slots are computed once and kept (a bounded LRU of
``max_keys`` keys, which also remembers the engine each went to last, for ``moves``), then a
pin read, at most once a second a last-use write, and two counter writes (in flight):
O(1). A placement sums the workers' rows (numpy over workers x engines), once per rollout.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import re
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

#: An attempt suffix of a rollout id (DESIGN.md, "Words": a retried episode is ``<id>-a<n>``).
_ATTEMPT_SUFFIX = re.compile(r"-a\d+$")

#: Hash slots of the pins (``PinBoard``): 3 unsigned 32-bit words each (fingerprint, engine
#: index + 1, last use in seconds): 3 MiB, touched pages only.
PIN_SLOTS = 1 << 18
_WORDS = 3


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


def pin_board_words(engines: int, workers: int) -> int:
    """The 32-bit words of a ``PinBoard`` of ``engines`` backends and ``workers`` workers."""
    return PIN_SLOTS * _WORDS + workers * engines


class PinBoard:
    """The pins of the routing keys and the requests in flight per (worker, engine), in one
    buffer of ``pin_board_words`` unsigned 32-bit words (``memoryview.cast("I")`` of a
    ``bytearray`` for one process, of a shared ``mmap`` for workers): ``PIN_SLOTS`` slots of
    (fingerprint, engine index + 1 or 0 for none, last use in seconds), then per worker a row
    of ``engines`` counts. This worker (``index``) writes its own row only. Starting zeroes
    that row (a replaced worker's requests died with it); the pins stay. ``lock``: a context
    that excludes the other workers while one places a key (the adapter's ``flock``)."""

    def __init__(
        self,
        words: memoryview,
        *,
        engines: int,
        workers: int = 1,
        index: int = 0,
        lock: Callable[[], contextlib.AbstractContextManager[object]] = contextlib.nullcontext,
    ):
        if len(words) != pin_board_words(engines, workers) or words.format != "I":
            raise ValueError("a pin board needs pin_board_words(engines, workers) words 'I'")
        if not 0 <= index < workers:
            raise ValueError(f"worker index {index} not in 0..{workers - 1}")
        self.words = words
        self.lock = lock
        self.engines = engines
        self.workers = workers
        rows = PIN_SLOTS * _WORDS
        self._row = rows + index * engines
        words[self._row : self._row + engines] = memoryview(bytes(4 * engines)).cast("I")
        #: every worker's rows, [workers, engines] uint32, a view of ``words``
        self._rows = np.frombuffer(words, dtype=np.uint32, offset=4 * rows).reshape(
            workers, engines
        )

    @classmethod
    def local(cls, engines: int) -> PinBoard:
        """A board for one process."""
        return cls(memoryview(bytearray(4 * pin_board_words(engines, 1))).cast("I"),
                   engines=engines)  # fmt: skip

    def pinned(self, key: KeySlots, fresh_since: int) -> int | None:
        """The engine index ``key`` is pinned to, if its pin was used at ``fresh_since`` or
        later; else None."""
        w = self.words
        for slot in key.slots:
            i = slot * _WORDS
            if w[i] == key.fingerprint and w[i + 2] >= fresh_since and 0 < w[i + 1] <= self.engines:
                return int(w[i + 1]) - 1
        return None

    def pin(self, key: KeySlots, engine: int, now: int) -> None:
        """Pin ``key`` to ``engine`` at ``now``: in its slot if it has one, else in the slot
        used least lately of its two (under ``lock``)."""
        w = self.words
        a, b = (slot * _WORDS for slot in key.slots)
        if w[b] == key.fingerprint and w[a] != key.fingerprint:
            i = b
        elif w[a] == key.fingerprint:
            i = a
        else:
            i = a if w[a + 2] <= w[b + 2] else b
        w[i], w[i + 1], w[i + 2] = key.fingerprint, engine + 1, now

    def touch(self, key: KeySlots, engine: int, now: int) -> None:
        """Renew the last use of ``key``'s pin to ``engine`` (no lock: only the time is
        written, and only while the pin still names that engine)."""
        w = self.words
        for slot in key.slots:
            i = slot * _WORDS
            if w[i] == key.fingerprint and w[i + 1] == engine + 1:
                w[i + 2] = max(int(w[i + 2]), now)
                return

    def count(self, engine: int, delta: int) -> None:
        """Add ``delta`` to this worker's requests in flight on ``engine``."""
        i = self._row + engine
        self.words[i] = max(0, self.words[i] + delta)

    def loads(self) -> list[int]:
        """Requests in flight per engine, summed over the workers."""
        return [int(n) for n in self._rows.sum(axis=0, dtype=np.int64)]


@dataclass(frozen=True)
class KeySlots:
    """A routing key's place on a ``PinBoard``: a nonzero 32-bit fingerprint and two slots."""

    fingerprint: int
    slots: tuple[int, int]

    @classmethod
    def of(cls, key: str) -> KeySlots:
        digest = hashlib.blake2b(key.encode(), digest_size=12, person=b"engine-pin").digest()
        fingerprint = int.from_bytes(digest[:4], "big") or 1
        a = int.from_bytes(digest[4:8], "big") % PIN_SLOTS
        b = int.from_bytes(digest[8:12], "big") % PIN_SLOTS
        return cls(fingerprint, (a, b))


@dataclass
class Backend:
    """One engine: its base URL (no trailing slash, no credential), its index in the pool,
    this worker's requests in flight on it, health (None: not probed yet, taken as healthy),
    whether it takes connections (False while its last failure was a connection that could
    not be made: nothing listens) and how many requests it was chosen for."""

    url: str
    index: int = 0
    in_flight: int = 0
    healthy: bool | None = None
    chosen: int = 0
    reachable: bool = True

    @property
    def up(self) -> bool:
        return self.healthy is not False


@dataclass
class _Key:
    """A routing key this worker routed: its ranking (backend indexes, highest hash weight
    first), its pin slots, the engine it last went to and when (seconds), its requests in
    flight here."""

    ranking: tuple[int, ...]
    slots: KeySlots
    engine: int = -1
    used_at: int = -1
    #: this worker's requests of the key in flight
    in_flight: int = 0


class BackendPool:
    """The backends and the choice among them (module docstring). Not thread-safe: one
    event loop owns it. ``pins``: the board shared with the other workers (default: this
    process's own); ``pin_idle_s``: seconds after a key's last request that its pin holds."""

    def __init__(
        self,
        urls: list[str],
        *,
        balance_factor: float = 1.1,
        pin_idle_s: int = 600,
        pins: PinBoard | None = None,
        max_keys: int = 65536,
    ) -> None:
        if not urls:
            raise ValueError("a backend pool needs at least one backend")
        if len(set(urls)) != len(urls):
            raise ValueError(f"backend URLs repeat: {urls}")
        if balance_factor < 1.0:
            raise ValueError("balance_factor must be >= 1.0")
        if pins is not None and pins.engines != len(urls):
            raise ValueError(f"the pin board is for {pins.engines} engines, not {len(urls)}")
        self.backends = [Backend(url, i) for i, url in enumerate(urls)]
        self.by_url = {b.url: b for b in self.backends}
        self.balance_factor = balance_factor
        self.pin_idle_s = pin_idle_s
        self.pins = pins or PinBoard.local(len(urls))
        self.max_keys = max_keys
        #: the keys this worker routed, least lately used first (at most ``max_keys``)
        self._keys: OrderedDict[str, _Key] = OrderedDict()
        #: the keys with requests in flight here
        self._busy: dict[str, _Key] = {}
        #: how many times a key's request went to another backend than its previous one
        self.moves = 0
        self._up = len(self.backends)

    @property
    def primary(self) -> Backend:
        return self.backends[0]

    def ranking(self, key: str) -> tuple[Backend, ...]:
        """The backends in ``key``'s rendezvous order (highest hash weight first)."""
        return tuple(self.backends[i] for i in self._key(key).ranking)

    def _key(self, key: str) -> _Key:
        known = self._keys.get(key)
        if known is not None:
            return known
        urls = [b.url for b in self.backends]
        order = sorted(range(len(urls)), key=lambda i: _weight(key, urls[i]), reverse=True)
        return _Key(tuple(order), KeySlots.of(key))

    def cap(self, loads: list[int]) -> int:
        """Most requests in flight an engine may hold before a key placed now goes past it."""
        healthy = self._up or len(self.backends)
        return math.ceil(self.balance_factor * (sum(loads) + 1) / healthy)

    def choose(self, key: str | None, now: int) -> Backend:
        """The backend for one request with routing key ``key`` (None: the healthy one with
        the fewest of this worker's requests in flight) at ``now`` (seconds). Pins nothing
        and counts nothing (``acquire``)."""
        if len(self.backends) == 1:
            return self.primary
        if key is None:
            return self.backends[self._least_loaded()]
        return self.backends[self._choose(self._key(key), now, place=False)[0]]

    def _least_loaded(self) -> int:
        up = [i for i, b in enumerate(self.backends) if b.up] or range(len(self.backends))
        return min(up, key=lambda i: self.backends[i].in_flight)

    def _choose(self, state: _Key, now: int, *, place: bool) -> tuple[int, bool]:
        """The backend index for the key of ``state``, and whether it is the key's pin (to
        renew; not a placement, not the all-down choice); ``place``: pin a placement (under
        the board's lock, so two workers placing one key at once agree)."""
        pinned = self.pins.pinned(state.slots, now - self.pin_idle_s)
        if pinned is not None and self.backends[pinned].up:
            return pinned, True
        if state.in_flight:  # a request of it still runs here: not idle, its pin holds
            held = self.pins.pinned(state.slots, 0)
            engine = held if held is not None else state.engine
            if self.backends[engine].up:
                return engine, True
        with self.pins.lock() if place else contextlib.nullcontext():
            if place:  # another worker's pin, made meanwhile
                pinned = self.pins.pinned(state.slots, now - self.pin_idle_s)
                if pinned is not None and self.backends[pinned].up:
                    return pinned, True
            loads = self.pins.loads()
            cap = self.cap(loads)
            for i in state.ranking:
                if self.backends[i].up and loads[i] < cap:
                    if place:
                        self.pins.pin(state.slots, i, now)
                    return i, False
        # all down: its pinned engine if that takes connections (slow, not dead), else the
        # key's first that does, else its first
        if pinned is not None and self.backends[pinned].reachable:
            return pinned, False
        live = (i for i in state.ranking if self.backends[i].reachable)
        return next(live, state.ranking[0]), False

    def acquire(self, key: str | None, now: int) -> Backend:
        """``choose`` at ``now`` (seconds), pin the key where it was placed, and count the
        request in flight on its backend (``release`` it)."""
        if len(self.backends) == 1:  # nothing to choose, pin or share
            self.primary.in_flight += 1
            self.primary.chosen += 1
            return self.primary
        if key is None:
            index = self._least_loaded()
        else:
            state = self._keys.pop(key, None) or self._key(key)
            self._keys[key] = state  # most lately used last
            index, pinned = self._choose(state, now, place=True)
            self._use(state, index, now, renew=pinned)
            state.in_flight += 1
            self._busy[key] = state
            if len(self._keys) > self.max_keys:
                self._evict()
        backend = self.backends[index]
        backend.in_flight += 1
        backend.chosen += 1
        self.pins.count(index, +1)
        return backend

    def _use(self, state: _Key, index: int, now: int, *, renew: bool) -> None:
        if renew and state.used_at != now:
            self.pins.touch(state.slots, index, now)  # its last use, at most once a second
        if state.engine != index:
            if state.engine >= 0:
                self.moves += 1
            state.engine = index
        state.used_at = now

    def _evict(self) -> None:
        """Forget the least lately used keys with no request in flight here, down to
        ``max_keys`` (keys in flight stay: their pins are renewed from them)."""
        excess = len(self._keys) - self.max_keys
        victims: list[str] = []
        for key, state in self._keys.items():  # least lately used first; the busy are few
            if len(victims) == excess:
                break
            if not state.in_flight:
                victims.append(key)
        for key in victims:
            del self._keys[key]

    def release(self, backend: Backend, key: str | None, now: int | None = None) -> None:
        """A request ``acquire(key, ...)`` counted ended (``key``: the same, ``now``: seconds,
        None: no renewal): its key's pin is renewed, as its last use is the end of its last
        request."""
        backend.in_flight -= 1
        if len(self.backends) == 1:
            return
        self.pins.count(backend.index, -1)
        state = self._busy.get(key) if key is not None else None
        if key is None or state is None:
            return
        state.in_flight -= 1
        if not state.in_flight:
            del self._busy[key]
        if now is not None:
            self.pins.touch(state.slots, state.engine, now)

    def renew(self, now: int) -> None:
        """Renew the pins of the keys with requests in flight here at ``now`` (a call that
        runs longer than ``pin_idle_s`` keeps its rollout's pin for the other workers too):
        every probe round, O(keys in flight)."""
        for state in self._busy.values():
            self.pins.touch(state.slots, state.engine, now)

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
