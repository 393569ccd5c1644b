"""Call records: what one captured model call is, in memory.

Owns the ``CallRecord`` data model, its status vocabulary and the diagnostics vocabulary.
It must not know how records are stored (see ``codec``) or how they were observed (see
``assembly``). Arrays are numpy arrays with fixed dtypes so that what is stored is exactly
what the engine sent.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import operator
from array import array as c_array
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

#: Version of the stored record format. Readers refuse records with a newer version.
SCHEMA_VERSION = 4

TOKEN_DTYPE = np.uint32
LOG_PROB_DTYPE = np.float32


class CallStatus(enum.StrEnum):
    """Outcome of one call, as far as capture is concerned.

    - ``complete``: the harness got its answer and the record holds all token data.
    - ``incomplete``: the harness got its answer but token data is missing or inconsistent
      (see the record's diagnostics). Never part of a chain.
    - ``failed``: the engine gave no answer (unreachable, error status, broken stream); the
      harness got an error. Never part of a chain.
    """

    COMPLETE = "complete"
    INCOMPLETE = "incomplete"
    FAILED = "failed"


class DiagnosticKind(enum.StrEnum):
    """Named conditions recorded on a call or a rollout (see DESIGN.md, diagnostics)."""

    CAPTURE_INCOMPLETE = "capture_incomplete"
    UPSTREAM_FAILED = "upstream_failed"
    STORE_FAILED = "store_failed"
    NON_FINITE_LOGPROB = "non_finite_logprob"
    ROUTED_EXPERTS_MISMATCH = "routed_experts_mismatch"
    HARNESS_NOTE_REWRITTEN = "harness_note_rewritten"
    PARENT_DIGEST_MISMATCH = "parent_digest_mismatch"
    FOREIGN_TURN = "foreign_turn_projected_portable"
    RETRY = "retry"
    PARENT_MODEL_MISMATCH = "parent_model_mismatch"
    TURN_REWRITTEN = "turn_rewritten"
    TOKEN_COUNT_MISMATCH = "token_count_mismatch"
    ROUTED_EXPERTS_UNAVAILABLE = "routed_experts_unavailable"
    #: the request declared tools the engine cannot render (Anthropic server tools, Responses
    #: hosted tools, namespaces): the model was not shown them
    TOOLS_NOT_RENDERED = "tools_not_rendered"
    #: the engine's answer ended with ``finish_reason: null``: whether the model stopped or
    #: was cut off is unknown (the call is kept complete, flagged)
    FINISH_REASON_MISSING = "finish_reason_missing"
    #: the engine aborted the generation (a pause for a weight update) and the proxy continued
    #: it tokens in once the engine served again: ``{"resumes": [{"at_token", "waited_ms",
    #: "paused", "from_version", "to_version"}]}``
    GENERATION_RESUMED = "generation_resumed"
    #: the engine aborted the generation and the proxy could not continue it (``reason``):
    #: the call is incomplete and the harness got a retryable error
    GENERATION_ABORTED = "generation_aborted"
    #: the engine's weight version changed inside a whole answer (observed versions): where
    #: is unknown, the older version is kept for every token
    WEIGHT_VERSION_CHANGED = "weight_version_changed"
    #: the prompt's image placeholder runs (``<|vision_start|><|image_pad|>...``) do not match
    #: the request's images one for one: the images' spans are unknown (the call incomplete)
    IMAGE_SPANS_UNALIGNED = "image_spans_unaligned"
    #: an image's placeholder run has another length than its processor's arithmetic gives
    #: (the engine's processor settings differ from ``image_processors``): span kept as found
    IMAGE_TOKENS_MISMATCH = "image_tokens_mismatch"
    #: a generated token's log prob above 0 (a probability above 1) by more than float
    #: rounding (``LOG_PROB_TOLERANCE``): kept as sent, ``{"positions", "values"}``
    POSITIVE_LOGPROB = "positive_logprob"
    #: a finite log prob beyond float32's range (magnitude above 3.4e38), which the float32
    #: array can only hold as +-inf: stored so, ``{"positions", "values"}`` (as sent)
    LOGPROB_OUT_OF_FLOAT32_RANGE = "logprob_out_of_float32_range"


@dataclass(frozen=True)
class Diagnostic:
    """One named condition with JSON-serialisable details (``{"reason": ...}`` and more)."""

    kind: str
    details: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "details": self.details}

    def with_call_ids_of(self, later: Diagnostic) -> Diagnostic:
        """This diagnostic with the calls ``later`` names (``details["call_ids"]``, a list of
        call ids, e.g. ``store_failed``'s lost calls) added, each once, in order; the other
        details stay this one's."""
        added = later.details.get("call_ids")
        if not isinstance(added, list):
            return self
        known = self.details.get("call_ids")
        ids = list(known) if isinstance(known, list) else []
        ids += [i for i in added if i not in ids]
        return Diagnostic(self.kind, {**self.details, "call_ids": ids})

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Diagnostic:
        return cls(kind=str(obj["kind"]), details=dict(obj.get("details") or {}))


def _empty_tokens() -> npt.NDArray[np.uint32]:
    return np.zeros(0, dtype=TOKEN_DTYPE)


def _empty_log_probs() -> npt.NDArray[np.float32]:
    return np.zeros(0, dtype=LOG_PROB_DTYPE)


@dataclass
class CallRecord:
    """One model call through a capture path, and everything the trainer needs of it.

    Token arrays (exact, as the engine reported them):
    - ``prompt_token_ids``: uint32 ``[num_prompt_tokens]``, the full prompt the engine saw.
    - ``generation_token_ids``: uint32 ``[num_generation_tokens]``, sampled ids; with vLLM
      the last one is the stop token (e.g. ``<|im_end|>``) unless the call stopped on length.
    - ``generation_log_probs``: float32 ``[num_generation_tokens]``, the log prob of each
      sampled id under the sampling distribution, as reported; non-finite values are kept
      and flagged with ``non_finite_logprob`` (``logprob_out_of_float32_range`` when the engine
      sent a finite value float32 cannot hold), positive ones with ``positive_logprob``, never
      clamped.
    - ``routed_experts``: uint8/uint16/int32 ``[num_rows, num_layers, top_k]`` or None; rows
      cover token positions ``[routed_experts_start, routed_experts_start + num_rows)`` of
      prompt + generation (vLLM omits the last sampled token's row).

    Metadata: ``created_at`` is Unix seconds when the proxy received the request;
    ``latency_ms`` the wall time until the engine's answer was complete. ``request_messages``
    and ``request_tools`` are the messages and tools as forwarded to the engine;
    ``response_message`` is the assembled assistant message (``content``,
    ``reasoning_content``, ``tool_calls``). ``parent_call_id`` is a link resolved when the call
    was captured and verified by tokens (None for a root or a refused link). ``linking`` holds
    the resolution: ``verdict`` (root | resolved | refused | unresolved), ``parent_digest``,
    ``child_digest`` (under which a child finds this call), ``request_digest``, ``reason``,
    ``harness_note`` (key of a rewritten note), ``prefill`` (True: the call continued its
    request's last, assistant, message; it offers its children the merged turn,
    ``linking.prefill``). ``retry_of``: the earlier call this one repeats.

    ``api``: the wire API the call came in on (``chat_completions`` | ``responses`` |
    ``messages``); ``request_messages`` / ``request_tools`` are always the canonical
    (chat-completions) form. ``request_received``: the body as the harness sent it, less its
    history field (``messages`` / ``input``, whose canonical form is ``request_messages``);
    None for records written before it existed. ``session_headers``: the request headers that
    name the harness's session, by lowercase name (OpenCode's ``x-session-id`` and, on a
    sub-agent's requests, ``x-parent-session-id``): only the names ``core.sessions``
    declares, each value a plain id of at most 128 characters; None when the request sent
    none, and on records written before they were kept (an additive v4 field). No other
    header is ever kept. ``sampling``: ``{"sent": {name: value},
    "engine_defaults": [name]}``, the sampling settings sent to the engine and those left to
    its defaults (``core.sampling.sampling_record``), for importance ratios.

    Schema v4 fields (None on records written before them, or where unknown):
    ``prompt_mode``: how the prompt's tokens were made (``backend_template`` |
    ``exact_tokens``). ``weight_versions``: ``[{"version": str, "start": int, "end": int}]``,
    the policy weight version of each generation token over half-open index ranges
    ``[start, end)`` of ``generation_token_ids`` (vLLM 0.32's ``WeightVersionSpan`` shape),
    in order, covering every generated token. ``weight_version_source``: how they were known
    (``engine_spans``: the engine named each token's version; ``engine_reported``: the engine
    named one version for the call; ``observed``: read from the engine around the call, so a
    change inside it is a bound, not a boundary). ``images``: the prompt's images in prompt
    order, each ``{"sha256", "media_type", "width", "height", "prompt_start",
    "prompt_end", "processor"}`` (``prompt_start``/``prompt_end``: the half-open token span
    the image's placeholder tokens occupy in ``prompt_token_ids``; ``processor``: what the
    model's processor needs to rebuild the pixel input, e.g. the grid); the bytes are stored
    once per store, content-addressed by ``sha256``.

    ``image_data``: sha256 -> the image's bytes, for the store to keep with the record (never
    part of the stored form; None on a record read back: the bytes are the store's, read by
    ``sha256``).
    """

    call_id: str
    rollout_id: str
    created_at: float
    model: str | None = None
    status: CallStatus = CallStatus.COMPLETE
    latency_ms: float | None = None
    stream: bool = False
    upstream_path: str = "/v1/chat/completions"
    api: str = "chat_completions"
    request_received: dict[str, Any] | None = None
    session_headers: dict[str, str] | None = None
    sampling: dict[str, Any] | None = None
    request_messages: list[dict[str, Any]] = field(default_factory=list)
    request_tools: list[dict[str, Any]] | None = None
    response_message: dict[str, Any] | None = None
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    http_status: int | None = None
    prompt_token_ids: npt.NDArray[np.uint32] = field(default_factory=_empty_tokens)
    generation_token_ids: npt.NDArray[np.uint32] = field(default_factory=_empty_tokens)
    generation_log_probs: npt.NDArray[np.float32] = field(default_factory=_empty_log_probs)
    routed_experts: npt.NDArray[np.integer[Any]] | None = None
    routed_experts_start: int = 0
    parent_call_id: str | None = None
    linking: dict[str, Any] | None = None
    retry_of: str | None = None
    diagnostics: list[Diagnostic] = field(default_factory=list)
    prompt_mode: str | None = None
    weight_versions: list[dict[str, Any]] | None = None
    weight_version_source: str | None = None
    images: list[dict[str, Any]] | None = None
    schema_version: int = SCHEMA_VERSION
    image_data: dict[str, bytes] | None = field(default=None, compare=False, repr=False)

    @property
    def num_prompt_tokens(self) -> int:
        return int(self.prompt_token_ids.shape[0])

    @property
    def num_generation_tokens(self) -> int:
        return int(self.generation_token_ids.shape[0])

    @property
    def linkable(self) -> bool:
        """True when the record may take part in a chain (complete token data)."""
        return self.status is CallStatus.COMPLETE

    def full_token_ids(self) -> npt.NDArray[np.uint32]:
        """prompt + generation ids, uint32 ``[num_prompt_tokens + num_generation_tokens]``."""
        return np.concatenate([self.prompt_token_ids, self.generation_token_ids])

    def replace(self, **changes: Any) -> CallRecord:
        """A copy with ``changes`` (as ``dataclasses.replace``, without its per-call walk over
        the fields: a record is copied several times per call). Raises TypeError naming an
        unknown field."""
        unknown = changes.keys() - _RECORD_FIELDS
        if unknown:
            raise TypeError(f"CallRecord has no field {sorted(unknown)[0]!r}")
        copy = object.__new__(CallRecord)
        copy.__dict__.update(self.__dict__)
        copy.__dict__.update(changes)
        return copy


_RECORD_FIELDS = frozenset(f.name for f in dataclasses.fields(CallRecord))


#: ``array.array("I")`` holds uint32 (C's unsigned int: 4 bytes on every platform we know)
_U32_ARRAY = c_array("I").itemsize == np.dtype(TOKEN_DTYPE).itemsize


def ids_array(ids: Any) -> npt.NDArray[np.uint32]:
    """``np.asarray(ids, dtype=np.uint32)`` (the same values, a writable uint32 ``[n]`` array):
    a list of Python ints (a renderer's ids) is converted through ``array('I')``, a third of
    numpy's instructions per id (a 5,203-id prompt: 1.46 M -> 0.35 M); what ``array('I')``
    refuses (a float, a value outside uint32) and anything but a list go to numpy, as they
    did."""
    if _U32_ARRAY and type(ids) is list:
        try:
            return np.frombuffer(c_array("I", ids), dtype=np.uint32)
        except (TypeError, OverflowError):
            pass
    return np.asarray(ids, dtype=np.uint32)


def as_token_array(values: Any, *, field_name: str) -> npt.NDArray[np.uint32]:
    """Convert a list of token ids to uint32 ``[n]``.

    Raises ValueError naming ``field_name`` when a value is not a non-negative integer
    below 2**32 (bools are refused too: JSON ``true`` is not a token id).
    """
    if not isinstance(values, list | tuple):
        raise ValueError(f"{field_name}: expected a list of token ids, got {type(values).__name__}")
    # Fast path (this runs on every prompt): exactly ints (no bool, no float), then a range check
    # in numpy; the per-element scan below only runs to name the offending position.
    if not values:
        return np.zeros(0, dtype=TOKEN_DTYPE)
    # (countOf compares each value's type with int by identity, in C: 2.5x faster than
    # collecting the types in a set, which is a quarter of a long prompt's conversion.)
    # ``array('I')`` refuses an int outside uint32 while it converts (OverflowError): one
    # pass, a third of ``np.fromiter``'s instructions per id (no per-element pack); the array
    # is a view of it (writable, C order, the same dtype).
    if operator.countOf(map(type, values), int) == len(values):
        try:
            if _U32_ARRAY:
                return np.frombuffer(c_array("I", values), dtype=TOKEN_DTYPE)
            return np.fromiter(values, dtype=TOKEN_DTYPE, count=len(values))
        except OverflowError:
            pass
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 2**32:
            raise ValueError(f"{field_name}[{i}]: expected a token id (uint32), got {v!r}")
    raise AssertionError("unreachable: every value was a valid token id")


def as_log_prob_array(values: list[float | None], *, field_name: str) -> npt.NDArray[np.float32]:
    """Convert log probs to float32 ``[n]``; ``None`` (JSON null, how some engines send NaN)
    becomes NaN so it is kept and flagged rather than dropped. A finite value beyond float32's
    range becomes +-inf (``log_prob_diagnostics`` names it). Raises ValueError on non-numbers.
    """
    # Fast paths (this runs on every generation): plain floats (and ints) convert in one call,
    # rounded to float32 as the per-element assignment below would; None and bad values take
    # the loop, which keeps None as NaN and names a bad position. (errstate: an overflow to
    # inf is named by a diagnostic, not a RuntimeWarning.)
    with np.errstate(over="ignore"):
        # What engines send, floats only (``countOf`` as in ``as_token_array``): each rounded
        # from its double straight to float32, the same bits as through a float64 array.
        if operator.countOf(map(type, values), float) == len(values):
            return np.fromiter(values, dtype=LOG_PROB_DTYPE, count=len(values))
        # With ints: through float64, as an int converts to float32 by way of a double (an
        # int beyond float64 takes the loop).
        if set(map(type, values)) <= {float, int}:
            try:
                return np.array(values, dtype=np.float64).astype(LOG_PROB_DTYPE)
            except OverflowError:
                pass
        out = np.empty(len(values), dtype=LOG_PROB_DTYPE)
        for i, v in enumerate(values):
            if v is None:
                out[i] = math.nan
            elif isinstance(v, bool) or not isinstance(v, int | float):
                raise ValueError(f"{field_name}[{i}]: expected a number, got {v!r}")
            else:
                try:
                    out[i] = v
                except OverflowError:  # an int beyond float64
                    out[i] = math.inf if v > 0 else -math.inf
    return out


#: How far above 0 a log prob may be and still be taken for float rounding of a log prob of 0
#: (a token of probability 1). An engine's log-softmax in float32 (``logit - logsumexp``) errs
#: by a few ulps at the logits' magnitude, and an ulp of a float32 of 30 to 60 is 1.9e-6 to
#: 3.8e-6; 1e-5 covers that, and the largest excess it lets through is a probability of
#: 1.00001, below anything a trainer's ratios resolve. Past it the value is impossible.
LOG_PROB_TOLERANCE = 1e-5
#: Most positions (and values) one log-prob diagnostic lists.
_MAX_LISTED = 16


def log_prob_diagnostics(
    array: npt.NDArray[np.float32], sent: list[float | None]
) -> list[Diagnostic]:
    """What is impossible in a generation's log probs: ``array`` (``as_log_prob_array`` of
    ``sent``, the values as the engine sent them). ``non_finite_logprob``: NaN, +-inf or null
    as sent; ``logprob_out_of_float32_range``: a finite value the float32 array holds as +-inf;
    ``positive_logprob``: above ``LOG_PROB_TOLERANCE``. Each gives ``count``, how many
    positions it has, and lists the first 16 (and the values as sent). Whole-array numpy
    checks; Python touches only the flagged positions."""
    if array.size == 0:
        return []
    # The common case in two reductions: a NaN makes the max NaN (the test fails), +inf makes
    # it inf, -inf shows in the min.
    # (The ufuncs' reduce, as ``max`` and ``min`` do, without their Python wrappers.)
    high, low = float(np.maximum.reduce(array)), float(np.minimum.reduce(array))
    if high <= LOG_PROB_TOLERANCE and low != -math.inf:
        return []
    out: list[Diagnostic] = []
    finite = np.isfinite(array)
    if not finite.all():
        non_finite: list[int] = []
        overflowed: list[int] = []
        for i in np.flatnonzero(~finite).tolist():
            v = sent[i]
            is_finite = v is not None and (isinstance(v, int) or math.isfinite(v))
            (overflowed if is_finite else non_finite).append(i)
        if non_finite:
            out.append(
                Diagnostic(
                    DiagnosticKind.NON_FINITE_LOGPROB,
                    {"positions": non_finite[:_MAX_LISTED], "count": len(non_finite)},
                )
            )
        if overflowed:
            listed = overflowed[:_MAX_LISTED]
            out.append(
                Diagnostic(
                    DiagnosticKind.LOGPROB_OUT_OF_FLOAT32_RANGE,
                    {
                        "positions": listed,
                        "values": [_reported(sent[i]) for i in listed],
                        "count": len(overflowed),
                    },
                )
            )
    positive = np.flatnonzero(array > LOG_PROB_TOLERANCE)
    if positive.size:
        listed = positive[:_MAX_LISTED].tolist()
        out.append(
            Diagnostic(
                DiagnosticKind.POSITIVE_LOGPROB,
                {
                    "positions": listed,
                    "values": [_reported(sent[i]) for i in listed],
                    "count": int(positive.size),
                },
            )
        )
    return out


def _reported(value: float | None) -> float | str | None:
    """A log prob as sent, for a diagnostic's JSON: a float; an int beyond float64 (which JSON
    writers refuse) as its sign and digit count."""
    if value is None or isinstance(value, float):
        return value
    try:
        return float(value)
    except OverflowError:
        return f"{'-' if value < 0 else ''}{len(str(abs(value)))}-digit integer"
