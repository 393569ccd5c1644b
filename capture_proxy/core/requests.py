"""Validation of captured chat-completions requests, before anything is forwarded.

Owns what a captured request must look like (OpenAI chat completions, with vLLM's extras passed
through untouched) and the field-naming error messages. A request that fails here is answered
with a 400 and never forwarded half-parsed.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Annotated, Any, Literal

import orjson
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StrictBool,
    StrictInt,
    Tag,
    TypeAdapter,
    ValidationError,
    field_validator,
)
from pydantic_core import PydanticCustomError

if TYPE_CHECKING:
    from capture_proxy.core.known_messages import MessageFacts


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
        problem = arguments_problem(value)
        if problem is not None:
            raise ValueError(problem)
        return value


def arguments_problem(value: str) -> str | None:
    """Why tool-call ``arguments`` text is not what vLLM accepts (it parses them with
    ``json.loads``, chat_utils._postprocess_messages, and answers 400 otherwise); None when
    it is. orjson first (what it accepts the stdlib accepts too); the stdlib decides what
    orjson refuses (NaN, Infinity)."""
    try:
        orjson.loads(value)
    except orjson.JSONDecodeError:
        try:
            json.loads(value)
        except ValueError as exc:
            return f"tool call arguments must be JSON text: {exc}"
        except RecursionError:
            return f"tool call arguments nest too deeply (at most {MAX_NESTING} levels)"
    return None


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


class FunctionDefinition(_Lenient):
    """A tool's function as vLLM reads it (``ChatCompletionToolsParam``); ``strict`` and other
    keys pass through."""

    name: str = Field(min_length=1)
    description: str | None = None
    #: a JSON Schema object, checked by the engine
    parameters: dict[str, Any] | None = None


class ToolDefinition(_Lenient):
    """One entry of ``tools``: vLLM takes function tools only (a missing ``type`` is one)."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Lenient):
    name: str = Field(min_length=1)


class NamedToolChoice(_Lenient):
    type: Literal["function"]
    function: NamedFunction


def _tool_choice_kind(value: Any) -> str | None:
    if isinstance(value, str):
        return "[mode]"
    if isinstance(value, dict):
        return "[function]"
    return None


#: ``tool_choice``: a mode or a named function. The tags (dropped from field paths, see
#: ``_is_union_tag``) pick the member by JSON kind, so that an error is the chosen member's.
ToolChoice = Annotated[
    Annotated[Literal["none", "auto", "required"], Tag("[mode]")]
    | Annotated[NamedToolChoice, Tag("[function]")],
    Discriminator(
        _tool_choice_kind,
        custom_error_type="tool_choice",
        custom_error_message=(
            "must be 'none', 'auto', 'required' or "
            '{"type": "function", "function": {"name": ...}}'
        ),
    ),
]


