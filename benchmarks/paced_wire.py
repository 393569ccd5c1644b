"""What the paced engine (``paced_engine.py``) and the paced client (``paced_client.py``) of the
saturation bench (``saturation.py``) agree on: a tokenizer that costs nothing, the answers,
and how a request says what it wants.

The tokenizer: a message is ``<|im_start|> ROLE \\n`` + its content's ids + ``<|im_end|> \\n``,
each content id one 4-byte piece of the UTF-8 text (padded with spaces to a multiple of 4):
``int.from_bytes(piece, "big") % 150,000 + 1,000``, one vectorised numpy pass. The generation
prompt is ``<|im_start|> assistant \\n``. An answer is ``n - 1`` pieces of ``PIECES`` and
``<|im_end|>``, so the answer's text, echoed back as the assistant message, tokenizes to the
ids that were generated, and every call's prompt extends its parent's prompt and generation
token for token (the chain the proxy links and verifies), as a chat template does.

A request's last message carries ``[paced seed=S tokens=N rate=R ttft_ms=T]``: the answer's
seed and length, the stream's tokens per second and its time to first token. The client
knows every answer before it asks (``answer_text``), so it need not parse what it reads.

Must not: do I/O.
"""

from __future__ import annotations

import re
from functools import lru_cache

import numpy as np

IM_START, IM_END, NL = 151644, 151645, 198
ROLE_IDS = {"system": 8948, "user": 872, "assistant": 77091, "tool": 14172}
GENERATION_PROMPT = (IM_START, ROLE_IDS["assistant"], NL)
MODEL = "paced"

#: 256 pieces of 4 characters (3 letters and a space): an answer's pieces, its tokens.
PIECES: tuple[str, ...] = tuple(
    f"{a}{b}{c} " for a in "bcdfghlmnprstvwz" for b in "aeiou" for c in "nrst"
)[:256]
PIECE_IDS: tuple[int, ...] = tuple(
    int.from_bytes(p.encode(), "big") % 150_000 + 1_000 for p in PIECES
)
#: each piece's log prob (fixed, so a stored record can be compared exactly)
PIECE_LOG_PROBS: tuple[float, ...] = tuple(-0.125 * (1 + i % 7) for i in range(len(PIECES)))
END_LOG_PROB = -0.0625

_DIRECTIVE = re.compile(r"\[paced seed=(\d+) tokens=(\d+) rate=([0-9.]+) ttft_ms=([0-9.]+)\]")


def content_ids(text: str) -> np.ndarray:
    """The ids of a message's content (int64[ceil(len(utf8) / 4)])."""
    raw = text.encode()
    if len(raw) % 4:
        raw += b" " * (4 - len(raw) % 4)
    return np.frombuffer(raw, dtype=">u4").astype(np.int64) % 150_000 + 1_000


def prompt_ids(messages: list[dict]) -> np.ndarray:
    """The prompt of a chat request (int64[n]), the generation prompt at its end."""
    parts = []
    for m in messages:
        content = m.get("content")
        text = content if isinstance(content, str) else ""
        parts += [
            np.array([IM_START, ROLE_IDS.get(m.get("role", "user"), 872), NL], dtype=np.int64),
            content_ids(text),
            np.array([IM_END, NL], dtype=np.int64),
        ]
    parts.append(np.array(GENERATION_PROMPT, dtype=np.int64))
    return np.concatenate(parts)


@lru_cache(maxsize=4096)
def answer_pieces(seed: int, tokens: int) -> tuple[int, ...]:
    """The piece indexes of an answer of ``tokens`` tokens (``tokens - 1`` pieces; the last
    token is ``<|im_end|>``)."""
    rng = np.random.default_rng(seed)
    return tuple(int(i) for i in rng.integers(0, len(PIECES), max(0, tokens - 1)))


def answer_text(seed: int, tokens: int) -> str:
    return "".join(PIECES[i] for i in answer_pieces(seed, tokens))


def answer_ids(seed: int, tokens: int) -> list[int]:
    return [PIECE_IDS[i] for i in answer_pieces(seed, tokens)] + [IM_END]


def answer_log_probs(seed: int, tokens: int) -> list[float]:
    return [PIECE_LOG_PROBS[i] for i in answer_pieces(seed, tokens)] + [END_LOG_PROB]


def directive(seed: int, tokens: int, rate: float, ttft_ms: float) -> str:
    return f"[paced seed={seed} tokens={tokens} rate={rate:g} ttft_ms={ttft_ms:g}]"


def parse_directive(text: str) -> tuple[int, int, float, float] | None:
    """(seed, tokens, tokens per second, time to first token in ms) of a message's text."""
    m = _DIRECTIVE.search(text)
    if m is None:
        return None
    return int(m[1]), int(m[2]), float(m[3]), float(m[4])
