"""Earlier request bodies, so that a call parses only the bytes its history does not repeat.

An agent harness sends the whole history with every call, serialised the same way each time:
the bytes of a request begin with the bytes of the session's previous request up to the end
of its last message (or of an earlier one, where the harness rewrote the history). Parsed whole,
with its checks (``json_bodies.parse_json_object``: a 19-digit number, the nesting), a request
cost grows with the history: about 330 us at the 120th call of a coding session (180 KB, 240
messages), and the message facts (``known_messages``) another 120 us.

``KnownBodies.parse(raw, scope, name)`` gives what ``parse_json_object(raw)`` gives (the same
values, types and key order; errors: the same InvalidRequest, from ``parse_json_object`` itself)
and, where it can, reads only the new bytes:

1. The compiled scan (``chunk_scan.SCAN_HISTORY``, ``_chunkscan.c``'s ``scan_history``) reads the
   top-level object up to the end of the second element of its ``name`` array (``messages``,
   Responses' ``input``): the bytes up to there, with ``scope`` (the rollout), are the key
   under which the session's earlier bodies are kept.
2. Of the bodies kept under that key, the one sharing the longest byte prefix with ``raw``
   (``common_prefix``, a memcmp) whose first ``k`` elements lie wholly inside that prefix:
   those ``k`` elements are the same JSON values in ``raw`` (the same bytes, read from the
   same state), so they are taken from the earlier body as they are (the same objects), and
   so are the top-level members before the array (their bytes are in the prefix too).
3. The scan validates ``raw`` again, but from the end of element ``k - 1`` (the prefix was
   validated when the earlier body was read) to the end, and gives where each new element
   ends; orjson parses the new elements and the members after the array (taken from the
   earlier body too when their bytes are the same).

The compiled scan accepts only what orjson and the stdlib read the same way and
``parse_json_object`` accepts unchanged (strict JSON, no integer of more than 18 digits, no
exponent of more than 2 digits, no ``\\u`` escape of a surrogate, at most 64 levels, no name
twice in an object, at most 32 members, no escaped member names; see ``_chunkscan.c``):
anything else, and anything orjson then refuses, goes to ``parse_json_object`` whole, as
before, and is not kept. So the body's value is exactly the whole parse's; only the work
differs. Bodies are shared, never changed: the proxy makes new dicts and lists where it
changes a request (``tests/core/test_known_bodies.py`` compares both paths over generated
bodies and edits).

Kept: at most ``max_bytes`` in all, a body counted as twice its bytes (the bytes and their
parsed value, which is about as large for an agent's text; the records of recent calls hold
most of those values too) and a key as its bytes; at most ``per_key`` bodies per key (the
branches of one session); the least recently used key out first. A body whose every element
the next one repeats is replaced by it: a session keeps one body per live branch. Eviction
costs time, never correctness. Without the compiled module every body is parsed whole. Pure: no I/O.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson

from capture_proxy.core.chunk_scan import COMMON_PREFIX, SCAN_HISTORY
from capture_proxy.core.json_bodies import parse_json_object
from capture_proxy.core.known_messages import MessageFacts
from capture_proxy.core.linking.digests import RequestDigestState

#: Default bound (``KnownBodies.kept_bytes``): the latest requests of a few hundred long
#: sessions.
DEFAULT_MAX_BYTES = 128 * 1024 * 1024
#: Bodies kept under one key: the branches of one session (its first two messages).
DEFAULT_PER_KEY = 8
#: Elements of the history array in a key (a system prompt and the first user message tell
#: the sessions of one rollout apart).
KEY_ELEMENTS = 2

_WHITESPACE = b" \t\n\r"

M = TypeVar("M")


@dataclass(slots=True, eq=False)
class KnownBody:
    """One parsed request as kept: ``raw`` its bytes, ``body`` its value (never changed),
    ``name`` its history member, ``ends`` the byte offset after each element of
    ``body[name]``, ``array_close`` the offset of that array's ``]``. What the call made of
    it, for the session's next request: ``canonical`` and ``facts``, the call's canonical
    messages (the front's: ``body[name]`` itself for chat completions) and their
    ``known_messages`` facts; ``front_memo``, the front's conversion of the history (the
    Messages front's ``MessagesMemo``, the Responses front's ``ResponsesMemo``);
    ``digest_state``, the request digest's state after
    the canonical messages (``digests.request_digest_after``). None: not made."""

    raw: bytes
    body: dict[str, Any]
    name: str
    ends: tuple[int, ...]
    array_close: int
    canonical: Sequence[Any] | None = None
    facts: tuple[MessageFacts, ...] | None = None
    front_memo: Any = None
    digest_state: RequestDigestState | None = None


@dataclass(frozen=True, slots=True)
class ParsedBody:
    """``KnownBodies.parse``'s answer: ``body`` (``parse_json_object``'s value); ``repeated``:
    how many leading elements of its history array are ``previous``'s own (0: none, or
    ``previous`` is None); ``kept``: this body as kept (None: parsed whole and not kept)."""

    body: dict[str, Any]
    repeated: int = 0
    previous: KnownBody | None = None
    kept: KnownBody | None = None

    def head_facts_for(self, messages: Sequence[Any]) -> tuple[MessageFacts, ...]:
        """The earlier request's facts of the leading ``messages`` that are its canonical
        messages' very objects (the same objects: the same values; a front that converts the
        history gives the same objects where it took them from its ``front_memo``); empty
        when none, or the earlier facts are not known."""
        previous = self.previous
        if previous is None or previous.facts is None or previous.canonical is None:
            return ()
        same = 0
        for a, b in zip(previous.canonical, messages, strict=False):
            if a is not b:
                break
            same += 1
        return previous.facts[:same]

    def keep_facts(
        self, messages: Sequence[Any] | None, facts: tuple[MessageFacts, ...] | None
    ) -> None:
        """Keep the call's canonical ``messages`` and their ``facts`` with this body."""
        kept = self.kept
        fits = messages is not None and facts is not None and len(facts) == len(messages)
        if kept is not None and fits:
            kept.canonical, kept.facts = messages, facts

    def front_memo(self, kind: type[M]) -> M | None:
        """The front's conversion of the earlier request's history, when it is a ``kind``
        (the front's own memo type; None: none kept, or another front's)."""
        memo = self.previous.front_memo if self.previous is not None else None
        return memo if isinstance(memo, kind) else None

    def keep_front_memo(self, memo: Any) -> None:
        """Keep the front's conversion of this request's history with this body."""
        if self.kept is not None:
            self.kept.front_memo = memo

    def earlier_digest_state(self) -> RequestDigestState | None:
        """The earlier body's request digest state (``digests.request_digest_after``), if
        made."""
        return self.previous.digest_state if self.previous is not None else None

    def keep_digest_state(self, state: RequestDigestState | None) -> None:
        """Keep the call's request digest state with this body, for the session's next."""
        if self.kept is not None:
            self.kept.digest_state = state


