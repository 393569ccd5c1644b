"""The scripted engine's model family: the proxy's renderer and output format, engine-side.

Owns what the engine needs of a family (``capture_proxy.families.ModelFamily``, the same
objects exact-token mode renders and parses with, so ids agree by construction): rendering a
chat request, the ids a scripted message is sampled as (``ModelFamily.write``: Hermes JSON,
Qwen3-Coder XML or harmony channels) with the per-token events the chat endpoint streams,
reading a token prompt back into a conversation (tokens-in endpoints), token bytes, the stop
ids and the special ids ``skip_special_tokens`` drops. Pure: no aiohttp, no I/O. llama3
renders with the model's own tokenizer directory and reads prompts back with
``llama_prompt``.

qwen3 keeps ``generation.generate`` (its character splits and vLLM-hermes argument re-dump);
the other families' events come from running the family's own stream parser over the ids.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from capture_proxy.families import ModelFamily
from capture_proxy.families.qwen_vocab import QWEN_ADDED_TOKENS, SPECIAL_START_ID
from capture_proxy.scripted_engine.chatml import parse_chatml
from capture_proxy.scripted_engine.generation import (
    Generation,
    TokenEvent,
    assemble_message,
    generate,
    synthetic_logprob,
    token_bytes,
)
from capture_proxy.scripted_engine.llama_prompt import parse_llama3_prompt

QWEN_SPECIAL_IDS = frozenset(
    SPECIAL_START_ID + i for i, (_, special) in enumerate(QWEN_ADDED_TOKENS) if special
)
_CODER_TOOL_RESPONSES = re.compile(r"(?:<tool_response>\n.*?\n</tool_response>\n)+", re.S)
_CODER_TOOL_RESPONSE = re.compile(r"<tool_response>\n(.*?)\n</tool_response>\n", re.S)


@dataclass
class EngineFamily:
    """A model family as the scripted engine uses it (module docstring)."""

    family: ModelFamily
    tokenizer: Any = None  # the HF tokenizer of the Qwen families and llama3

    @property
    def name(self) -> str:
        return self.family.name

    @property
    def harmony(self) -> bool:
        return self.family.name == "gpt_oss"

    # ------------------------------------------------------------------ tokens
    @property
    def vocab_size(self) -> int:
        if self.harmony:
            from capture_proxy.families.gpt_oss import HARMONY_VOCAB_SIZE

            return HARMONY_VOCAB_SIZE
        return len(self.tokenizer)

    @property
    def stop_ids(self) -> frozenset[int]:
        """The ids the engine stops at by itself (vLLM: the model's EOS / harmony's
        assistant-action stops)."""
        if self.harmony:
            return frozenset(self.family.close_ids - {self.family.end_of_turn_id})
        return frozenset({self.family.end_of_turn_id})

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids ``skip_special_tokens`` drops."""
        if self.harmony:
            return cast(frozenset[int], self.family.renderer.special_ids)
        if self.name == "llama3":
            added = self.tokenizer.added_tokens_decoder.items()
            return frozenset(i for i, t in added if t.special)
        return QWEN_SPECIAL_IDS

    def token_bytes(self, token_id: int) -> bytes:
        if self.harmony:
            return _harmony_bytes(self, token_id)
        if self.name == "llama3" and token_id in self.special_ids:
            return str(self.tokenizer.convert_ids_to_tokens(token_id)).encode("utf-8")
        return token_bytes(self.tokenizer, token_id)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, special tokens included."""
        if self.harmony:
            return str(self.family.renderer.decode(list(ids)))
        return str(self.tokenizer.decode(list(ids)))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Ids of ``text``, special tokens recognised (``add_special_tokens``: a BOS where the
        tokenizer has one; neither family does)."""
        if self.harmony:
            return list(self.family.renderer.encoding.encode(text, allowed_special="all"))
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def __len__(self) -> int:
        return self.vocab_size

    # ------------------------------------------------------------------ chat
    def render(
        self, messages: Sequence[Mapping[str, Any]], tools: Any, generation_prompt: bool
    ) -> list[int]:
        """Prompt ids, with the proxy's renderer. Raises RenderError."""
        return list(
            self.family.renderer.render_sync(
                messages, tools or None, add_generation_prompt=generation_prompt
            )
        )

    def generate(
        self,
        message: dict[str, Any],
        max_tokens: int | None = None,
        *,
        token_split: str = "canonical",
        tools: Any = None,
        id_seed: str = "",
        prompt: Sequence[int] = (),
    ) -> Generation:
        """The scripted message as sampled tokens, written in the family's format, from
        inside the reasoning block when ``prompt`` (the ids it continues) opened one."""
        opened = self.family.opens_reasoning(prompt)
        if self.name == "qwen3":
            return generate(
                self.tokenizer,
                message,
                max_tokens,
                token_split=token_split,
                reasoning_opened=opened,
            )
        ids = self.family.write(message)
        # id_seed: the seed the policy made the message's tool-call ids from, so the ids the
        # parser gives are the message's own
        stream = self.family.parser.stream(id_seed, tools, in_reasoning=opened)
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        events: list[TokenEvent] = []
        for k, tid in enumerate(ids):
            piece = "" if tid in self.special_ids else decoder.decode(self.token_bytes(tid))
            deltas = stream.feed(piece, [tid])
            if k == len(ids) - 1:
                deltas += stream.finish()
            events.append(_event(tid, synthetic_logprob(tid, k), deltas))
        finish = "tool_calls" if message.get("tool_calls") else "stop"
        if max_tokens is not None and len(ids) > max_tokens:
            events, finish = events[:max_tokens], "length"
        return Generation(
            token_ids=[e.token_id for e in events],
            log_probs=[e.logprob for e in events],
            events=events,
            finish_reason=finish,
            message=assemble_message(events),
        )

    def read_prompt(self, ids: Sequence[int]) -> tuple[list[dict[str, Any]], list[Any] | None]:
        """Messages (roles, text, tool calls counted) and whether tools were offered."""
        if self.harmony:
            return _read_harmony(self, ids)
        if self.name == "llama3":
            return parse_llama3_prompt(self.decode(ids))
        messages, tools = parse_chatml(self.decode(ids))
        if self.name == "qwen3_coder":
            tools = _qwen3_coder_tools(messages) if tools is None else tools
            messages = [t for m in messages for t in _qwen3_coder_tool_results(m)]
        return messages, tools


