"""Rendering a chat conversation to token ids, the way the engine would.

Owns the two renderers of exact-token mode: ``LocalRenderer`` (the model's own HF tokenizer and
chat template, from a local directory; no hub access) and ``EngineRenderer`` (the engine's
``/tokenize`` chat endpoint, vLLM: ``{messages, tools, add_generation_prompt,
chat_template_kwargs}`` -> ``{tokens}``). Both apply vLLM's message preprocessing: assistant
tool-call arguments arrive as JSON strings and are parsed into objects before the template
runs (vLLM ``chat_utils._postprocess_messages``), so templates re-serialise them with ``tojson``.

``render_tail`` renders only what follows a continued assistant turn (exact-token mode's
per-call work in proportion to the new tokens): the turn is rendered in a small context (the
system message and the last user query before it, the same tools), and the part after its
end-of-turn token is kept. That is exact for templates that render a non-assistant message from
its own content, its role neighbours, the system message and the tools (ChatML, Qwen3, Hermes
templates do); the caller still checks every extended prompt token for token.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import aiohttp


class RenderError(ValueError):
    """The conversation cannot be rendered (template error, engine refused); names the cause."""


class RendererUnavailable(RenderError):
    """The engine that renders could not be reached (or answered with a server error): the
    caller gets a 502, not a 400; the conversation itself may be fine."""


def parse_tool_arguments(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Copy of ``messages`` with assistant tool-call ``arguments`` strings parsed as JSON.
    Raises RenderError when an argument string is not JSON (vLLM answers 400 then too)."""
    out = []
    for m in messages:
        m = dict(m)
        calls = m.get("tool_calls") if m.get("role") == "assistant" else None
        if isinstance(calls, list) and calls:
            parsed = []
            for call in calls:
                fn = dict(call.get("function") or {})
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"])
                    except ValueError as exc:
                        raise RenderError(f"tool call arguments are not JSON: {exc}") from exc
                parsed.append({**call, "function": fn})
            m["tool_calls"] = parsed
        out.append(m)
    return out


def tail_context(messages: Sequence[Mapping[str, Any]], turn_index: int) -> list[Mapping[str, Any]]:
    """The small context a tail is rendered in: the leading system/developer message and the
    last user message before ``turn_index``, then the continued turn itself."""
    head: list[Mapping[str, Any]] = []
    if messages and messages[0].get("role") in ("system", "developer") and turn_index > 0:
        head.append(messages[0])
    user = next(
        (i for i in range(turn_index - 1, len(head) - 1, -1) if messages[i].get("role") == "user"),
        None,
    )
    if user is not None:
        head.append(messages[user])
    return [*head, messages[turn_index]]


def cut_after_end_of_turn(
    through: Sequence[int], full: Sequence[int], end_of_turn_ids: frozenset[int]
) -> list[int] | None:
    """``full[cut:]`` where ``cut`` is one past the last end-of-turn token of ``through`` (the
    context rendered without the generation prompt), provided ``full`` renders the same tokens
    up to there; else None."""
    cut = next(
        (i + 1 for i in range(len(through) - 1, -1, -1) if through[i] in end_of_turn_ids), None
    )
    if cut is None or len(full) < cut or list(full[:cut]) != list(through[:cut]):
        return None
    return list(full[cut:])


