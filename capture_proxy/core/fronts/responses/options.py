"""What the Responses encoders need back from the request (``FrontRequest.options``).

Owns ``ResponsesOptions``: made by ``parse``, read by ``encode`` and ``stream``. Pure; nothing
but the options and what follows from them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: The ``include`` value that asks for ``encrypted_content`` on reasoning items.
ENCRYPTED_REASONING = "reasoning.encrypted_content"


@dataclass(frozen=True)
class ResponsesOptions:
    """What the encoder needs back from the request (``FrontRequest.options``)."""

    #: names of freeform tools: a call of one is answered as a ``custom_tool_call``
    custom_tools: frozenset[str] = frozenset()
    #: the tools left out of the chat tools, as sent: namespaces, hosted tools
    unrendered_tools: tuple[Mapping[str, Any], ...] = ()
    #: the request's ``reasoning`` object (``effort``, ``summary``) and ``include`` list
    reasoning: Mapping[str, Any] | None = None
    include: tuple[str, ...] = ()

    @property
    def encrypted_reasoning(self) -> bool:
        """Whether reasoning items carry ``encrypted_content`` (the client included it)."""
        return ENCRYPTED_REASONING in self.include

    @property
    def reasoning_summary(self) -> bool:
        """Whether reasoning items carry the text as a summary (``reasoning.summary`` set)."""
        summary = (self.reasoning or {}).get("summary")
        return isinstance(summary, str) and summary not in ("", "none")
