"""JSON bodies: parsing a request body, and the text checks every front and the read API share.

Owns how a body's bytes become a JSON value (orjson where it parses the same as the stdlib;
strict: no NaN, no number past a double, no nesting past ``MAX_NESTING``, no lone surrogate)
and ``InvalidRequest``, the 400 that names the field. Pure; must not know any API's fields
(``core.requests`` validates chat bodies, each front its own).
"""

from __future__ import annotations

import json
import math
from typing import Any

import orjson


class InvalidRequest(ValueError):
    """A body that is not valid JSON, or not a valid captured request. ``param`` names the
    field (dotted)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    """A JSON number as a float; one past the double range (``1e400``) is refused, not made
    an infinity that JSON cannot write back (orjson would send it on as ``null``)."""
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"number {text[:40]} is out of the range of a double")
    return value


#: Digits 1-9 to 0, so that ``_LONG_NUMBER in raw.translate(...)`` finds any run of 19 digits.
_DIGITS_TO_ZERO = bytes.maketrans(b"123456789", b"000000000")
#: orjson keeps integers in [-2**63, 2**64) exact and parses any other as a float: 2**64 has 20
#: digits, but -2**63 - 1 has 19, so a body with a run of 19 digits takes the stdlib's exact
#: path (slower, and rare: token ids and counts have fewer digits).
_LONG_NUMBER = b"0" * 19


#: The stride of ``_holds_long_number``'s sample: a run of 19 digits holds a position that
#: is a multiple of 19.
_SAMPLE_STRIDE = 19
#: Past this many digits in the sample, the whole body is translated at once.
_MAX_SAMPLED_DIGITS = 64
#: A body of at most this many bytes is translated whole, not sampled: cheaper than looking
#: around each sampled digit (an engine's answer, dense with token ids and log probs: 2 us
#: against 12 for 0.9 KB).
_WHOLE_BELOW = 8192

#: Deepest nesting of arrays and objects a request may have: what orjson serialises (it
#: refuses deeper values, which is how a deep body is noticed without a walk over every
#: request); no chat request comes near it.
MAX_NESTING = 254


def _holds_long_number(raw: bytes) -> bool:
    """``_LONG_NUMBER in raw.translate(_DIGITS_TO_ZERO)``: ``raw`` holds a run of 19 digits.
    Such a run holds a position that is a multiple of 19 (``_SAMPLE_STRIDE``): only the
    digits at those positions are looked around (the 18 bytes either side hold every run of
    19 through them; the pieces are joined by a comma, so no run spans two), the whole body
    only when the sample has more than ``_MAX_SAMPLED_DIGITS``. An agent's request of tens of
    KB of text is sampled, not translated whole (each ``translate`` also costs about a
    microsecond whatever its length: one for the sample, one for the pieces); a body of at
    most ``_WHOLE_BELOW`` bytes is translated whole."""
    if len(raw) <= _WHOLE_BELOW:
        return _LONG_NUMBER in raw.translate(_DIGITS_TO_ZERO)
    sample = raw[::_SAMPLE_STRIDE].translate(_DIGITS_TO_ZERO)
    digits = sample.count(b"0")
    if not digits:
        return False
    if digits > _MAX_SAMPLED_DIGITS:
        return _LONG_NUMBER in raw.translate(_DIGITS_TO_ZERO)
    reach = len(_LONG_NUMBER) - 1
    pieces = []
    at = -1
    for _ in range(digits):
        at = sample.find(b"0", at + 1)
        p = at * _SAMPLE_STRIDE
        pieces.append(raw[max(p - reach, 0) : p + reach + 1])
    return _LONG_NUMBER in b",".join(pieces).translate(_DIGITS_TO_ZERO)


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """Parse a request body as a JSON object (strict: no NaN/Infinity). Raises InvalidRequest.

    orjson first (3-5x faster on agent histories of tens of KB); a body orjson refuses, or
    one with a 19-digit number, goes through the stdlib, which keeps big integers exact and
    names what is wrong."""
    if not _holds_long_number(raw):
        try:
            fast = orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass
        else:
            if isinstance(fast, dict):
                # orjson refuses lone surrogates but takes 1,024 levels: deeper than
                # MAX_NESTING is possible only with that many brackets. Past that many bytes,
                # orjson's write (``check_text``) tells: cheaper than counting the brackets
                # (about 3.6 against 9.6 instructions per byte on an agent's request).
                if len(raw) > MAX_NESTING:
                    check_text(fast)
                return fast
    try:
        obj = json.loads(raw, parse_constant=_reject_constant, parse_float=_finite_float)
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"request body is not UTF-8: {exc.reason}", "body") from exc
    except ValueError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}", "body") from exc
    except RecursionError as exc:
        raise InvalidRequest(
            f"request body nests too deeply; at most {MAX_NESTING} levels are accepted", "body"
        ) from exc
    if not isinstance(obj, dict):
        raise InvalidRequest(
            f"request body must be a JSON object, got {type(obj).__name__}", "body"
        )
    check_text(obj)
    return obj


def text_problem(value: Any) -> InvalidRequest | None:
    """What makes a parsed JSON value unfit to forward, store or record, or None: nesting past
    ``MAX_NESTING`` levels (``param`` ``body``), or a lone UTF-16 surrogate (JSON allows
    ``"\\ud800"``; UTF-8 cannot carry it) in a string or key (``param``: its dotted path,
    e.g. ``messages.0.content``). The one text check of every API front and the read API.
    Cheap when the value is fine (orjson's encoder refuses both); iterative otherwise."""
    try:
        orjson.dumps(value)
    except TypeError:
        pass
    else:
        return None
    depth = _nesting(value)
    if depth > MAX_NESTING:
        return InvalidRequest(
            f"request body nests {depth} levels deep; at most {MAX_NESTING} are accepted", "body"
        )
    surrogate = _lone_surrogate_path(value)
    if surrogate is not None:
        return InvalidRequest(
            f"'{surrogate}' contains a lone UTF-16 surrogate, which is not valid Unicode",
            surrogate,
        )
    return None  # orjson refused something else (an integer past 64 bits): fine


def check_text(value: Any) -> None:
    """Raises ``text_problem(value)``, if there is one."""
    problem = text_problem(value)
    if problem is not None:
        raise problem


def loads_like_stdlib(raw: bytes) -> Any:
    """``json.loads(raw)``, by orjson where that parses to the same value (3-5x faster on an
    engine answer carrying a long prompt's ids): a body with a 19-digit number (orjson makes
    a float of an integer past 64 bits) or one orjson refuses (``NaN`` literals, lone
    surrogates) takes the stdlib. Raises ValueError."""
    if not _holds_long_number(raw):
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass
    return json.loads(raw)


def _children(value: Any, path: str) -> list[tuple[str, Any]]:
    if isinstance(value, dict):
        return [(f"{path}.{k}" if path else str(k), v) for k, v in value.items()]
    if isinstance(value, list):
        return [(f"{path}.{i}" if path else str(i), v) for i, v in enumerate(value)]
    return []


def _nesting(value: Any) -> int:
    """How many arrays and objects deep ``value`` goes (without recursion)."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for _, child in _children(item, ""))
    return deepest


def _lone_surrogate_path(value: Any) -> str | None:
    """Dotted path of the first string (key or value, in document order) holding a lone
    surrogate (JSON allows ``\ud800``); walked without recursion."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            if not _encodes(item):
                return path or "body"
            continue
        if isinstance(item, dict):
            for key in item:
                if isinstance(key, str) and not _encodes(key):
                    return path or "body"
        stack.extend(reversed(_children(item, path)))
    return None


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def json_kind(value: Any) -> str:
    """What a parsed JSON value is, with its article, for messages: ``null``, ``a boolean``,
    ``a string``, ``a number``, ``an array``, ``an object``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, list):
        return "an array"
    return "an object"