@runtime_checkable
class TailRenderer(Protocol):
    """A renderer that renders only what follows a continued turn, on the caller's thread
    (small: the new messages and the context of ``tail_context``)."""

    def render_tail_sync(
        self,
        context: Sequence[Mapping[str, Any]],
        new_messages: Sequence[Mapping[str, Any]],
        tools: list[dict[str, Any]] | None,
        *,
        end_of_turn_text: str,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[int] | None: ...


@runtime_checkable
class ContinuationRenderer(Protocol):
    """A renderer that can leave the last message open for the model to continue (an
    Anthropic prefill, vLLM's ``continue_final_message``)."""

    async def render_continuation(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: list[dict[str, Any]] | None,
        *,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of the conversation, its last message left open. Raises RenderError."""


class ChatRenderer(Protocol):
    async def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: list[dict[str, Any]] | None,
        *,
        add_generation_prompt: bool,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of the rendered conversation. Raises RenderError."""


class LocalRenderer:
    """Renders with a local HF tokenizer (``tokenizer``) and chat template (its own, or
    ``chat_template``): template text, then ``encode`` without adding special tokens, as vLLM."""

    def __init__(self, tokenizer: Any, chat_template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template

    @classmethod
    def from_directory(cls, path: Path) -> LocalRenderer:
        """Load a tokenizer directory (``tokenizer.json`` + config with a chat template).
        Never touches a hub. Raises RenderError when it cannot be loaded."""
        try:
            from transformers import AutoTokenizer
        except ImportError as exc:
            raise RenderError(
                f"setting tokenizer needs transformers ({exc}): install the tokenizer extra, "
                "pip install 'capture-proxy[tokenizer]'"
            ) from exc
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError) as exc:
            raise RenderError(f"cannot load tokenizer from {path}: {exc}") from exc
        if not getattr(tokenizer, "chat_template", None):
            raise RenderError(f"tokenizer at {path} has no chat template")
        return cls(tokenizer)

    def render_sync(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: list[dict[str, Any]] | None,
        *,
        add_generation_prompt: bool,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        text = self._text(messages, tools, add_generation_prompt, chat_template_kwargs)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def render_continuation_sync(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: list[dict[str, Any]] | None,
        *,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of the conversation with its last message left open for the model to
        continue (transformers' ``continue_final_message``, as vLLM's chat extra of that
        name: no generation prompt, the final turn's end-of-turn text cut)."""
        text = self._text(messages, tools, False, chat_template_kwargs, continue_final=True)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    async def render_continuation(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: list[dict[str, Any]] | None,
        *,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        return await asyncio.to_thread(
            self.render_continuation_sync,
            messages,
            tools,
            chat_template_kwargs=chat_template_kwargs,
        )

    def _text(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool,
        chat_template_kwargs: dict[str, Any] | None,
        continue_final: bool = False,
    ) -> str:
        try:
            return str(
                self.tokenizer.apply_chat_template(
                    parse_tool_arguments(messages),
                    tools=tools or None,
                    chat_template=self.chat_template,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final,
                    tokenize=False,
                    **(chat_template_kwargs or {}),
                )
            )
        except RenderError:
            raise
        except Exception as exc:  # jinja errors: the request's fault
            raise RenderError(f"chat template failed: {exc}") from exc

    def render_tail_sync(
        self,
        context: Sequence[Mapping[str, Any]],
        new_messages: Sequence[Mapping[str, Any]],
        tools: list[dict[str, Any]] | None,
        *,
        end_of_turn_text: str,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[int] | None:
        """Token ids after the end-of-turn token of ``context``'s last turn when
        ``new_messages`` follow it and the generation prompt closes it; None when the
        template does not render ``context`` as a text prefix of the longer conversation.

        Only the tail text is tokenized: it begins right after an added special token, where
        the tokenizer always splits, so its ids are those of the whole text's tokenization."""
        through = self._text(context, tools, False, chat_template_kwargs)
        full = self._text([*context, *new_messages], tools, True, chat_template_kwargs)
        at = through.rfind(end_of_turn_text)
        if at < 0:
            return None
        cut = at + len(end_of_turn_text)
        if full[:cut] != through[:cut]:
            return None
        return list(self.tokenizer.encode(full[cut:], add_special_tokens=False))

    async def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: list[dict[str, Any]] | None,
        *,
        add_generation_prompt: bool,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        return await asyncio.to_thread(
            self.render_sync,
            messages,
            tools,
            add_generation_prompt=add_generation_prompt,
            chat_template_kwargs=chat_template_kwargs,
        )

    def decode(self, token_ids: list[int]) -> str:
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=False))

    def decode_text(self, token_ids: list[int]) -> str:
        """The text of ``token_ids`` without special tokens (what an engine answers)."""
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=True))

    def token_id(self, token: str) -> int | None:
        """The id of ``token`` when it is one token of the vocabulary, else None."""
        tid = self.tokenizer.convert_tokens_to_ids(token)
        if not isinstance(tid, int) or tid == self.tokenizer.unk_token_id:
            return None
        return tid


def _reasoning_as_vllm_reads_it(message: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM 0.32's chat form of /tokenize drops ``reasoning_content`` (only chat completions
    rename it to ``reasoning``): send it as ``reasoning`` so the template sees it."""
    if message.get("role") != "assistant" or "reasoning_content" not in message:
        return dict(message)
    out = {k: v for k, v in message.items() if k != "reasoning_content"}
    out.setdefault("reasoning", message["reasoning_content"])
    return out


class EngineRenderer:
    """Renders through the engine's ``/tokenize`` chat form (vLLM 0.32)."""

    def __init__(self, session: aiohttp.ClientSession, backend: str, timeout_s: float = 60.0):
        self.session = session
        self.backend = backend
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: list[dict[str, Any]] | None,
        *,
        add_generation_prompt: bool,
        chat_template_kwargs: dict[str, Any] | None = None,
        model: str | None = None,
        continue_final_message: bool = False,
    ) -> list[int]:
        body: dict[str, Any] = {
            "messages": [_reasoning_as_vllm_reads_it(m) for m in messages],
            "add_generation_prompt": add_generation_prompt,
        }
        if continue_final_message:
            body["continue_final_message"] = True
        if tools:
            body["tools"] = tools
        if chat_template_kwargs:
            body["chat_template_kwargs"] = chat_template_kwargs
        if model:
            body["model"] = model
        try:
            async with self.session.post(
                self.backend + "/tokenize", json=body, timeout=self.timeout, auto_decompress=True
            ) as resp:
                data = await resp.json(content_type=None)
                if resp.status >= 500:
                    raise RendererUnavailable(f"engine /tokenize answered {resp.status}: {data}")
                if resp.status != 200:
                    raise RenderError(f"engine /tokenize answered {resp.status}: {data}")
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise RendererUnavailable(
                f"engine /tokenize at {self.backend} failed: {type(exc).__name__}: {exc}"
            ) from exc
        except ValueError as exc:
            raise RenderError(f"engine /tokenize failed: {type(exc).__name__}: {exc}") from exc
        tokens = data.get("tokens") if isinstance(data, dict) else None
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise RenderError("engine /tokenize returned no token list")
        return tokens

    async def render_continuation(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: list[dict[str, Any]] | None,
        *,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """``/tokenize`` with vLLM's ``continue_final_message`` (no generation prompt)."""
        return await self.render(
            messages,
            tools,
            add_generation_prompt=False,
            chat_template_kwargs=chat_template_kwargs,
            continue_final_message=True,
        )
