"""Text of a growing id sequence decoded by a local tokenizer (for dialects whose answers
carry ids but no text; see ``capture_proxy.core.engine_formats``). Pure."""

from __future__ import annotations

from capture_proxy.core.engine_formats.base import Decode


class IncrementalText:
    """Text of a growing id sequence, emitted as it becomes stable, at a constant cost per
    token: each step decodes only a short window (the ids from ``prefix`` on), as vLLM's and
    transformers' incremental detokenizers do, and emits what the window's text gained over
    the text of its already-emitted part (both decoded from the same start, so a token that
    decodes differently at the window's edge cancels out). A trailing U+FFFD (a multi-byte
    character split across tokens) is held back until it completes, or until ``final``."""

    def __init__(self, decode: Decode) -> None:
        self.decode = decode
        self.ids: list[int] = []
        #: the window's start and the end of the ids whose text was emitted
        self.prefix = 0
        self.read = 0
        #: characters at the end of the emitted ids' text not emitted (``resume_after``)
        self.held = 0

    def resume_after(self, ids: list[int], given: str) -> None:
        """Go on after ``ids``, of whose text ``given`` was emitted (a continuation's first ids
        follow). What ``given`` lacks of the ids' text (the first bytes of a character an abort
        split, held back) comes out with the character once the next ids complete it."""
        self.ids = list(ids)
        self.read = len(self.ids)
        self.prefix = max(0, self.read - WINDOW)
        whole = self.decode(self.ids)
        self.held = len(whole) - len(given) if whole.startswith(given) else 0

    def add(self, ids: list[int], *, final: bool = False) -> str:
        self.ids.extend(ids)
        if len(self.ids) == self.read:
            return ""
        emitted = self.decode(self.ids[self.prefix : self.read])
        text = self.decode(self.ids[self.prefix :])
        start = len(emitted) - self.held
        if len(text) <= start or (text.endswith("\ufffd") and not final):
            return ""
        self.prefix = max(self.prefix, self.read - WINDOW)
        self.read = len(self.ids)
        self.held = 0
        return text[start:]


#: ids before the newly emitted ones a window keeps
#: (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET)
WINDOW = 5
