"""The response-time verification step: which parent a captured call is linked to, and why.

Owns the fail-closed decisions taken once a call's tokens are known: the diagnostics of its
request-time resolution (harness note, retry, foreign turn, another model's turns, a dropped or
edited turn, a rewritten turn), the digest check of the candidates (the common case, without
reading a parent), the token check against the digest parent and the classification of a
mismatch (by text when the driver can detokenise), the prefix-ancestor fallback of a refused or
unmatched link, the routed-experts rows a link not taken leaves missing, and the ``linking``
dict stored on the record. Pure: a generator of ``commands`` (``ReadParent``,
``Detokenize``, ``FindPrefixAncestor``); ``proxy.linker.Linker.verify`` drives it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from capture_proxy.core.linking.commands import (
    Detokenize,
    FindPrefixAncestor,
    ReadParent,
    Step,
    ask,
)
from capture_proxy.core.linking.digests import (
    child_digest,
    child_digest_after,
    last_linking_item,
    trailing_images,
)
from capture_proxy.core.linking.mismatch import DecodedTexts, Mismatch, classify_mismatch
from capture_proxy.core.linking.prefill import history_before_turn, record_prefill
from capture_proxy.core.linking.record_digests import RecordDigests
from capture_proxy.core.linking.resolution import Candidate, Resolution
from capture_proxy.core.linking.verdicts import (
    CALL_INCOMPLETE,
    IMAGES_DIFFER,
    PARENT_INCOMPLETE,
    Reason,
    ReasonKind,
    Verdict,
    adapter_reason,
    prefix_linked,
    tokens_do_not_chain,
)
from capture_proxy.core.records import CallRecord, CallStatus, Diagnostic, DiagnosticKind
from capture_proxy.core.splice import (
    SpliceRefused,
    check_extension,
    only_system_messages_differ,
)
from capture_proxy.families.vision import IMAGE_PAD_ID

#: Reasons of an unresolved verdict after which a token-exact ancestor may still be linked (a
#: history no call matched for a named reason; not the source_history refusal of a note
#: parent, which asks for a new chain).
_PREFIX_LINKABLE = frozenset(
    {
        ReasonKind.NO_MATCH,
        ReasonKind.HISTORY_EDITED,
        ReasonKind.TOOL_CALL_IDS,
        ReasonKind.MODEL_SCOPE,
    }
)


@dataclass(frozen=True)
class TokenCheck:
    """The outcome of checking a child's prompt against its digest parent's tokens.
    ``mismatch``: the ``parent_digest_mismatch`` diagnostic's details (None: none)."""

    verdict: Verdict
    reason: Reason | None
    parent_call_id: str | None
    mismatch: dict[str, Any] | None = None


