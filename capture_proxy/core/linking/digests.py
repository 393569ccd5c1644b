"""Canonical linking items and their digests: how a turn that arrives as text is named.

Owns the canonical form of a model-authored turn, the chained history digests (a request's
parent digest, a captured call's child digest), the request digest (for retries), a turn's own
digest and tool-call ids, and the digest check that a prompt begins with a parent's tokens.
Pure: no aiohttp, no I/O; knows nothing of the index or of records.

Canonical form of a model-authored turn (an assistant message), as decided here:
- ``content``: text; ``null``, ``""`` and an absent key are the same (OpenCode sends ``""``
  where the engine sent ``null``); a list of text parts is joined with ``"\\n"`` (vLLM's join).
- ``tool_calls``: in order, each as ``(id, name, arguments)`` with arguments as canonical JSON
  (parsed, then dumped with sorted keys, no spaces, no ASCII escaping), so OpenCode's compact
  re-serialisation and ``\\u00e9``-to-UTF-8 rewriting compare equal; arguments that are not
  JSON are compared as the raw string.
- reasoning is NOT part of the digest: harnesses drop or keep it depending on their
  configuration, and a template may drop it; whether the tokens still chain is for token
  verification to decide (``parent_digest_mismatch`` with class ``template_rerendered``).

Digests chain: ``d_0 = sha256("capture-proxy/linking/v2")`` and
``d_k = sha256(d_{k-1} || canonical(item_k))``. The items are the assistant turns, each
preceded by the images of the messages since the turn before (``image_payload``: one item per
user or tool message with images, ``{"images": [sha256, ...]}`` in prompt order): an image's
placeholder tokens depend only on its size, so its identity must be in the digest for two
calls whose images differ never to link. A history without images digests as it always did.
A request's *parent digest* is the digest over the items up to its last assistant turn; a
captured call's *child digest* (under which a child finds it) is the digest over all its
request's items (its images after the last turn included) followed by its own response
message.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np
import orjson

_DIGEST_SEED = hashlib.sha256(b"capture-proxy/linking/v2").hexdigest()

#: Request fields that do not change what the engine computes (so a retry may differ in them).
_NON_SEMANTIC_REQUEST_FIELDS = frozenset({"stream", "stream_options", "user", "metadata"})


def content_text(content: Any) -> str:
    """A message's content as the digests read it: text parts joined with ``"\\n"`` (as vLLM
    joins them), None as ``""``."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
    return str(content)


def canonical_json(value: Any) -> str:
    """Sorted keys, no spaces, UTF-8 text (no ASCII escapes): the digests' serialisation.
    orjson for speed; the stdlib (same output) for integers past 64 bits."""
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()
    except TypeError:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def canonical_arguments(arguments: Any) -> str:
    """Tool-call arguments as canonical JSON text (raw text when not JSON)."""
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments)
        except ValueError:
            return arguments
    else:
        value = arguments
    return canonical_json(value)


def canonical_turn(message: Mapping[str, Any]) -> dict[str, Any]:
    """The canonical form of one assistant message (see the module docstring)."""
    calls = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function") or {}
        calls.append(
            {
                "id": call.get("id"),
                "name": fn.get("name"),
                "arguments": canonical_arguments(fn.get("arguments")),
            }
        )
    return {"content": content_text(message.get("content")), "tool_calls": calls}


def turn_payload(turn: Mapping[str, Any]) -> str:
    """``canonical(turn)``: the text one assistant message adds to a digest."""
    return canonical_json(canonical_turn(turn))


def _extend(digest: str, payload: str) -> str:
    return hashlib.sha256((digest + payload).encode("utf-8")).hexdigest()