class KnownBodies:
    """Recent request bodies by rollout and history head (see the module docstring)."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES, per_key: int = DEFAULT_PER_KEY):
        self.max_bytes = max_bytes
        self.per_key = max(per_key, 1)  # (the body just kept stays)
        self._kept: OrderedDict[tuple[str, str, bytes], list[KnownBody]] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return sum(len(bodies) for bodies in self._kept.values())

    @property
    def kept_bytes(self) -> int:
        """What is kept, as bounded: twice the bytes of each body, and the keys' bytes."""
        return self._bytes

    def parse(self, raw: bytes, scope: str, name: str) -> ParsedBody:
        """``raw`` parsed as ``parse_json_object`` does (raises its InvalidRequest), from
        the bytes an earlier body of ``scope`` did not hold where one does; ``name``: the
        member holding the history (an array)."""
        scan, common = SCAN_HISTORY, COMMON_PREFIX
        if scan is None or common is None or type(raw) is not bytes:  # (the scan's type)
            return ParsedBody(parse_json_object(raw))
        member = name.encode("utf-8")
        head = scan(raw, member, 0, 0, KEY_ELEMENTS)
        if head is None or not head[0]:
            return ParsedBody(parse_json_object(raw))
        key = (scope, name, raw[: head[0][-1]])
        previous, repeated = _longest(self._kept.get(key), raw, common)
        if previous is not None:
            spans = scan(raw, member, previous.ends[repeated - 1], repeated, 0)
            made = _extend(raw, previous, repeated, spans) if spans is not None else None
            if made is not None:
                kept = self._keep(key, made, previous if repeated == len(previous.ends) else None)
                return ParsedBody(made.body, repeated, previous, kept)
        spans = scan(raw, member, 0, 0, 0)
        if spans is None:
            return ParsedBody(parse_json_object(raw))
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:  # (what the scan took and orjson does not: the stdlib's)
            return ParsedBody(parse_json_object(raw))
        made = KnownBody(raw, body, name, tuple(spans[0]), spans[1])
        return ParsedBody(body, kept=self._keep(key, made, None))

    def _keep(
        self, key: tuple[str, str, bytes], body: KnownBody, replaces: KnownBody | None
    ) -> KnownBody | None:
        size = _size(body)
        if size + len(key[2]) > self.max_bytes:
            return None
        bodies = self._kept.get(key)
        if bodies is None:
            bodies = self._kept[key] = []
            self._bytes += len(key[2])
        else:
            self._kept.move_to_end(key)
        if replaces is not None and replaces in bodies:
            bodies.remove(replaces)
            self._bytes -= _size(replaces)
        bodies.append(body)
        self._bytes += size
        if len(bodies) > self.per_key:
            self._bytes -= _size(bodies.pop(0))
        while self._bytes > self.max_bytes:
            old_key = next(iter(self._kept))
            if old_key == key:
                # (only this key left, its branches over the bound: its oldest go, never the
                # body just kept, which fits alone)
                self._bytes -= _size(bodies.pop(0))
                continue
            old = self._kept.pop(old_key)
            self._bytes -= len(old_key[2]) + sum(_size(b) for b in old)
        return body


