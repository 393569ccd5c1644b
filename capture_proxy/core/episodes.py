"""Episodes: the executions of one rollout, told apart by the attempt suffix ``-a<n>``. Pure.

A rollout is one sample of a task and gets at most one reward; an episode is one execution of
it. A retry after an infrastructure failure is a new episode of the same rollout, with the
attempt suffix in its id: ``task7-s3`` is attempt 0, ``task7-s3-a1`` attempt 1, and so on.
Only the final episode (the highest attempt the store knows of) counts for training.

An id ends in an attempt suffix when it matches ``<base>-a<n>`` with ``n`` decimal digits
without a leading zero (``-a0`` is allowed and means attempt 0 spelt out) and a non-empty base.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

_SUFFIX = re.compile(r"^(?P<base>.+)-a(?P<n>0|[1-9][0-9]{0,8})$")


@dataclass(frozen=True, order=True)
class Episode:
    """One episode: ``rollout_id`` as captured, the ``base`` rollout id it belongs to and its
    ``attempt`` (0 for an id without suffix)."""

    base: str
    attempt: int
    rollout_id: str


def parse_episode(rollout_id: str) -> Episode:
    """Split a rollout id into its base rollout and attempt number."""
    m = _SUFFIX.match(rollout_id)
    if m is None:
        return Episode(rollout_id, 0, rollout_id)
    return Episode(m["base"], int(m["n"]), rollout_id)


def episode_glob(base: str) -> str:
    """A SQLite GLOB pattern matching the suffixed ids of ``base`` (and some others, filter
    with ``parse_episode``). Rollout ids never hold GLOB's special characters (``*?[``)."""
    return f"{base}-a[0-9]*"


def final_episodes(rollout_ids: Iterable[str]) -> dict[str, str]:
    """Map each base rollout id to the id of its final episode (highest attempt; between
    ``x`` and ``x-a0``, which are both attempt 0, the suffixed one)."""
    best: dict[str, Episode] = {}
    for rid in rollout_ids:
        ep = parse_episode(rid)
        cur = best.get(ep.base)
        if cur is None or (ep.attempt, ep.rollout_id != ep.base) > (
            cur.attempt,
            cur.rollout_id != cur.base,
        ):
            best[ep.base] = ep
    return {base: ep.rollout_id for base, ep in best.items()}


def is_final(rollout_id: str, siblings: Iterable[str]) -> bool:
    """Whether ``rollout_id`` is the final episode among itself and ``siblings`` (episode ids
    of any rollouts; only those of the same base count)."""
    base = parse_episode(rollout_id).base
    ids = [rollout_id, *(s for s in siblings if parse_episode(s).base == base)]
    return final_episodes(ids)[base] == rollout_id