def verify_step(
    record: CallRecord,
    resolution: Resolution,
    linking_messages: Sequence[Mapping[str, Any]],
    *,
    harness_note: str | None,
    retry_count: str | None,
    can_decode: bool,
    digests: RecordDigests | None = None,
    prefill: Mapping[str, Any] | None = None,
) -> Step[CallRecord]:
    """``record`` with the verdict, the digests and the diagnostics attached; its parent set
    only when the parent's prompt + generation ids are a prefix of its prompt ids: the first
    digest candidate that verifies (by digest, else by reading the parent's tokens), else
    (refused or unmatched) the deepest token-exact ancestor of the same model (verdict
    ``prefix``), else none. ``can_decode``: whether a mismatch may be classified by text
    (``Detokenize`` is asked only then). ``digests``: the record's ``RecordDigests``, to be
    filled here for indexing it later (a new one when None or of another record)."""
    if digests is None or not digests.describes(record):
        digests = RecordDigests(record)
    diagnostics = [*record.diagnostics, *request_diagnostics(resolution, harness_note, retry_count)]
    verdict, reason = resolution.verdict, adapter_reason(resolution.reason)
    parent_call_id: str | None = None
    if verdict is Verdict.RESOLVED:
        assert resolution.parent_call_id is not None
        verified = verified_by_digest(record, resolution.candidates, digests)
        if verified is not None:
            # The common case, without reading the parent: the digest of the child's
            # prompt head equals the digest of a candidate's prompt + generation.
            parent_call_id, reason = verified, None
        else:
            check = yield from check_tokens(
                record, resolution.parent_call_id, linking_messages, can_decode=can_decode
            )
            verdict, reason, parent_call_id = check.verdict, check.reason, check.parent_call_id
            if check.mismatch is not None:
                diagnostics.append(
                    Diagnostic(DiagnosticKind.PARENT_DIGEST_MISMATCH, check.mismatch)
                )
    if parent_call_id is None and may_prefix_link(verdict, reason, record):
        ancestor = yield from ask(
            FindPrefixAncestor(
                record.rollout_id, record.prompt_token_ids, record.model, record.call_id
            )
        )
        if ancestor is not None and may_carry_images(record):
            found = yield from ask(ReadParent(ancestor))
            if found is None or not images_agree(found, record):
                ancestor = None  # the same tokens, other images: no link
        if ancestor is not None:
            reason = prefix_linked(verdict, reason)
            verdict, parent_call_id = Verdict.PREFIX, ancestor
    diagnostics.extend(routed_experts_diagnostics(record, resolution, parent_call_id))
    linking: dict[str, Any] = {
        "verdict": verdict.value,
        "parent_digest": resolution.parent_digest,
        "child_digest": _child_digest(resolution, linking_messages, record, digests),
        "request_digest": resolution.request_digest,
        "digest_parent_call_id": resolution.parent_call_id,
        "reason": None if reason is None else reason.text,
        "harness_note": harness_note,
        "prefill": prefill is not None,
    }
    if prefill is not None:
        # What a row's metadata must hold for the turn the call offers (``stored.of_row``):
        # a worker catching up reads the row's metadata, not its messages.
        linking["prefill_message"] = dict(prefill)
    return record.replace(
        parent_call_id=parent_call_id,
        linking=linking,
        retry_of=resolution.retry_of,
        diagnostics=diagnostics,
    )


def request_diagnostics(
    resolution: Resolution, harness_note: str | None, retry_count: str | None
) -> list[Diagnostic]:
    """The diagnostics the request-time resolution and the request's headers decide, in the
    order they are recorded."""
    diagnostics = []
    reason = adapter_reason(resolution.reason)
    kind = None if reason is None else reason.kind
    if harness_note is not None:
        diagnostics.append(
            Diagnostic(DiagnosticKind.HARNESS_NOTE_REWRITTEN, {"note": harness_note})
        )
    if resolution.retry_of is not None:
        details: dict[str, Any] = {"retry_of": resolution.retry_of}
        if retry_count is not None:
            details["retry_count_header"] = retry_count
        diagnostics.append(Diagnostic(DiagnosticKind.RETRY, details))
    if reason is not None and kind is ReasonKind.NO_MATCH:
        diagnostics.append(Diagnostic(DiagnosticKind.FOREIGN_TURN, {"reason": reason.text}))
    elif reason is not None and kind is ReasonKind.MODEL_SCOPE:
        diagnostics.append(
            Diagnostic(DiagnosticKind.PARENT_MODEL_MISMATCH, {"reason": reason.text})
        )
    elif resolution.mismatch is not None:
        diagnostics.append(
            Diagnostic(DiagnosticKind.PARENT_DIGEST_MISMATCH, dict(resolution.mismatch))
        )
    if reason is not None and kind is ReasonKind.TURN_REWRITTEN:
        diagnostics.append(
            Diagnostic(
                DiagnosticKind.TURN_REWRITTEN,
                {"parent_call_id": resolution.parent_call_id, "reason": reason.text},
            )
        )
    return diagnostics


