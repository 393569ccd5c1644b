"""Twin sessions driven through a ``Linker`` as the call flow drives it: one task, the same
answer token for token, a continuation whose prompt extends each twin's prompt + answer
(``TASK`` -> ``ANSWER`` -> ``NEXT``). Shared by the tests of the link indexes in memory and of
a ``--workers`` catch-up."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from capture_proxy.core.capture import PreparedRequest, prepare_request
from capture_proxy.core.known_messages import KnownMessages
from capture_proxy.core.linking.resolution import Resolution
from capture_proxy.core.records import CallRecord
from capture_proxy.proxy.linker import Linker
from capture_proxy.store.base import CaptureStore

TASK = [{"role": "user", "content": "Count the files."}]
ANSWER = "There are 2 files."
NEXT = [*TASK, {"role": "assistant", "content": ANSWER}, {"role": "user", "content": "Go on."}]
KNOWN = KnownMessages()


def twin_record(
    call_id: str, rollout_id: str, at: float, messages: list[dict[str, Any]]
) -> CallRecord:
    """The record of a call sending ``messages``: ``TASK``'s prompt [1, 2] and answer [3, 4]
    (``ANSWER``), anything else continuing it: prompt [1, 2, 3, 4, 5], answer [6]."""
    first = messages is TASK
    prompt, gen = ([1, 2], [3, 4]) if first else ([1, 2, 3, 4, 5], [6])
    return CallRecord(
        call_id=call_id,
        rollout_id=rollout_id,
        created_at=at,
        model="m",
        request_messages=messages,
        request_received={"model": "m"},
        response_message={"role": "assistant", "content": ANSWER if first else "ok"},
        prompt_token_ids=np.asarray(prompt, np.uint32),
        generation_token_ids=np.asarray(gen, np.uint32),
        generation_log_probs=np.full(len(gen), -0.5, np.float32),
    )


@dataclass
class InFlight:
    """A call resolved (``resolve_call``), not yet finished."""

    rollout_id: str
    call_id: str
    at: float
    messages: list[dict[str, Any]]
    prepared: PreparedRequest
    resolution: Resolution

    async def finish(self, linker: Linker, store: CaptureStore) -> str | None:
        """The rest of the call as the flow drives it: verify, put, remember, release; the
        verified parent."""
        record = await linker.verify(
            twin_record(self.call_id, self.rollout_id, self.at, self.messages),
            self.resolution,
            self.prepared.linking_messages,
            harness_note=None,
            retry_count=None,
            decode=None,
        )
        await store.put_call(record)
        await linker.remember(record)
        linker.release(self.rollout_id, self.call_id)
        return record.parent_call_id


async def resolve_call(
    linker: Linker,
    rollout_id: str,
    call_id: str,
    at: float,
    messages: list[dict[str, Any]],
    *,
    left: bool = False,
) -> InFlight:
    """A call resolved as the flow does when its request arrives (then in flight). ``left``:
    its harness is known gone (``ends_incomplete``)."""
    prepared = prepare_request({"model": "m", "messages": messages}, None, KNOWN.facts(messages))
    resolution = await linker.resolve(
        rollout_id,
        prepared.linking_messages,
        prepared.body,
        call_id=call_id,
        created_at=at,
        linking_facts=prepared.linking_facts,
        history_keys=prepared.history_keys,
        ends_incomplete=(lambda: True) if left else None,
    )
    return InFlight(rollout_id, call_id, at, messages, prepared, resolution)


async def twin_call(
    linker: Linker,
    store: CaptureStore,
    rollout_id: str,
    call_id: str,
    at: float,
    messages: list[dict[str, Any]],
) -> str | None:
    """A whole call: resolved, then finished; its verified parent."""
    return await (await resolve_call(linker, rollout_id, call_id, at, messages)).finish(
        linker, store
    )
