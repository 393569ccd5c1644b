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

import dataclasses
import enum
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from capture_proxy.core.prefixes import StoredPrefix, choose_prompt_parent

#: Reason of an unresolved verdict whose last model-authored turn matches no captured output.
NO_MATCH_REASON = "no captured call produced the last model-authored turn"
#: ... whose last turn is a captured output, under another history (turns dropped or edited).
HISTORY_EDITED_REASON = (
    "the last model-authored turn is a captured call's output, but the history before it was edited"
)
#: ... whose last turn is a captured output but for its tool-call ids.
TOOL_CALL_IDS_REASON = (
    "the last model-authored turn equals a captured call's output but for its tool-call ids"
)
#: A resolution by the last turn's tool-call ids: the harness rewrote that turn's text.
TURN_REWRITTEN_REASON = (
    "the last model-authored turn was rewritten by the harness; found by its tool-call ids"
)
#: ... whose turns were produced by a call to another model.
MODEL_SCOPE_REASON = "the matching turns come from a call to another model"
#: Record statuses the index keeps (``CallStatus`` values; core.records is not imported here).
CALL_FAILED = "failed"
CALL_INCOMPLETE = "incomplete"

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
    - ``prefix``: the digest parent was refused, or none matched, but an earlier call of the
      rollout is a token-exact ancestor: the call is linked to the deepest one (its prompt
      begins with that call's prompt + generation); the refusal is kept as a diagnostic.
    """

    ROOT = "root"
    RESOLVED = "resolved"
    REFUSED = "refused"
    UNRESOLVED = "unresolved"
    PREFIX = "prefix"


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


def turn_payload(turn: Mapping[str, Any]) -> str:
    """``canonical(turn)``: the text one assistant message adds to a digest."""
    return canonical_json(canonical_turn(turn))


def _extend(digest: str, payload: str) -> str:
    return hashlib.sha256((digest + payload).encode("utf-8")).hexdigest()


def extend_digest(digest: str, turn: Mapping[str, Any]) -> str:
    """``sha256(digest || canonical(turn))`` as hex."""
    return _extend(digest, turn_payload(turn))


def linking_items(messages: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The model-authored turns of a history: its assistant messages, in order."""
    return [m for m in messages if m.get("role") == "assistant"]


def history_digest(
    messages: Sequence[Mapping[str, Any]], payloads: Sequence[str | None] | None = None
) -> str | None:
    """The parent digest of a request: None when it has no model-authored turn (a root).

    ``payloads``: ``turn_payload`` of each assistant message (None for the others), when
    known already (``known_messages``); then only the digest chain is computed."""
    if payloads is None:
        turns = [turn_payload(m) for m in linking_items(messages)]
    else:
        if len(payloads) != len(messages):
            raise ValueError(f"{len(payloads)} payloads for {len(messages)} messages")
        turns = [
            p if p is not None else turn_payload(m)
            for m, p in zip(messages, payloads, strict=True)
            if m.get("role") == "assistant"
        ]
    if not turns:
        return None
    digest = _DIGEST_SEED
    for payload in turns:
        digest = _extend(digest, payload)
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
class Candidate:
    """A digest-resolved parent candidate: its id, the routed-expert rows it holds (one past
    the last; None: none) and its prompt + generation length and ``codec.token_digest`` (None:
    no complete token data), so a child is verified without reading the candidate's arrays."""

    call_id: str
    rows_end: int | None = None
    num_tokens: int | None = None
    tokens_sha256: bytes | None = None


@dataclass(frozen=True)
class Resolution:
    """Request-time answer: the verdict so far, the parent candidates and the retry target.

    ``candidates``: every captured call of the same model whose child digest is the request's
    parent digest, the preferred first (see ``LinkIndex.resolve``); verification takes the
    first whose tokens the child extends. ``parent_call_id`` and the ``parent_*`` fields are
    the preferred candidate's. ``mismatch``: for an unresolved history whose last turn is a
    captured output under another history (a turn dropped or edited), the diagnostic details
    (``parent_digest_mismatch``, class ``history_edited``)."""

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
    candidates: tuple[Candidate, ...] = ()
    mismatch: dict[str, Any] | None = None

    def preferring(self, call_id: str) -> Resolution:
        """The same resolution with ``call_id`` (one of the candidates) preferred: the parent
        an exact-token prompt was spliced from."""
        chosen = [c for c in self.candidates if c.call_id == call_id]
        if not chosen:
            return self
        rest = tuple(c for c in self.candidates if c.call_id != call_id)
        first = chosen[0]
        return dataclasses.replace(
            self,
            parent_call_id=first.call_id,
            parent_rows_end=first.rows_end,
            parent_num_tokens=first.num_tokens,
            parent_tokens_sha256=first.tokens_sha256,
            candidates=(first, *rest),
        )


#: Status of an index entry whose call is still in flight.
IN_FLIGHT = "in_flight"


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
    model: str | None = None
    status: str = IN_FLIGHT
    #: digests of the call's own answer, alone (with and without its tool-call ids)
    turn_digest: str | None = None
    turn_digest_without_ids: str | None = None
    #: the tool-call ids of its answer (ids are unique per answer: engine- or proxy-made)
    tool_call_ids: tuple[str, ...] = ()
    #: verified children so far; a later identical retry that supersedes this call
    children: int = 0
    superseded_by: str | None = None


def tool_call_ids(turn: Mapping[str, Any] | None) -> tuple[str, ...]:
    """The ids of a turn's tool calls, in order (empty when it has none or one lacks an id)."""
    ids = tuple(str(c.get("id") or "") for c in (turn or {}).get("tool_calls") or [])
    return ids if all(ids) else ()


def turn_digest(turn: Mapping[str, Any], *, with_ids: bool = True) -> str:
    """Digest of one assistant turn alone (not chained): finds the call that produced a turn
    whatever history came before it."""
    canonical = canonical_turn(turn)
    if not with_ids:
        canonical = {
            **canonical,
            "tool_calls": [{**c, "id": None} for c in canonical["tool_calls"]],
        }
    return hashlib.sha256(canonical_json(canonical).encode("utf-8")).hexdigest()


@dataclass
class LinkIndex:
    """Per-rollout digests of captured calls, looked up by child digest, by request digest and
    by answer digest (dicts: a lookup costs the same at call 5 and at call 5,000). Not
    thread-safe; one per rollout."""

    entries: dict[str, _Entry] = field(default_factory=dict)
    _by_child: dict[str, dict[str, _Entry]] = field(default_factory=dict, repr=False)
    _by_request: dict[str, dict[str, _Entry]] = field(default_factory=dict, repr=False)
    _by_turn: dict[str, dict[str, _Entry]] = field(default_factory=dict, repr=False)
    _by_turn_without_ids: dict[str, dict[str, _Entry]] = field(default_factory=dict, repr=False)
    _by_tool_call_ids: dict[str, dict[str, _Entry]] = field(default_factory=dict, repr=False)

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
        model: str | None = None,
        status: str = IN_FLIGHT,
        response: Mapping[str, Any] | None = None,
        parent_call_id: str | None = None,
        retry_of: str | None = None,
    ) -> None:
        """Add a call, or replace what is known of it (a call is added when its request
        arrives and again, with its child digest and status, once it is stored).
        ``response``: its answer (indexed alone, to name a history that dropped turns);
        ``parent_call_id`` / ``retry_of``: its verified parent and the call it retried."""
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
            model,
            status,
            turn_digest(response) if response is not None else None,
            turn_digest(response, with_ids=False) if response is not None else None,
            tool_call_ids(response),
        )
        if old is not None:
            entry.children, entry.superseded_by = old.children, old.superseded_by
        self.entries[call_id] = entry
        for index, digest in self._keys(entry):
            if digest is not None:
                index.setdefault(digest, {})[call_id] = entry
        if old is None or old.status == IN_FLIGHT:
            if parent_call_id is not None and parent_call_id in self.entries:
                self.entries[parent_call_id].children += 1
            if retry_of is not None and retry_of in self.entries:
                self.entries[retry_of].superseded_by = call_id

    def _keys(self, entry: _Entry) -> tuple[tuple[dict[str, dict[str, _Entry]], str | None], ...]:
        return (
            (self._by_child, entry.child_digest),
            (self._by_request, entry.request_digest),
            (self._by_turn, entry.turn_digest),
            (self._by_turn_without_ids, entry.turn_digest_without_ids),
            (self._by_tool_call_ids, "\x1f".join(entry.tool_call_ids) or None),
        )

    def _unindex(self, entry: _Entry) -> None:
        for index, digest in self._keys(entry):
            if digest is not None and digest in index:
                index[digest].pop(entry.call_id, None)
                if not index[digest]:
                    del index[digest]

    @staticmethod
    def _ordered(entries: dict[str, _Entry] | None) -> list[_Entry]:
        return sorted((entries or {}).values(), key=lambda e: (e.created_at, e.call_id))

    def _retry_of(self, req_digest: str, retry_requested: bool) -> str | None:
        """The call an identical request retries: only on an explicit signal (the harness says
        it retries, or the latest identical call failed or was left incomplete). Identical
        requests otherwise are sibling samples, each its own call."""
        earlier = self._ordered(self._by_request.get(req_digest))
        if not earlier:
            return None
        latest = earlier[-1]
        if retry_requested or latest.status in (CALL_FAILED, CALL_INCOMPLETE):
            return latest.call_id
        return None

    @staticmethod
    def _preference(entry: _Entry) -> tuple[bool, bool, bool, float, str]:
        # Verifiable first; a call a retry superseded last (the harness lost its answer);
        # then one with no child yet (parallel sub-agents that answered alike: each continues
        # its own), then the earliest.
        return (
            entry.num_tokens is None,
            entry.superseded_by is not None,
            entry.children > 0,
            entry.created_at,
            entry.call_id,
        )

    def resolve(
        self,
        parent_digest: str | None,
        req_digest: str,
        *,
        model: str | None = None,
        last_turn: Mapping[str, Any] | None = None,
        retry_requested: bool = False,
        refuse_note_parents: bool = False,
    ) -> Resolution:
        """Find the parent candidates by digest, and the call an identical request retries.

        Candidates are the calls of the same ``model`` (a parent from another model would put
        its tokens and log probs in this model's chain) whose child digest is
        ``parent_digest``, preferred in this order: verifiable, not superseded by a retry,
        without a child yet, earliest (see ``_preference``). With ``refuse_note_parents``
        (``parent_resolution = source_history``), a parent whose prompt carried a rewritten
        harness note is not taken: the call starts a new chain. ``last_turn``: the history's
        last assistant message, to tell a dropped or edited turn from a foreign one when no
        call matches.
        """
        retry_of = self._retry_of(req_digest, retry_requested)
        if parent_digest is None:
            return Resolution(Verdict.ROOT, None, req_digest, retry_of=retry_of)
        found = list((self._by_child.get(parent_digest) or {}).values())
        matches = sorted((e for e in found if e.model == model), key=self._preference)
        rewritten = None
        if not found and last_turn is not None and not self._is_captured_turn(last_turn, model):
            # The harness rewrote the model's last turn (Claude Code rebuilds tool inputs,
            # adding defaults): its tool-call ids still name the call that produced it.
            # Tokens decide whether the link is taken.
            ids = "\x1f".join(tool_call_ids(last_turn))
            by_ids = (self._by_tool_call_ids.get(ids) or {}).values() if ids else ()
            matches = sorted((e for e in by_ids if e.model == model), key=self._preference)
            rewritten = TURN_REWRITTEN_REASON if matches else None
        if not matches:
            reason, mismatch = self._why_unmatched(found, model, last_turn)
            return Resolution(
                Verdict.UNRESOLVED,
                parent_digest,
                req_digest,
                retry_of=retry_of,
                reason=reason,
                mismatch=mismatch,
            )
        if refuse_note_parents and matches[0].harness_note:
            return Resolution(
                Verdict.UNRESOLVED,
                parent_digest,
                req_digest,
                retry_of=retry_of,
                reason="parent prompt carried a rewritten harness note (source_history)",
            )
        candidates = tuple(
            Candidate(e.call_id, e.rows_end, e.num_tokens, e.tokens_sha256) for e in matches
        )
        first = candidates[0]
        return Resolution(
            Verdict.RESOLVED,
            parent_digest,
            req_digest,
            first.call_id,
            retry_of=retry_of,
            reason=rewritten,
            parent_rows_end=first.rows_end,
            parent_num_tokens=first.num_tokens,
            parent_tokens_sha256=first.tokens_sha256,
            candidates=candidates,
        )

    def _is_captured_turn(self, turn: Mapping[str, Any], model: str | None) -> bool:
        """True when ``turn`` is, exactly or but for its tool-call ids, a captured output."""
        for index, digest in (
            (self._by_turn, turn_digest(turn)),
            (self._by_turn_without_ids, turn_digest(turn, with_ids=False)),
        ):
            if any(e.model == model for e in (index.get(digest) or {}).values()):
                return True
        return False

    def _why_unmatched(
        self, found: list[_Entry], model: str | None, last_turn: Mapping[str, Any] | None
    ) -> tuple[str, dict[str, Any] | None]:
        if found:
            models = sorted({str(e.model) for e in found})
            return (
                f"{MODEL_SCOPE_REASON}: the turns were produced by model {', '.join(models)}, "
                f"this call is to {model}",
                None,
            )
        if last_turn is None:
            return NO_MATCH_REASON, None
        same = self._ordered(self._by_turn.get(turn_digest(last_turn)))
        same = [e for e in same if e.model == model]
        if same:
            return (
                HISTORY_EDITED_REASON,
                {
                    "class": MismatchClass.HISTORY_EDITED.value,
                    "parent_call_id": same[-1].call_id,
                    "explanation": "the last model-authored turn is this call's output, but "
                    "the turns before it differ from its history (a turn was dropped or "
                    "edited)",
                },
            )
        alike = self._ordered(self._by_turn_without_ids.get(turn_digest(last_turn, with_ids=False)))
        alike = [e for e in alike if e.model == model]
        if alike:
            return (
                TOOL_CALL_IDS_REASON,
                {
                    "class": MismatchClass.HISTORY_EDITED.value,
                    "parent_call_id": alike[-1].call_id,
                    "explanation": "the last model-authored turn equals this call's output "
                    "but for its tool-call ids (the harness rewrote them)",
                },
            )
        return NO_MATCH_REASON, None

    def prefix_ancestor(self, prompt: np.ndarray, *, model: str | None, exclude: str) -> str | None:
        """The deepest complete call of ``model`` whose prompt + generation ids begin
        ``prompt`` (the store's prompt-parent rule, ``prefixes``), or None. O(prompt length +
        calls), from the digests kept per entry: no arrays are read."""
        candidates = [
            StoredPrefix(e.call_id, e.created_at, e.num_tokens, e.tokens_sha256)
            for e in self.entries.values()
            if e.model == model and e.num_tokens is not None and e.tokens_sha256 is not None
        ]
        parent = choose_prompt_parent(prompt, candidates, exclude=exclude)
        return parent.call_id if parent is not None else None


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
) -> Mismatch | None:
    """Why ``child_prompt`` does not begin with parent prompt + generation (None if it does).

    - ``history_edited``: it differs inside the parent's prompt: the harness changed earlier
      turns (compaction, pruning, a dropped harness note, a changed system prompt). With
      ``history_unchanged`` (the child's messages begin with the parent's request messages
      as sent, compared canonically) it is ``template_rerendered`` instead: the template
      renders the same history differently (e.g. drops the reasoning of earlier turns).
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
        if history_unchanged:
            return Mismatch(
                pos,
                MismatchClass.TEMPLATE_RERENDERED,
                "differs inside the parent's prompt, though the harness sent the parent's "
                "history unchanged: the template renders it differently (e.g. it drops the "
                "reasoning of earlier turns)",
            )
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
