"""Validation of captured chat-completions requests, before anything is forwarded.

Owns what a captured request must look like (OpenAI chat completions, with vLLM's extras passed
through untouched) and the field-naming error messages. A request that fails here is answered
with a 400 and never forwarded half-parsed.
"""

from __future__ import annotations

import json
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

from capture_proxy.core.json_bodies import MAX_NESTING, InvalidRequest, check_text, json_kind

if TYPE_CHECKING:
    from capture_proxy.core.known_messages import MessageFacts
    from capture_proxy.core.known_tools import ToolsFacts


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


class TextPart(_Lenient):
    type: Literal["text"]
    text: str


class ImageURL(_Lenient):
    """An ``image_url`` part's object: a ``data:`` URL (or a remote one, see
    ``core.images``) and OpenAI's ``detail``."""

    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(_Lenient):
    """An image content part (OpenAI chat ``image_url``); its bytes are checked by
    ``core.images`` (format, size, scheme) once the message is valid."""

    type: Literal["image_url"]
    image_url: ImageURL

    @field_validator("image_url", mode="before")
    @classmethod
    def _image_url_is_an_object(cls, value: Any) -> Any:
        # pydantic would say "a valid dictionary or instance of ImageURL": name the shape.
        if not isinstance(value, dict) and not isinstance(value, ImageURL):
            raise PydanticCustomError(
                "image_url_object",
                'must be an object with a "url" ({"url": "data:image/png;base64,..."}), got {kind}',
                {"kind": json_kind(value)},
            )
        return value


def _part_kind(value: Any) -> str | None:
    if isinstance(value, dict):
        return "[image]" if value.get("type") == "image_url" else "[text]"
    return None


#: A content part: text, or an image (tagged by its ``type``, so that an error is the
#: chosen member's).
ContentPart = Annotated[
    Annotated[TextPart, Tag("[text]")] | Annotated[ImagePart, Tag("[image]")],
    Discriminator(
        _part_kind,
        custom_error_type="content_part",
        custom_error_message="a content part must be an object",
    ),
]


def _content_kind(value: Any) -> str | None:
    if isinstance(value, str):
        return "str"
    return "list[ContentPart]" if isinstance(value, list) else None


#: A message's content: a string or a list of parts (tagged by the value's JSON type, so that
#: an error in a part names the part, not the string the content is not).
Content = Annotated[
    Annotated[str, Tag("str")] | Annotated[list[ContentPart], Tag("list[ContentPart]")],
    Discriminator(
        _content_kind,
        custom_error_type="content",
        custom_error_message="content must be a string, an array of content parts or null",
    ),
]


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
    """Why tool-call ``arguments`` text cannot be taken, else None. vLLM 0.32 takes any text
    (``renderers/chat_utils._postprocess_messages``: "" and text that is not a JSON object
    become ``{}`` for the template; invalid JSON too, with a warning, so that a conversation
    holding a malformed call can go on). The proxy keeps the text as sent (records, digests)
    and renders ``{}`` as vLLM does (``families.vllm_messages.template_arguments``); only JSON
    nested past ``MAX_NESTING`` levels is refused (the stdlib parser vLLM uses raises
    ``RecursionError`` there, which vLLM does not catch)."""
    try:
        orjson.loads(value)
    except orjson.JSONDecodeError:
        try:
            json.loads(value)
        except ValueError:
            return None
        except RecursionError:
            return f"tool call arguments nest too deeply (at most {MAX_NESTING} levels)"
    return None


class ToolCall(_Lenient):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content | None = None
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


_MESSAGES: TypeAdapter[list[Message]] = TypeAdapter(list[Message])


def validate_chat_request(
    body: dict[str, Any],
    facts: Sequence[MessageFacts] | None = None,
    tools_facts: ToolsFacts | None = None,
) -> ChatCompletionRequest:
    """Check a captured chat request. Raises InvalidRequest naming the first bad field.

    ``facts``: the ``known_messages`` facts of ``body["messages"]``; a message validated in an
    earlier request (``valid``) is not validated again, and the ones that pass here are marked.
    ``tools_facts``: the ``known_tools`` facts of ``body["tools"]``, likewise: tools validated
    in an earlier request are not validated again (the returned model's ``tools`` is then
    None: what the engine gets is the body's), and tools that pass here are marked.

    Refused under capture: ``n`` > 1 (one record per call; send n requests instead: identical
    ones are siblings, ``docs/linking.md``) and content parts other than text and
    ``image_url`` (an image's bytes are checked by ``core.images`` afterwards).
    """
    skip_tools = tools_facts is not None and tools_facts.valid
    head = {k: v for k, v in body.items() if k != "tools"} if skip_tools else body
    head_error: ValidationError | None = None
    try:
        req = ChatCompletionRequest.model_validate(head)
    except ValidationError as exc:
        head_error = exc
    else:
        if tools_facts is not None:
            tools_facts.valid = True  # (its checks are the tools' own: no other field's)
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
            "'n' > 1 is not supported under capture (one record per call): send n separate "
            "requests; identical requests in one rollout are siblings, each its own sample (a "
            "retry only with an x-stainless-retry-count header > 0, or after the earlier one "
            "failed)",
            "n",
        )
    if not _is_valid_unicode(body, facts, tools_facts):
        check_text(body)  # orjson refused the body: name what is too deep or not Unicode
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
    elif ".content." in loc and (loc.endswith(".type") or err["type"] == "content_part"):
        # a part of another type (or not an object): the error is its kind, not its fields
        message = f"'{loc}': {err['msg']} (only text and image_url content parts can be captured)"
    elif loc.startswith("tools.") and loc.endswith(".type"):
        message = f"'{loc}': {err['msg']} (the engine renders function tools only)"
    else:
        message = f"'{loc}': {err['msg']}"
    return InvalidRequest(message, param=loc or None)


def _is_valid_unicode(
    body: dict[str, Any], facts: Sequence[MessageFacts] | None, tools_facts: ToolsFacts | None
) -> bool:
    """Fast check (orjson refuses lone surrogates); the slow walk only names the field. A
    message with a ``known_messages`` key, and tools with a ``known_tools`` key, were written
    by orjson already."""
    skip = set()
    if facts is not None and all(f.key is not None for f in facts):
        skip.add("messages")
    if tools_facts is not None and tools_facts.key is not None:
        skip.add("tools")
    if skip:
        body = {k: v for k, v in body.items() if k not in skip}
    try:
        orjson.dumps(body)
    except TypeError:
        return False
    return True


def _is_union_tag(part: object) -> bool:
    return isinstance(part, str) and (part in {"str", "int", "bool"} or "[" in part)
