"""Registry of harness notes: messages a harness adds in the model's name (role assistant)
that the model never wrote.

Adding a harness is adding one module (``harness_notes/<harness>.py`` with a ``NOTES`` tuple)
and listing it in ``_MODULES`` below; the shared tests cover every registered note. A
harness's lineage declarations (``LINEAGE``: sub-agent tools, fork markers, how a compaction
summary is carried; see ``harness_notes.lineage``) are listed in ``_LINEAGE_MODULES``.
"""

from harness_notes import claude_code, codex, opencode
from harness_notes.lineage import LineageDeclaration
from harness_notes.registry import HarnessNote, NoteRegistry

_MODULES = (opencode,)
_LINEAGE_MODULES = (claude_code, codex, opencode)

#: Every note of every registered harness.
ALL_NOTES: tuple[HarnessNote, ...] = tuple(n for m in _MODULES for n in m.NOTES)


#: Every lineage declaration of every harness (``harness_notes.lineage``).
ALL_LINEAGE: tuple[LineageDeclaration, ...] = tuple(d for m in _LINEAGE_MODULES for d in m.LINEAGE)


def default_registry() -> NoteRegistry:
    """A registry holding every registered note."""
    return NoteRegistry(ALL_NOTES)


__all__ = ["ALL_LINEAGE", "ALL_NOTES", "HarnessNote", "NoteRegistry", "default_registry"]
