"""The exact-token prompt of a call, as a flow (sans-io): which parent, which prompt path.

Owns the one place the prompt path of an exact-token call is decided: a prefill (the request
continues its final message) is rendered whole with the message left open, or refused when
the family's renderer cannot; a call with no verified parent is rendered from scratch; a
resolved call's prompt is the parent's prompt + generation ids extended by the rendering of
the new messages only (``core.splice``), or, where that extension cannot be had, the whole
conversation rendered and spliced (``exact_prompt_full_render``). A refused splice falls back
to a full render and says why (``exact_prompt_refused``). Rendering is a command: the
family's renderer may be the engine's ``/tokenize``. Must not import aiohttp or do any I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from capture_proxy.core.engine_formats import Dialect
from capture_proxy.core.flow.call import Call, Flow
from capture_proxy.core.flow.commands import LookUpCall, Render, RenderTail
from capture_proxy.core.flow.errors import PrefillNotSupported
from capture_proxy.core.flow.events import CallFound, Rendered, RenderFailed
from capture_proxy.core.json_bodies import InvalidRequest
from capture_proxy.core.known_messages import KnownMessages, MessageFacts, same_messages
from capture_proxy.core.known_tools import tools_key
from capture_proxy.core.linking.prefill import (
    closes_without_generation_prompt,
    continues_final_message,
    generation_prompt_conflict,
    history_before_turn,
    offered_turn,
)
from capture_proxy.core.linking.verdicts import TURN_REWRITTEN, Verdict
from capture_proxy.core.records import CallRecord, CallStatus, Diagnostic, ids_array
from capture_proxy.core.routed_experts import rows_end
from capture_proxy.core.splice import (
    SpliceRefused,
    adds_defaults_only,
    check_extension,
    check_prefix,
    extend_prompt,
    only_system_messages_differ,
    splice_prompt,
)
from capture_proxy.families.base import ChatRenderer, ContinuationRenderer, renders_tails
from capture_proxy.families.hf_template import find_tail_ids, tail_context, tail_renderable
from capture_proxy.families.parsing import OutputParser

EXACT_PROMPT_REFUSED = "exact_prompt_refused"
#: a resolved call whose prompt was spliced from a full render, not extended (see exact_prompt)
EXACT_PROMPT_FULL_RENDER = "exact_prompt_full_render"
#: the ``exact_prompt_refused`` reason of a history that is the parent's but for its system
#: messages (``splice.only_system_messages_differ``)
SYSTEM_CHANGED = (
    "the system messages differ from the parent's request (a changed system prompt, e.g. a "
    "Responses request's instructions, which previous_response_id does not carry over): the "
    "prompt is rendered whole"
)


class ExactFamily(Protocol):
    """What an exact-token flow needs of a model family's machinery (``proxy.exact``'s
    ``ExactTokens``): its renderer (for its capabilities; rendering itself is a command),
    output parser, the engine's tokens-in dialect and its turn markers."""

    renderer: ChatRenderer
    parser: OutputParser
    dialect: Dialect
    end_of_turn_token: str
    full_render: bool
    #: decode ids to text without special tokens, when the renderer is local
    decode: Callable[[list[int]], str] | None

    def close_ids(self, end_of_turn_ids: frozenset[int]) -> frozenset[int]: ...

    def opens_reasoning(self, prompt_token_ids: Any) -> bool: ...


@dataclass(frozen=True)
class Prompt:
    """``experts_start``: the first token position to ask routed-expert rows for: where the
    parent's rows end when the prompt extends the parent, else 0; ``spliced_from``: the
    parent the prompt extends (None: rendered from scratch)."""

    token_ids: np.ndarray
    spliced_from: str | None
    diagnostics: list[Diagnostic]
    experts_start: int = 0


def refuse_if_cannot_continue(exact: ExactFamily, body: Mapping[str, Any]) -> None:
    """Raise ``InvalidRequest`` (param ``add_generation_prompt``) for the pair of flags vLLM
    refuses (``continue_final_message`` without ``add_generation_prompt: false``), and
    ``PrefillNotSupported`` for a prefill the family's renderer cannot leave open (the
    HF-template families can; harmony cannot): refused before anything is forwarded."""
    conflict = generation_prompt_conflict(body)
    if conflict is not None:
        raise InvalidRequest(conflict, "add_generation_prompt")
    if continues_final_message(body) and not isinstance(exact.renderer, ContinuationRenderer):
        raise PrefillNotSupported()


