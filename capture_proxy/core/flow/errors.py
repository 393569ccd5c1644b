"""The errors a call's flow raises to end the call with a client error (sans-io).

Owns the flow's own exception classes; ``proxy.errors.CORE_ERRORS`` maps each (and the core's
``InvalidRequest``, ``InvalidFrontRequest``, ``RenderError``, ``RendererUnavailable``,
``SamplingError``) to the client's status, error type, code and param in one table. ``call_id``
names the stored call the error ended (a failed engine call), so its id goes on the answer.
Must not import aiohttp or know HTTP statuses.
"""

from __future__ import annotations


class CallError(Exception):
    """Base of the flow's errors; ``message`` for the client (masked by the adapter)."""

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.call_id: str | None = None


class PrefillNotSupported(CallError, ValueError):
    """The request continues its final assistant message and the family's renderer cannot
    leave a message open (exact-token mode): refused, nothing forwarded or stored."""

    def __init__(self) -> None:
        super().__init__(
            "continuing a final assistant message (an Anthropic prefill, or "
            "continue_final_message with add_generation_prompt=false) is not supported by this "
            "model family's renderer in exact-token mode; end the conversation with a user or "
            "tool message, or use prompt_mode backend_template",
            code="prefill_not_supported",
        )


class UnknownPreviousResponse(CallError, LookupError):
    """A Responses ``previous_response_id`` that names no answered response of the rollout."""

    def __init__(self, response_id: str) -> None:
        super().__init__(
            f"previous_response_id {response_id!r} names no answered response of this rollout",
            code="previous_response_not_found",
        )


class EngineUnreachable(CallError):
    """The engine could not be reached or could not tell what the call needs; ``code``:
    ``engine_unreachable``, ``engine_error``, ``engine_bad_response``, ..."""


class EngineTimedOut(EngineUnreachable):
    """The engine did not answer in time (``code``: ``engine_timeout``)."""


def engine_unreachable(
    message: str, code: str | None, timeout: bool, call_id: str
) -> EngineUnreachable:
    """The error ending a call whose engine failed (``timeout``: it timed out), naming the
    stored call."""
    err = (EngineTimedOut if timeout else EngineUnreachable)(message, code=code)
    err.call_id = call_id
    return err


class EngineAnswerUnusable(CallError):
    """The engine answered with a body the proxy cannot read (not JSON, not its format)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, code="engine_bad_response")


#: the code of an abort the proxy did not continue (a 503, or a stream's in-band error)
GENERATION_ABORTED = "generation_aborted"


class GenerationAborted(CallError):
    """The engine aborted the generation (a pause for a weight update) and the proxy could not
    continue it: the call is stored incomplete, and the harness gets an error it retries
    rather than a truncated answer that looks finished."""

    def __init__(self, reason: str, call_id: str) -> None:
        super().__init__(
            f"the engine aborted the generation and it could not be continued ({reason}); "
            "retry the request",
            code=GENERATION_ABORTED,
        )
        self.call_id = call_id


class StoreUnavailable(CallError):
    """The call's record could not be stored, so the call is not answered as a success
    (setting ``store_failure = refuse``): a retryable error for the harness. Raised by
    ``core.flow.call.finish`` before any answer is sent; a stream whose headers are out ends
    with its API's in-band error instead (``call.refused_stream_end``)."""

    def __init__(self, call_id: str, reason: str | None = None) -> None:
        """``reason``: what the store said (``Persisted.reason``), quoted for the harness
        and the operator reading its error."""
        super().__init__(
            f"the proxy could not store call {call_id}'s record "
            f"({reason or 'the capture store refuses writes'}), so it is not answered; "
            "retry the call",
            code="store_unavailable",
        )
