"""The note registry and the detector for a trailing harness note.

Owns what counts as a harness note: the LAST message of a request is an assistant message
whose only payload is the exact text of a registered note (content as a string or as a single
text part; no tool calls, no reasoning, no other content). Anything else is not a note: a model
may well have written text that quotes a note, and treating it as one would drop a real turn.
Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class HarnessNote:
    """A message a harness adds in the model's name. ``text`` is matched exactly (bytes);
    ``releases_checked`` lists harness releases whose traffic showed this exact text."""

    harness: str
    name: str
    text: str
    releases_checked: tuple[str, ...]

    @property
    def key(self) -> str:
        return f"{self.harness}.{self.name}"


class NoteRegistry:
    """Known notes by exact text."""

    def __init__(self, notes: Iterable[HarnessNote]) -> None:
        self._by_text: dict[str, HarnessNote] = {}
        for note in notes:
            if note.text in self._by_text:
                raise ValueError(f"note text registered twice: {note.key}")
            self._by_text[note.text] = note

    @property
    def notes(self) -> tuple[HarnessNote, ...]:
        return tuple(self._by_text.values())

    def match_trailing_note(self, messages: Sequence[Mapping[str, Any]]) -> HarnessNote | None:
        """The note carried by the last message, or None when it is not exactly a note."""
        if not messages:
            return None
        last = messages[-1]
        if last.get("role") != "assistant":
            return None
        if last.get("tool_calls") or last.get("reasoning_content") or last.get("reasoning"):
            return None
        if set(last) - {"role", "content", "tool_calls", "reasoning_content", "reasoning", "name"}:
            return None
        content = last.get("content")
        if isinstance(content, list):
            if len(content) != 1 or not isinstance(content[0], Mapping):
                return None
            part = content[0]
            if part.get("type") != "text" or set(part) != {"type", "text"}:
                return None
            content = part.get("text")
        if not isinstance(content, str):
            return None
        return self._by_text.get(content)
