"""Fault injection for the scripted engine's chat completions (the proxy's error paths).

Owns the catalogue of engine misbehaviour the proxy must survive: slow first byte, slow or
stalled chunks, a stream cut without ``[DONE]``, a connection dropped mid-stream, a malformed
chunk, dropped chunks (ids lost, usage still counting them), a missing log prob (ids and log
probs of different lengths), a NaN log prob sent as
JSON ``null`` (how pydantic-based servers serialise NaN) or bare (``NaN``, ``-Infinity``, on
the tokens-in endpoints), and a null ``finish_reason``. Pure data; ``app.py`` applies it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Faults:
    """All off by default. Positions count generated tokens (stream chunks after the first)."""

    #: seconds before the response headers
    first_byte_delay_s: float = 0.0
    #: seconds before each stream chunk after the first (the tokens-in endpoints' too)
    chunk_delay_s: float = 0.0
    #: end the stream without ``data: [DONE]``
    drop_done: bool = False
    #: seconds between ``data: [DONE]`` and the end of the body
    hold_body_after_done_s: float = 0.0
    #: close the connection after this many token chunks (no ``[DONE]``, no end of body)
    disconnect_after_chunks: int | None = None
    #: send ``data: {not json`` in place of the chunk of this token
    malformed_chunk_at: int | None = None
    #: leave out the chunks of these tokens (their ids and log probs too), as vLLM #27482's
    #: tool parser did; the usage chunk still counts every token
    drop_chunks_at: frozenset[int] = frozenset()
    #: leave out the log prob entry of this token
    drop_logprob_at: int | None = None
    #: the log prob of this token is NaN, sent as JSON null
    nan_logprob_at: int | None = None
    #: tokens-in endpoints: (position, value): the log prob of that token is the value
    #: (NaN, -inf), written bare (``NaN``, ``-Infinity``) as Python's json.dumps does
    bare_logprob_at: tuple[int, float] | None = None
    #: chat completions: the answer's ``finish_reason`` is null (the last chunk's too)
    null_finish_reason: bool = False
    #: chat completions: only the first this many requests get ``first_byte_delay_s`` and
    #: ``chunk_delay_s`` (None: every one), e.g. a slow attempt and its quick retry
    slow_first_n: int | None = None

    def delays_of(self, index: int) -> tuple[float, float]:
        """(``first_byte_delay_s``, ``chunk_delay_s``) of the chat request ``index`` (0: the
        engine's first)."""
        if self.slow_first_n is not None and index >= self.slow_first_n:
            return 0.0, 0.0
        return self.first_byte_delay_s, self.chunk_delay_s

    @property
    def any(self) -> bool:
        return self != Faults()
