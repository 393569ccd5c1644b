"""The questions the linking steps ask their driver, and the step protocol.

A step (``parent_lookup.resolve_step``, ``verification.verify_step``) is a generator: it
yields a command, receives the reply through ``send``, and returns its result (``StopIteration``
value). It does no I/O; the adapter that drives it (``proxy.linker.Linker``) answers each
command from memory, the store or the engine. A test plays the replies by hand, no event loop.

Commands and their replies:

- ``ReadParent(call_id)`` -> ``CallRecord | None``: the stored call (None: not found).
- ``ReadParentCandidates(rollout_id, parent_digest)`` -> ``Sequence[CallRecord]``: the
  rollout's stored calls whose child digest is ``parent_digest`` (the calls a history with
  that digest continues), in stored order: an index range of the store, not the rollout.
- ``FindPrefixAncestor(rollout_id, prompt_token_ids, model, exclude)`` -> ``str | None``: the
  call id of the deepest complete call of ``model`` in the rollout's index whose prompt +
  generation begin ``prompt_token_ids`` (``index.LinkIndex.prefix_ancestor``).
- ``CatchUp(rollout_id)`` -> ``LinkIndex``: the rollout's index holding every call stored
  before now (with ``serve --workers``: the other workers' puts read in).
- ``AwaitAttempts(key)`` -> ``bool``: wait, bounded, while a call in flight in another process
  has that ``late_retry.attempt_key``; True when one had (the index is then caught up again).
- ``Detokenize(parent_prompt, parent_full, child_prompt)`` -> ``tuple[str | None, str | None,
  str | None] | None``: the three id lists as text, in that order (an element None: that list
  could not be decoded; None: decoding failed).
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar, cast

import numpy as np

from capture_proxy.core.linking.index import LinkIndex
from capture_proxy.core.records import CallRecord

T = TypeVar("T")


class Command(Generic[T]):
    """A question of a step; ``T`` is the type of its reply."""


#: A step that returns a ``T``: yields commands, is sent their replies.
Step = Generator[Command[Any], Any, T]


def ask(command: Command[T]) -> Generator[Command[Any], Any, T]:
    """Yield ``command`` and return its reply, typed (``reply = yield from ask(...)``)."""
    reply = yield command
    return cast(T, reply)


@dataclass(frozen=True)
class ReadParent(Command["CallRecord | None"]):
    """Read a stored call (a digest parent, to verify a child's tokens against)."""

    call_id: str


@dataclass(frozen=True)
class ReadParentCandidates(Command[Sequence[CallRecord]]):
    """Read the rollout's stored calls a history with ``parent_digest`` continues (to refresh
    its index after a digest miss: another replica may have stored the parent)."""

    rollout_id: str
    parent_digest: str


@dataclass(frozen=True)
class CatchUp(Command[LinkIndex]):
    """Bring the rollout's index up to every call stored before now (another worker's puts
    committed since it was last brought up)."""

    rollout_id: str


@dataclass(frozen=True)
class AwaitAttempts(Command[bool]):
    """Wait, bounded, until no call in flight in another process (``serve --workers``) has
    ``key`` (``late_retry.attempt_key``: an identical request of one harness session); reply
    whether one had. Without other processes: False at once."""

    key: str


@dataclass(frozen=True)
class FindPrefixAncestor(Command["str | None"]):
    """Find the deepest token-exact ancestor of a prompt in the rollout's index.
    ``prompt_token_ids``: uint32[num_prompt_tokens] (not compared: the other fields name the
    question, the array is the call's own)."""

    rollout_id: str
    prompt_token_ids: np.ndarray = field(compare=False, repr=False)
    model: str | None = None
    exclude: str = ""


@dataclass(frozen=True)
class Detokenize(Command["tuple[str | None, str | None, str | None] | None"]):
    """Detokenise three id lists (to classify a token mismatch by text)."""

    parent_prompt: list[int]
    parent_full: list[int]
    child_prompt: list[int]
