"""What the Messages encoders need back, and what the request said that the engine does not see.

Owns ``MessagesOptions`` (``FrontRequest.options``): made by ``parse``, read by ``encode`` and
``stream``. Pure; nothing but the options.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MessagesOptions:
    """What the encoder needs back, and what the request said that the engine does not see.

    ``thinking``: the request's ``thinking`` object; ``omit_thinking``: its ``display`` was
    ``omitted`` (thinking blocks carry ``""``, the signature still seals the text);
    ``server_tools``: tools left out of the chat tools; ``tool_errors``: ``tool_use_id`` of each
    ``tool_result`` marked ``is_error``; ``reasoning_hints``: call ids found in the thinking
    signatures this proxy issued (a hint, never a link); ``prefill``: the last message is an
    assistant turn (Anthropic continues it; a chat template renders it as a finished turn);
    ``count_tokens``: parsed from a ``count_tokens`` body."""

    thinking: dict[str, Any] | None = None
    omit_thinking: bool = False
    server_tools: tuple[dict[str, Any], ...] = ()
    tool_errors: tuple[str, ...] = ()
    reasoning_hints: tuple[str, ...] = ()
    prefill: bool = False
    count_tokens: bool = False