def _render_ids(
    messages: Any, tools: Any, kwargs: Any, *, generation: bool = True, continuation: bool = False
) -> Flow[list[int]]:
    """The renderer's ids (as it gave them). Raises its RenderError."""
    reply = yield Render(messages, tools, generation, kwargs, continuation)
    if isinstance(reply, RenderFailed):
        raise reply.error
    assert isinstance(reply, Rendered) and reply.token_ids is not None
    return reply.token_ids


def _render(
    messages: Any,
    tools: Any,
    kwargs: Any,
    *,
    continuation: bool = False,
    generation: bool = True,
) -> Flow[np.ndarray]:
    """A whole prompt, as uint32 ids: the last message left open (``continuation``), else
    the generation prompt after it unless ``generation`` is false. Raises RenderError."""
    ids = yield from _render_ids(
        messages,
        tools,
        kwargs,
        generation=generation and not continuation,
        continuation=continuation,
    )
    return ids_array(ids)


def _render_tail(
    exact: ExactFamily,
    messages: list[dict[str, Any]],
    j: int,
    tools: Any,
    kwargs: Any,
    end_of_turn_ids: frozenset[int],
) -> Flow[list[int] | None]:
    """What follows the parent's end-of-turn token, rendered in a small context (see
    ``families.hf_template``); None when it cannot be found that way."""
    context, new = tail_context(messages, j), messages[j + 1 :]
    if renders_tails(exact.renderer):
        reply = yield RenderTail(context, new, tools, exact.end_of_turn_token, kwargs)
        if isinstance(reply, RenderFailed):
            raise reply.error
        return reply.token_ids
    if not tail_renderable(context, new):
        return None
    head_ids = yield from _render_ids(context[:-1], tools, kwargs, generation=False)
    small = yield from _render_ids([*context, *new], tools, kwargs)
    return find_tail_ids(head_ids, small, end_of_turn_ids)


def _parent_request_messages(parent: CallRecord) -> list[dict[str, Any]]:
    """The parent's request as the harness sent it before the turn the parent offers: less a
    rewritten trailing note, less a prefill (the start of that turn, ``linking.prefill``)."""
    messages = history_before_turn(parent)
    if (parent.linking or {}).get("harness_note") and messages:
        messages = messages[:-1]
    return messages


def _refused(parent_call_id: str, exc: SpliceRefused) -> Diagnostic:
    details: dict[str, Any] = {"parent_call_id": parent_call_id, "reason": exc.reason}
    if exc.message_index is not None:
        details["message_index"] = exc.message_index
    return Diagnostic(EXACT_PROMPT_REFUSED, details)


def _extended_parent(
    call: Call, known: KnownMessages
) -> Flow[tuple[CallRecord | None, int, Diagnostic | None]]:
    """Several candidates share the digest (parallel sub-agents that answered alike): the
    first, in the resolution's preference, whose request this history extends (its
    messages, and the same tools: the same orjson text, which tells ``1`` from ``1.0``,
    about 10 us for OpenCode's 21 KB), with the index of its continued turn; else None and
    the first refusal."""
    refusal: Diagnostic | None = None
    child_facts = call.prepared.linking_facts
    tools = call.prepared.body.get("tools")
    tools_facts = call.prepared.tools_facts
    tools_text = tools_facts.key if tools_facts is not None else tools_key(tools)
    for candidate in call.resolution.candidates or ():
        found: CallFound = yield LookUpCall(candidate.call_id)
        parent = found.record
        if parent is None or parent.status is not CallStatus.COMPLETE:
            continue
        parent_messages = _parent_request_messages(parent)
        same = None
        if child_facts is not None:
            facts: tuple[MessageFacts, ...]
            kept = found.message_facts
            if kept is not None and len(kept) >= len(parent_messages):
                facts = kept[: len(parent_messages)]
            else:
                facts = known.facts(parent_messages)
            same = same_messages(facts, child_facts)
        try:
            if parent.request_tools is not tools and (
                tools_text is None or tools_key(parent.request_tools) != tools_text
            ):
                # The template renders the tools in the prompt's head (the system turn): the
                # parent's tokens show the model other tools than this request offers.
                raise SpliceRefused(
                    "the harness changed the tools since the parent's request: the prompt "
                    "is rendered whole"
                )
            j = check_extension(parent_messages, call.prepared.linking_messages, same)
            if call.resolution.reason == TURN_REWRITTEN and not adds_defaults_only(
                offered_turn(parent) or {}, call.prepared.linking_messages[j]
            ):
                raise SpliceRefused(
                    "the harness rewrote the model's turn (found by its tool-call ids) beyond "
                    "adding arguments: the engine is shown the harness's turn",
                    j,
                )
        except SpliceRefused as exc:
            if refusal is None:
                if only_system_messages_differ(parent_messages, call.prepared.linking_messages):
                    exc = SpliceRefused(SYSTEM_CHANGED, exc.message_index)
                refusal = _refused(parent.call_id, exc)
            continue
        return parent, j, None
    return None, -1, refusal