def linking_items(messages: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The model-authored turns of a history: its assistant messages, in order."""
    return [m for m in messages if m.get("role") == "assistant"]


def last_linking_item(messages: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """``linking_items(messages)[-1]`` (None when there is none), looking only at the
    messages after it."""
    for message in reversed(messages):
        if message.get("role") == "assistant":
            return message
    return None


def image_payload(message: Mapping[str, Any]) -> str | None:
    """The digest item of a (non-assistant) message's images: ``{"images": [sha256, ...]}``
    in order; None when it has none (the canonical image parts of ``core.images``)."""
    content = message.get("content")
    if not isinstance(content, list):
        return None
    shas = [p.get("sha256") for p in content if isinstance(p, Mapping) and p.get("type") == "image"]
    return canonical_json({"images": shas}) if shas else None


def message_payload(message: Mapping[str, Any]) -> str | None:
    """What one message adds to the digest chain: an assistant turn's ``turn_payload``, another
    message's ``image_payload`` (None: nothing)."""
    if message.get("role") == "assistant":
        return turn_payload(message)
    return image_payload(message)


def _chain_items(
    messages: Sequence[Mapping[str, Any]],
    payloads: Sequence[str | None] | None,
    owners: list[int] | None = None,
) -> tuple[list[str], list[str]]:
    """(the items up to the last assistant turn, the image items after it). ``owners``: when
    given, the index of the message each of the first list's items is of is appended to it."""
    if payloads is not None and len(payloads) != len(messages):
        raise ValueError(f"{len(payloads)} payloads for {len(messages)} messages")
    items: list[str] = []
    pending: list[str] = []
    pending_at: list[int] = []
    for i, message in enumerate(messages):
        known = payloads[i] if payloads is not None else None
        if message.get("role") == "assistant":
            items.extend(pending)
            items.append(known if known is not None else turn_payload(message))
            if owners is not None:
                owners.extend(pending_at)
                owners.append(i)
            pending, pending_at = [], []
        elif payloads is None or known is not None:
            # (known payloads: None stands for a message without images)
            payload = known if known is not None else image_payload(message)
            if payload is not None:
                pending.append(payload)
                pending_at.append(i)
    return items, pending


def _chain(items: Sequence[str]) -> str:
    digest = _DIGEST_SEED
    for payload in items:
        digest = _extend(digest, payload)
    return digest


class ChainStep(Protocol):
    """Where one message remembers the step its item last took in a digest chain:
    ``(digest before, digest after)`` (``known_messages.MessageFacts``)."""

    linked: tuple[str, str] | None


def history_digest(
    messages: Sequence[Mapping[str, Any]],
    payloads: Sequence[str | None] | None = None,
    steps: Sequence[ChainStep] | None = None,
) -> str | None:
    """The parent digest of a request: None when it has no model-authored turn (a root).

    ``payloads``: ``message_payload`` of each message (None for a message that adds nothing),
    when known already (``known_messages``); then only the digest chain is computed.
    ``steps``: with ``payloads``, each message's ``ChainStep`` (the facts its payload is of):
    an item after the same digest as the step it last took is not hashed again (an agent's
    history repeats its turns after the same ones at every call)."""
    owners: list[int] | None = None
    if steps is not None and payloads is not None:
        if len(steps) != len(messages):
            raise ValueError(f"{len(steps)} steps for {len(messages)} messages")
        owners = []
    items, _ = _chain_items(messages, payloads, owners)
    if not items:
        return None
    if steps is None or owners is None:
        return _chain(items)
    digest = _DIGEST_SEED
    for i, payload in zip(owners, items, strict=True):
        digest = _step(steps[i], digest, payload)
    return digest


def _step(step: ChainStep, digest: str, payload: str) -> str:
    """``_extend(digest, payload)``, taken from ``step`` when it last started from ``digest``
    (the payload is the one its message always gives), else computed and remembered there."""
    seen = step.linked
    if seen is not None and seen[0] == digest:
        return seen[1]
    after = _extend(digest, payload)
    step.linked = (digest, after)
    return after


def child_digest(messages: Sequence[Mapping[str, Any]], response: Mapping[str, Any]) -> str:
    """The digest under which a child of this call finds it."""
    items, trailing = _chain_items(messages, None)
    return _chain([*items, *trailing, turn_payload({"role": "assistant", **response})])


def trailing_images(messages: Sequence[Mapping[str, Any]]) -> bool:
    """The messages after the last assistant turn carry images (``child_digest_after`` from a
    history digest would leave them out)."""
    for message in reversed(messages):
        if message.get("role") == "assistant":
            return False
        if image_payload(message) is not None:
            return True
    return False


def child_digest_after(
    parent_digest: str | None, response: Mapping[str, Any], payload: str | None = None
) -> str:
    """``child_digest(messages, response)`` from ``parent_digest = history_digest(messages)``:
    one step of the chain instead of the whole history again. ``payload``:
    ``turn_payload(response)``, when known already."""
    start = parent_digest if parent_digest is not None else _DIGEST_SEED
    return _extend(start, payload if payload is not None else turn_payload(response))


def request_digest(body: Mapping[str, Any], tools_text: bytes | None = None) -> str:
    """Digest of everything in a request that affects the engine's answer (for retries):
    SHA-256 of ``canonical_json`` of the body less its non-semantic fields.

    ``tools_text``: ``body["tools"]`` as orjson writes it with sorted keys, when known already
    (``known_tools.ToolsFacts.sorted_text``); it is spliced into the body's text instead of
    written again. The digest is the same: where orjson writes the rest of the body, it writes
    the whole body as the rest with that text in place; where it does not (an integer past 64
    bits), the whole body is written by the stdlib, as without ``tools_text``."""
    semantic = {k: v for k, v in body.items() if k not in _NON_SEMANTIC_REQUEST_FIELDS}
    if tools_text is not None and semantic.get("tools") is not None:
        try:
            data = orjson.dumps(
                {**semantic, "tools": orjson.Fragment(tools_text)}, option=orjson.OPT_SORT_KEYS
            )
        except TypeError:
            pass
        else:
            return hashlib.sha256(data).hexdigest()
    text = canonical_json(semantic)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


class RequestDigestState:
    """``request_digest``'s SHA-256 part way: after the body's members before ``messages``
    and its messages (``messages``: that very list, kept so that a later request's messages
    are known to be the same objects, hence the same values: never changed), the ``]`` not
    yet written. ``head``: the text hashed before the first message."""

    __slots__ = ("head", "messages", "sha")

    def __init__(self, head: bytes, messages: list[Any], sha: Any) -> None:
        self.head = head
        self.messages = messages
        self.sha = sha


def request_digest_after(
    body: Mapping[str, Any],
    tools_text: bytes | None = None,
    earlier: RequestDigestState | None = None,
) -> tuple[str, RequestDigestState | None]:
    """``request_digest(body, tools_text)``, and the state a later request of the session
    goes on from. ``earlier``: an earlier request's state; where this body's members before
    ``messages`` write the same and its first messages are that request's very objects (an
    agent's next call, read by ``known_bodies``), only the messages after them are written
    and hashed: work for the new messages, not the history. The text hashed is the one
    ``request_digest`` hashes (orjson, sorted keys), written in pieces: the members before
    ``messages``, each message, the members after. Where orjson cannot write the body (an
    integer past 64 bits), or ``messages`` is not a non-empty list, ``request_digest`` whole
    and no state."""
    semantic = {k: v for k, v in body.items() if k not in _NON_SEMANTIC_REQUEST_FIELDS}
    messages = semantic.get("messages")
    if not isinstance(messages, list) or not messages:
        return request_digest(body, tools_text), None
    if tools_text is not None and semantic.get("tools") is not None:
        semantic["tools"] = orjson.Fragment(tools_text)
    before = {k: v for k, v in semantic.items() if k < "messages"}
    after = {k: v for k, v in semantic.items() if k > "messages"}
    sort = orjson.OPT_SORT_KEYS
    try:
        head = (orjson.dumps(before, option=sort)[:-1] + b"," if before else b"{") + b'"messages":['
        tail = b"]" + (b"," + orjson.dumps(after, option=sort)[1:] if after else b"}")
        sha, done = None, 0
        if earlier is not None and earlier.head == head and len(earlier.messages) <= len(messages):
            known = earlier.messages
            if all(a is b for a, b in zip(known, messages, strict=False)):  # (over known)
                sha, done = earlier.sha.copy(), len(known)
        if sha is None:
            sha = hashlib.sha256(head)
            sha.update(memoryview(orjson.dumps(messages, option=sort))[1:-1])
        else:
            for message in messages[done:]:
                sha.update(b"," + orjson.dumps(message, option=sort))
    except TypeError:  # (orjson cannot write it: the stdlib's text, whole)
        return request_digest(body, tools_text), None
    state = RequestDigestState(head, messages, sha.copy())
    sha.update(tail)
    return sha.hexdigest(), state


def tool_call_ids(turn: Mapping[str, Any] | None) -> tuple[str, ...]:
    """The ids of a turn's tool calls, in order (empty when it has none or one lacks an id)."""
    calls = turn.get("tool_calls") if turn is not None else None
    if not calls:  # (a call in flight has no answer yet: no generator made for nothing)
        return ()
    ids = tuple(str(c.get("id") or "") for c in calls)
    return ids if all(ids) else ()


def turn_digest(turn: Mapping[str, Any], *, with_ids: bool = True) -> str:
    """Digest of one assistant turn alone (not chained): finds the call that produced a turn
    whatever history came before it."""
    canonical = canonical_turn(turn)
    return _turn_digest(canonical if with_ids else _without_ids(canonical))


def turn_digests(turn: Mapping[str, Any]) -> tuple[str, str]:
    """``(turn_digest(turn), turn_digest(turn, with_ids=False))``, canonicalising once."""
    canonical = canonical_turn(turn)
    return canonical_digests(canonical, canonical_json(canonical))


def canonical_digests(canonical: dict[str, Any], payload: str) -> tuple[str, str]:
    """``turn_digests`` of the turn whose ``canonical_turn`` is ``canonical`` and whose
    ``turn_payload`` is ``payload`` (its canonical JSON): a turn without tool calls is the
    same without ids, so it is digested once."""
    digest = hashlib.sha256(payload.encode("utf-8")).hexdigest()
    if not canonical["tool_calls"]:
        return digest, digest
    return digest, _turn_digest(_without_ids(canonical))


def _without_ids(canonical: dict[str, Any]) -> dict[str, Any]:
    return {**canonical, "tool_calls": [{**c, "id": None} for c in canonical["tool_calls"]]}


def _turn_digest(canonical: dict[str, Any]) -> str:
    return hashlib.sha256(canonical_json(canonical).encode("utf-8")).hexdigest()


def extends_by_digest(child_prompt: np.ndarray, num_tokens: int, tokens_sha256: bytes) -> bool:
    """True when ``child_prompt`` begins with the ``num_tokens`` ids whose ``<u4`` bytes hash
    to ``tokens_sha256`` (the parent's prompt + generation, ``codec.token_digest``)."""
    if child_prompt.shape[0] < num_tokens:
        return False
    head = child_prompt[:num_tokens].astype("<u4", copy=False).tobytes()
    return hashlib.sha256(head).digest() == tokens_sha256
