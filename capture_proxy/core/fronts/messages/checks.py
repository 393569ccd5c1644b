"""The checks of a Messages body's fields, and the error each makes.

Owns how this front reads a field it expects (a string, an object, an array, an array of
blocks, an integer, a number, a boolean) and the ``InvalidFrontRequest`` naming it as a dotted
path (``messages.3.content.1.type``), in Anthropic's wording (``<path>: <what is wrong>``).
``fail`` returns the error for the caller to raise. Pure; each module that reads the body reads
its fields so.
"""

from __future__ import annotations

from typing import Any

from capture_proxy.core.fronts.base import InvalidFrontRequest, is_int, is_number


def fail(path: str, what: str) -> InvalidFrontRequest:
    return InvalidFrontRequest(f"{path}: {what}", path)


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def as_str(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise fail(path, f"must be a string, not {_type_name(value)}")
    return value


def as_object(value: Any, path: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise fail(path, f"must be an object, not {_type_name(value)}")
    return value


def as_list(value: Any, path: str) -> list[Any]:
    if not isinstance(value, list):
        raise fail(path, f"must be an array, not {_type_name(value)}")
    return value


def as_blocks(value: Any, path: str, what: str = "content blocks") -> list[Any]:
    """The blocks of a field that is a string (the caller takes that) or an array of blocks."""
    if not isinstance(value, list):
        raise fail(path, f"must be a string or an array of {what}, not {_type_name(value)}")
    return value


def as_int(value: Any, path: str) -> int:
    if not is_int(value):
        raise fail(path, f"must be an integer, not {_type_name(value)}")
    return value


def as_number(value: Any, path: str) -> float | int:
    if not is_number(value):
        raise fail(path, f"must be a number, not {_type_name(value)}")
    return value


def as_bool(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        raise fail(path, f"must be a boolean, not {_type_name(value)}")
    return value
