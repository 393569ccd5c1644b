"""Claude Code's lineage declarations (no harness notes: it writes none in the model's name).

Observed through the proxy with Claude Code 2.1.328 (Anthropic Messages):
- a sub-agent started through the ``Agent`` tool (``Task`` in earlier releases) gets the tool
  input's ``prompt`` as its first user message;
- a ``fork`` sub-agent replays the parent's history (less the thinking of the parent's
  ``Agent`` turn), then the tool result "Fork started — that fork is you." and a
  ``<fork-boilerplate>`` block;
- ``/compact``: the summary call's answer wraps the summary in ``<summary>...</summary>``; its
  body is carried into the first user message of the next conversation.
"""

from harness_notes.lineage import ForkMarker, SpawnTool, SummaryTags

LINEAGE = (
    SpawnTool("claude_code", "Agent", "prompt"),
    SpawnTool("claude_code", "Task", "prompt"),
    ForkMarker("claude_code", "Fork started \u2014 that fork is you."),
    ForkMarker("claude_code", "<fork-boilerplate>"),
    SummaryTags("claude_code", "<summary>", "</summary>"),
)
