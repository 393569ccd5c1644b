"""Output parsers: generated text back into a chat message, per model family.

One small interface (``OutputParser``: ``stream()`` gives an incremental parser; ``parse`` is
feeding the whole text at once, so streamed deltas always concatenate to the non-streamed
message). Adding a family (DeepSeek, GLM, gpt-oss) is adding one module and one registry entry.
"""

from capture_proxy.core.parsers.base import (
    MessageDelta,
    OutputParser,
    ParsedMessage,
    StreamParser,
    tool_call_id,
)
from capture_proxy.core.parsers.qwen import QwenHermesParser

PARSERS: dict[str, OutputParser] = {"qwen": QwenHermesParser()}


def get_parser(family: str) -> OutputParser:
    """The parser for a model family. Raises KeyError naming the known families."""
    try:
        return PARSERS[family]
    except KeyError:
        raise KeyError(f"unknown parser family {family!r}; known: {', '.join(PARSERS)}") from None


__all__ = [
    "PARSERS",
    "MessageDelta",
    "OutputParser",
    "ParsedMessage",
    "QwenHermesParser",
    "StreamParser",
    "get_parser",
    "tool_call_id",
]