def _event(tid: int, logprob: float, deltas: list[Any]) -> TokenEvent:
    reasoning = "".join(d.reasoning for d in deltas if d.reasoning is not None)
    content = "".join(d.content for d in deltas if d.content is not None)
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        if d.tool_call is None:
            continue
        tc = d.tool_call
        call = calls.setdefault(
            tc["index"],
            {
                "index": tc["index"],
                "id": tc.get("id"),
                "type": "function",
                "function": {"name": "", "arguments": ""},
            },
        )
        fn = tc.get("function") or {}
        call["function"]["name"] += fn.get("name") or ""
        call["function"]["arguments"] += fn.get("arguments") or ""
    return TokenEvent(tid, logprob, reasoning, content, tuple(calls[i] for i in sorted(calls)))


def _harmony_bytes(ef: EngineFamily, token_id: int) -> bytes:
    inverse = getattr(ef, "_inverse", None)
    if inverse is None:
        from capture_proxy.families.gpt_oss import o200k_ranks

        inverse = {rank: piece for piece, rank in o200k_ranks().items()}
        ef._inverse = inverse  # type: ignore[attr-defined]
    if token_id in inverse:
        return cast(bytes, inverse[token_id])
    return ef.decode([token_id]).encode("utf-8")


def _qwen3_coder_tool_results(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A Qwen3-Coder user turn of ``<tool_response>`` blocks as tool messages."""
    content = message.get("content")
    if message.get("role") != "user" or not isinstance(content, str):
        return [message]
    if not _CODER_TOOL_RESPONSES.fullmatch(content):
        return [message]
    return [{"role": "tool", "content": c} for c in _CODER_TOOL_RESPONSE.findall(content)]


def _qwen3_coder_tools(messages: list[dict[str, Any]]) -> list[Any] | None:
    """Qwen3-Coder lists tools as XML in the system turn: pull it out, keep the system text."""
    for m in messages:
        if m.get("role") == "system" and "\n\n# Tools\n\nYou have access" in str(m["content"]):
            text, _, tools = str(m["content"]).partition("\n\n# Tools\n\nYou have access")
            m["content"] = text
            return [t for t in re.findall(r"<name>(.*?)</name>", tools)]
    return None


def _read_harmony(
    ef: EngineFamily, ids: Sequence[int]
) -> tuple[list[dict[str, Any]], list[Any] | None]:
    from openai_harmony import Role

    renderer = ef.family.renderer
    prompt = list(ids)
    gp = renderer.generation_prompt
    if prompt[-len(gp) :] == gp:
        prompt = prompt[: -len(gp)]
    parsed = renderer.encoding.parse_messages_from_completion_tokens(prompt, None)
    messages: list[dict[str, Any]] = []
    tools: list[Any] | None = None
    for h in parsed:
        text = "".join(getattr(c, "text", "") for c in h.content)
        role = h.author.role
        if role == Role.SYSTEM:
            continue
        if role == Role.DEVELOPER:
            if "# Tools" in text:
                tools = re.findall(r"^type (\w+) = ", text, re.M)
            instructions = text.partition("# Instructions\n\n")[2].partition("\n\n# Tools")[0]
            if instructions:
                messages.append({"role": "system", "content": instructions})
        elif role == Role.USER:
            messages.append({"role": "user", "content": text})
        elif role == Role.TOOL:
            messages.append({"role": "tool", "content": text})
        else:  # assistant: consecutive harmony messages are one turn
            if not messages or messages[-1]["role"] != "assistant":
                messages.append({"role": "assistant", "content": "", "tool_calls": []})
            turn = messages[-1]
            if h.recipient:
                turn["tool_calls"].append({"function": {"name": h.recipient, "arguments": text}})
            elif h.channel == "analysis":
                turn["reasoning_content"] = text
            else:
                turn["content"] = text
    return messages, tools
