"""What the executor answers a call's flow with: the replies and events (sans-io).

Owns the vocabulary of the flow's inbound side: one reply per command of
``core.flow.commands`` (the render's ids or its error, the engine's status, body, stream pieces
and end, the engine failing, the client leaving). Frozen dataclasses, compared by value in the
flow's tests (slotted, not frozen: a stream makes a few per engine read; never changed once
made). Must not import aiohttp or asyncio or do any I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from capture_proxy.core.known_messages import MessageFacts
from capture_proxy.core.linking.resolution import Resolution
from capture_proxy.core.records import CallRecord
from capture_proxy.families.base import RenderError


@dataclass(slots=True)
class Resolved:
    resolution: Resolution


@dataclass(slots=True)
class StepFailed:
    """A step whose failure the flow absorbs (resolution, verification): the exception's
    class name and text."""

    error_type: str
    message: str


@dataclass(slots=True)
class CallFound:
    """``record`` None: no such call; ``message_facts``: its request's facts, when kept."""

    record: CallRecord | None
    message_facts: tuple[MessageFacts, ...] | None = None


@dataclass(slots=True)
class EngineFacts:
    """``served_model``: the engine's first model id ("" when it names none), when asked."""

    max_model_len: int
    end_of_turn_ids: frozenset[int]
    served_model: str | None = None


@dataclass(slots=True)
class Rendered:
    """Token ids (None from ``RenderTail``: the tail cannot be found in a small context)."""

    token_ids: list[int] | None


@dataclass(slots=True)
class RenderFailed:
    """The renderer refused (``RenderError``) or could not be reached
    (``RendererUnavailable``, a subclass)."""

    error: RenderError


@dataclass(slots=True)
class EngineResponded:
    """The engine's status line; ``event_stream``: its body is ``text/event-stream``;
    ``reason``: the status's reason phrase; ``weight_version``: the engine's weight version
    as the proxy last read it (``GET /weight_info``, off the call's path; None: unknown)."""

    status: int
    event_stream: bool
    reason: str | None = None
    weight_version: str | None = None


@dataclass(slots=True)
class EngineFailed:
    """The engine could not be reached, or its body could not be read (``message`` for the
    client and the record; ``code`` as the client's error code; ``timeout``: it timed out, a
    504 rather than a 502; ``error_type``, ``detail``: the exception's class name and text)."""

    message: str
    code: str | None
    timeout: bool = False
    error_type: str = ""
    detail: str = ""


@dataclass(slots=True)
class EngineBody:
    """The engine's whole body; ``weight_version``: its version as last read, after it."""

    data: bytes
    weight_version: str | None = None


@dataclass(slots=True)
class EnginePiece:
    """Bytes of the engine's stream as they arrived (any split: events may be cut);
    ``weight_version``: set when the engine's version as last read changed since the call's
    previous reading (None: no change seen)."""

    data: bytes
    weight_version: str | None = None


@dataclass(slots=True)
class EngineEnd:
    """The engine's stream ended (``weight_version``: as last read)."""

    weight_version: str | None = None


@dataclass(slots=True)
class EngineServing:
    """The engine serves again after aborting a call's generation: ``paused``: it was seen
    paused (``GET /is_paused``; None: it cannot say); ``waited_ms``: how long the proxy
    waited; ``weight_version``: its version now (``GET /weight_info``; None: unknown)."""

    paused: bool | None
    waited_ms: float
    weight_version: str | None


@dataclass(slots=True)
class EngineBroke:
    """The engine's stream broke mid-way: the exception's class name and text."""

    error_type: str
    message: str


@dataclass(slots=True)
class ClientLeft:
    """The harness left (its connection closed, the handler cancelled)."""


@dataclass(slots=True)
class ClientState:
    """After a write: ``gone``: the client has left (later writes are dropped)."""

    gone: bool


#: the two client states, made once (one per client write otherwise)
CLIENT_THERE = ClientState(False)
CLIENT_GONE = ClientState(True)


@dataclass(slots=True)
class Verified:
    record: CallRecord


@dataclass(slots=True)
class Persisted:
    """``ok``: stored; ``refused``: not stored, and the call must not be answered as a
    success (setting ``store_failure = refuse``)."""

    ok: bool
    refused: bool = False
    #: why the store did not take it (its error's text), for the refusal's message
    reason: str | None = None