class ChatCompletionRequest(_Lenient):
    """The fields the proxy relies on; all other fields go to the engine as sent. The messages
    are validated one by one (``Message``, see ``validate_chat_request``)."""

    model: str | None = None
    messages: list[Any] = Field(min_length=1)
    #: checked so that a record's ``request_tools`` are tools the engine could render
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    stream: StrictBool = False
    n: StrictInt = Field(1, ge=1)
    logprobs: StrictBool | None = None
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    #: the proxy adds ``include_usage`` to it, and reads what the harness asked from it
    stream_options: dict[str, Any] | None = None
    # Sampling (``core.sampling``: passed to tokens-in engines by name, and recorded),
    # declared so that a bad type or an out-of-range value is a 400 naming the field before
    # anything is forwarded or stored (the body is forwarded as sent, never this model).
    # Ranges: OpenAI's where vLLM refuses the same values, vLLM's where it takes more. A
    # number is an int or a float (never a bool or a numeric string), finite (the stdlib
    # parses ``1e400`` as infinity).
    temperature: float | None = Field(None, strict=True, allow_inf_nan=False, ge=0, le=2)
    #: (0, 1]: vLLM refuses 0
    top_p: float | None = Field(None, strict=True, allow_inf_nan=False, gt=0, le=1)
    presence_penalty: float | None = Field(None, strict=True, allow_inf_nan=False, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, strict=True, allow_inf_nan=False, ge=-2, le=2)
    #: vLLM's range: a 64-bit signed integer (``torch.long``)
    seed: StrictInt | None = Field(None, ge=-(2**63), le=2**63 - 1)
    #: a string or a list of strings, none empty (vLLM refuses an empty one)
    stop: str | list[str] | None = None
    #: -1 (vLLM): the whole vocabulary; past OpenAI's 20 the engine's ``max_logprobs`` decides
    top_logprobs: StrictInt | None = Field(None, ge=-1)
    #: token id (a JSON object key) -> the bias added to its logit
    logit_bias: dict[str, float] | None = None
    #: vLLM's extras; 0 or -1 turn ``top_k`` off
    top_k: StrictInt | None = Field(None, ge=-1)
    min_p: float | None = Field(None, strict=True, allow_inf_nan=False, ge=0, le=1)
    repetition_penalty: float | None = Field(None, strict=True, allow_inf_nan=False, gt=0)
    min_tokens: StrictInt | None = Field(None, ge=0)
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: StrictBool | None = None
    #: constrained decoding: objects, checked by the engine
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_strings(cls, value: Any) -> Any:
        if value is None:
            return value
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list):
            raise PydanticCustomError(
                "stop", "must be a string or a list of strings, not {kind}", {"kind": _kind(value)}
            )
        for i, item in enumerate(items):
            where = "stop" if isinstance(value, str) else f"stop[{i}]"
            if not isinstance(item, str):
                raise PydanticCustomError(
                    "stop", "{where} is {kind}, not a string", {"where": where, "kind": _kind(item)}
                )
            if not item:
                raise PydanticCustomError(
                    "stop",
                    "{where} is empty (the engine refuses an empty stop string)",
                    {"where": where},
                )
        return value

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _logit_bias(cls, value: Any) -> Any:
        # OpenAI's [-100, 100]: vLLM would clamp a bias past it; refused instead, so that the
        # call's record names the bias that was applied.
        if not isinstance(value, dict):
            return value  # null, or not an object (the dict type names that)
        for key, bias in value.items():
            # JSON object keys are strings; vLLM turns each into a token id with int().
            if not (isinstance(key, str) and key.isascii() and key.isdecimal()):
                raise PydanticCustomError(
                    "token_id",
                    "key {key} is not a token id (a decimal integer)",
                    {"key": repr(key)},
                )
            if isinstance(bias, bool) or not isinstance(bias, int | float):
                raise PydanticCustomError(
                    "bias",
                    "the bias of {key} is {kind}, not a number",
                    {"key": key, "kind": _kind(bias)},
                )
            if not -100 <= bias <= 100:
                raise PydanticCustomError(
                    "bias",
                    "the bias of {key} is {bias}, not from -100 to 100",
                    {"key": key, "bias": bias},
                )
        return value


def _kind(value: Any) -> str:
    """A JSON value's kind, for messages (``int``, ``dict``, ``list``, ...)."""
    return "null" if value is None else type(value).__name__


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    """A JSON number as a float; one past the double range (``1e400``) is refused, not made
    an infinity that JSON cannot write back (orjson would send it on as ``null``)."""
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"number {text[:40]} is out of the range of a double")
    return value


#: Digits 1-9 to 0, so that ``_LONG_NUMBER in raw.translate(...)`` finds any run of 19 digits.
_DIGITS_TO_ZERO = bytes.maketrans(b"123456789", b"000000000")
#: orjson keeps integers in [-2**63, 2**64) exact and parses any other as a float: 2**64 has 20
#: digits, but -2**63 - 1 has 19, so a body with a run of 19 digits takes the stdlib's exact
#: path (slower, and rare: token ids and counts have fewer digits).
_LONG_NUMBER = b"0" * 19


