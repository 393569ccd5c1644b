"""The SQLite writer's prompt-parent index: each rollout's stored complete calls with output by
their token prefixes, kept in the writer's memory.

Owns how a put finds its prompt parent (``prefixes``' rule: the deepest stored call whose
prompt + generation ids begin the new prompt) without reading the rollout's other rows: a
rollout's calls are read once, on its first put in this process (its ``calls_by_prefix``
entries and their ``tokens_block_sha256``), then each committed put is added. A put then
costs O(prompt length + the lengths of the calls that share the prompt's blocks), whatever
the number of calls in the rollout. Before, a root put (no verified parent to start from)
read every shorter call of the rollout: 2.9 ms per put at 500 calls of an evaluation sweep,
26 ms at 4,500.

Rows written before layout 9 have no block digest: those of one block or more are kept aside
and compared as before (``choose_prompt_parent``), so an older rollout gets the same parents.

Writer thread only (the SQLite store is one process, its writes one thread: nothing else adds
or removes a rollout's calls). Must not: write, or be used for a shared store (another
replica's puts would be missing).
"""

from __future__ import annotations

import sqlite3
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from capture_proxy.core.codec import PromptParent
from capture_proxy.core.prefixes import (
    PREFIX_BLOCK,
    PrefixIndex,
    StoredPrefix,
    choose_prompt_parent,
)

#: Rollouts, and calls filed over all of them, kept at once (least recently put rollout dropped
#: first; it is read again on its next put). A filed call costs about 1.4 KB: 65,536 about
#: 90 MB. Bounded by calls, not only by rollouts: 1,024 agent sessions put at once, each its
#: rollout, stay filed (64 rollouts, as before, made most of their puts read their rollout's
#: rows again: O(calls in the rollout) per put).
MAX_ROLLOUTS = 4096
MAX_CALLS = 65_536

_LOAD = (
    "SELECT call_id, created_at, num_prompt_tokens + num_generation_tokens, tokens_sha256, "
    "tokens_block_sha256 FROM calls INDEXED BY calls_by_prefix WHERE rollout_id = ? "
    "AND status = 'complete' AND num_generation_tokens > 0"
)


@dataclass
class _Rollout:
    index: PrefixIndex = field(default_factory=PrefixIndex)
    #: calls of a block or more stored without a block digest (before layout 9)
    older: list[StoredPrefix] = field(default_factory=list)

    @property
    def size(self) -> int:
        """Calls filed."""
        return len(self.index) + len(self.older)

    def deepest(self, prompt: np.ndarray, exclude: str, states: list[Any]) -> PromptParent | None:
        found = self.index.deepest_call(prompt, model=None, exclude=exclude, states=states)
        if self.older:  # the index's answer competes with them under the same rule
            return choose_prompt_parent(
                prompt, [*self.older, *filter(None, [found])], exclude=exclude
            )
        return None if found is None else PromptParent(found.call_id, found.num_tokens)


class PromptParents:
    """Per rollout, its stored calls' prefix index (see the module docstring)."""

    def __init__(self, max_rollouts: int = MAX_ROLLOUTS, max_calls: int = MAX_CALLS) -> None:
        self.max_rollouts = max_rollouts
        self.max_calls = max_calls
        self._rollouts: OrderedDict[str, _Rollout] = OrderedDict()
        #: calls filed over all kept rollouts
        self.filed = 0

    def __len__(self) -> int:
        """Rollouts kept."""
        return len(self._rollouts)

    def choose(
        self,
        db: sqlite3.Connection,
        rollout_id: str,
        prompt: np.ndarray,
        call_id: str,
        states: list[Any],
        *,
        empty: bool = False,
    ) -> PromptParent | None:
        """The prompt parent of call ``call_id`` with ``prompt`` (``states``: its
        ``prefixes.block_states``) among the rollout's stored calls (read from ``db`` on the
        rollout's first put in this process; ``empty``: the caller knows it holds none)."""
        return self._rollout(db, rollout_id, empty).deepest(prompt, call_id, states)

    def stored(
        self,
        rollout_id: str,
        call: StoredPrefix,
        block_sha256: bytes,
    ) -> None:
        """A complete call with output was committed (``prefixes.token_digests``)."""
        rollout = self._rollouts.get(rollout_id)
        if rollout is not None:
            before = len(rollout.index)
            rollout.index.add(None, call, block_sha256)
            self.filed += len(rollout.index) - before
            self._evict()

    def forget(self, rollout_id: str | None = None) -> None:
        """Drop a rollout's index (its calls were deleted or retired); None: every rollout."""
        if rollout_id is None:
            self._rollouts.clear()
            self.filed = 0
        else:
            gone = self._rollouts.pop(rollout_id, None)
            if gone is not None:
                self.filed -= gone.size

    def _rollout(self, db: sqlite3.Connection, rollout_id: str, empty: bool) -> _Rollout:
        rollout = self._rollouts.get(rollout_id)
        if rollout is not None:
            self._rollouts.move_to_end(rollout_id)
            return rollout
        rollout = _Rollout()
        rows = () if empty else db.execute(_LOAD, (rollout_id,))
        for call_id, created_at, num_tokens, tokens_sha256, block in rows:
            call = StoredPrefix(call_id, created_at, num_tokens, bytes(tokens_sha256))
            if block is None and num_tokens >= PREFIX_BLOCK:
                rollout.older.append(call)
            else:
                rollout.index.add(None, call, None if block is None else bytes(block))
        self._rollouts[rollout_id] = rollout
        self.filed += rollout.size
        self._evict()
        return rollout

    def _evict(self) -> None:
        """Drop the least recently put rollouts past either bound (never the latest)."""
        rollouts = self._rollouts
        while len(rollouts) > 1 and (
            len(rollouts) > self.max_rollouts or self.filed > self.max_calls
        ):
            _, gone = rollouts.popitem(last=False)
            self.filed -= gone.size
