"""Shared tests over every registered harness note (adding a harness adds its notes here)."""

import pytest

from harness_notes import ALL_NOTES, NoteRegistry, default_registry
from harness_notes.opencode import STEP_LIMIT_NOTE

HISTORY = [
    {"role": "system", "content": "s"},
    {"role": "user", "content": "u"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "read", "arguments": "{}"}}
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "x"},
]


def test_opencode_note_is_the_recorded_text(request):
    recorded = request.config.rootpath / "tests/fixtures/opencode/step_limit_note.txt"
    assert STEP_LIMIT_NOTE.text == recorded.read_text()
    assert len(STEP_LIMIT_NOTE.text.encode()) == 750
    assert "1.18.33" in STEP_LIMIT_NOTE.releases_checked


@pytest.mark.parametrize("note", ALL_NOTES, ids=lambda n: n.key)
class TestEveryNote:
    def test_trailing_note_is_detected(self, note):
        registry = default_registry()
        assert (
            registry.match_trailing_note([*HISTORY, {"role": "assistant", "content": note.text}])
            is note
        )
        as_part = {"role": "assistant", "content": [{"type": "text", "text": note.text}]}
        assert registry.match_trailing_note([*HISTORY, as_part]) is note

    @pytest.mark.parametrize(
        "last",
        [
            lambda t: {"role": "user", "content": t},
            lambda t: {"role": "assistant", "content": t + "\n"},
            lambda t: {"role": "assistant", "content": t + " And more."},
            lambda t: {
                "role": "assistant",
                "content": t,
                "tool_calls": [
                    {
                        "id": "c2",
                        "type": "function",
                        "function": {"name": "bash", "arguments": "{}"},
                    }
                ],
            },
            lambda t: {"role": "assistant", "content": t, "reasoning_content": "thinking"},
            lambda t: {
                "role": "assistant",
                "content": [{"type": "text", "text": t}, {"type": "text", "text": "x"}],
            },
        ],
        ids=["user-role", "extra-newline", "extra-content", "tool-call", "reasoning", "two-parts"],
    )
    def test_anything_more_is_not_a_note(self, note, last):
        assert default_registry().match_trailing_note([*HISTORY, last(note.text)]) is None

    def test_note_not_at_the_end_is_not_a_trailing_note(self, note):
        messages = [
            *HISTORY,
            {"role": "assistant", "content": note.text},
            {"role": "user", "content": "go"},
        ]
        assert default_registry().match_trailing_note(messages) is None


def test_duplicate_registration_is_refused():
    with pytest.raises(ValueError):
        NoteRegistry([STEP_LIMIT_NOTE, STEP_LIMIT_NOTE])


def test_keys_are_unique():
    assert len({n.key for n in ALL_NOTES}) == len(ALL_NOTES)