#: Deepest nesting of arrays and objects a request may have: what orjson serialises (it
#: refuses deeper values, which is how a deep body is noticed without a walk over every
#: request); no chat request comes near it.
MAX_NESTING = 254


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """Parse a request body as a JSON object (strict: no NaN/Infinity). Raises InvalidRequest.

    orjson first (3-5x faster on agent histories of tens of KB); a body orjson refuses, or
    one with a 19-digit number, goes through the stdlib, which keeps big integers exact and
    names what is wrong."""
    if _LONG_NUMBER not in raw.translate(_DIGITS_TO_ZERO):
        try:
            fast = orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass
        else:
            if isinstance(fast, dict):
                # orjson refuses lone surrogates but takes 1,024 levels: deeper than
                # MAX_NESTING is possible only with that many brackets.
                if raw.count(b"[") + raw.count(b"{") > MAX_NESTING:
                    _check_text(fast)
                return fast
    try:
        obj = json.loads(raw, parse_constant=_reject_constant, parse_float=_finite_float)
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"request body is not UTF-8: {exc.reason}", "body") from exc
    except ValueError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}", "body") from exc
    except RecursionError as exc:
        raise InvalidRequest(
            f"request body nests too deeply; at most {MAX_NESTING} levels are accepted", "body"
        ) from exc
    if not isinstance(obj, dict):
        raise InvalidRequest(
            f"request body must be a JSON object, got {type(obj).__name__}", "body"
        )
    _check_text(obj)
    return obj


def text_problem(value: Any) -> InvalidRequest | None:
    """What makes a parsed JSON value unfit to forward, store or record, or None: nesting past
    ``MAX_NESTING`` levels (``param`` ``body``), or a lone UTF-16 surrogate (JSON allows
    ``"\\ud800"``; UTF-8 cannot carry it) in a string or key (``param``: its dotted path,
    e.g. ``messages.0.content``). The one text check of every API front and the read API.
    Cheap when the value is fine (orjson's encoder refuses both); iterative otherwise."""
    try:
        orjson.dumps(value)
    except TypeError:
        pass
    else:
        return None
    depth = _nesting(value)
    if depth > MAX_NESTING:
        return InvalidRequest(
            f"request body nests {depth} levels deep; at most {MAX_NESTING} are accepted", "body"
        )
    surrogate = _lone_surrogate_path(value)
    if surrogate is not None:
        return InvalidRequest(
            f"'{surrogate}' contains a lone UTF-16 surrogate, which is not valid Unicode",
            surrogate,
        )
    return None  # orjson refused something else (an integer past 64 bits): fine


def _check_text(value: Any) -> None:
    problem = text_problem(value)
    if problem is not None:
        raise problem


def loads_like_stdlib(raw: bytes) -> Any:
    """``json.loads(raw)``, by orjson where that parses to the same value (3-5x faster on an
    engine answer carrying a long prompt's ids): a body with a 19-digit number (orjson makes
    a float of an integer past 64 bits) or one orjson refuses (``NaN`` literals, lone
    surrogates) takes the stdlib. Raises ValueError."""
    if _LONG_NUMBER not in raw.translate(_DIGITS_TO_ZERO):
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass
    return json.loads(raw)


_MESSAGES: TypeAdapter[list[Message]] = TypeAdapter(list[Message])


