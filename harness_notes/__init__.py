"""Registry of harness notes: messages a harness adds in the model's name (role assistant)
that the model never wrote.

Adding a harness is adding one module (``harness_notes/<harness>.py`` with a ``NOTES`` tuple)
and listing it in ``_MODULES`` below; the shared tests cover every registered note.
"""

from harness_notes import opencode
from harness_notes.registry import HarnessNote, NoteRegistry

_MODULES = (opencode,)

#: Every note of every registered harness.
ALL_NOTES: tuple[HarnessNote, ...] = tuple(n for m in _MODULES for n in m.NOTES)


def default_registry() -> NoteRegistry:
    """A registry holding every registered note."""
    return NoteRegistry(ALL_NOTES)


__all__ = ["ALL_NOTES", "HarnessNote", "NoteRegistry", "default_registry"]
