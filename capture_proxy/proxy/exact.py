"""Exact-token mode's adapter: the family machinery and the executor of its calls.

Owns ``ExactTokens`` (a model family's renderer, output parser, the engine's tokens-in dialect,
and the engine facts fetched once: context length, end-of-turn ids, served model) and
``ExactExecutor``, which adds to the shared executor (``proxy.executor``) the commands only
exact-token calls yield: render with the family's renderer (which may be the engine's
``/tokenize``), render a tail in a small context, ask the engine's facts. Every decision of an
exact-token call (prompt path, splice, sampling, parsing, the answer) is the flow's
(``core.flow.exact_mode``, ``core.flow.prompt``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp
from aiohttp import web

from capture_proxy.core.engine_formats import Dialect
from capture_proxy.core.flow import commands as cmd
from capture_proxy.core.flow import events as ev
from capture_proxy.families.base import (
    ChatRenderer,
    ContinuationRenderer,
    ModelFamily,
    RenderError,
    ends_in_open_block,
    renders_tails,
)
from capture_proxy.families.hf_template import INLINE_RENDER_CHARS, smaller_than
from capture_proxy.families.parsing import OutputParser
from capture_proxy.proxy.calls import CaptureDeps
from capture_proxy.proxy.errors import UpstreamTimeout, UpstreamUnavailable
from capture_proxy.proxy.executor import CallExecutor
from capture_proxy.proxy.upstream import CLIENT_ERRORS, translate_client_error

log = logging.getLogger("capture_proxy")


class ExactTokens:
    """What exact-token mode needs: a renderer, an output parser, the engine's tokens-in
    dialect, the context length and the template's end-of-turn token ids.

    The last two may be left to the engine: ``max_model_len`` from its ``/v1/models`` (vLLM
    reports it per model) and the end-of-turn ids by tokenizing ``end_of_turn_token`` with its
    ``/tokenize``. They are fetched at the first exact-token call, not at start-up, so the proxy
    can start before the engine is ready (a sidecar usually does).
    """

    def __init__(
        self,
        renderer: ChatRenderer,
        parser: OutputParser,
        dialect: Dialect,
        *,
        max_model_len: int | None = None,
        end_of_turn_ids: frozenset[int] | None = None,
        end_of_turn_token: str = "<|im_end|>",
        close_tokens: tuple[str, ...] = ("<|endoftext|>",),
        full_render: bool = False,
        by_model: Mapping[str, ExactTokens] | None = None,
        reasoning_tokens: tuple[str, str] | None = ("<think>", "</think>"),
    ) -> None:
        self.renderer = renderer
        self.parser = parser
        self.dialect = dialect
        self.max_model_len = max_model_len
        self.end_of_turn_ids = end_of_turn_ids
        #: the engine's first ``/v1/models`` id ("": it names none; None: not asked yet), for
        #: an answer to a request that names no model
        self.served_model: str | None = None
        self.end_of_turn_token = end_of_turn_token
        #: render every resolved call's whole conversation (the path before per-call
        #: extension; kept for comparison, e.g. ``benchmarks/long_session.py``)
        self.full_render = full_render
        #: the model family of each model named in ``model_families`` (this one: the rest)
        self.by_model: dict[str, ExactTokens] = dict(by_model or {})
        self._lock = asyncio.Lock()
        token_id = getattr(renderer, "token_id", None)
        #: decode without special tokens, when the renderer is local
        self.decode: Callable[[list[int]], str] | None = getattr(renderer, "decode_text", None)
        #: other stop tokens that close a model's turn when sampled (besides end of turn)
        self._close_extra: frozenset[int] = frozenset()
        if token_id is not None:
            ids = [token_id(t) for t in close_tokens]
            self._close_extra = frozenset(i for i in ids if isinstance(i, int))
        #: the (open, close) markers of the family's reasoning block, and their ids (None:
        #: not known yet; asked of the engine's /tokenize in ``ready`` without a local one)
        self.reasoning_tokens = reasoning_tokens
        self.reasoning_ids: tuple[int, int] | None = None
        if token_id is not None and reasoning_tokens is not None:
            pair = (token_id(reasoning_tokens[0]), token_id(reasoning_tokens[1]))
            if isinstance(pair[0], int) and isinstance(pair[1], int):
                self.reasoning_ids = (pair[0], pair[1])
        if dialect.needs_decode and self.decode is None:
            raise RenderError(
                f"tokens_in_dialect {dialect.name} needs a local tokenizer (tokenizer)"
            )

    @classmethod
    def of_family(
        cls,
        family: ModelFamily,
        dialect: Dialect,
        *,
        max_model_len: int | None = None,
        full_render: bool = False,
    ) -> ExactTokens:
        """Exact tokens with a model family's renderer, parser and turn closers."""
        return cls(
            family.renderer,
            family.parser,
            dialect,
            max_model_len=max_model_len,
            end_of_turn_ids=frozenset({family.end_of_turn_id}),
            end_of_turn_token=family.end_of_turn_token,
            close_tokens=family.close_tokens,
            full_render=full_render,
            reasoning_tokens=family.reasoning_tokens,
        )

    def for_model(self, model: str | None) -> ExactTokens:
        """The exact-token machinery of ``model``'s family (this one when it has none)."""
        return self.by_model.get(model or "", self)

    def opens_reasoning(self, prompt_token_ids: Any) -> bool:
        """Whether the prompt ends inside an open reasoning block (Qwen3-2507 Thinking's
        generation prompt ``<|im_start|>assistant\n<think>\n``): the generation then starts
        as reasoning (``families.base.ends_in_open_block``)."""
        if self.reasoning_ids is None:
            return False
        return ends_in_open_block(prompt_token_ids, *self.reasoning_ids)

    def close_ids(self, end_of_turn_ids: frozenset[int]) -> frozenset[int]:
        """Sampled stop tokens that close the model's turn: end of turn, and (with a local
        tokenizer) ``close_tokens``; after any other last token the turn gets the template's
        end-of-turn token appended."""
        return end_of_turn_ids | self._close_extra

    async def ready(
        self, session: aiohttp.ClientSession, backend: str
    ) -> tuple[int, frozenset[int]]:
        """(max_model_len, end_of_turn_ids), fetched from the engine once when not configured.
        Raises UpstreamUnavailable when the engine cannot tell."""
        async with self._lock:
            timeout = aiohttp.ClientTimeout(total=30)
            try:
                if self.max_model_len is None:
                    data = await _models(session, backend)
                    lengths = [m.get("max_model_len") for m in data.get("data", [])]
                    found = [n for n in lengths if isinstance(n, int)]
                    if not found:
                        raise UpstreamUnavailable(
                            "engine /v1/models reports no max_model_len; set max_model_len",
                            code="engine_bad_response",
                        )
                    self.max_model_len = min(found)
                    self.served_model = _first_model_id(data)
                if self.end_of_turn_ids is None:
                    body = {"prompt": self.end_of_turn_token, "add_special_tokens": False}
                    async with session.post(
                        backend + "/tokenize", json=body, timeout=timeout
                    ) as resp:
                        data = await resp.json(content_type=None)
                    tokens = data.get("tokens") if isinstance(data, dict) else None
                    if not isinstance(tokens, list) or len(tokens) != 1:
                        raise UpstreamUnavailable(
                            f"engine /tokenize does not map {self.end_of_turn_token!r} "
                            "to one token",
                            code="engine_bad_response",
                        )
                    self.end_of_turn_ids = frozenset(tokens)
                if self.reasoning_ids is None and self.reasoning_tokens is not None:
                    self.reasoning_ids = await _single_ids(
                        session, backend, self.reasoning_tokens, timeout
                    )
            except CLIENT_ERRORS as exc:
                raise translate_client_error(exc, backend, fixed_s=timeout.total) from exc
            except ValueError as exc:
                raise UpstreamUnavailable(f"engine metadata unusable: {exc}") from exc
        return self.max_model_len, self.end_of_turn_ids

    async def served_model_name(self, session: aiohttp.ClientSession, backend: str) -> str:
        """The engine's served model (its first ``/v1/models`` id): kept from ``ready``, else
        asked once; "" when the engine cannot tell (asked again at the next call)."""
        async with self._lock:
            if self.served_model is None:
                try:
                    self.served_model = _first_model_id(await _models(session, backend))
                except CLIENT_ERRORS + (ValueError,) as exc:
                    log.warning("engine /v1/models unusable for the model name: %s", exc)
                    return ""
            return self.served_model


