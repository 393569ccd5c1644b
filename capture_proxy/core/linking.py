"""Parent resolution: canonical linking items, digests, the per-rollout index, verification.

Owns how a request that arrives as text finds the captured call it continues, and the
fail-closed check that the tokens really chain. Pure: no aiohttp, no I/O.

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
``d_k = sha256(d_{k-1} || canonical(turn_k))``. A request's *parent digest* is the digest over
all assistant turns of its history; a captured call's *child digest* (under which a child finds
it) is the digest over its request's turns followed by its own response message.
"""

from __future__ import annotations

import enum
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

#: Reason of an unresolved verdict whose last model-authored turn matches no captured output.
NO_MATCH_REASON = "no captured call produced the last model-authored turn"

_DIGEST_SEED = hashlib.sha256(b"capture-proxy/linking/v2").hexdigest()

#: Request fields that do not change what the engine computes (so a retry may differ in them).
_NON_SEMANTIC_REQUEST_FIELDS = frozenset({"stream", "stream_options", "user", "metadata"})


class Verdict(enum.StrEnum):
    """Outcome of parent resolution, stored on every captured call.

    - ``root``: no model-authored turn in the history: a new chain starts.
    - ``resolved``: the digest found a captured call and its tokens were verified.
    - ``refused``: the digest found a call but the tokens do not chain: the link is refused
      (``parent_digest_mismatch``) and the call starts a new chain.
    - ``unresolved``: the history has model-authored turns but no captured call matches.
    """

    ROOT = "root"
    RESOLVED = "resolved"
    REFUSED = "refused"
    UNRESOLVED = "unresolved"


class MismatchClass(enum.StrEnum):
    RETOKENIZED = "retokenized"
    TEMPLATE_RERENDERED = "template_rerendered"
    HISTORY_EDITED = "history_edited"


def _content_text(content: Any) -> str:
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
    return {"content": _content_text(message.get("content")), "tool_calls": calls}


def extend_digest(digest: str, turn: Mapping[str, Any]) -> str:
    """``sha256(digest || canonical(turn))`` as hex."""
    payload = canonical_json(canonical_turn(turn))
    return hashlib.sha256((digest + payload).encode("utf-8")).hexdigest()


