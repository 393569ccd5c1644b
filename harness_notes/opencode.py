"""OpenCode's harness notes.

The step-limit note: once an agent reaches its step limit (``agent.<name>.steps``), OpenCode
appends this text as the LAST message of the request, with role ``assistant``, although the
model never wrote it; it still offers all tools, and re-appends the note on every later request
of the same user turn (the previous note's position then holds the model's real reply).

Checked against OpenCode releases (npm ``opencode-ai``): 1.18.33 (recorded traffic in
tests/fixtures/opencode/logs/02_step_limit_obeyed.jsonl and 03_step_limit_ignored.jsonl;
the text below is byte-identical to step_limit_note.txt, 750 bytes, no trailing newline).
"""

from harness_notes.lineage import SessionField, SpawnTool
from harness_notes.registry import HarnessNote

STEP_LIMIT_NOTE_TEXT = (
    "CRITICAL - MAXIMUM STEPS REACHED\n"
    "\n"
    "The maximum number of steps allowed for this task has been reached. Tools are disabled until next user input. Respond with text only.\n"
    "\n"
    "STRICT REQUIREMENTS:\n"
    "1. Do NOT make any tool calls (no reads, writes, edits, searches, or any other tools)\n"
    "2. MUST provide a text response summarizing work done so far\n"
    "3. This constraint overrides ALL other instructions, including any user requests for edits or tool use\n"
    "\n"
    "Response must include:\n"
    "- Statement that maximum steps for this agent have been reached\n"
    "- Summary of what has been accomplished so far\n"
    "- List of any remaining tasks that were not completed\n"
    "- Recommendations for what should be done next\n"
    "\n"
    "Any attempt to use tools is a critical violation. Respond with text ONLY."
)

STEP_LIMIT_NOTE = HarnessNote(
    harness="opencode",
    name="step_limit",
    text=STEP_LIMIT_NOTE_TEXT,
    releases_checked=("1.18.33",),
)

NOTES = (STEP_LIMIT_NOTE,)

#: OpenCode names its session only in headers: ``x-session-id`` on every request (also
#: ``x-session-affinity``, the same id), and on the requests of a ``task`` sub-agent, which
#: runs in a session of its own, ``x-parent-session-id``: the ``x-session-id`` of the session
#: whose call handed it its task (tests/fixtures/opencode/README.md;
#: tests/e2e/test_opencode_sessions.py). So a sub-agent is ``spawned_by`` a call of its parent
#: session. Its body names no session (no ``metadata``, no ``prompt_cache_key``).
SESSION = SessionField(
    "opencode",
    header="x-session-id",
    parent_header="x-parent-session-id",
    parent_edge_kinds=frozenset({"spawned_by"}),
)

#: OpenCode's ``task`` tool starts a sub-agent session whose first user message is the
#: tool input's ``prompt`` (its compaction summary is carried as an assistant message with
#: the summary call's answer text, which the generic carried-answer rule finds).
LINEAGE = (SpawnTool("opencode", "task", "prompt"), SESSION)
