"""Facts about the ``tools`` of earlier requests, so that a call derives them for new values only.

An agent harness sends the same tool definitions with every call of a session (OpenCode about
21 KB, Codex CLI 17 KB, Claude Code 31 KB). What the proxy derives from them depends on their
value only: whether they are valid chat tools (``core.requests``), their canonical text and
content address for the store (``core.codec``), their part of the request digest
(``linking.digests.request_digest``), and what the Responses and Messages fronts make of their
own tools (the chat tools, ``forms``). Derived anew on every call, that came to 75-200 us per
call (``benchmarks/tools_pieces.py``).

``KnownTools`` keeps those facts per tools value, as ``known_messages.KnownMessages`` does per
message. The key is the value's orjson text (compact, keys in their order): two values with
the same key are the same JSON value, and the key tells apart what Python's ``==`` does not
(``1``, ``1.0`` and ``true``). A value orjson cannot write (an integer past 64 bits, a lone
surrogate, deep nesting) gets facts that are derived every time and not kept. Bounded by the
bytes of the kept keys and texts, least recently used out first: eviction costs time, never
correctness. Facts are shared by the calls that send the same value: treat what they hold
(``forms`` included) as read-only. Pure: no I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import orjson

from capture_proxy.core.known_messages import message_key
from capture_proxy.core.stored_form import canonical_json, json_sha256

#: Default bound (bytes of keys, texts and forms): a few hundred distinct tool sets.
DEFAULT_MAX_BYTES = 16 * 1024 * 1024

#: What a kept entry costs beyond its texts (the facts object, the dict slot).
_OVERHEAD = 200


@dataclass(slots=True, eq=False)
class ToolsFacts:
    """What is known of one tools value.

    ``key``: its orjson text (None when orjson cannot write it; such facts are not kept);
    ``text``/``sha256``: its canonical JSON text (``stored_form.canonical_json``; None when it
    has none, e.g. NaN) and the hex SHA-256 of that text (``stored_form.json_sha256``, the
    store's content address); ``sorted_text``: its text with sorted keys as orjson writes it,
    the bytes ``linking.digests.canonical_json`` gives (``request_digest`` splices it into the
    body's text; None when ``key`` is); ``valid``: it passed chat tools validation (set by
    ``core.requests``); ``forms``: what a front made of it, by front (``Api`` value; set by
    ``KnownTools.keep_form``)."""

    key: bytes | None
    text: str | None
    sha256: str | None
    sorted_text: bytes | None
    valid: bool = False
    forms: dict[str, Any] = field(default_factory=dict)
    #: bytes counted for this entry (texts and forms), when kept
    size: int = 0


def derive_tools_facts(tools: Any, key: bytes | None) -> ToolsFacts:
    """The facts of one tools value (``key``: its orjson text, or None)."""
    try:
        text: str | None = canonical_json(tools)
    except ValueError:  # NaN or infinities: no canonical text (the store's write names it)
        text = None
    sorted_text = orjson.dumps(tools, option=orjson.OPT_SORT_KEYS) if key is not None else None
    sha = json_sha256(text) if text is not None else None
    return ToolsFacts(key, text, sha, sorted_text)


#: A tools value's key: its orjson text, as a message's (None when orjson cannot write it).
tools_key = message_key


class KnownTools:
    """Facts by tools key, at most ``max_bytes`` (keys, texts and forms) in all."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._facts: OrderedDict[bytes, ToolsFacts] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._facts)

    @property
    def kept_bytes(self) -> int:
        """The bytes counted for the kept entries."""
        return self._bytes

    def facts(self, tools: Any) -> ToolsFacts:
        """The facts of ``tools``: as kept when known, else derived (and kept). Work for a
        known value: one orjson write and one lookup."""
        key = tools_key(tools)
        if key is None:
            return derive_tools_facts(tools, None)
        found = self._facts.get(key)
        if found is not None:
            self._facts.move_to_end(key)
            return found
        found = derive_tools_facts(tools, key)
        found.size = _OVERHEAD + len(key) + len(found.text or "") + len(found.sorted_text or b"")
        if found.size <= self.max_bytes:
            self._facts[key] = found
            self._bytes += found.size
            self._evict()
        return found

    def keep_form(self, facts: ToolsFacts, front: str, form: Any, size: int) -> None:
        """Keep what ``front`` made of the value of ``facts`` (``size``: about its bytes, counted
        against the bound). Nothing is kept for facts that are not (or no longer) kept."""
        key = facts.key
        if key is None or self._facts.get(key) is not facts or front in facts.forms:
            return
        facts.forms[front] = form
        facts.size += size
        self._bytes += size
        self._facts.move_to_end(key)
        self._evict()

    def _evict(self) -> None:
        while self._bytes > self.max_bytes:
            _, old = self._facts.popitem(last=False)
            self._bytes -= old.size
