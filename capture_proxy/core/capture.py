"""Capture transforms: what the proxy adds to a chat request and strips from the answer.

Owns the contract "capture is additive" (DESIGN.md): the engine is asked for token data
(vLLM chat extras, checked against vLLM 0.32: ``logprobs``, ``top_logprobs``,
``return_token_ids``, ``stream_options.include_usage``) and everything the harness did not ask
for is removed again, so the harness receives what the engine would have sent it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from capture_proxy.core.conversation import ChatRequest, open_dict
from capture_proxy.core.images import PromptImage, engine_messages
from capture_proxy.core.known_messages import (
    MessageFacts,
    derive_facts,
    message_digests,
    message_key,
)
from capture_proxy.core.known_tools import ToolsFacts
from capture_proxy.core.linking.prefill import split_prefill
from capture_proxy.core.routed_experts import routed_experts_request_fields
from capture_proxy.core.stored_form import MessageDigests


class NoteMatcher(Protocol):
    """What the capture path needs of a harness-note registry (``harness_notes``)."""

    def match_trailing_note(self, messages: Sequence[Mapping[str, Any]]) -> Any: ...


@dataclass(frozen=True)
class PreparedRequest:
    """A captured request after harness-note handling.

    ``body``: what goes to the engine (a trailing note becomes a user message, so the engine
    generates a fresh assistant turn); ``linking_messages``: the history used for parent
    resolution (the note left out: the model never wrote it; a prefill left out: it is the
    start of this call's own turn, see ``linking.prefill``); ``harness_note``: the note's key.
    """

    body: dict[str, Any]
    linking_messages: list[dict[str, Any]]
    harness_note: str | None
    #: the ``known_messages`` facts of ``body["messages"]`` and of ``linking_messages``
    message_facts: tuple[MessageFacts, ...] | None = None
    linking_facts: tuple[MessageFacts, ...] | None = None
    #: the ``known_tools`` facts of ``body["tools"]``
    tools_facts: ToolsFacts | None = None
    #: the trailing assistant message the engine continues (``linking.prefill``), else None
    prefill: dict[str, Any] | None = None
    #: ``message_digests(message_facts)`` (None: no facts, or a message without a canonical
    #: text): the record's message chain, and the linking history's (its first entries)
    digests: MessageDigests | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if self.message_facts is not None:
            # NaN or infinities: no canonical text (the store's write names it)
            with contextlib.suppress(ValueError):
                object.__setattr__(self, "digests", message_digests(self.message_facts))

    @property
    def history_keys(self) -> tuple[bytes | None, bytes | None]:
        """``(own, continued)``: the chain digests (``stored_form.MessageDigests.chain``) of
        ``linking_messages``, the history this request sent before the turn it asks for (what
        a call continuing its answer repeats before that answer), and of the history before
        the turn this request continues (its last assistant message; None: none). The second
        equals the first of the call whose answer it continues when this request repeats
        that call's history exactly (``candidate_order._same_history_first``). None when not known.
        ``linking_messages`` begin ``body["messages"]`` (a note or a prefill leaves out only
        the last), so both are entries of ``digests.chain``."""
        chain = self.digests.chain if self.digests is not None else ()
        n = len(self.linking_messages)
        if len(chain) <= n:
            return None, None
        for i in range(n - 1, -1, -1):  # from the end: the last turn is near it
            if self.linking_messages[i].get("role") == "assistant":
                return chain[n], chain[i]
        return chain[n], None


def prepare_request(
    request: ChatRequest | dict[str, Any],
    notes: NoteMatcher | None,
    facts: Sequence[MessageFacts] | None = None,
    tools_facts: ToolsFacts | None = None,
) -> PreparedRequest:
    """Rewrite a trailing harness note into a user message (the request is copied, not
    changed); else split off a prefill the engine continues (``linking.prefill``). ``facts``:
    the ``known_messages`` facts of ``request["messages"]``, ``tools_facts`` the
    ``known_tools`` facts of ``request["tools"]``, carried along."""
    body = open_dict(request)  # the engine's body: the canonical request, extras and all
    messages = list(body.get("messages") or [])
    known = tuple(facts) if facts is not None and len(facts) == len(messages) else None
    if body.get("tools") is None:
        tools_facts = None
    note = notes.match_trailing_note(messages) if notes is not None else None
    if note is None:
        prefill = split_prefill(body, messages)
        if prefill is not None:
            linking_facts = known[:-1] if known is not None else None
            return PreparedRequest(
                body, messages[:-1], None, known, linking_facts, tools_facts, dict(prefill)
            )
        return PreparedRequest(body, messages, None, known, known, tools_facts)
    out = dict(body)
    rewritten = {"role": "user", "content": note.text}
    out["messages"] = [*messages[:-1], rewritten]
    if known is None:
        return PreparedRequest(out, messages[:-1], note.key, tools_facts=tools_facts)
    new = derive_facts(rewritten, message_key(rewritten))
    return PreparedRequest(
        out, messages[:-1], note.key, (*known[:-1], new), known[:-1], tools_facts
    )


@dataclass(frozen=True)
class HarnessAsked:
    """What the harness itself requested, so we strip only what we added. The keys to drop
    follow from it once (``top_level_drop``, ``choice_drop``): stripping runs per streamed
    token.

    What the proxy adds (``augment_chat_request``) and what each addition brings back:
    ``logprobs`` -> ``choices[i].logprobs`` (nulled, as vLLM sends it unasked);
    ``return_token_ids`` -> top-level ``prompt_token_ids`` and ``choices[i].token_ids`` (a
    stream's first chunk may carry ``prompt_token_ids`` in its choice);
    ``stream_options.include_usage`` -> ``usage`` (``strip_chat_chunk``); the routed-expert
    rows -> ``routed_experts`` / ``prompt_routed_experts`` / ``routed_experts_prompt_start``.
    Nothing else is stripped: a field the harness asked for itself that the proxy never adds
    (``prompt_logprobs``, ``kv_transfer_params``, ...) reaches it as the engine sent it."""

    logprobs: bool
    return_token_ids: bool
    include_usage: bool
    routed_experts: bool
    top_level_drop: tuple[str, ...] = field(init=False)
    choice_drop: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        top: list[str] = []
        choice: list[str] = []
        if not self.return_token_ids:
            top.append("prompt_token_ids")
            choice += ["token_ids", "prompt_token_ids"]
        if not self.routed_experts:
            top += ["routed_experts", "prompt_routed_experts"]
            choice += ["routed_experts", "routed_experts_prompt_start"]
        object.__setattr__(self, "top_level_drop", tuple(top))
        object.__setattr__(self, "choice_drop", tuple(choice))


def augment_chat_request(
    body: dict[str, Any],
    *,
    parent_rows_end: int | None = None,
    routed_experts: bool = True,
    images: Mapping[str, PromptImage] | None = None,
) -> tuple[dict[str, Any], HarnessAsked]:
    """Return (the body to send to the engine, what the harness asked for).

    The body is copied, never modified in place. Added: ``logprobs: true`` with
    ``top_logprobs: 0`` unless the harness set them (an explicit null ``top_logprobs`` would
    turn log probs off in vLLM, so null becomes 0), ``return_token_ids: true``, and for streams
    ``stream_options.include_usage: true`` (the record keeps the usage). With
    ``parent_rows_end`` (the routed-expert rows the parent already holds, see
    ``routed_experts.rows_end``) only the rows after it are asked for; None asks for all.
    ``routed_experts`` False (the model's ``routed_experts = off``): none are asked for.
    ``images``: the bytes of the canonical image parts of the messages, which the engine gets
    as ``image_url`` parts with ``data:`` URLs (``images.engine_messages``).
    """
    stream_options = body.get("stream_options")
    asked = HarnessAsked(
        logprobs=bool(body.get("logprobs")),
        return_token_ids=bool(body.get("return_token_ids")),
        include_usage=bool(
            isinstance(stream_options, dict) and stream_options.get("include_usage")
        ),
        routed_experts=bool(body.get("return_routed_experts")),
    )
    # A shallow copy: only top-level keys change; the messages are shared, never modified.
    out = dict(body)
    out["logprobs"] = True
    if out.get("top_logprobs") is None:
        out["top_logprobs"] = 0
    out["return_token_ids"] = True
    if out.get("stream"):
        opts = dict(stream_options) if isinstance(stream_options, dict) else {}
        opts["include_usage"] = True
        out["stream_options"] = opts
    if routed_experts:
        out.update(routed_experts_request_fields(parent_rows_end))
    if images:
        out["messages"] = engine_messages(out.get("messages") or [], images)
    return out, asked


def strip_chat_response(body: dict[str, Any], asked: HarnessAsked) -> dict[str, Any]:
    """Strip the added token data from a non-streaming chat completion (in place; returned).
    Runs per streamed token too (``strip_chat_chunk``): a key is looked for before it is
    deleted (most are absent), not popped."""
    for key in asked.top_level_drop:
        if key in body:
            del body[key]
    choices = body.get("choices")
    if choices:
        drop, null_logprobs = asked.choice_drop, not asked.logprobs
        for choice in choices:
            if isinstance(choice, dict):
                for key in drop:
                    if key in choice:
                        del choice[key]
                if null_logprobs and "logprobs" in choice:
                    choice["logprobs"] = None  # what vLLM sends when log probs were not asked for
    return body


def strip_chat_chunk(chunk: dict[str, Any], asked: HarnessAsked) -> dict[str, Any] | None:
    """Strip one streamed chunk (in place). Returns None when the whole chunk must be dropped:
    the usage-only chunk that exists only because the proxy asked for ``include_usage``."""
    if not asked.include_usage and "usage" in chunk:
        if chunk["usage"] is not None and not chunk.get("choices"):
            return None
        del chunk["usage"]
    return strip_chat_response(chunk, asked)