def _size(body: KnownBody) -> int:
    return 2 * len(body.raw)


def _longest(
    bodies: list[KnownBody] | None, raw: bytes, common: Any
) -> tuple[KnownBody | None, int]:
    """Of ``bodies``, the one whose leading elements ``raw`` repeats most (the latest of
    equals), and how many (0: none)."""
    best, most = None, 0
    for body in reversed(bodies or ()):
        shared = common(raw, body.raw)
        repeated = bisect_right(body.ends, shared)  # the elements ending inside the prefix
        if repeated > most:
            best, most = body, repeated
    return best, most


def _extend(
    raw: bytes, previous: KnownBody, repeated: int, spans: tuple[list[int], int]
) -> KnownBody | None:
    """``raw``'s value from ``previous``'s first ``repeated`` elements and members before the
    array, and orjson's parse of the rest (``spans``: ``scan_history`` from the end of element
    ``repeated - 1``). None where orjson refuses a piece."""
    ends, array_close = spans
    name = previous.name
    head: dict[str, Any] = {}
    tail_kept: dict[str, Any] = {}
    seen = False
    for key, value in previous.body.items():
        if key == name:
            seen = True
        elif seen:
            tail_kept[key] = value
        else:
            head[key] = value
    tail_bytes = raw[array_close + 1 :]
    try:
        # b"[0" + b", <element>, ..." + b"]": the new elements after a placeholder
        added = orjson.loads(b"[0" + raw[previous.ends[repeated - 1] : array_close] + b"]")[1:]
        if tail_bytes == previous.raw[previous.array_close + 1 :]:
            tail = tail_kept
        else:
            rest = tail_bytes.lstrip(_WHITESPACE)
            tail = orjson.loads(b"{" + rest[1:]) if rest[:1] == b"," else {}
    except orjson.JSONDecodeError:
        return None
    items = previous.body[name]
    body = {**head, name: [*items[:repeated], *added], **tail}
    return KnownBody(raw, body, name, previous.ends[:repeated] + tuple(ends), array_close)
