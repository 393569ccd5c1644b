"""Exact-token prompts: the parent's own tokens, then the rendering of only the new messages.

Owns the splice of DESIGN.md ("exact-token prompt"): for a child call whose parent was resolved
by digest, the prompt sent to the engine is

    parent prompt ids + parent generation ids [+ end-of-turn id if no sampled token closed the
    turn] + the rendering of what follows the parent's turn

so the model always sees the tokens it sampled, never a re-tokenisation or a re-rendering of
them. What closes a turn (``turn_is_closed``): a stop token the model sampled (Qwen:
``<|im_end|>`` or ``<|endoftext|>``); only a turn cut on length (or on a stop string) gets the
template's end-of-turn token appended, so a turn never carries two end tokens the model never
produced together. The template's separator after the parent's end-of-turn token (Qwen:
``\\n`` after ``<|im_end|>``, which the model never generates) is part of the new tail, as are
tool results, user turns, a rewritten harness note and the generation prompt. Pure: renders are
passed in.

It refuses (``SpliceRefused``) when the request's history is not an extension of the parent's:
the messages before the parent's output differ from what the parent was asked (a harness edited,
pruned or compacted earlier turns), or the renders do not line up.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from capture_proxy.core.linking.digests import canonical_json, canonical_turn

TOKEN_DTYPE = np.uint32


class SpliceRefused(ValueError):
    """The history is not an extension of the parent's; ``reason`` names why and ``message_index``
    the first differing message (None when the renders, not the messages, disagree)."""

    def __init__(self, reason: str, message_index: int | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.message_index = message_index


def adds_defaults_only(model_turn: Mapping[str, Any], harness_turn: Mapping[str, Any]) -> bool:
    """True when ``harness_turn`` is the model's ``model_turn`` with arguments added to its
    tool calls and nothing else changed (a harness filling in defaults: Claude Code adds
    ``"replace_all": false``): the same text, the same tool calls (ids, names) in order, and
    every argument the model wrote, with its value. Both are chat-format assistant messages
    (``function.arguments`` JSON text), compared canonically (``canonical_turn``). A turn
    matched by its tool-call ids only (``turn_rewritten``) may be spliced from the model's
    tokens only then: any other rewrite is what the harness wants the model to see."""
    model, harness = canonical_turn(model_turn), canonical_turn(harness_turn)
    if model["content"] != harness["content"]:
        return False
    if len(model["tool_calls"]) != len(harness["tool_calls"]):
        return False
    for wrote, sent in zip(model["tool_calls"], harness["tool_calls"], strict=True):
        if (wrote["id"], wrote["name"]) != (sent["id"], sent["name"]):
            return False
        if wrote["arguments"] == sent["arguments"]:
            continue
        try:
            written, given = orjson.loads(wrote["arguments"]), orjson.loads(sent["arguments"])
        except orjson.JSONDecodeError:
            return False
        if not isinstance(written, dict) or not isinstance(given, dict):
            return False
        for key, value in written.items():
            if key not in given or canonical_json(given[key]) != canonical_json(value):
                return False
    return True


def _comparable(message: Mapping[str, Any]) -> Any:
    if message.get("role") == "assistant":
        return ("assistant", canonical_turn(message))
    content = message.get("content")
    if isinstance(content, list):
        content = "\n".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
    return (message.get("role"), content or "", message.get("tool_call_id"), message.get("name"))


def parent_turn_index(messages: Sequence[Mapping[str, Any]]) -> int:
    """Index of the parent's output turn: the last assistant message. Raises SpliceRefused."""
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].get("role") == "assistant":
            return i
    raise SpliceRefused("the request has no assistant turn to continue")


def _is_system(message: Mapping[str, Any]) -> bool:
    return message.get("role") == "system"


def only_system_messages_differ(
    parent_messages: Sequence[Mapping[str, Any]], child_messages: Sequence[Mapping[str, Any]]
) -> bool:
    """True when ``child_messages`` is an extension of the parent's request
    (``check_extension``) once the system messages are left out of both, and the system
    messages before the continued turn are not the parent's: the request changed its system
    prompt (e.g. a Responses request whose ``instructions`` differ from those of the response
    it names by ``previous_response_id``: they are not carried over), it did not edit the
    conversation."""
    try:
        j = parent_turn_index(child_messages)
    except SpliceRefused:
        return False
    systems = [_comparable(m) for m in child_messages[:j] if _is_system(m)]
    if systems == [_comparable(m) for m in parent_messages if _is_system(m)]:
        return False
    try:
        check_extension(
            [m for m in parent_messages if not _is_system(m)],
            [m for m in child_messages if not _is_system(m)],
        )
    except SpliceRefused:
        return False
    return True


