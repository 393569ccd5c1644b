"""Continuing a generation the engine aborted (a pause for a weight update), tokens in (sans-io).

Owns the decision and the request of a continuation in exact-token mode: wait until the engine
serves again (``AwaitEngineServing``), continue only when it was seen paused or its weight
version changed (an abort without either, a trainer's ``/abort_requests``, is not undone, nor
one on an engine that cannot say: no ``/is_paused``, no version change seen), never a
constrained generation (its grammar would start again) nor past ``MAX_RESUMES``; then send the
call's prompt and every token so far with the rest of ``max_tokens`` (``continued_sampling``),
rows asked from the last token before it, and read on with a reader that keeps the text exact
across the cut (``_LocallyDecoded``). Must not import aiohttp or asyncio or do any I/O.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import orjson

from capture_proxy.core.engine_formats import IncrementalText, Piece, Reader, ends_text
from capture_proxy.core.flow.call import Call, Clock, Flow
from capture_proxy.core.flow.commands import AwaitEngineServing, ReadEngineBody, SendToEngine
from capture_proxy.core.flow.events import (
    ClientLeft,
    EngineBody,
    EngineFailed,
    EngineResponded,
    EngineServing,
)
from capture_proxy.core.flow.prompt import ExactFamily
from capture_proxy.core.sampling import Sampling, continued_sampling
from capture_proxy.core.tokens_in_assembly import TokensInAssembler, prompt_ids_json

#: continuations of one call after engine aborts (one per weight update; more is a loop)
MAX_RESUMES = 8
#: sampling fields whose constraint an engine applies from a request's first generated token
CONSTRAINED = frozenset({"structured_outputs", "response_format"})


class Resumable(Protocol):
    """The generation a continuation goes on (``exact_mode._Generation``)."""

    call: Call
    exact: ExactFamily
    asm: TokensInAssembler
    reader: Reader
    sampling: Sampling
    resumes: list[dict[str, Any]]
    aborted: str | None

    @property
    def clock(self) -> Clock: ...


def resume(gen: Resumable) -> Flow[str]:
    """After the engine aborted the generation: wait until it serves again, then send the
    continuation (the prompt and every token so far, the rest of ``max_tokens``).
    ``"continued"``: its response is open; ``"left"``: the harness left; ``"stopped"``:
    not continued, ``aborted`` says why."""
    asm = gen.asm
    generated = len(asm.token_ids)
    if len(gen.resumes) >= MAX_RESUMES:
        gen.aborted = f"the engine aborted the generation {MAX_RESUMES + 1} times"
        return "stopped"
    if gen.call.front_request.images is not None:
        # The engine expands the images itself: a continuation would have to send them again
        # beside the unexpanded prompt (not built).
        gen.aborted = "a generation over images is not continued after the engine aborted it"
        return "stopped"
    constrained = sorted(CONSTRAINED & gen.sampling.extra.keys())
    if constrained:
        # The grammar would start again at the continuation's first token.
        gen.aborted = (
            f"a constrained generation ({', '.join(constrained)}) cannot be continued "
            "exactly after the engine aborted it"
        )
        return "stopped"
    started = asm.segment.observed.last or asm.segment.observed.first
    t_wait = gen.clock()
    waited = yield AwaitEngineServing()
    if isinstance(waited, ClientLeft):
        return "left"
    if isinstance(waited, EngineFailed):
        gen.aborted = f"the engine aborted the generation and did not serve again: {waited.message}"
        return "stopped"
    assert isinstance(waited, EngineServing)
    refused = _not_undone(waited, started)
    if refused is not None:
        gen.aborted = refused
        return "stopped"
    prompt_ids = np.concatenate(
        [asm.prompt_token_ids, np.asarray(asm.token_ids, dtype=asm.prompt_token_ids.dtype)]
    )
    prompt_json = prompt_ids_json(prompt_ids)
    experts_start = int(prompt_ids.shape[0]) - 1
    body = gen.exact.dialect.request(
        orjson.Fragment(prompt_json),
        continued_sampling(gen.sampling, generated),
        stream=gen.call.ctx.stream,
        model=gen.call.prepared.body.get("model"),
        experts_start=experts_start,
    )
    reply = yield SendToEngine(gen.exact.dialect.path, orjson.dumps(body), False)
    if isinstance(reply, ClientLeft):
        return "left"
    if isinstance(reply, EngineFailed):
        gen.aborted = f"continuing the aborted generation failed: {reply.message}"
        return "stopped"
    assert isinstance(reply, EngineResponded)
    if reply.status >= 400 or reply.event_stream != gen.call.ctx.stream:
        got = yield ReadEngineBody()
        size = len(got.data) if isinstance(got, EngineBody) else 0
        gen.aborted = (
            f"the engine answered the continuation of the aborted generation with HTTP "
            f"{reply.status} ({size} bytes)"
        )
        return "stopped"
    gen.resumes.append(
        {
            "at_token": generated,
            "waited_ms": round((gen.clock() - t_wait) * 1000.0, 3),
            "paused": waited.paused,
            "from_version": started,
            "to_version": waited.weight_version,
        }
    )
    asm.begin_continuation(prompt_json, experts_start)
    asm.observe(reply.weight_version)
    gen.reader = _continued_reader(gen)
    return "continued"


def _not_undone(waited: EngineServing, started: str | None) -> str | None:
    """Why an abort is not continued (None: it is): the engine was not seen paused and its
    version (``started``: as the generation began) did not change. An engine that cannot say
    whether it paused, and whose version did not change or cannot be read, may have had the
    request aborted on purpose (a trainer's ``/abort_requests``)."""
    changed = None not in (started, waited.weight_version) and started != waited.weight_version
    if waited.paused is True or changed:
        return None
    if waited.paused is False:
        return (
            "the engine aborted the generation while neither paused nor updated (a request "
            "aborted on the engine, e.g. /abort_requests): not continued"
        )
    return (
        "the engine aborted the generation and neither said it was paused (no GET "
        "/is_paused) nor changed its weight version: not continued"
    )


def _continued_reader(gen: Resumable) -> Reader:
    """A continuation's reader: the same one where it decodes the ids itself (its text
    state goes on), else a new one whose text is decoded locally from every id of the
    call when a tokenizer is at hand (the engine's text of a continuation starts at its
    own first token, which may end a character the abort split)."""
    if gen.exact.dialect.needs_decode:
        return gen.reader
    fresh = gen.exact.dialect.reader(gen.exact.decode)
    if gen.exact.decode is None:
        return fresh
    return _LocallyDecoded(fresh, gen.exact.decode, gen.asm.token_ids, gen.asm.generated_text)


class _LocallyDecoded:
    """A continuation's reader whose pieces' text is decoded locally from every id of the
    call so far (``decode``), picking up after the text already given (``given``: a
    character the abort split was held back and comes with the ids that complete it)."""

    def __init__(self, inner: Reader, decode: Any, ids: list[int], given: str) -> None:
        self.inner = inner
        self.text = IncrementalText(decode)
        self.text.resume_after(ids, given)

    def whole(self, body: dict[str, Any]) -> Piece:
        return self._decoded(self.inner.whole(body), whole=True)

    def chunk(self, body: dict[str, Any]) -> Piece:
        return self._decoded(self.inner.chunk(body), whole=False)

    def chunk_data(self, data: bytes) -> Piece:
        return self._decoded(self.inner.chunk_data(data), whole=False)

    def _decoded(self, piece: Piece, *, whole: bool) -> Piece:
        piece.text = self.text.add(piece.token_ids, final=ends_text(piece.finish_reason, whole))
        return piece
