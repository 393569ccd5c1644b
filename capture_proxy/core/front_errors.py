"""The fronts' client error, below every front module (``core.images`` raises it too).

Must not import anything of the project: ``core.images`` (imported by the fronts) builds on it.
"""

from __future__ import annotations


class InvalidFrontRequest(ValueError):
    """A request body that its API does not allow; ``param`` names the field (dotted path).
    The client gets a 400 in its API's error shape; nothing is forwarded."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param