async def _single_ids(
    session: aiohttp.ClientSession,
    backend: str,
    markers: tuple[str, str],
    timeout: aiohttp.ClientTimeout,
) -> tuple[int, int] | None:
    """The engine's ids of two markers that are one token each, else None (the vocabulary
    has no such tokens: the family's prompts never open a reasoning block)."""
    ids = []
    for marker in markers:
        body = {"prompt": marker, "add_special_tokens": False}
        async with session.post(backend + "/tokenize", json=body, timeout=timeout) as resp:
            data = await resp.json(content_type=None)
        tokens = data.get("tokens") if isinstance(data, dict) else None
        if not isinstance(tokens, list) or len(tokens) != 1 or not isinstance(tokens[0], int):
            return None
        ids.append(tokens[0])
    return ids[0], ids[1]


async def _models(session: aiohttp.ClientSession, backend: str) -> Any:
    """The engine's ``GET /v1/models`` answer (JSON). Raises aiohttp's errors, ValueError."""
    timeout = aiohttp.ClientTimeout(total=30)
    async with session.get(backend + "/v1/models", timeout=timeout) as resp:
        return await resp.json(content_type=None)


def _first_model_id(models: Any) -> str:
    """The first model id of a ``/v1/models`` answer, or ""."""
    data = models.get("data") if isinstance(models, dict) else None
    first = data[0] if isinstance(data, list) and data else None
    model_id = first.get("id") if isinstance(first, dict) else None
    return model_id if isinstance(model_id, str) else ""


