"""Why a child's prompt does not extend its parent's tokens: the mismatch classification.

Owns ``MismatchClass`` (stored in ``parent_digest_mismatch`` diagnostics), the first differing
position and the classification, from the token ids and, when the engine could detokenise
them, the texts. Pure: no I/O (the texts are fetched by whoever drives verification).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np


class MismatchClass(enum.StrEnum):
    RETOKENIZED = "retokenized"
    TEMPLATE_RERENDERED = "template_rerendered"
    HISTORY_EDITED = "history_edited"
    SYSTEM_CHANGED = "system_changed"


def first_difference(expected: np.ndarray, actual: np.ndarray) -> int | None:
    """First index where ``actual`` does not continue ``expected`` token for token, or None
    when ``expected`` is a prefix of ``actual``. A shorter ``actual`` differs at its end."""
    n = min(expected.shape[0], actual.shape[0])
    diff = np.flatnonzero(expected[:n] != actual[:n])
    if diff.size:
        return int(diff[0])
    return None if actual.shape[0] >= expected.shape[0] else n


@dataclass(frozen=True)
class Mismatch:
    position: int
    mismatch_class: MismatchClass
    explanation: str


@dataclass(frozen=True)
class DecodedTexts:
    """Detokenised texts for classification: parent prompt, parent prompt + generation, child
    prompt (from the engine's ``/detokenize`` or a local tokenizer)."""

    parent_prompt: str
    parent_full: str
    child_prompt: str


def classify_mismatch(
    parent_prompt: np.ndarray,
    parent_generation: np.ndarray,
    child_prompt: np.ndarray,
    *,
    texts: DecodedTexts | None = None,
    parent_reasoning: str | None = None,
    history_unchanged: bool = False,
    system_changed: bool = False,
    parent_prefilled: bool = False,
) -> Mismatch | None:
    """Why ``child_prompt`` does not begin with parent prompt + generation (None if it does).

    - ``history_edited``: it differs inside the parent's prompt: the harness changed earlier
      turns (compaction, pruning, a dropped harness note, a changed system prompt). With
      ``history_unchanged`` (the child's messages begin with the parent's request messages
      as sent, compared canonically) it is ``template_rerendered`` instead: the template
      renders the same history differently (e.g. drops the reasoning of earlier turns).
      With ``system_changed`` (the child's messages are the parent's request, answer and new
      messages but for the system messages before the continued turn,
      ``splice.only_system_messages_differ``) it is ``system_changed``: the request changed
      its system prompt (a Responses request's ``instructions``, which
      ``previous_response_id`` does not carry over), not the conversation.
    - ``retokenized``: inside the parent's output, and the text is the same (parent prompt +
      generation text is a prefix of the child's text): the model's own token split does not
      survive detokenise-then-retokenise.
    - ``template_rerendered``: inside the parent's output, and the text differs too: the
      template or the harness renders the turn differently (dropped reasoning, re-serialised
      tool-call arguments, ...).
    Without ``texts`` an output-side difference is reported as ``template_rerendered``.
    ``parent_prefilled``: the parent continued a prefill, so its turn starts inside its prompt
    (the prefill's tokens): a difference there under the same text is ``retokenized`` too
    (the prefill and the continuation re-encode differently as one text).
    """
    expected = np.concatenate([parent_prompt, parent_generation])
    pos = first_difference(expected, child_prompt)
    if pos is None:
        return None
    if pos < int(parent_prompt.shape[0]):
        return _inside_prompt(pos, texts, history_unchanged, system_changed, parent_prefilled)
    if pos == int(expected.shape[0]) - 1 and pos < int(child_prompt.shape[0]):
        # Everything but the last sampled token chains: the parent stopped on a stop token
        # the template does not close turns with (e.g. <|endoftext|> where it renders <|im_end|>).
        return Mismatch(
            pos,
            MismatchClass.TEMPLATE_RERENDERED,
            f"the parent stopped on token {int(expected[pos])}; the template closes the turn "
            f"with {int(child_prompt[pos])}",
        )
    if texts is not None:
        if texts.child_prompt.startswith(texts.parent_full):
            return Mismatch(
                pos,
                MismatchClass.RETOKENIZED,
                "same text, different tokens: the parent's output re-encodes differently",
            )
        child_turn = texts.child_prompt[len(texts.parent_prompt) :]
        if parent_reasoning and parent_reasoning not in child_turn:
            return Mismatch(
                pos,
                MismatchClass.TEMPLATE_RERENDERED,
                "the parent's reasoning is missing from the re-rendered turn",
            )
    return Mismatch(
        pos,
        MismatchClass.TEMPLATE_RERENDERED,
        "the parent's turn renders differently from what the model generated",
    )


def _inside_prompt(
    pos: int,
    texts: DecodedTexts | None,
    history_unchanged: bool,
    system_changed: bool,
    parent_prefilled: bool,
) -> Mismatch:
    """``classify_mismatch`` of a first difference inside the parent's prompt."""
    if parent_prefilled and texts is not None and texts.child_prompt.startswith(texts.parent_full):
        return Mismatch(
            pos,
            MismatchClass.RETOKENIZED,
            "same text, different tokens: the parent's prefill and its continuation re-encode "
            "differently as one turn",
        )
    if history_unchanged:
        return Mismatch(
            pos,
            MismatchClass.TEMPLATE_RERENDERED,
            "differs inside the parent's prompt, though the harness sent the parent's "
            "history unchanged: the template renders it differently (e.g. it drops the "
            "reasoning of earlier turns)",
        )
    if system_changed:
        return Mismatch(
            pos,
            MismatchClass.SYSTEM_CHANGED,
            "differs inside the parent's prompt, where the request's system messages are "
            "not the parent's; the rest of the history is the parent's (a changed system "
            "prompt, e.g. a Responses request's instructions, which previous_response_id "
            "does not carry over)",
        )
    return Mismatch(pos, MismatchClass.HISTORY_EDITED, "differs inside the parent's prompt")
