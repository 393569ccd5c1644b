"""Claude Code's lineage declarations. It has no trailing harness note (``NOTES``), but it does
write one message in the model's name: ``INTERRUPTED_TURN_TEXT`` below, inside the history.

Observed through the proxy with Claude Code 2.1.328 (Anthropic Messages):
- a sub-agent started through the ``Agent`` tool (``Task`` in earlier releases) gets the tool
  input's ``prompt`` as its first user message;
- a ``fork`` sub-agent replays the parent's history (less the thinking of the parent's
  ``Agent`` turn), then the tool result "Fork started — that fork is you." and a
  ``<fork-boilerplate>`` block;
- ``/compact``: the summary call's answer wraps the summary in ``<summary>...</summary>``; its
  body is carried into the first user message of the next conversation;
- ``--continue`` after a turn whose answer never arrived (the process was killed while the
  model was generating): the resumed request replays the lost call's request, then an
  assistant message "No response requested." (the CLI's constant for it; its transcript marks
  the message's model ``<synthetic>``), then the new prompt. The model never wrote it; it
  stays in every later request of the session (so it is no trailing note to rewrite);
- every request carries ``metadata.user_id``, a JSON string with ``device_id``,
  ``account_uuid`` and ``session_id``. The session id is the ``claude`` process's session
  (also sent as the ``X-Claude-Code-Session-Id`` header, which the proxy does not store): the
  main agent's calls, its sub-agents' and its fork's, the summary call of ``/compact``, and
  the calls of a later ``claude --continue`` all send the same one; two ``claude`` sessions
  send two (tests/fixtures/claude_code/*.jsonl, tests/e2e/test_claude_code_lineage.py). A
  sub-agent is always its spawner's session, and so is the conversation after ``/compact``;
  a history can be replayed into a new session (``--continue --fork-session``, ``--resume``
  of another session's transcript), so a fork or resume edge may join two sessions.
"""

from harness_notes.lineage import (
    ForkMarker,
    InterruptedTurn,
    SessionField,
    SpawnTool,
    SummaryTags,
)

#: The assistant message Claude Code puts in place of a lost turn when it resumes a session.
INTERRUPTED_TURN_TEXT = "No response requested."

SESSION = SessionField(
    "claude_code",
    ("metadata", "user_id"),
    json_key="session_id",
    edge_kinds=frozenset({"spawned_by", "compacted_from"}),
)

LINEAGE = (
    SpawnTool("claude_code", "Agent", "prompt"),
    SpawnTool("claude_code", "Task", "prompt"),
    ForkMarker("claude_code", "Fork started \u2014 that fork is you."),
    ForkMarker("claude_code", "<fork-boilerplate>"),
    SummaryTags("claude_code", "<summary>", "</summary>"),
    InterruptedTurn("claude_code", INTERRUPTED_TURN_TEXT),
    SESSION,
)