def check_extension(
    parent_messages: Sequence[Mapping[str, Any]],
    child_messages: Sequence[Mapping[str, Any]],
    same: Sequence[bool] | None = None,
) -> int:
    """Check that ``child_messages`` = the parent's request messages (harness notes left out,
    as for linking) + the parent's output turn + new messages. Returns the index of the parent's
    output turn in ``child_messages``. Raises SpliceRefused naming the first differing message.

    ``same[i]`` True: message i of both is known to be the same value (``known_messages``), so
    it is not compared again; the others are compared canonically.
    """
    j = parent_turn_index(child_messages)
    if j != len(parent_messages):
        n = min(j, len(parent_messages))
        first = next(
            (
                i
                for i in range(n)
                if _comparable(parent_messages[i]) != _comparable(child_messages[i])
            ),
            n,
        )
        raise SpliceRefused(
            f"history has {j} messages before the continued turn; the parent was asked with "
            f"{len(parent_messages)}",
            first,
        )
    known = same or ()
    for i, (a, b) in enumerate(zip(parent_messages, child_messages, strict=False)):
        if i < len(known) and known[i]:
            continue
        if _comparable(a) != _comparable(b):
            raise SpliceRefused(f"message {i} differs from the parent's request", i)
    return j


@dataclass(frozen=True)
class Splice:
    """The spliced prompt, uint32 ``[num_tokens]``, and where its parts start:
    ``parent_end`` = len(parent prompt + generation) (the child's exact prefix),
    ``added_end_of_turn`` = True when an end-of-turn id was inserted after a length stop."""

    prompt_token_ids: np.ndarray
    parent_end: int
    added_end_of_turn: bool


def turn_is_closed(generation: np.ndarray, close_ids: frozenset[int]) -> bool:
    """True when the last sampled id is a stop token that ends the model's turn."""
    return generation.shape[0] > 0 and int(generation[-1]) in close_ids


def extend_prompt(
    parent_prompt: np.ndarray,
    parent_generation: np.ndarray,
    tail: Sequence[int],
    *,
    end_of_turn_id: int,
    close_ids: frozenset[int],
) -> Splice:
    """The child prompt from the parent's tokens and ``tail``: the rendering of what follows the
    parent's end-of-turn token (the template's separator, new messages, generation prompt).
    Work in proportion to the new tokens: the parent's ids are copied, never re-rendered."""
    generation = np.asarray(parent_generation, dtype=TOKEN_DTYPE)
    added = not turn_is_closed(generation, close_ids)
    parts = [np.asarray(parent_prompt, dtype=TOKEN_DTYPE), generation]
    if added:
        parts.append(np.asarray([end_of_turn_id], dtype=TOKEN_DTYPE))
    parts.append(np.asarray(tail, dtype=TOKEN_DTYPE))
    parent_end = int(parent_prompt.shape[0] + generation.shape[0])
    return Splice(np.concatenate(parts), parent_end, added)


def check_prefix(
    prompt: np.ndarray, parent_prompt: np.ndarray, parent_generation: np.ndarray
) -> int | None:
    """None when ``prompt`` begins with parent prompt + generation, token for token; else the
    first differing position (fail closed: the caller refuses the link)."""
    n_p, n_g = int(parent_prompt.shape[0]), int(parent_generation.shape[0])
    if prompt.shape[0] < n_p + n_g:
        return int(prompt.shape[0])
    for lo, part in ((0, parent_prompt), (n_p, parent_generation)):
        diff = np.flatnonzero(prompt[lo : lo + part.shape[0]] != part)
        if diff.size:
            return lo + int(diff[0])
    return None


def splice_prompt(
    parent_prompt: np.ndarray,
    parent_generation: np.ndarray,
    full_render: Sequence[int],
    through_parent_render: Sequence[int],
    *,
    end_of_turn_ids: frozenset[int],
    close_ids: frozenset[int] | None = None,
) -> Splice:
    """Build the exact-token prompt.

    ``full_render``: the whole conversation rendered with the generation prompt.
    ``through_parent_render``: the conversation up to and including the parent's output turn,
    without the generation prompt. The parent's turn ends at the k-th end-of-turn token of the
    full render, where k is the number of end-of-turn tokens in ``through_parent_render``
    (reasoning a template drops does not change that count). ``close_ids``: the stop tokens
    that close a turn (default ``end_of_turn_ids``), see ``turn_is_closed``. Raises
    SpliceRefused.
    """
    k = sum(1 for t in through_parent_render if t in end_of_turn_ids)
    if k == 0:
        raise SpliceRefused("the render up to the parent's turn has no end-of-turn token")
    seen, cut = 0, -1
    for i, t in enumerate(full_render):
        if t in end_of_turn_ids:
            seen += 1
            if seen == k:
                cut = i + 1
                break
    if cut < 0:
        raise SpliceRefused("the full render ends before the parent's turn does")
    return extend_prompt(
        parent_prompt,
        parent_generation,
        full_render[cut:],
        end_of_turn_id=int(full_render[cut - 1]),
        close_ids=end_of_turn_ids if close_ids is None else close_ids | end_of_turn_ids,
    )
