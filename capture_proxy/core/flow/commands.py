"""What a call's flow asks its executor to do: the commands (sans-io, mitmproxy's model).

Owns the vocabulary of the flow's outbound side. Each command is a dataclass the executor
(``proxy.executor`` and one subclass per back end) performs with real I/O, answering with one
reply of ``core.flow.events``. A command does nothing by itself: it is data, compared
by value in the flow's tests. Must not import aiohttp or asyncio or do any I/O.

Commands are not changed once made (slotted, not frozen: a stream makes a few per engine
read, and a frozen dataclass costs twice as much to make). ``client_left_reply``: whether a
cancellation of the handler (the harness left) while the command runs is answered with
``ClientLeft`` (the flow then records the call); for the other commands a cancellation goes
through unrecorded, as the flow cannot act on it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from capture_proxy.core.known_messages import MessageFacts
from capture_proxy.core.known_tools import ToolsFacts
from capture_proxy.core.linking.resolution import Resolution
from capture_proxy.core.records import CallRecord
from capture_proxy.core.request_encoding import RequestEncoding


@dataclass(slots=True)
class Command:
    """Base of every command."""

    client_left_reply: ClassVar[bool] = False


@dataclass(slots=True)
class Resolve(Command):
    """Request-time parent resolution (``Linker.resolve``). Reply: ``Resolved`` or
    ``StepFailed`` (the call then goes on unresolved)."""

    rollout_id: str
    linking_messages: list[dict[str, Any]]
    body: dict[str, Any]
    call_id: str
    created_at: float
    linking_facts: tuple[MessageFacts, ...] | None
    #: the ``known_tools`` facts of ``body["tools"]`` (None: derive what is needed)
    tools_facts: ToolsFacts | None = None
    #: the harness session the request names (``core.sessions``; None: none)
    session: tuple[str, str] | None = None
    #: the harness says the request is a retry (``x-stainless-retry-count`` > 0)
    retry_requested: bool = False
    #: ``digests.request_digest`` of ``body`` when made already (None: made by the linker)
    request_digest: str | None = None
    #: ``capture.PreparedRequest.history_keys`` (own, continued; None: not known)
    history_keys: tuple[bytes | None, bytes | None] = (None, None)


@dataclass(slots=True)
class LookUpCall(Command):
    """A stored call by id, with its request messages' facts when kept in memory. Reply:
    ``CallFound``."""

    call_id: str


@dataclass(slots=True)
class AskEngineFacts(Command):
    """The engine's context length and end-of-turn ids (exact-token mode; asked of the engine
    once when not configured), and its served model when ``served_model`` is asked for.
    Reply: ``EngineFacts`` or ``EngineFailed``."""

    served_model: bool


@dataclass(slots=True)
class Render(Command):
    """Render messages with the family's chat template (the renderer may be the engine's
    ``/tokenize``). ``continuation``: leave the last message open (a prefill). Reply:
    ``Rendered`` or ``RenderFailed``."""

    messages: Sequence[dict[str, Any]]
    tools: Any
    add_generation_prompt: bool
    chat_template_kwargs: Any
    continuation: bool = False


@dataclass(slots=True)
class RenderTail(Command):
    """Render what follows a continued turn in a small context (``TailRenderer``). Reply:
    ``Rendered`` (``token_ids`` None: not findable so) or ``RenderFailed``."""

    context: Sequence[Mapping[str, Any]]
    new: Sequence[Mapping[str, Any]]
    tools: Any
    end_of_turn_text: str
    chat_template_kwargs: Any


@dataclass(slots=True)
class SendToEngine(Command):
    """POST ``body`` (JSON bytes) to the engine's ``path`` and wait for its status line.
    ``harness_headers``: forward the harness's headers (backend-template mode), else only its
    ``Authorization``. Reply: ``EngineResponded``, ``EngineFailed`` or ``ClientLeft``."""

    client_left_reply: ClassVar[bool] = True
    path: str
    body: bytes
    harness_headers: bool


@dataclass(slots=True)
class ReadEngineBody(Command):
    """Read the engine's whole body. Reply: ``EngineBody``, ``EngineFailed`` or
    ``ClientLeft``."""

    client_left_reply: ClassVar[bool] = True


@dataclass(slots=True)
class ReadEngine(Command):
    """Read the next bytes of the engine's streamed body, as they arrive. Reply:
    ``EnginePiece``, ``EngineEnd``, ``EngineBroke`` or ``ClientLeft``."""

    client_left_reply: ClassVar[bool] = True


#: ``ReadEngine()``, made once (one per engine read otherwise)
READ_ENGINE = ReadEngine()


@dataclass(slots=True)
class AwaitEngineServing(Command):
    """The engine aborted the call's generation: wait (bounded) until it serves again, that
    is until it is not paused (``GET /is_paused``), and read its weight version. Reply:
    ``EngineServing``, ``EngineFailed`` (it did not serve again in time, or cannot be
    reached) or ``ClientLeft``."""

    client_left_reply: ClassVar[bool] = True


@dataclass(slots=True)
class DrainEngine(Command):
    """Read the end of the engine's body after its ``[DONE]`` (bounded), so the connection
    goes back to the pool. Reply: None."""


@dataclass(slots=True)
class StartClientStream(Command):
    """Send the client the head of an SSE response with ``status``. Reply: ``ClientState``."""

    client_left_reply: ClassVar[bool] = True
    status: int


@dataclass(slots=True)
class WriteClient(Command):
    """Write bytes to the client's stream. Reply: ``ClientState``."""

    client_left_reply: ClassVar[bool] = True
    data: bytes


@dataclass(slots=True)
class EndClient(Command):
    """Write the last bytes and end the client's stream. Reply: ``ClientState``."""

    client_left_reply: ClassVar[bool] = True
    data: bytes


@dataclass(slots=True)
class RespondJson(Command):
    """Answer the client with one JSON body (the call id header set). Reply: None."""

    status: int
    body: Any


@dataclass(slots=True)
class Verify(Command):
    """Verify the record's link (``Linker.verify``, which may detokenize through the engine).
    Reply: ``Verified`` or ``StepFailed``."""

    record: CallRecord
    resolution: Resolution
    linking_messages: list[dict[str, Any]]
    harness_note: str | None
    retry_count: str | None
    #: the prefill the call continued (``PreparedRequest.prefill``), else None
    prefill: dict[str, Any] | None = None


@dataclass(slots=True)
class Persist(Command):
    """Store the record durably (``request``: its request encoding, if known). Reply:
    ``Persisted``."""

    record: CallRecord
    request: RequestEncoding | None


@dataclass(slots=True)
class Remember(Command):
    """Make a persisted call findable by its children. Reply: None."""

    record: CallRecord
    message_facts: tuple[MessageFacts, ...] | None
    #: the harness session its request names, as read for ``Resolve`` (the record's own
    #: ``request_received`` and ``session_headers`` name it: not read twice)
    session: tuple[str, str] | None
