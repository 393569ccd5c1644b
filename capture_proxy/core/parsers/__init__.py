"""Output parsers: generated text back into a chat message, per model family.

One small interface (``OutputParser``: ``stream()`` gives an incremental parser; ``parse`` is
feeding the whole text at once, so streamed deltas always concatenate to the non-streamed
message). Adding a family (DeepSeek, GLM) is adding one module and one registry entry.
Families: ``qwen`` / ``qwen3`` (Hermes JSON tool calls, ``qwen``), ``qwen3_coder`` (XML tool
calls, ``qwen3_coder``), ``gpt_oss`` (harmony, ``harmony``: built with its encoding, see
``capture_proxy.renderers``).
"""

from capture_proxy.core.parsers.base import (
    MessageDelta,
    OutputParser,
    ParsedMessage,
    StreamParser,
    tool_call_id,
)
from capture_proxy.core.parsers.qwen import QwenHermesParser
from capture_proxy.core.parsers.qwen3_coder import Qwen3CoderParser

#: parsers that need nothing but their module (gpt_oss needs its encoding)
PARSERS: dict[str, OutputParser] = {
    "qwen": QwenHermesParser(),
    "qwen3": QwenHermesParser(),
    "qwen3_coder": Qwen3CoderParser(),
}


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
    "Qwen3CoderParser",
    "QwenHermesParser",
    "StreamParser",
    "get_parser",
    "tool_call_id",
]
