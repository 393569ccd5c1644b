"""Facts about the messages of earlier requests, so that a call derives them for its new ones only.

An agent harness sends the whole history with every call: all but the last few messages of a
request were in the rollout's previous request. What the proxy derives from one message depends
on its value only: whether it is a valid chat message (``core.requests``), its canonical text
and content address for the store (``core.codec``), and its canonical turn for the parent digest
(``core.linking``). Derived anew on every call, that work grew with the history (on a 120-turn
session: about 3 ms of a 20 ms call at the last turn, against nothing at the first).

``KnownMessages`` keeps those facts per message value. The key is the message's orjson text
(compact, keys in their order): two messages with the same key are the same JSON value, and the
key tells apart what Python's ``==`` does not (``1``, ``1.0`` and ``true``). Messages come from
JSON, which has no NaN or infinities (``json_bodies.parse_json_object`` refuses them, also a number
past the double range), so no key's ``null`` stands for one (orjson writes them as ``null``). A
message orjson
cannot write (an integer past 64 bits, a lone surrogate, deep nesting) gets facts that are
derived every time and not kept. Bounded by the bytes of the kept keys and texts, least
recently used out first: eviction costs time, never correctness. Pure: no I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from capture_proxy.core.linking.digests import message_payload
from capture_proxy.core.stored_form import (
    CHAIN_START,
    MessageDigests,
    canonical_json,
    chain_step,
    json_sha256_bytes,
)

#: Default bound (bytes of keys and texts): the histories of a few hundred long sessions.
DEFAULT_MAX_BYTES = 128 * 1024 * 1024


@dataclass(slots=True, eq=False)
class MessageFacts:
    """What is known of one message value.

    ``key``: its orjson text (None when orjson cannot write it; such facts are not kept);
    ``text``/``sha256``: its canonical JSON text (``stored_form.canonical_json``; None when it has
    none, e.g. NaN) and the SHA-256 of that text's UTF-8 bytes; ``turn``: what the message adds
    to the parent digest (``linking.message_payload``: an assistant turn's payload, another
    message's images; None: nothing); ``valid``: it passed chat-message validation (set by
    ``core.requests``); ``chain``: ``(before, after)``, the chain digests
    (``stored_form.MessageDigests.chain``, 32 bytes each) before and after this message where
    ``message_digests`` last saw it (an agent's history repeats each message after the same
    ones at every call: its chain digest is then not hashed again); ``linked``: the same for
    the parent digest's chain (``linking.digests.history_digest``'s ``steps``: hex digests)."""

    key: bytes | None
    text: str | None
    sha256: bytes | None
    turn: str | None
    valid: bool = False
    chain: tuple[bytes, bytes] | None = None
    linked: tuple[str, str] | None = None

    def same_value(self, other: MessageFacts) -> bool:
        """True when both are known to be the same JSON value (equal keys)."""
        return self is other or (self.key is not None and self.key == other.key)


def derive_facts(message: Any, key: bytes | None) -> MessageFacts:
    """The facts of one message (``key``: its orjson text, or None)."""
    try:
        text: str | None = canonical_json(message)
    except ValueError:  # NaN or infinities: no canonical text (the store's write names it)
        text = None
    sha = json_sha256_bytes(text) if text is not None else None
    turn = None
    if isinstance(message, Mapping):
        try:
            turn = message_payload(message)
        except Exception:  # a malformed message: validation names it; digests derive anew
            turn = None
    return MessageFacts(key, text, sha, turn)


def message_key(message: Any) -> bytes | None:
    """A message's key: its orjson text; None when orjson cannot write it."""
    try:
        return orjson.dumps(message)
    except TypeError:
        return None


class KnownMessages:
    """Facts by message key, at most ``max_bytes`` (keys and texts) in all."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._facts: OrderedDict[bytes, MessageFacts] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._facts)

    def facts(
        self, messages: Sequence[Any], head: Sequence[MessageFacts] = ()
    ) -> tuple[MessageFacts, ...]:
        """The facts of each message, in order: known ones as kept, new ones derived (and
        kept). Work per known message: one orjson write and one lookup. ``head``: the facts
        of the first ``len(head)`` messages, known already (``known_bodies``: the same
        objects as an earlier request's, whose facts these are): taken as they are."""
        out = list(head)
        kept = self._facts
        for message in messages[len(head) :]:
            key = message_key(message)
            if key is None:
                out.append(derive_facts(message, None))
                continue
            found = kept.get(key)
            if found is None:
                found = derive_facts(message, key)
                self._keep(key, found)
            else:
                kept.move_to_end(key)
            out.append(found)
        return tuple(out)

    def _keep(self, key: bytes, facts: MessageFacts) -> None:
        size = _size(key, facts)
        if size > self.max_bytes:
            return
        self._facts[key] = facts
        self._bytes += size
        while self._bytes > self.max_bytes:
            old_key, old = self._facts.popitem(last=False)
            self._bytes -= _size(old_key, old)


def _size(key: bytes, facts: MessageFacts) -> int:
    return len(key) + len(facts.text or "") + len(facts.turn or "") + 200


def message_digests(facts: Sequence[MessageFacts]) -> MessageDigests:
    """The ``stored_form.MessageDigests`` of the messages these are the facts of. Raises ValueError
    when one has no canonical text (as ``MessageDigests.of`` does). A message whose facts saw
    the same chain digest before it last time (``MessageFacts.chain``) is not hashed again:
    work for the history a call repeats is a lookup per message, not a SHA-256."""
    texts, digests, chain = [], [], [CHAIN_START]
    for i, f in enumerate(facts):
        if f.text is None or f.sha256 is None:
            raise ValueError(f"message {i} has no canonical JSON text (NaN or infinity)")
        texts.append(f.text)
        digests.append(f.sha256)
        before, seen = chain[-1], f.chain
        if seen is not None and seen[0] == before:
            chain.append(seen[1])
        else:
            after = chain_step(before, f.sha256)
            f.chain = (before, after)
            chain.append(after)
    return MessageDigests(tuple(texts), tuple(digests), tuple(chain))


def turn_payloads(facts: Sequence[MessageFacts]) -> list[str | None]:
    """The parent-digest payloads of the messages (``linking.history_digest``'s ``payloads``)."""
    return [f.turn for f in facts]


def same_messages(a: Sequence[MessageFacts], b: Sequence[MessageFacts]) -> list[bool]:
    """Position by position: known to be the same value (over the shorter of the two)."""
    return [x.same_value(y) for x, y in zip(a, b, strict=False)]
