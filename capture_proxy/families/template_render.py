"""A chat template rendered as transformers' ``apply_chat_template`` renders it, minus its walks.

Owns ``PlainTemplate``: the text ``tokenizer.apply_chat_template(messages, tools=...,
chat_template=..., add_generation_prompt=..., tokenize=False, **kwargs)`` gives, for inputs
that are already plain JSON data (what ``families.vllm_messages`` builds from a request body),
and token ids as ``tokenizer.encode(text, add_special_tokens=False)`` gives them (by the
pieces between added tokens, remembered: ``families.segment_encode``).

Why: for a short conversation transformers spends more time walking the inputs than jinja
spends rendering them (it converts message objects to dicts, then rebuilds every value from
plain JSON types so that the sandbox never sees a rich object, then validates its options:
about 70 us of the 110 us of a four-message render, and 13 us of the 30 us of encoding a
short tail). Both walks copy plain data into equal plain data, so skipping them changes
nothing the template sees. What is left is what transformers 5 does for plain data (read
from ``tokenization_utils_base.apply_chat_template`` and ``chat_template_utils
.render_jinja_template``): the message keys whose value is None dropped, the reasoning
aliased (``thinking`` and ``reasoning_content`` from the first of ``reasoning_content``,
``thinking``, ``reasoning``), the tokenizer's named special tokens under the request's
keyword arguments, rendered by transformers' own compiled template (its sandbox, filters and
globals).

``PlainTemplate.of`` returns None where that shortcut is not known to hold (another
tokenizer class, a transformers without these helpers, a backend tokenizer set to truncate
or pad): the caller then renders through ``apply_chat_template``. A keyword argument that
``apply_chat_template`` reads itself (``documents``, ...) takes the slow path too. Must not
do I/O; ``tests/families/test_template_render.py`` compares both paths.
"""

from __future__ import annotations

import inspect
import marshal
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from capture_proxy.families.locked_lru import LockedLru
from capture_proxy.families.segment_encode import SegmentEncoder

#: the names a message's reasoning goes by, the first the standard one (transformers 5's
#: ``_REASONING_FIELDS``)
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    """The message with ``thinking`` and ``reasoning_content`` filled from the first set
    reasoning field (transformers 5's ``_alias_reasoning_fields``)."""
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


class MemoTojson:
    """The template's ``tojson`` filter (transformers': ``json.dumps``), remembering the texts
    of the objects and arrays it wrote with its default options: a harness sends the same tools
    with every call (OpenCode's ten: 21 KB of JSON, about 200 us of ``json.dumps`` per render),
    and a template writes each tool with ``tool | tojson``.

    A text is remembered under the value's ``marshal`` bytes (version 2: no back-references,
    so they do not depend on which equal strings are the same object): marshal takes only
    plain data (dict, list, str, int, float, bool, None, and not their subclasses), and equal
    bytes are values of the same types with the same contents in the same order (a NaN is not
    a None, an int not a float, unlike their JSON texts), which ``json.dumps`` writes alike.
    The latest ``max_entries`` are kept, each of at most ``max_chars`` (text and key); any
    other call (other options, a value marshal refuses) is the filter's own. Thread-safe (a
    large render runs on a worker thread)."""

    def __init__(
        self, dumps: Callable[..., str], max_entries: int = 256, max_chars: int = 16384
    ) -> None:
        self.dumps = dumps
        self.max_chars = max_chars
        self._texts: LockedLru[bytes, str] = LockedLru(max_entries, lambda _, __: 1)

    def __call__(
        self,
        x: Any,
        ensure_ascii: bool = False,
        indent: Any = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        if (
            ensure_ascii
            or indent is not None
            or separators is not None
            or sort_keys
            or (type(x) is not dict and type(x) is not list)
        ):
            return self.dumps(
                x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                sort_keys=sort_keys,
            )  # fmt: skip
        try:
            key = marshal.dumps(x, 2)
        except ValueError:  # not plain data: the filter says what it makes of it
            return self.dumps(x)
        text = self._texts.get(key)
        if text is None:
            text = self.dumps(x)
            if len(key) <= self.max_chars and len(text) <= self.max_chars:
                self._texts.put(key, text)
        return text


def _with_memo_tojson(compiled: Any, template: str) -> Any:
    """``template`` compiled again in an overlay of ``compiled``'s environment whose
    ``tojson`` filter is a ``MemoTojson`` of its own (transformers' compiled template, which
    its cache shares with every other caller, is left as it is)."""
    base = compiled.environment
    env = base.overlay()
    env.filters = {**base.filters, "tojson": MemoTojson(base.filters["tojson"])}
    return env.from_string(template)


class PlainTemplate:
    """One tokenizer's chat template, rendered and encoded without transformers' per-call
    walks over plain inputs (see the module docstring)."""

    def __init__(
        self, compiled: Any, special_tokens: dict[str, str], backend: Any, reserved: frozenset[str]
    ) -> None:
        self._compiled = compiled
        self._special = special_tokens
        self._backend = backend
        #: the encoding from remembered pieces between added tokens, where it holds
        self._segments = SegmentEncoder.of(backend)
        #: keyword names ``apply_chat_template`` or ``render_jinja_template`` read themselves
        self._reserved = reserved

    @classmethod
    def of(cls, tokenizer: Any, template: str) -> PlainTemplate | None:
        """The shortcut for ``tokenizer`` and ``template``, or None where it is not known to
        give what ``apply_chat_template`` and ``encode`` give."""
        try:
            from transformers.tokenization_utils_base import PreTrainedTokenizerBase
            from transformers.tokenization_utils_tokenizers import TokenizersBackend
            from transformers.utils import chat_template_utils as ctu
        except ImportError:
            return None
        helpers = ("_compile_jinja_template", "_alias_reasoning_fields", "render_jinja_template")
        if not all(hasattr(ctu, name) for name in helpers):
            return None
        if getattr(ctu, "_REASONING_FIELDS", None) != _REASONING_FIELDS:
            return None
        kind = type(tokenizer)
        if not isinstance(tokenizer, TokenizersBackend) or (
            kind.apply_chat_template is not PreTrainedTokenizerBase.apply_chat_template
        ):
            return None
        backend = getattr(tokenizer, "_tokenizer", None)
        if backend is None or backend.truncation is not None or backend.padding is not None:
            return None
        if bool(backend.encode_special_tokens) != bool(tokenizer.split_special_tokens):
            return None
        reserved = set(inspect.signature(kind.apply_chat_template).parameters)
        reserved |= set(inspect.signature(ctu.render_jinja_template).parameters)
        try:
            compiled = _with_memo_tojson(ctu._compile_jinja_template(template), template)
        except Exception:  # a template jinja cannot compile: the slow path reports it
            return None
        return cls(compiled, dict(tokenizer.special_tokens_map), backend, frozenset(reserved))

    def accepts(self, kwargs: Mapping[str, Any]) -> bool:
        """Whether the request's template keyword arguments leave the shortcut exact."""
        return not any(k in self._reserved for k in kwargs)

    def text(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool,
        kwargs: Mapping[str, Any],
    ) -> str:
        """The template's text. Raises what the template raises."""
        chat = [_alias_reasoning({k: v for k, v in m.items() if v is not None}) for m in messages]
        return str(
            self._compiled.render(
                messages=chat,
                tools=tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **{**self._special, **kwargs},
            )
        )

    def encode(self, text: str) -> list[int]:
        """``text``'s ids, no special tokens added."""
        if self._segments is not None:
            return self._segments.encode(text)
        return list(self._backend.encode(text, add_special_tokens=False).ids)