def linking_items(messages: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The model-authored turns of a history: its assistant messages, in order."""
    return [m for m in messages if m.get("role") == "assistant"]


def history_digest(messages: Sequence[Mapping[str, Any]]) -> str | None:
    """The parent digest of a request: None when it has no model-authored turn (a root)."""
    items = linking_items(messages)
    if not items:
        return None
    digest = _DIGEST_SEED
    for item in items:
        digest = extend_digest(digest, item)
    return digest


def child_digest(messages: Sequence[Mapping[str, Any]], response: Mapping[str, Any]) -> str:
    """The digest under which a child of this call finds it."""
    return history_digest([*linking_items(messages), {"role": "assistant", **response}]) or ""


def child_digest_after(parent_digest: str | None, response: Mapping[str, Any]) -> str:
    """``child_digest(messages, response)`` from ``parent_digest = history_digest(messages)``:
    one step of the chain instead of the whole history again."""
    start = parent_digest if parent_digest is not None else _DIGEST_SEED
    return extend_digest(start, {"role": "assistant", **response})


def request_digest(body: Mapping[str, Any]) -> str:
    """Digest of everything in a request that affects the engine's answer (for retries)."""
    semantic = {k: v for k, v in body.items() if k not in _NON_SEMANTIC_REQUEST_FIELDS}
    text = canonical_json(semantic)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class Resolution:
    """Request-time answer: the verdict so far, the parent candidate and the retry target."""

    verdict: Verdict
    parent_digest: str | None
    request_digest: str
    parent_call_id: str | None = None
    retry_of: str | None = None
    reason: str | None = None
    #: one past the last routed-expert row the parent holds (None: no rows), so only the rows
    #: after it are asked for
    parent_rows_end: int | None = None
    #: the parent's prompt + generation length and their ``codec.token_digest``, so a child is
    #: verified without reading the parent's arrays (None: unknown, read them)
    parent_num_tokens: int | None = None
    parent_tokens_sha256: bytes | None = None


@dataclass
class _Entry:
    call_id: str
    created_at: float
    child_digest: str | None
    request_digest: str | None
    harness_note: bool
    rows_end: int | None = None
    num_tokens: int | None = None
    tokens_sha256: bytes | None = None


@dataclass
class LinkIndex:
    """Per-rollout digests of captured calls, looked up by child digest and by request digest
    (dicts: a lookup costs the same at call 5 and at call 5,000). Not thread-safe; one per
    rollout."""

    entries: dict[str, _Entry] = field(default_factory=dict)
    _by_child: dict[str, dict[str, _Entry]] = field(default_factory=dict, repr=False)
    _by_request: dict[str, dict[str, _Entry]] = field(default_factory=dict, repr=False)

    def add(
        self,
        call_id: str,
        created_at: float,
        *,
        child_digest: str | None,
        request_digest: str | None,
        harness_note: bool = False,
        rows_end: int | None = None,
        num_tokens: int | None = None,
        tokens_sha256: bytes | None = None,
    ) -> None:
        """Add a call, or replace what is known of it (a call is added when its request
        arrives and again, with its child digest, once it is stored)."""
        old = self.entries.get(call_id)
        if old is not None:
            self._unindex(old)
        entry = _Entry(
            call_id,
            created_at,
            child_digest,
            request_digest,
            harness_note,
            rows_end,
            num_tokens,
            tokens_sha256,
        )
        self.entries[call_id] = entry
        if child_digest is not None:
            self._by_child.setdefault(child_digest, {})[call_id] = entry
        if request_digest is not None:
            self._by_request.setdefault(request_digest, {})[call_id] = entry

    def _unindex(self, entry: _Entry) -> None:
        for index, digest in (
            (self._by_child, entry.child_digest),
            (self._by_request, entry.request_digest),
        ):
            if digest is not None and digest in index:
                index[digest].pop(entry.call_id, None)
                if not index[digest]:
                    del index[digest]

    @staticmethod
    def _ordered(entries: dict[str, _Entry] | None) -> list[_Entry]:
        return sorted((entries or {}).values(), key=lambda e: (e.created_at, e.call_id))

    def resolve(
        self,
        parent_digest: str | None,
        req_digest: str,
        *,
        refuse_note_parents: bool = False,
    ) -> Resolution:
        """Find the parent candidate by digest, and an earlier identical request (a retry).

        Several calls with the same child digest (retries that produced the same output): the
        latest wins, since a harness retries when it lost the earlier answer. With
        ``refuse_note_parents`` (``parent_resolution = source_history``), a parent whose prompt
        carried a rewritten harness note is not taken: the call starts a new chain.
        """
        earlier = self._ordered(self._by_request.get(req_digest))
        retry_of = earlier[0].call_id if earlier else None
        if parent_digest is None:
            return Resolution(Verdict.ROOT, None, req_digest, retry_of=retry_of)
        matches = self._ordered(self._by_child.get(parent_digest))
        if not matches:
            return Resolution(
                Verdict.UNRESOLVED,
                parent_digest,
                req_digest,
                retry_of=retry_of,
                reason=NO_MATCH_REASON,
            )
        parent = matches[-1]
        if refuse_note_parents and parent.harness_note:
            return Resolution(
                Verdict.UNRESOLVED,
                parent_digest,
                req_digest,
                retry_of=retry_of,
                reason="parent prompt carried a rewritten harness note (source_history)",
            )
        return Resolution(
            Verdict.RESOLVED,
            parent_digest,
            req_digest,
            parent.call_id,
            retry_of=retry_of,
            parent_rows_end=parent.rows_end,
            parent_num_tokens=parent.num_tokens,
            parent_tokens_sha256=parent.tokens_sha256,
        )


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
) -> Mismatch | None:
    """Why ``child_prompt`` does not begin with parent prompt + generation (None if it does).

    - ``history_edited``: it differs inside the parent's prompt: the harness changed earlier
      turns (compaction, pruning, a dropped harness note, a changed system prompt).
    - ``retokenized``: inside the parent's output, and the text is the same (parent prompt +
      generation text is a prefix of the child's text): the model's own token split does not
      survive detokenise-then-retokenise.
    - ``template_rerendered``: inside the parent's output, and the text differs too: the
      template or the harness renders the turn differently (dropped reasoning, re-serialised
      tool-call arguments, ...).
    Without ``texts`` an output-side difference is reported as ``template_rerendered``.
    """
    expected = np.concatenate([parent_prompt, parent_generation])
    pos = first_difference(expected, child_prompt)
    if pos is None:
        return None
    if pos < int(parent_prompt.shape[0]):
        return Mismatch(pos, MismatchClass.HISTORY_EDITED, "differs inside the parent's prompt")
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


def extends_by_digest(child_prompt: np.ndarray, num_tokens: int, tokens_sha256: bytes) -> bool:
    """True when ``child_prompt`` begins with the ``num_tokens`` ids whose ``<u4`` bytes hash
    to ``tokens_sha256`` (the parent's prompt + generation, ``codec.token_digest``)."""
    if child_prompt.shape[0] < num_tokens:
        return False
    head = child_prompt[:num_tokens].astype("<u4", copy=False).tobytes()
    return hashlib.sha256(head).digest() == tokens_sha256