class ExactExecutor(CallExecutor):
    """The executor of an exact-token call: the shared commands, and rendering with
    ``exact``'s renderer and the engine's facts."""

    def __init__(
        self,
        request: web.Request,
        deps: CaptureDeps,
        call_id: str,
        rollout_id: str,
        exact: ExactTokens,
    ) -> None:
        super().__init__(request, deps, call_id, rollout_id)
        self.exact = exact

    async def _render(self, c: cmd.Render) -> ev.Rendered | ev.RenderFailed:
        renderer = self.exact.renderer
        try:
            if c.continuation:
                assert isinstance(renderer, ContinuationRenderer)
                ids = await renderer.render_continuation(
                    c.messages, c.tools, chat_template_kwargs=c.chat_template_kwargs
                )
            else:
                ids = await renderer.render(
                    c.messages,
                    c.tools,
                    add_generation_prompt=c.add_generation_prompt,
                    chat_template_kwargs=c.chat_template_kwargs,
                )
        except RenderError as exc:
            return ev.RenderFailed(exc)
        return ev.Rendered(ids)

    async def _render_tail(self, c: cmd.RenderTail) -> ev.Rendered | ev.RenderFailed:
        renderer = self.exact.renderer
        assert renders_tails(renderer)
        render = functools.partial(
            renderer.render_tail_sync,
            c.context,
            c.new,
            c.tools,
            end_of_turn_text=c.end_of_turn_text,
            chat_template_kwargs=c.chat_template_kwargs,
        )
        try:
            # Small new messages: cheaper on the loop than a hop to a worker thread and back.
            # A large one (a file the agent read) takes milliseconds to tokenize: off the loop.
            if smaller_than(c.new, INLINE_RENDER_CHARS):
                ids = render()
            else:
                ids = await asyncio.to_thread(render)
        except RenderError as exc:
            return ev.RenderFailed(exc)
        return ev.Rendered(ids)

    async def _engine_facts(self, c: cmd.AskEngineFacts) -> ev.EngineFacts | ev.EngineFailed:
        exact, deps = self.exact, self.deps
        try:
            max_model_len, end_of_turn_ids = await exact.ready(deps.session, deps.backend)
        except (UpstreamUnavailable, UpstreamTimeout) as exc:
            return ev.EngineFailed(exc.message, exc.code, isinstance(exc, UpstreamTimeout))
        served = None
        if c.served_model:
            served = await exact.served_model_name(deps.session, deps.backend)
        return ev.EngineFacts(max_model_len, end_of_turn_ids, served)


ExactExecutor.HANDLERS = {
    **CallExecutor.HANDLERS,
    cmd.Render: ExactExecutor._render,
    cmd.RenderTail: ExactExecutor._render_tail,
    cmd.AskEngineFacts: ExactExecutor._engine_facts,
}
