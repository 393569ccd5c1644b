"""Validation of captured chat-completions requests, before anything is forwarded.

Owns what a captured request must look like (OpenAI chat completions, with vLLM's extras passed
through untouched) and the field-naming error messages. A request that fails here is answered
with a 400 and never forwarded half-parsed.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import orjson
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    ValidationError,
    field_validator,
)


class InvalidRequest(ValueError):
    """The body is not a valid captured chat request. ``param`` names the field (dotted)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


class TextPart(_Lenient):
    type: Literal["text"]
    text: str


class FunctionCall(_Lenient):
    name: str
    arguments: str

    @field_validator("arguments")
    @classmethod
    def _arguments_are_json(cls, value: str) -> str:
        # vLLM parses them (chat_utils._postprocess_messages) and answers 400 otherwise.
        try:
            json.loads(value)
        except ValueError as exc:
            raise ValueError(f"tool call arguments must be JSON text: {exc}") from None
        return value


class ToolCall(_Lenient):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class ChatCompletionRequest(_Lenient):
    """The fields the proxy relies on; all other fields go to the engine as sent."""

    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    stream: StrictBool = False
    n: StrictInt = Field(1, ge=1)
    logprobs: StrictBool | None = None
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


#: Digits 1-9 to 0, so that ``_LONG_NUMBER in raw.translate(...)`` finds any run of 20 digits.
_DIGITS_TO_ZERO = bytes.maketrans(b"123456789", b"000000000")
#: 2**64 has 20 digits: a number this long may be past what orjson keeps exact (it parses
#: integers past 64 bits as floats), so such bodies take the stdlib's exact path.
_LONG_NUMBER = b"0" * 20


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """Parse a request body as a JSON object (strict: no NaN/Infinity). Raises InvalidRequest.

    orjson first (3-5x faster on agent histories of tens of KB); a body orjson refuses, or
    one with a 20-digit number, goes through the stdlib, which keeps big integers exact and
    names what is wrong."""
    if _LONG_NUMBER not in raw.translate(_DIGITS_TO_ZERO):
        try:
            fast = orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass
        else:
            if isinstance(fast, dict):
                return fast
    try:
        obj = json.loads(raw, parse_constant=_reject_constant)
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"request body is not UTF-8: {exc.reason}") from exc
    except ValueError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise InvalidRequest(f"request body must be a JSON object, got {type(obj).__name__}")
    return obj


def validate_chat_request(body: dict[str, Any]) -> ChatCompletionRequest:
    """Check a captured chat request. Raises InvalidRequest naming the first bad field.

    Refused under capture: ``n`` > 1 (one record per call; send n requests instead) and
    content parts other than text (their token data cannot be captured yet).
    """
    try:
        req = ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        # Drop pydantic's union-member tags ("str", "list[TextPart]") from the field path.
        loc = ".".join(str(p) for p in err["loc"] if not _is_union_tag(p))
        if err["type"] == "missing":
            message = f"'{loc}' is required"
        elif loc.endswith(".type") or ".content." in f"{loc}.":
            message = f"'{loc}': {err['msg']} (only text content parts can be captured)"
        else:
            message = f"'{loc}': {err['msg']}"
        raise InvalidRequest(message, param=loc or None) from exc
    if req.n != 1:
        raise InvalidRequest(
            "'n' > 1 is not supported under capture: each sample is its own rollout; send one "
            "request per rollout id (identical requests in one rollout are recorded as retries)",
            "n",
        )
    surrogate = _lone_surrogate_path(body) if not _is_valid_unicode(body) else None
    if surrogate is not None:
        raise InvalidRequest(
            f"'{surrogate}' contains a lone UTF-16 surrogate, which is not valid Unicode",
            surrogate,
        )
    return req


def _is_valid_unicode(body: dict[str, Any]) -> bool:
    """Fast check (orjson refuses lone surrogates); the slow walk only names the field."""
    try:
        orjson.dumps(body)
    except TypeError:
        return False
    return True


def _is_union_tag(part: object) -> bool:
    return isinstance(part, str) and (part in {"str", "int", "bool"} or "[" in part)


def _lone_surrogate_path(value: Any, path: str = "") -> str | None:
    """Dotted path of the first string holding a lone surrogate (JSON allows ``\\ud800``)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    items = (
        value.items()
        if isinstance(value, dict)
        else enumerate(value)
        if isinstance(value, list)
        else ()
    )
    for key, item in items:
        found = _lone_surrogate_path(key, path) if isinstance(key, str) else None
        found = found or _lone_surrogate_path(item, f"{path}.{key}" if path else str(key))
        if found:
            return found
    return None
