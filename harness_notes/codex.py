"""Codex CLI's lineage declarations (no harness notes: it writes none in the model's name).

Codex CLI (codex-rs, ``core/templates/compact/``): a compaction asks the model for a handoff
summary with the instruction below as the last user message; the next request rebuilds the
history as the initial context, the earlier user messages and one user message made of the
summary prefix below, a newline and the summary. ``codex exec resume`` replays a stored
session's history, which the generic replay rule finds.

Every request's ``prompt_cache_key`` is the thread (conversation) id, also sent in
``client_metadata`` (``session_id``, ``thread_id``) and the ``session-id`` / ``thread-id``
headers: a compaction's calls and a resumed session keep it (tests/fixtures/codex/*.jsonl,
tests/e2e/test_codex_lineage.py). A sub-agent (``multi_agent_v1``) or a forked thread starts
a thread of its own (codex-rs: ``forked_from_id``, ``fork_turns``; not observed here), so no
edge kind is declared to stay in one thread: the thread is only preferred.
"""

from harness_notes.lineage import SessionField, SummaryPrefix, SummaryRequest

SUMMARY_PREFIX = (
    "Another language model started to solve this problem and produced a summary of its "
    "thinking process."
)
COMPACT_INSTRUCTION = "You are performing a CONTEXT CHECKPOINT COMPACTION."

SESSION = SessionField("codex", ("prompt_cache_key",))

LINEAGE = (
    SummaryPrefix("codex", SUMMARY_PREFIX),
    SummaryRequest("codex", COMPACT_INSTRUCTION),
    SESSION,
)
