"""Prefills: a call that continues the harness's partial assistant message, and the turn it
offers for linking.

A prefill is a request whose last message is an assistant message the engine continues
rather than answers (Anthropic Messages' trailing assistant message; chat completions'
``continue_final_message``, with ``add_generation_prompt: false``). The harness wrote that
text, not the model: its tokens are in the call's prompt, never in its generation, so they
get no loss. It is not a turn of the call's history either: it is the start of the call's
own turn. So:

- request time: the prefill is left out of the linking items (``split_prefill``); the call
  finds its parent by the turns before it, and the prefill is not a foreign turn;
- the turn the call offers its children (``offered_turn``) is the merged turn the harness
  sends next, prefill + the model's continuation (``continued_turn``): its text the
  prefill's then the continuation's, its tool calls the prefill's then the continuation's,
  the continuation's reasoning;
- a stored call says it continued a prefill (``linking.prefill``: true) and keeps it
  (``linking.prefill_message``, so a stored row's metadata tells the turn it offers without
  its messages: ``stored.of_row``); the prefill is the last of its ``request_messages``
  (``record_prefill``), and its history for a child's extension check leaves it out
  (``history_before_turn``).

The merged turn's tokens are the call's prompt tokens from the prefill on, then its
generation: a child that extends the call's prompt + generation shows the model its own
continuation after the very prefill tokens it saw (exact-token splicing needs nothing else).
Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from capture_proxy.core.linking.digests import content_text
from capture_proxy.core.records import CallRecord, CallStatus

#: the response fields of the continuation that the merged turn keeps as they are
_REASONING_KEYS = ("reasoning_content", "reasoning")


def continues_final_message(body: Mapping[str, Any]) -> bool:
    """The request asks to continue its last message rather than answer it (an Anthropic
    prefill; on chat completions ``continue_final_message: true`` with
    ``add_generation_prompt: false``, the one pair vLLM 0.32 continues with).
    ``add_generation_prompt: false`` alone renders the conversation closed, without a
    generation prompt (``closes_without_generation_prompt``)."""
    return bool(body.get("continue_final_message")) and body.get("add_generation_prompt") is False


def closes_without_generation_prompt(body: Mapping[str, Any]) -> bool:
    """``add_generation_prompt: false`` without ``continue_final_message``: vLLM renders
    every message closed and no generation prompt after them."""
    return body.get("add_generation_prompt") is False and not body.get("continue_final_message")


def generation_prompt_conflict(body: Mapping[str, Any]) -> str | None:
    """Why vLLM 0.32 refuses the request's pair of flags, else None:
    ``continue_final_message: true`` with ``add_generation_prompt`` true or left out (its
    default is true; transformers' ``apply_chat_template`` refuses the two together, and
    vLLM answers 400)."""
    if body.get("continue_final_message") and body.get("add_generation_prompt") is not False:
        return (
            "continue_final_message: true needs add_generation_prompt: false (its default is "
            "true; vLLM refuses the two together)"
        )
    return None


def split_prefill(
    body: Mapping[str, Any], messages: Sequence[Mapping[str, Any]]
) -> Mapping[str, Any] | None:
    """The prefill ``messages`` (the request's, as sent to the engine) end with: their last
    message when it is an assistant message the request continues; else None."""
    if not messages or not continues_final_message(body):
        return None
    last = messages[-1]
    return last if last.get("role") == "assistant" else None


def continued_turn(prefill: Mapping[str, Any], response: Mapping[str, Any]) -> dict[str, Any]:
    """The assistant turn a harness sends after a prefilled call: the prefill's text followed
    by the continuation's, the prefill's tool calls then the continuation's, the
    continuation's reasoning. ``content`` is None when both have no text."""
    text = content_text(prefill.get("content")) + content_text(response.get("content"))
    calls = [*(prefill.get("tool_calls") or []), *(response.get("tool_calls") or [])]
    turn: dict[str, Any] = {"role": "assistant", "content": text or None, "tool_calls": calls}
    for key in _REASONING_KEYS:
        if response.get(key) is not None:
            turn[key] = response[key]
    return turn


def record_prefill(record: CallRecord) -> Mapping[str, Any] | None:
    """The prefill a stored call continued (``linking.prefill``), else None: the record's
    ``linking.prefill_message``, else (a record stored before it was kept there) its last
    request message."""
    linking = record.linking or {}
    if not linking.get("prefill"):
        return None
    message = linking.get("prefill_message")
    if message is not None:
        return message  # type: ignore[no-any-return]
    return record.request_messages[-1] if record.request_messages else None


def offered_turn(
    record: CallRecord, prefill: Mapping[str, Any] | None = None
) -> Mapping[str, Any] | None:
    """The model-authored turn a call offers its children: its answer, merged after its
    prefill (``prefill``, else the record's own) when it continued one; None for a failed
    call or one without an answer."""
    response = record.response_message
    if response is None or record.status is CallStatus.FAILED:
        return None
    if prefill is None:
        prefill = record_prefill(record)
    return response if prefill is None else continued_turn(prefill, response)


def history_before_turn(record: CallRecord) -> list[dict[str, Any]]:
    """The call's request messages before the turn it offers: a prefill left out (it is the
    start of that turn)."""
    messages = list(record.request_messages)
    if record_prefill(record) is not None:
        messages = messages[:-1]
    return messages
