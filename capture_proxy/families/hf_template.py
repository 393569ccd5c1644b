"""Rendering a conversation with a Hugging Face tokenizer and chat template, as vLLM does.

Owns ``LocalRenderer``: the model's own HF tokenizer and chat template (from a local
directory; no hub access), rendering the way vLLM 0.32 renders a chat-completions request:
vLLM's message normalisation first (``families.vllm_messages``: null content, content parts,
tool-call arguments as objects, reasoning fields, tools as vLLM dumps them), the template's
keyword arguments filtered to what it reads, then the text encoded without added special
tokens.

``render_tail_sync`` renders only what follows a continued assistant turn (exact-token mode's
per-call work in proportion to the new tokens): the turn is rendered in a small context (the
leading system message and the last user query before it, the same tools) followed by the new
messages and the generation prompt; the context before the turn, rendered alone, must be a
text prefix of that render, and the turn ends at the first end-of-turn text after it. What
follows is the tail. The turn itself may render differently as the last message than inside a
longer conversation (Qwen3's empty think block): it is cut away, so that does not matter.
Where the tail cannot be found that way (no user before the turn, an assistant message among
the new ones, a context that is not a prefix) the caller renders the whole conversation. The
context's head repeats from call to call (an agent's system prompt and task): where the small
render starts with a head seen before, it is not rendered again (``families.head_memo``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from capture_proxy.families.base import RenderError
from capture_proxy.families.head_memo import HeadMemo
from capture_proxy.families.template_ast import template_variables
from capture_proxy.families.template_render import PlainTemplate
from capture_proxy.families.vision import VisionProcessorConfig, expand_image_pads, image_sizes
from capture_proxy.families.vllm_messages import (
    MessageError,
    detect_content_format,
    names_developer_role,
    normalise_messages,
    normalise_tools,
)

#: keyword arguments the renderer sets itself; a request's ``chat_template_kwargs`` cannot
#: override them
_OWN_KWARGS = frozenset(
    {
        "add_generation_prompt",
        "continue_final_message",
        "tools",
        "chat_template",
        "tokenize",
        "conversation",
        "messages",
        "return_dict",
    }
)


#: a conversation up to about this many characters (message and tool texts) renders on the
#: event loop: its render (some 100 us) costs less than a hop to a worker thread and back
INLINE_RENDER_CHARS = 8192


def smaller_than(value: Any, limit: int) -> bool:
    """Whether the strings in ``value`` (nested dicts and lists) hold fewer than ``limit``
    characters; stops counting at the limit."""
    stack = [value]
    left = limit
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            left -= len(item)
            if left <= 0:
                return False
        elif isinstance(item, Mapping):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return True


def tail_context(messages: Sequence[Mapping[str, Any]], turn_index: int) -> list[Mapping[str, Any]]:
    """The small context a tail is rendered in: the leading system/developer message and the
    last user message before ``turn_index``, then the continued turn itself."""
    head: list[Mapping[str, Any]] = []
    if messages and messages[0].get("role") in ("system", "developer") and turn_index > 0:
        head.append(messages[0])
    user = next(
        (i for i in range(turn_index - 1, len(head) - 1, -1) if messages[i].get("role") == "user"),
        None,
    )
    if user is not None:
        head.append(messages[user])
    return [*head, messages[turn_index]]


def tail_renderable(
    context: Sequence[Mapping[str, Any]], new_messages: Sequence[Mapping[str, Any]]
) -> bool:
    """Whether the tail can be rendered in the small context: something before the turn to
    anchor it (a system or user message), and no assistant message among the new ones (its
    rendering may depend on the whole conversation, e.g. Qwen3's last-query rule)."""
    return len(context) > 1 and not any(m.get("role") == "assistant" for m in new_messages)


def find_tail_ids(
    head: Sequence[int], small: Sequence[int], end_of_turn_ids: frozenset[int]
) -> list[int] | None:
    """``find_tail_text`` on token ids (for renderers without a text form: the engine's
    ``/tokenize``): the ids after the first end-of-turn token that follows ``head`` in
    ``small``; None when ``head`` is not a prefix of ``small`` or no end of turn follows."""
    n = len(head)
    if len(small) < n or list(small[:n]) != list(head):
        return None
    at = next((i for i in range(n, len(small)) if small[i] in end_of_turn_ids), None)
    return None if at is None else list(small[at + 1 :])


def find_tail_text(head_text: str, small_text: str, end_of_turn_text: str) -> str | None:
    """The text after the continued turn in ``small_text`` (the head, the turn, the new
    messages, the generation prompt): the turn starts where ``head_text`` ends and ends at
    the first ``end_of_turn_text`` after it. None when ``head_text`` is not a prefix of
    ``small_text`` or no end of turn follows it."""
    if not small_text.startswith(head_text):
        return None
    return tail_after(small_text, len(head_text), end_of_turn_text)


def tail_after(small_text: str, head_length: int, end_of_turn_text: str) -> str | None:
    """The text after the first ``end_of_turn_text`` at or after ``head_length``; None when
    there is none."""
    at = small_text.find(end_of_turn_text, head_length)
    if at < 0:
        return None
    return small_text[at + len(end_of_turn_text) :]


class LocalRenderer:
    """Renders with a local HF tokenizer (``tokenizer``) and chat template (its own, or
    ``chat_template``): template text, then ``encode`` without adding special tokens, as vLLM.
    ``vision``: the image processor settings of a vision-language model (Qwen-VL): each image's
    placeholder token is then expanded as vLLM's processor expands it
    (``vision.expand_image_pads``); without, a conversation with images is refused."""

    def __init__(
        self,
        tokenizer: Any,
        chat_template: str | None = None,
        vision: VisionProcessorConfig | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.vision = vision
        #: the template rendered with, its shortcut past transformers' input walks
        #: (``families.template_render``; None: it does not hold) and the heads of its tail
        #: renders (``families.head_memo``)
        self._state: tuple[str, PlainTemplate | None, HeadMemo] | None = None

    def _template_state(self) -> tuple[str, PlainTemplate | None, HeadMemo]:
        template = self.template_text
        if self._state is None or self._state[0] != template:
            self._state = (template, PlainTemplate.of(self.tokenizer, template), HeadMemo())
        return self._state

    @property
    def plain(self) -> PlainTemplate | None:
        """The template's shortcut render and encode, None where they do not hold."""
        return self._template_state()[1]

    def _encode(self, text: str, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """``text`` encoded without added special tokens; its image placeholders expanded for
        the images of ``messages`` (the messages ``text`` renders). Raises RenderError."""
        plain = self.plain
        if plain is not None:
            ids = plain.encode(text)
        else:
            ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        try:
            sizes = image_sizes(messages)
            if not sizes:
                return ids
            if self.vision is None:
                raise ValueError("this renderer has no image processor (a text-only model)")
            return expand_image_pads(ids, sizes, self.vision)
        except ValueError as exc:
            raise RenderError(f"images: {exc}") from exc

    @classmethod
    def from_directory(cls, path: Path) -> LocalRenderer:
        """Load a tokenizer directory (``tokenizer.json`` + config with a chat template).
        Never touches a hub. Raises RenderError when it cannot be loaded."""
        try:
            from transformers import AutoTokenizer
        except ImportError as exc:
            raise RenderError(
                f"setting tokenizer needs transformers ({exc}): install the tokenizer extra, "
                "pip install 'capture-proxy[tokenizer]'"
            ) from exc
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError) as exc:
            raise RenderError(f"cannot load tokenizer from {path}: {exc}") from exc
        if not getattr(tokenizer, "chat_template", None):
            raise RenderError(f"tokenizer at {path} has no chat template")
        return cls(tokenizer)

    def render_sync(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: list[dict[str, Any]] | None,
        *,
        add_generation_prompt: bool,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        text = self._text(messages, tools, add_generation_prompt, chat_template_kwargs)
        return self._encode(text, messages)

    def render_text_sync(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: list[dict[str, Any]] | None,
        *,
        add_generation_prompt: bool,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The template's text of the conversation (before tokenizing). Raises RenderError."""
        return self._text(messages, tools, add_generation_prompt, chat_template_kwargs)

    def render_continuation_sync(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: list[dict[str, Any]] | None,
        *,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of the conversation with its last message left open for the model to
        continue (transformers' ``continue_final_message``, as vLLM's chat extra of that
        name: no generation prompt, the final turn's end-of-turn text cut)."""
        text = self._text(messages, tools, False, chat_template_kwargs, continue_final=True)
        return self._encode(text, messages)

    async def render_continuation(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: list[dict[str, Any]] | None,
        *,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        if smaller_than((messages, tools), INLINE_RENDER_CHARS):
            return self.render_continuation_sync(
                messages, tools, chat_template_kwargs=chat_template_kwargs
            )
        return await asyncio.to_thread(
            self.render_continuation_sync,
            messages,
            tools,
            chat_template_kwargs=chat_template_kwargs,
        )

    def _text(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool,
        chat_template_kwargs: dict[str, Any] | None,
        continue_final: bool = False,
    ) -> str:
        template = self.template_text
        try:
            normalised = normalise_messages(
                messages,
                content_format=detect_content_format(template),
                developer_role=names_developer_role(template),
            )
        except MessageError as exc:
            raise RenderError(str(exc)) from exc
        kwargs = self.template_kwargs(chat_template_kwargs)
        plain = self.plain
        try:
            if plain is not None and normalised and not continue_final and plain.accepts(kwargs):
                return plain.text(normalised, normalise_tools(tools), add_generation_prompt, kwargs)
            return str(
                self.tokenizer.apply_chat_template(
                    normalised,
                    tools=normalise_tools(tools),
                    chat_template=template,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final,
                    tokenize=False,
                    **kwargs,
                )
            )
        except Exception as exc:  # jinja errors: the request's fault
            raise RenderError(f"chat template failed: {exc}") from exc

    @property
    def template_text(self) -> str:
        """The jinja source rendered with (the given one, else the tokenizer's own)."""
        template = self.chat_template or getattr(self.tokenizer, "chat_template", None)
        if not isinstance(template, str):
            raise RenderError("the tokenizer has no (single) chat template")
        return template

    def template_kwargs(self, chat_template_kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
        """A request's ``chat_template_kwargs`` as vLLM passes them: only the variables the
        template reads (vLLM's ``resolve_chat_template_kwargs``), never the renderer's own."""
        if not chat_template_kwargs:
            return {}
        names = template_variables(self.template_text)
        return {
            k: v for k, v in chat_template_kwargs.items() if k in names and k not in _OWN_KWARGS
        }

    def render_tail_sync(
        self,
        context: Sequence[Mapping[str, Any]],
        new_messages: Sequence[Mapping[str, Any]],
        tools: list[dict[str, Any]] | None,
        *,
        end_of_turn_text: str,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[int] | None:
        """Token ids after the end-of-turn text of ``context``'s last turn (the continued
        one) when ``new_messages`` follow it and the generation prompt closes it; None when the
        tail cannot be found (see the module docstring). Raises RenderError.

        Only the tail text is tokenized: it begins right after an added special token, where
        the tokenizer always splits, so its ids are those of the whole text's tokenization."""
        if not tail_renderable(context, new_messages):
            return None
        small = self._text([*context, *new_messages], tools, True, chat_template_kwargs)
        heads, head = self._template_state()[2], context[:-1]
        key = heads.key(head, tools, chat_template_kwargs)
        length = None if key is None else heads.head_length(key, small)
        if length is None:
            head_text = self._text(head, tools, False, chat_template_kwargs)
            if key is not None:
                heads.remember(key, head_text)
            tail = find_tail_text(head_text, small, end_of_turn_text)
        else:
            tail = tail_after(small, length, end_of_turn_text)
        if tail is None:
            return None
        return self._encode(tail, new_messages)

    async def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: list[dict[str, Any]] | None,
        *,
        add_generation_prompt: bool,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        if smaller_than((messages, tools), INLINE_RENDER_CHARS):
            return self.render_sync(
                messages,
                tools,
                add_generation_prompt=add_generation_prompt,
                chat_template_kwargs=chat_template_kwargs,
            )
        return await asyncio.to_thread(
            self.render_sync,
            messages,
            tools,
            add_generation_prompt=add_generation_prompt,
            chat_template_kwargs=chat_template_kwargs,
        )

    def decode(self, token_ids: list[int]) -> str:
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=False))

    def decode_text(self, token_ids: list[int]) -> str:
        """The text of ``token_ids`` without special tokens (what an engine answers)."""
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=True))

    def token_id(self, token: str) -> int | None:
        """The id of ``token`` when it is one token of the vocabulary, else None."""
        tid = self.tokenizer.convert_tokens_to_ids(token)
        if not isinstance(tid, int) or tid == self.tokenizer.unk_token_id:
            return None
        return tid
