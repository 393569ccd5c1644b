"""Rendering through the engine: vLLM's ``/tokenize`` chat form as a ``ChatRenderer``.

Owns the adapter that asks the engine to render a conversation (vLLM 0.32:
``POST /tokenize {messages, tools, add_generation_prompt, continue_final_message,
chat_template_kwargs, model}`` -> ``{count, max_model_len, tokens, token_strs}``), for
exact-token mode without a local tokenizer and for Anthropic ``count_tokens``. The engine
applies its own message normalisation (``families.vllm_messages`` mirrors it for local
renders), except that the chat form of ``/tokenize`` does not read ``reasoning_content``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp

from capture_proxy.families.base import RenderError, RendererUnavailable
from capture_proxy.proxy.engines import current_backend
from capture_proxy.proxy.upstream import timeout_text


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
        # The engine chosen for the rollout being served (``proxy.engines``), else ours.
        backend = current_backend(self.backend)
        try:
            async with self.session.post(
                backend + "/tokenize", json=body, timeout=self.timeout, auto_decompress=True
            ) as resp:
                data = await resp.json(content_type=None)
                if resp.status >= 500:
                    raise RendererUnavailable(f"engine /tokenize answered {resp.status}: {data}")
                if resp.status != 200:
                    raise RenderError(f"engine /tokenize answered {resp.status}: {data}")
        except (TimeoutError, aiohttp.ClientError) as exc:
            if isinstance(exc, TimeoutError):
                why = timeout_text(exc, self.timeout.total)
                raise RendererUnavailable(
                    f"engine /tokenize at {backend} timed out: {why}"
                ) from exc
            raise RendererUnavailable(
                f"engine /tokenize at {backend} failed: {type(exc).__name__}: {exc}"
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
