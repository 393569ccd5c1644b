"""Credentials out of text: the one place that masks the secrets a URL may carry.

Owns how a URL with user info (``http://user:PASSWORD@host``, ``postgresql://u:p@db/x``) is
shown: ``user:***@host``. ``redact_url`` masks one URL; ``redact_text`` masks every URL with a
password inside a message (an exception's text, a log line, an error body, a stored failure
reason). ``split_credentials`` takes the user info out of a URL so that the rest of the proxy
never holds it (the engine's credentials become one header, ``basic_auth_header``).
``RedactingFilter`` applies ``redact_text`` to every log line. Pure: no I/O; must not log.
"""

from __future__ import annotations

import base64
import functools
import logging
import re
import urllib.parse

MASK = "***"

#: ``scheme://user:password@`` inside any text (the password: no ``@``, ``/`` or whitespace).
_USERINFO_RE = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^\s:/@]*):(?P<secret>[^\s@/]*)@")


def redact_url(url: str) -> str:
    """``url`` with its password replaced by ``***`` (unchanged when it has none)."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    if parts.port is not None:
        host += f":{parts.port}"
    netloc = f"{parts.username or ''}:{MASK}@{host}"
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def redact_text(text: str) -> str:
    """``text`` with the password of every ``scheme://user:password@`` in it masked."""
    if "@" not in text:
        return text
    return _USERINFO_RE.sub(lambda m: f"{m['head']}:{MASK}@", text)


@functools.lru_cache(maxsize=64)
def split_credentials(url: str) -> tuple[str, str | None, str | None]:
    """``(url without user info, username, password)``; the names are percent-decoded (as
    user agents send them). ``username`` and ``password`` are None when absent. Cached: the
    backend URL is split on every engine request."""
    parts = urllib.parse.urlsplit(url)
    if parts.username is None and parts.password is None:
        return url, None, None
    netloc = parts.netloc.rpartition("@")[2]
    bare = urllib.parse.urlunsplit(parts._replace(netloc=netloc))
    user = urllib.parse.unquote(parts.username or "")
    password = None if parts.password is None else urllib.parse.unquote(parts.password)
    return bare, user, password


def basic_auth_header(username: str, password: str | None) -> str:
    """RFC 7617 ``Authorization`` value: ``Basic base64(user:password)`` (UTF-8)."""
    raw = f"{username}:{password or ''}".encode()
    return "Basic " + base64.b64encode(raw).decode("ascii")


class RedactingFilter(logging.Filter):
    """A log filter masking URL passwords in every record's final message (installed on the
    process's log handlers by ``serve``): a library's message that quotes a URL with user
    info cannot write the password to the log."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        masked = redact_text(message)
        if masked != message:
            record.msg, record.args = masked, None
        return True
