"""Scripted policies: which assistant message the scripted engine answers a request with.

Owns the policy file format (JSON, validated by pydantic) and the pure choice of a step from
a request's messages. Must not: import aiohttp, tokenize, or do I/O beyond ``Policy.load``.

Step selection: index = number of assistant messages after the LAST user message, so each
agent call of one user turn advances one step and a new user turn restarts at step 0. Past
the last step the engine answers with ``final``. A request without ``tools`` is a side
request (e.g. a harness's title request) and gets ``title``.

Rules (optional ``rules``) are checked in order before all of that: the first rule whose
``when_last_message_contains`` occurs in the text of the LAST message of the request (any
role; string content, or the text parts of a part list), or whose
``when_first_user_message_contains`` / ``when_last_user_message_contains`` occurs in the text
of the FIRST / LAST user message, answers with its ``step``. This lets a scripted model obey
a harness note, e.g. OpenCode's step-limit note once the proxy has forwarded it as a user
message (after which step selection alone would restart at step 0), and play a sub-agent
whose task the first user message holds.
"""

from __future__ import annotations

import hashlib
import json
import unicodedata
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

DEFAULT_POLICY_PATH = Path(__file__).resolve().parent.parent / "policies" / "default.json"


def _nfc(text: str) -> str:
    # The tokenizer normalises to NFC; policy text must survive encode/decode unchanged.
    return unicodedata.normalize("NFC", text)


class ToolCallSpec(BaseModel):
    """One scripted tool call. ``arguments_raw`` (verbatim) wins over ``arguments``."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1)
    arguments: dict[str, Any] = Field(default_factory=dict)
    arguments_raw: str | None = None

    def arguments_text(self) -> str:
        """Arguments as a Hermes-format model writes them: ``json.dumps`` defaults (``", "``,
        ``": "``, UTF-8 kept), which is also how the chat template's ``tojson`` re-renders them,
        so the turn survives the round trip through a harness. ``arguments_raw`` is verbatim
        (e.g. odd spacing, which does not survive it)."""
        if self.arguments_raw is not None:
            return _nfc(self.arguments_raw)
        return _nfc(json.dumps(self.arguments, ensure_ascii=False))


class Step(BaseModel):
    """One scripted assistant turn: optional reasoning, content and tool calls."""

    model_config = ConfigDict(extra="forbid")
    content: str = ""
    reasoning: str | None = None
    tool_calls: list[ToolCallSpec] = Field(default_factory=list)
    #: "characters": the content is sampled one character at a time, a non-canonical split
    #: (its ids differ from the tokenizer's encoding of the same text), as real models do.
    token_split: Literal["canonical", "characters"] = "canonical"

    def assistant_message(self, call_id_seed: str) -> dict[str, Any]:
        """The OpenAI assistant message this step produces (content "" when empty).

        ``call_id_seed``: any string identifying the request (e.g. a prompt digest); tool-call
        ids are ``call_`` + 24 hex chars of sha256(seed, index), so they are deterministic.
        """
        msg: dict[str, Any] = {"role": "assistant", "content": _nfc(self.content)}
        if self.reasoning:
            msg["reasoning_content"] = _nfc(self.reasoning)
        if self.tool_calls:
            msg["tool_calls"] = [
                {
                    "id": tool_call_id(call_id_seed, i),
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments_text()},
                }
                for i, c in enumerate(self.tool_calls)
            ]
        return msg


class Rule(BaseModel):
    """Answer with ``step`` when the last message's text contains
    ``when_last_message_contains``, or the first (last) user message's text contains
    ``when_first_user_message_contains`` (``when_last_user_message_contains``); exactly one of
    the three is given."""

    model_config = ConfigDict(extra="forbid")
    when_last_message_contains: str | None = Field(default=None, min_length=1)
    when_first_user_message_contains: str | None = Field(default=None, min_length=1)
    when_last_user_message_contains: str | None = Field(default=None, min_length=1)
    step: Step

    @model_validator(mode="after")
    def _one_condition(self) -> Rule:
        given = [
            self.when_last_message_contains,
            self.when_first_user_message_contains,
            self.when_last_user_message_contains,
        ]
        if sum(c is not None for c in given) != 1:
            raise ValueError(
                "a rule needs exactly one of when_last_message_contains, "
                "when_first_user_message_contains and when_last_user_message_contains"
            )
        return self

    def matches(self, messages: Sequence[Mapping[str, Any]]) -> bool:
        if self.when_last_message_contains is not None:
            return self.when_last_message_contains in message_text(messages[-1])
        users = [m for m in messages if m.get("role") == "user"]
        if not users:
            return False
        if self.when_first_user_message_contains is not None:
            return self.when_first_user_message_contains in message_text(users[0])
        assert self.when_last_user_message_contains is not None
        return self.when_last_user_message_contains in message_text(users[-1])


class Policy(BaseModel):
    """A policy file: ``{"title", "steps": [Step...], "final", "rules"?: [Rule...]}``."""

    model_config = ConfigDict(extra="forbid")
    title: str = "Scripted session"
    steps: list[Step] = Field(default_factory=list)
    final: str = "Done."
    rules: list[Rule] = Field(default_factory=list)

    @classmethod
    def load(cls, path: Path) -> Policy:
        """Read and validate a policy JSON file. Raises OSError or pydantic.ValidationError."""
        return cls.model_validate_json(Path(path).read_text(encoding="utf-8"))

    @classmethod
    def default(cls) -> Policy:
        """The shipped default policy (two tool steps, then an answer)."""
        return cls.load(DEFAULT_POLICY_PATH)

    def choose(self, messages: Sequence[Mapping[str, Any]], has_tools: bool) -> Step:
        """The step answering a request with these messages (see module docstring)."""
        if self.rules and messages:
            for rule in self.rules:
                if rule.matches(messages):
                    return rule.step
        if not has_tools:
            return Step(content=self.title)
        index = step_index(messages)
        if index < len(self.steps):
            return self.steps[index]
        return Step(content=self.final)


def step_index(messages: Sequence[Mapping[str, Any]]) -> int:
    """Number of assistant messages after the last user message (all of them if none)."""
    last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=-1)
    return sum(1 for m in messages[last_user + 1 :] if m.get("role") == "assistant")


def message_text(message: Mapping[str, Any]) -> str:
    """The text of a message's content: a string as is, the ``text`` of text parts joined."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            p["text"]
            for p in content
            if isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str)
        )
    return ""


def tool_call_id(seed: str, index: int) -> str:
    """``call_`` + 24 hex chars derived from (seed, index): OpenAI-like and deterministic."""
    return "call_" + hashlib.sha256(f"{seed}:{index}".encode()).hexdigest()[:24]
