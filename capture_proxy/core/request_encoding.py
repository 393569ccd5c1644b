"""The request side of a record's stored form, computed ahead of the engine's answer. Pure.

``RequestEncoding`` holds what ``codec.encode_record`` needs from a call's request: the
messages' digests and the tools' canonical text and content address.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from capture_proxy.core.known_tools import ToolsFacts
from capture_proxy.core.records import CallRecord
from capture_proxy.core.stored_form import MessageDigests, canonical_json, json_sha256


@dataclass(frozen=True)
class RequestEncoding:
    """The request side of a record's stored form: the messages' ``MessageDigests`` and the
    tools' canonical text and content address. It depends only on the request, so the proxy
    computes it while the engine is still prefilling, and the write at the end of the call
    (before ``[DONE]``) encodes only what the engine sent.

    ``messages`` and ``tools`` are the very objects it was computed from: ``belongs_to``
    compares them with a record's by identity (never by value, which would cost what this
    saves), so an encoding is only used for the record built from the same request.
    ``received_tools``: the received body's own tools (the Responses and Messages fronts';
    None: none, or the chat tools themselves) with their text and address, known already;
    the received body's value is taken for them only when it is that very object.
    """

    messages: tuple[Any, ...]
    tools: Any
    message_digests: MessageDigests
    tools_text: str | None
    tools_sha256: str | None
    received_tools: Any = None
    received_tools_text: str | None = None
    received_tools_sha256: str | None = None

    @classmethod
    def of(
        cls,
        messages: Sequence[Any],
        tools: Any,
        digests: MessageDigests | None = None,
        tools_facts: ToolsFacts | None = None,
        received_tools: Any = None,
        received_tools_facts: ToolsFacts | None = None,
    ) -> RequestEncoding:
        """``digests``: the messages' ``MessageDigests`` when known already; ``tools_facts``:
        the ``known_tools`` facts of ``tools``, ``received_tools_facts`` those of
        ``received_tools``, when known (their texts are not written again). Raises ValueError
        on values without a canonical text (NaN, infinities)."""
        if tools is None:
            text, sha = None, None
        elif tools_facts is not None and tools_facts.text is not None:
            text, sha = tools_facts.text, tools_facts.sha256
        else:
            text = canonical_json(tools)
            sha = json_sha256(text)
        received = received_tools_facts
        if received_tools is None or received is None or received.text is None:
            received_tools, received = None, None
        return cls(
            tuple(messages),
            tools,
            digests if digests is not None else MessageDigests.of(messages),
            text,
            sha,
            received_tools,
            received.text if received is not None else None,
            received.sha256 if received is not None else None,
        )

    def belongs_to(self, record: CallRecord) -> bool:
        """True when ``record`` carries the same message and tools objects."""
        messages = record.request_messages
        return (
            self.tools is record.request_tools
            and len(self.messages) == len(messages)
            and all(map(operator.is_, self.messages, messages))  # (a C loop: twice per put)
        )