def verified_by_digest(
    record: CallRecord, candidates: Sequence[Candidate], digests: RecordDigests | None = None
) -> str | None:
    """The first candidate whose prompt + generation the record's prompt begins with,
    checked by digest (candidates without complete token data are skipped). ``digests``: the
    record's ``RecordDigests``, if made already."""
    if record.status is not CallStatus.COMPLETE:
        return None
    if digests is None or not digests.describes(record):
        digests = RecordDigests(record)
    for candidate in candidates:
        if (
            candidate.num_tokens is not None
            and candidate.tokens_sha256 is not None
            and digests.extends(candidate.num_tokens, candidate.tokens_sha256)
        ):
            return candidate.call_id
    return None


def check_tokens(
    record: CallRecord,
    parent_id: str,
    linking_messages: Sequence[Mapping[str, Any]],
    *,
    can_decode: bool,
) -> Step[TokenCheck]:
    """Verify ``record`` against its digest parent's stored tokens (asks ``ReadParent``; on a
    mismatch, when ``can_decode``, ``Detokenize`` to classify it by text)."""
    if record.status is not CallStatus.COMPLETE:
        return TokenCheck(Verdict.UNRESOLVED, CALL_INCOMPLETE, None)
    parent = yield from ask(ReadParent(parent_id))
    if parent is None or parent.status is not CallStatus.COMPLETE:
        return TokenCheck(
            Verdict.REFUSED,
            PARENT_INCOMPLETE,
            None,
            {"parent_call_id": parent_id, "reason": "parent incomplete"},
        )
    unchanged = history_unchanged(parent, linking_messages)
    system_changed = not unchanged and only_system_messages_differ(
        history_before_turn(parent), linking_messages
    )
    mismatch = classify_mismatch(
        parent.prompt_token_ids,
        parent.generation_token_ids,
        record.prompt_token_ids,
        history_unchanged=unchanged,
        system_changed=system_changed,
    )
    if mismatch is None and not images_agree(parent, record):
        return TokenCheck(
            Verdict.REFUSED,
            IMAGES_DIFFER,
            None,
            {"parent_call_id": parent_id, "reason": "the same tokens, other images"},
        )
    if mismatch is None:
        return TokenCheck(Verdict.RESOLVED, None, parent_id)
    texts = None
    if can_decode:
        texts = decoded_texts(
            (
                yield from ask(
                    Detokenize(
                        parent.prompt_token_ids.tolist(),
                        parent.full_token_ids().tolist(),
                        record.prompt_token_ids.tolist(),
                    )
                )
            )
        )
    if texts is not None:
        mismatch = _classify_with_text(
            parent, record, texts, history_unchanged=unchanged, system_changed=system_changed
        )
    return TokenCheck(
        Verdict.REFUSED,
        tokens_do_not_chain(mismatch.mismatch_class.value),
        None,
        {
            "parent_call_id": parent_id,
            "position": mismatch.position,
            "class": mismatch.mismatch_class.value,
            "explanation": mismatch.explanation,
            "classified_with_text": texts is not None,
        },
    )


def _classify_with_text(
    parent: CallRecord,
    child: CallRecord,
    texts: DecodedTexts,
    *,
    history_unchanged: bool,
    system_changed: bool,
) -> Mismatch:
    response = parent.response_message or {}
    mismatch = classify_mismatch(
        parent.prompt_token_ids,
        parent.generation_token_ids,
        child.prompt_token_ids,
        texts=texts,
        parent_reasoning=response.get("reasoning_content") or response.get("reasoning"),
        history_unchanged=history_unchanged,
        system_changed=system_changed,
        parent_prefilled=record_prefill(parent) is not None,
    )
    assert mismatch is not None  # the ids differ, whatever the texts say
    return mismatch


