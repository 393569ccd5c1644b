"""A chat request to the scripted engine: its JSON body, its validation (OpenAI-shaped 400s,
as vLLM gives them) and its prompt rendered by the family's renderer (the proxy's).

Shared by ``/v1/chat/completions`` (``chat``) and ``/tokenize`` (``service``). Must not: answer
a request or load the tokenizer.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from capture_proxy.core.linking.prefill import generation_prompt_conflict
from capture_proxy.families.base import RenderError
from capture_proxy.families.hf_template import LocalRenderer
from capture_proxy.scripted_engine.state import FAMILY, RequestError

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


async def json_body(request: web.Request) -> dict[str, Any]:
    """The request's JSON object. Raises RequestError (not JSON, not an object)."""
    try:
        body = await request.json()
    except ValueError as e:
        raise RequestError(f"request body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    return body


def check(cond: bool, message: str, param: str) -> None:
    """Raise RequestError(``message``, ``param``) unless ``cond``."""
    if not cond:
        raise RequestError(message, param)


def validate_chat(body: dict[str, Any]) -> None:
    """Check a chat body's fields in vLLM's order. Raises RequestError naming the field."""
    msgs = body.get("messages")
    check(isinstance(msgs, list) and len(msgs) > 0, "messages must be a non-empty list", "messages")
    for i, m in enumerate(msgs or []):
        check(
            isinstance(m, dict) and m.get("role") in ROLES,
            f"messages[{i}] must be an object with a role in {sorted(ROLES)}",
            f"messages.{i}",
        )
        c = m.get("content")
        check(
            c is None or isinstance(c, str | list),
            f"messages[{i}].content must be a string, null or a list of parts",
            f"messages.{i}.content",
        )
        for j, tc in enumerate(m.get("tool_calls") or []):
            fn = tc.get("function") if isinstance(tc, dict) else None
            check(
                isinstance(fn, dict) and isinstance(fn.get("name"), str),
                "tool calls need function.name",
                f"messages.{i}.tool_calls.{j}",
            )
    tools = body.get("tools")
    check(tools is None or isinstance(tools, list), "tools must be a list", "tools")
    check(body.get("n", 1) == 1, "only n=1 is supported", "n")
    for key in ("max_tokens", "max_completion_tokens"):
        v = body.get(key)
        check(v is None or (type(v) is int and v > 0), f"{key} must be a positive integer", key)
    top = body.get("top_logprobs")
    check(
        top is None or (type(top) is int and 0 <= top <= 20),
        "top_logprobs must be an integer in [0, 20]",
        "top_logprobs",
    )
    check(isinstance(body.get("stream", False), bool), "stream must be a boolean", "stream")


def render_prompt(app: web.Application, body: dict[str, Any], generation_prompt: bool) -> list[int]:
    """Prompt token ids, rendered by the family's renderer (the proxy's): for the Qwen
    families the template rendered to text, then encoded without extra specials.

    Like vLLM 0.32 (``chat_utils._postprocess_messages``), assistant tool-call arguments
    arrive as JSON strings and are parsed into objects before rendering (the family's
    renderer: ``families.vllm_messages``), so the template re-serialises them with ``tojson``
    (``json.dumps`` defaults: ``", "`` and ``": "``, UTF-8 kept); "" and text that is not a
    JSON object render as ``{}``, as vLLM coerces them."""
    try:
        return app[FAMILY].render(body["messages"], body.get("tools"), generation_prompt)
    except RequestError:
        raise
    except (RenderError, Exception) as e:  # template errors are the client's fault
        raise RequestError(f"cannot render messages: {e}", "messages") from e


def render_continuation(app: web.Application, body: dict[str, Any]) -> list[int]:
    """Prompt ids with the last message left open (vLLM's ``continue_final_message``), by the
    family's renderer (the proxy's). Raises RequestError."""
    renderer = app[FAMILY].family.renderer
    if not isinstance(renderer, LocalRenderer):
        raise RequestError("continue_final_message is not supported for this family", "messages")
    try:
        return list(
            renderer.render_continuation_sync(
                body["messages"],
                body.get("tools") or None,
                chat_template_kwargs=body.get("chat_template_kwargs"),
            )
        )
    except RequestError:
        raise
    except Exception as e:  # template errors are the client's fault
        raise RequestError(f"cannot render messages: {e}", "messages") from e


def chat_prompt_ids(app: web.Application, body: dict[str, Any]) -> list[int]:
    """The chat form's prompt ids as vLLM 0.32 renders them: ``continue_final_message`` with
    ``add_generation_prompt: false`` leaves the last message open (transformers'
    ``continue_final_message``; with the generation prompt on, its default, transformers
    refuses the pair and vLLM answers 400); ``add_generation_prompt: false`` alone closes
    every message and adds no generation prompt. Raises RequestError."""
    conflict = generation_prompt_conflict(body)
    if conflict is not None:
        raise RequestError(conflict, "add_generation_prompt")
    if body.get("continue_final_message"):
        return render_continuation(app, body)
    return render_prompt(app, body, body.get("add_generation_prompt", True) is not False)
