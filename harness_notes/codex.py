"""Codex CLI's lineage declarations (no harness notes: it writes none in the model's name).

Codex CLI (codex-rs, ``core/templates/compact/``): a compaction asks the model for a handoff
summary with the instruction below as the last user message; the next request rebuilds the
history as the initial context, the earlier user messages and one user message made of the
summary prefix below, a newline and the summary. ``codex exec resume`` replays a stored
session's history, which the generic replay rule finds.
"""

from harness_notes.lineage import SummaryPrefix, SummaryRequest

SUMMARY_PREFIX = (
    "Another language model started to solve this problem and produced a summary of its "
    "thinking process."
)
COMPACT_INSTRUCTION = "You are performing a CONTEXT CHECKPOINT COMPACTION."

LINEAGE = (
    SummaryPrefix("codex", SUMMARY_PREFIX),
    SummaryRequest("codex", COMPACT_INSTRUCTION),
)
