"""Calls this process stored (or read from the store) lately, kept in memory for the next
call of their rollout.

Owns a bounded cache of stored records, so that the parent a call continues (exact-token
prompts, a Responses ``previous_response_id``, a token check) is taken from memory rather than
read from the store. Reading one call from the store decodes its whole prompt ancestry (a
stored prompt is a delta after its prompt parent's), so on a long session the read grows with
the number of turns: on the 120-turn benchmark session it took 13 ms at the last turn, more
than everything else exact-token mode does per call.

A cached record is the object the store was given; the store gives back the same values for it
(its stored form round-trips), so a hit answers what a read would. Like the store's records it
is read-only. Bounded by an estimate of the bytes it holds (token arrays, and the messages'
JSON size), least recently used out first; a miss reads the store, so eviction costs time,
never correctness. A deleted rollout's calls are dropped (``forget``). Must not: do I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import orjson

from capture_proxy.core.known_messages import MessageFacts
from capture_proxy.core.linking.record_digests import RecordDigests
from capture_proxy.core.records import CallRecord

#: Bytes of one SHA-256 state as kept (OpenSSL's context and the Python object), estimated
_STATE_BYTES = 256

#: Default bound of the cache (bytes, estimated): about a thousand 57k-token sessions' tips.
DEFAULT_MAX_BYTES = 512 * 1024 * 1024


def _size(record: CallRecord, facts: Sequence[MessageFacts] | None) -> int:
    """Bytes the record holds, estimated: its arrays, and its messages as JSON (their Python
    objects are larger; a bound, not an account), known from their facts' keys if given."""
    experts = record.routed_experts
    arrays = (
        record.prompt_token_ids.nbytes
        + record.generation_token_ids.nbytes
        + record.generation_log_probs.nbytes
        + (experts.nbytes if experts is not None else 0)
    )
    if facts is not None:
        return arrays + sum(len(f.key or b"") for f in facts)
    try:
        messages = len(orjson.dumps(record.request_messages))
    except TypeError:  # integers past 64 bits: rare, any estimate will do
        messages = 0
    return arrays + messages


@dataclass(frozen=True, slots=True)
class _Entry:
    record: CallRecord
    size: int
    #: the ``known_messages`` facts of ``record.request_messages``, when the call had them
    message_facts: tuple[MessageFacts, ...] | None
    #: the record's ``RecordDigests`` (its prompt's block states, for its children's:
    #: ``RecordDigests.seed``), when the call made them
    digests: RecordDigests | None = None


class RecentCalls:
    """Stored records by call id, at most ``max_bytes`` (estimated) in all."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._records: OrderedDict[str, _Entry] = OrderedDict()
        self._by_rollout: dict[str, set[str]] = {}
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._records)

    def get(self, call_id: str) -> CallRecord | None:
        entry = self._records.get(call_id)
        if entry is None:
            return None
        self._records.move_to_end(call_id)
        return entry.record

    def digests(self, call_id: str) -> RecordDigests | None:
        """A kept record's ``RecordDigests``, if it came with them."""
        entry = self._records.get(call_id)
        return entry.digests if entry is not None else None

    def message_facts(self, call_id: str) -> tuple[MessageFacts, ...] | None:
        """The facts of a kept record's request messages, if it came with them."""
        entry = self._records.get(call_id)
        return entry.message_facts if entry is not None else None

    def put(
        self,
        record: CallRecord,
        message_facts: Sequence[MessageFacts] | None = None,
        digests: RecordDigests | None = None,
    ) -> None:
        """Keep ``record`` (it was stored), the facts of its request messages and its
        ``RecordDigests`` (when of its very arrays); a record larger than the bound is not
        kept."""
        self._drop(record.call_id)
        facts = tuple(message_facts) if message_facts is not None else None
        if facts is not None and len(facts) != len(record.request_messages):
            facts = None
        if digests is not None and not digests.same_tokens(record):
            digests = None
        size = _size(record, facts) + (_STATE_BYTES * digests.num_states if digests else 0)
        if size > self.max_bytes:
            return
        self._records[record.call_id] = _Entry(record, size, facts, digests)
        self._by_rollout.setdefault(record.rollout_id, set()).add(record.call_id)
        self._bytes += size
        while self._bytes > self.max_bytes:
            oldest = next(iter(self._records))
            self._drop(oldest)

    def forget(self, rollout_id: str) -> None:
        """Drop the rollout's records (it was deleted or retired)."""
        for call_id in list(self._by_rollout.get(rollout_id, ())):
            self._drop(call_id)

    def _drop(self, call_id: str) -> None:
        entry = self._records.pop(call_id, None)
        if entry is None:
            return
        record = entry.record
        self._bytes -= entry.size
        ids = self._by_rollout.get(record.rollout_id)
        if ids is not None:
            ids.discard(call_id)
            if not ids:
                del self._by_rollout[record.rollout_id]
