"""The checks of a Responses body's fields, and the error each raises.

Owns how this front reads a field it expects (a string member, an object, an array) and the
``InvalidFrontRequest`` naming it as a dotted path (``input.3.content.0.type``), in OpenAI's
wording (``'<param>' <what is wrong>``). Pure; each module that reads the body reads its fields so.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NoReturn

from capture_proxy.core.fronts.base import InvalidFrontRequest


def fail(param: str, message: str) -> NoReturn:
    raise InvalidFrontRequest(f"'{param}' {message}", param)


def string_member(
    obj: Mapping[str, Any], key: str, path: str, *, required: bool = True
) -> str | None:
    value = obj.get(key)
    if value is None:
        if required:
            fail(f"{path}.{key}" if path else key, "is required")
        return None
    if not isinstance(value, str):
        fail(f"{path}.{key}" if path else key, f"must be a string, got {type(value).__name__}")
    return value


def as_object(value: Any, path: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        fail(path, f"must be an object, got {type(value).__name__}")
    return value


def as_list(value: Any, path: str) -> list[Any]:
    if not isinstance(value, list):
        fail(path, f"must be an array, got {type(value).__name__}")
    return value
