"""The per-event scan of a streamed chat chunk: compiled when built, else None.

``scan_chat_chunk(data, flags)`` (``_chunkscan.c``) reads one streamed ``chat.completion.chunk``
of vLLM's (0.32 dialect, compact JSON) in one pass over its bytes: it validates the event as
JSON and returns ``(event, delta, content, token_ids, log_probs)``:

- ``event``: ``bytes``, the event for the harness (``b"data: " + chunk + b"\\n\\n"``) with the
  members cut that ``capture.strip_chat_chunk`` drops (the values kept are the engine's bytes);
  None when ``flags`` has ``SCAN_NO_EVENT``;
- ``delta``: ``bytes``, ``choices[0].delta`` as JSON when it has members and is not
  content-only, else None;
- ``content``: ``str``, the text of a delta that is exactly ``{"content": <string>}`` (most
  tokens), else None;
- ``token_ids``: ``list[int]``, ``choices[0].token_ids`` (None: absent or null);
- ``log_probs``: ``list[float | int | None]``, each ``choices[0].logprobs.content[i].logprob``
  (None: no ``content``).

It returns None for any chunk it does not read exactly as the Python path would (the first
chunk with the prompt ids, the last with a ``finish_reason``, a usage, routed experts, more than
one choice, bytes that are not strict JSON or UTF-8, ...): the caller then parses the chunk with
orjson and hands it to ``ChatCaptureAssembler.add_chunk`` and ``strip_chat_chunk``. Both paths
give the same record and the same JSON to the harness (``tests/core/test_chunk_scan.py`` checks
it over generated chunks).

``SCAN`` and ``SCAN_COMPLETIONS`` are None where the extension was not built (no C compiler
at install: ``setup.py`` makes it optional), was built from another source than the one beside
it (``_load``), or when ``CAPTURE_PROXY_NO_COMPILED`` is 1, true, yes or on (to measure or test
the Python path alone).

``take_prompt(raw)`` reads a whole engine answer's (or a stream's first chunk's) top-level
``prompt_token_ids`` straight into their array (``take_prompt_ids`` in the same module): an
agent's call carries thousands of prompt ids, which orjson would make Python ints of and the
assembler an array of again.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from capture_proxy.core.capture import HarnessAsked

#: (data, flags) -> (event, delta, content, token_ids, log_probs) | None
Scan = Callable[
    [bytes, int], "tuple[bytes | None, bytes | None, str | None, list[int] | None, list] | None"
]

#: flag bits of ``scan_chat_chunk`` (the values are the C module's)
SCAN_STRIP_TOKEN_IDS = 1
SCAN_NULL_LOGPROBS = 2
SCAN_DROP_USAGE = 4
SCAN_NO_EVENT = 8


def python_path_only() -> bool:
    """``CAPTURE_PROXY_NO_COMPILED`` is set to 1, true, yes or on (any case)."""
    value = os.environ.get("CAPTURE_PROXY_NO_COMPILED", "")
    return value.strip().lower() in ("1", "true", "yes", "on")


#: data -> (text, token_ids, log_probs) | None
ScanCompletions = Callable[[bytes], "tuple[str, list[int], list | None] | None"]


def _load() -> ModuleType | None:
    """The compiled module when it is built from the source beside it (``setup.py`` puts the
    source's SHA-256 in it); None where it is not built, built from another source (a pull
    without ``scripts/setup``, a rebuild that failed and left the old one), or switched off.
    A module installed without its source is taken as built."""
    if python_path_only():
        return None
    try:
        from capture_proxy.core import _chunkscan  # type: ignore[attr-defined]
    except ImportError:
        return None
    source = Path(__file__).with_name("_chunkscan.c")
    built_from = getattr(_chunkscan, "SOURCE_SHA256", None)
    if source.is_file() and built_from != hashlib.sha256(source.read_bytes()).hexdigest():
        return None
    return _chunkscan  # type: ignore[no-any-return]


_MODULE = _load()
SCAN: Scan | None = getattr(_MODULE, "scan_chat_chunk", None)
#: ``scan_completions_chunk(data)``: a middle chunk of vLLM's completions stream (exact-token
#: mode), ``(text, token_ids, log_probs)``: ``choices[0].text`` ("" when absent or null),
#: ``choices[0].token_ids``, ``logprobs.token_logprobs`` (None: absent or null); None for any
#: other chunk, which ``engine_formats.VllmCompletionsReader`` then parses
SCAN_COMPLETIONS: ScanCompletions | None = getattr(_MODULE, "scan_completions_chunk", None)


#: ``take_prompt_ids(data)``: ``(rest, ids)`` or None (``take_prompt``)
_TAKE_PROMPT_IDS: Callable[[bytes], tuple[bytes, bytearray] | None] | None = getattr(
    _MODULE, "take_prompt_ids", None
)


#: ``scan_history(data, name, skip_to, skip_count, stop_after)``: ``(ends, array_close)`` or
#: None, and ``common_prefix(a, b)`` (``known_bodies``: a request's history array read from
#: its bytes)
SCAN_HISTORY: Callable[[bytes, bytes, int, int, int], tuple[list[int], int] | None] | None
SCAN_HISTORY = getattr(_MODULE, "scan_history", None)
COMMON_PREFIX: Callable[[bytes, bytes], int] | None = getattr(_MODULE, "common_prefix", None)


def take_prompt(raw: bytes) -> tuple[bytes, npt.NDArray[np.uint32] | None]:
    """``raw`` (a JSON object's bytes) with its top-level ``prompt_token_ids`` written as
    ``null``, and those ids as uint32 ``[num_prompt_tokens]`` (a writable array of their own);
    ``(raw, None)`` unchanged where the compiled module does not read them exactly as orjson
    and ``records.as_token_array`` would (not strict JSON, no such array, an element that is
    not a plain integer from 0 to 2**32 - 1, ...; see ``_chunkscan.c``) or is not built.
    Parsing ``rest`` then gives what parsing ``raw`` gives, but that member's value is None.
    Raises MemoryError only."""
    take = _TAKE_PROMPT_IDS
    taken = take(raw) if take is not None else None
    if taken is None:
        return raw, None
    rest, ids = taken
    return rest, np.frombuffer(ids, dtype=np.uint32)


def scan_flags(asked: HarnessAsked, *, event: bool) -> int:
    """The flags for what the harness asked for (``event``: the harness gets the chunk
    itself, a chat front; other fronts build their own events from the delta)."""
    flags = 0 if event else SCAN_NO_EVENT
    if not asked.return_token_ids:
        flags |= SCAN_STRIP_TOKEN_IDS
    if not asked.logprobs:
        flags |= SCAN_NULL_LOGPROBS
    if not asked.include_usage:
        flags |= SCAN_DROP_USAGE
    return flags