def decoded_texts(
    reply: tuple[str | None, str | None, str | None] | None,
) -> DecodedTexts | None:
    """The ``Detokenize`` reply as texts, or None when any of the three is missing."""
    if reply is None or any(part is None for part in reply):
        return None
    parent_prompt, parent_full, child_prompt = reply
    assert parent_prompt is not None and parent_full is not None and child_prompt is not None
    return DecodedTexts(parent_prompt, parent_full, child_prompt)


def history_unchanged(parent: CallRecord, linking_messages: Sequence[Mapping[str, Any]]) -> bool:
    """True when the child's history is the parent's request as the engine got it, its
    answer, then new messages: compared canonically, so a token difference inside the parent's
    prompt is the template's doing, not the harness's. (A parent whose rewritten harness note
    is gone from the child's history does not count as unchanged: the note was in its
    prompt. A parent's prefill is the start of its answer's turn, not history.)"""
    try:
        check_extension(history_before_turn(parent), linking_messages)
    except SpliceRefused:
        return False
    return True


def _image_spans(record: CallRecord, limit: int | None = None) -> list[tuple[Any, Any, Any]]:
    return [
        (e.get("sha256"), e.get("prompt_start"), e.get("prompt_end"))
        for e in record.images or []
        if limit is None or (e.get("prompt_start") is not None and e["prompt_start"] < limit)
    ]


def images_agree(parent: CallRecord, child: CallRecord) -> bool:
    """The child's images within the parent's prompt + generation are the parent's images,
    at the same spans: tokens alone cannot tell two images of one size apart."""
    if not parent.images and not child.images:
        return True
    limit = parent.num_prompt_tokens + parent.num_generation_tokens
    return _image_spans(child, limit) == _image_spans(parent)


def may_carry_images(record: CallRecord) -> bool:
    """The record has images, or its prompt holds an image token (a Qwen-VL placeholder): a
    token-exact ancestor must then also have the same images."""
    return bool(record.images) or bool(np.any(record.prompt_token_ids == IMAGE_PAD_ID))


def may_prefix_link(verdict: Verdict, reason: Reason | None, record: CallRecord) -> bool:
    """A refused link, or a history no call matched for a named reason (not the
    source_history refusal of a note parent, which asks for a new chain)."""
    if record.status is not CallStatus.COMPLETE:
        return False
    if verdict is Verdict.REFUSED:
        return True
    return verdict is Verdict.UNRESOLVED and reason is not None and reason.kind in _PREFIX_LINKABLE


def routed_experts_diagnostics(
    record: CallRecord, resolution: Resolution, parent_call_id: str | None
) -> list[Diagnostic]:
    """``routed_experts_mismatch`` when rows were asked for from the digest parent's end on
    (``routed_experts_start > 0``) but that link was not taken: the rows before it are
    missing."""
    if (
        parent_call_id == resolution.parent_call_id
        or resolution.parent_call_id is None
        or record.routed_experts_start <= 0
    ):
        return []
    return [
        Diagnostic(
            DiagnosticKind.ROUTED_EXPERTS_MISMATCH,
            {
                "reason": "the digest parent's link was not taken: rows before "
                "routed_experts_start were not asked for",
                "routed_experts_start": record.routed_experts_start,
            },
        )
    ]


def _child_digest(
    resolution: Resolution,
    linking_messages: Sequence[Mapping[str, Any]],
    record: CallRecord,
    digests: RecordDigests,
) -> str | None:
    """The history's digest extended by the turn the call offers (``digests.turn``: its
    answer, merged after its prefill)."""
    turn = digests.turn
    if turn is None:
        return None
    if trailing_images(linking_messages):
        # The images after the last turn are in the child digest, not in the parent digest.
        return child_digest(linking_messages, turn)
    if resolution.parent_digest is not None or last_linking_item(linking_messages) is None:
        # The request's own digest (history_digest of these messages): one more step.
        return child_digest_after(resolution.parent_digest, turn, digests.answer_payload())
    # Resolution failed before digesting the history: digest it now.
    return child_digest(linking_messages, turn)