def exact_prompt(
    call: Call, exact: ExactFamily, known: KnownMessages, end_of_turn_ids: frozenset[int]
) -> Flow[Prompt]:
    """The exact-token prompt for ``call``. Raises RenderError (the request cannot render),
    PrefillNotSupported.

    The extended prompt must begin with parent prompt + generation, token for token, or the
    link is refused with its reason."""
    body = call.prepared.body
    messages, tools = body["messages"], body.get("tools")
    kwargs = body.get("chat_template_kwargs")
    res = call.resolution
    if continues_final_message(body):
        # The last message is left open (a prefill): the whole conversation rendered so; the
        # link to the turns before the prefill is taken at verification, by tokens.
        refuse_if_cannot_continue(exact, body)
        ids = yield from _render(messages, tools, kwargs, continuation=True)
        why = {"reason": "continue_final_message"}
        return Prompt(ids, None, [Diagnostic(EXACT_PROMPT_FULL_RENDER, why)])
    if closes_without_generation_prompt(body):
        # vLLM renders every message closed and no generation prompt (a rare request: the
        # model writes its own turn header); the link is taken at verification, by tokens.
        ids = yield from _render(messages, tools, kwargs, generation=False)
        why = {"reason": "add_generation_prompt"}
        return Prompt(ids, None, [Diagnostic(EXACT_PROMPT_FULL_RENDER, why)])
    if res.verdict is not Verdict.RESOLVED or res.parent_call_id is None:
        return Prompt((yield from _render(messages, tools, kwargs)), None, [])
    parent, j, refusal = yield from _extended_parent(call, known)
    if parent is None:
        diagnostics = [] if refusal is None else [refusal]
        return Prompt((yield from _render(messages, tools, kwargs)), None, diagnostics)
    diags: list[Diagnostic] = []
    try:
        spliced = yield from _spliced(exact, parent, body, j, end_of_turn_ids, diags)
    except SpliceRefused as exc:
        full = yield from _render(messages, tools, kwargs)
        return Prompt(full, None, [*diags, _refused(parent.call_id, exc)])
    return Prompt(spliced, parent.call_id, diags, rows_end(parent) or 0)


def _spliced(
    exact: ExactFamily,
    parent: CallRecord,
    body: Mapping[str, Any],
    j: int,
    end_of_turn_ids: frozenset[int],
    diags: list[Diagnostic],
) -> Flow[np.ndarray]:
    """The parent's tokens extended by the tail rendered in a small context (work in
    proportion to the new tokens), else spliced from a full render (noted in ``diags``).
    Raises SpliceRefused."""
    messages, tools = body["messages"], body.get("tools")
    kwargs = body.get("chat_template_kwargs")
    close_ids = exact.close_ids(end_of_turn_ids)
    tail = None
    if not exact.full_render:
        tail = yield from _render_tail(exact, messages, j, tools, kwargs, end_of_turn_ids)
    if tail is not None:
        spliced = extend_prompt(
            parent.prompt_token_ids,
            parent.generation_token_ids,
            tail,
            end_of_turn_id=min(end_of_turn_ids),
            close_ids=close_ids,
        )
    else:
        reason = "configured" if exact.full_render else "template_not_prefix_stable"
        diags.append(Diagnostic(EXACT_PROMPT_FULL_RENDER, {"reason": reason}))
        full = yield from _render_ids(messages, tools, kwargs)
        through = yield from _render_ids(messages[: j + 1], tools, kwargs, generation=False)
        spliced = splice_prompt(
            parent.prompt_token_ids,
            parent.generation_token_ids,
            full,
            through,
            end_of_turn_ids=end_of_turn_ids,
            close_ids=close_ids,
        )
    bad = check_prefix(
        spliced.prompt_token_ids, parent.prompt_token_ids, parent.generation_token_ids
    )
    if bad is not None:
        raise SpliceRefused(f"the extended prompt differs from the parent's at token {bad}")
    return spliced.prompt_token_ids