def validate_chat_request(
    body: dict[str, Any], facts: Sequence[MessageFacts] | None = None
) -> ChatCompletionRequest:
    """Check a captured chat request. Raises InvalidRequest naming the first bad field.

    ``facts``: the ``known_messages`` facts of ``body["messages"]``; a message validated in an
    earlier request (``valid``) is not validated again, and the ones that pass here are marked.

    Refused under capture: ``n`` > 1 (one record per call; send n requests instead) and
    content parts other than text (their token data cannot be captured yet).
    """
    head_error: ValidationError | None = None
    try:
        req = ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        head_error = exc
    messages = body.get("messages")
    if head_error is not None and not _messages_first(head_error, messages):
        raise _invalid(head_error.errors()[0]) from head_error
    if isinstance(messages, list):
        if facts is not None and len(facts) != len(messages):
            raise ValueError(f"{len(facts)} facts for {len(messages)} messages")
        todo = [i for i in range(len(messages)) if facts is None or not facts[i].valid]
        try:
            _MESSAGES.validate_python([messages[i] for i in todo])
        except ValidationError as exc:
            err: dict[str, Any] = dict(exc.errors()[0])
            loc = tuple(err["loc"])
            err["loc"] = ("messages", todo[int(loc[0])], *loc[1:])
            raise _invalid(err) from exc
        if facts is not None:
            for i in todo:
                facts[i].valid = True
    if head_error is not None:
        raise _invalid(head_error.errors()[0]) from head_error
    if req.n != 1:
        raise InvalidRequest(
            "'n' > 1 is not supported under capture: each sample is its own rollout; send one "
            "request per rollout id (identical requests in one rollout are recorded as retries)",
            "n",
        )
    if _is_valid_unicode(body, facts):
        return req
    # orjson refused the body: too deep, or a lone surrogate (the walks below are iterative).
    depth = _nesting(body)
    if depth > MAX_NESTING:
        raise InvalidRequest(
            f"request body nests {depth} levels deep; at most {MAX_NESTING} are accepted", "body"
        )
    surrogate = _lone_surrogate_path(body)
    if surrogate is not None:
        raise InvalidRequest(
            f"'{surrogate}' contains a lone UTF-16 surrogate, which is not valid Unicode",
            surrogate,
        )
    return req


def _messages_first(head_error: ValidationError, messages: Any) -> bool:
    """The first error of the request in field order is in a message: the head's first error
    comes after ``messages`` (which the head only checks to be a non-empty list)."""
    loc = head_error.errors()[0]["loc"]
    return bool(loc) and loc[0] not in ("model", "messages") and isinstance(messages, list)


def _invalid(err: Any) -> InvalidRequest:
    # Drop pydantic's union-member tags ("str", "list[TextPart]") from the field path.
    loc = ".".join(str(p) for p in err["loc"] if not _is_union_tag(p))
    if err["type"] == "missing":
        message = f"'{loc}' is required"
    elif loc.startswith("messages.") and (loc.endswith(".type") or ".content." in f"{loc}."):
        message = f"'{loc}': {err['msg']} (only text content parts can be captured)"
    elif loc.startswith("tools.") and loc.endswith(".type"):
        message = f"'{loc}': {err['msg']} (the engine renders function tools only)"
    else:
        message = f"'{loc}': {err['msg']}"
    return InvalidRequest(message, param=loc or None)


def _is_valid_unicode(body: dict[str, Any], facts: Sequence[MessageFacts] | None) -> bool:
    """Fast check (orjson refuses lone surrogates); the slow walk only names the field. A
    message with a ``known_messages`` key was written by orjson already."""
    if facts is not None and all(f.key is not None for f in facts):
        body = {k: v for k, v in body.items() if k != "messages"}
    try:
        orjson.dumps(body)
    except TypeError:
        return False
    return True


def _is_union_tag(part: object) -> bool:
    return isinstance(part, str) and (part in {"str", "int", "bool"} or "[" in part)


def _children(value: Any, path: str) -> list[tuple[str, Any]]:
    if isinstance(value, dict):
        return [(f"{path}.{k}" if path else str(k), v) for k, v in value.items()]
    if isinstance(value, list):
        return [(f"{path}.{i}" if path else str(i), v) for i, v in enumerate(value)]
    return []


def _nesting(value: Any) -> int:
    """How many arrays and objects deep ``value`` goes (without recursion)."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for _, child in _children(item, ""))
    return deepest


def _lone_surrogate_path(value: Any) -> str | None:
    """Dotted path of the first string (key or value, in document order) holding a lone
    surrogate (JSON allows ``\ud800``); walked without recursion."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            if not _encodes(item):
                return path or "body"
            continue
        if isinstance(item, dict):
            for key in item:
                if isinstance(key, str) and not _encodes(key):
                    return path or "body"
        stack.extend(reversed(_children(item, path)))
    return None


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
