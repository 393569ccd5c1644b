"""Credentials out of text: the one place that masks the secrets a URL may carry.

Owns how a URL with user info (``http://user:PASSWORD@host``, ``postgresql://u:p@db/x``) is
shown: ``user:***@host``. ``redact_url`` masks one URL; ``redact_text`` masks every URL with a
password inside a message (an exception's text, a log line, an error body, a stored failure
reason). ``split_credentials`` takes the user info out of a URL so that the rest of the proxy
never holds it (the engine's credentials become one header, ``basic_auth_header``).
``RedactingFilter`` applies ``redact_text`` to every log line. ``redact_headers`` and
``redact_query`` mask what a recorded request (``serve --record-dir``) may carry: the value of
every header and query parameter whose name says it holds a credential (``secret_name``).
Pure: no I/O; must not log.
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
        # The message as formatted here is kept (masked or not), so the handler's formatter
        # does not format it again (``getMessage`` of a record without args is its msg).
        record.msg, record.args = redact_text(record.getMessage()), None
        return True


#: What replaces a credential's value in a recording (headers as is; in a query percent-encoded,
#: so the recorded path stays a valid request target).
REDACTED = "<redacted>"
REDACTED_IN_QUERY = "%3Credacted%3E"
#: A header or query parameter whose name (lower-cased, ``-``/``_`` kept) contains one of these
#: holds a credential: ``Authorization``, ``Proxy-Authorization``, ``x-api-key``, ``api-key``,
#: ``X-Goog-Api-Key``, ``Cookie``, ``X-Custom-Token``, ``?key=``, ``?api_key=``,
#: ``?access_token=``, ``?client_secret=``, ``?password=``, ``X-Amz-Security-Token``,
#: ``X-Amz-Signature``... Broad on purpose: a harmless value masked costs a recording little,
#: a credential kept leaks it (``Idempotency-Key`` or ``?author=`` are masked too).
SECRET_NAME_PARTS = (
    "token",
    "secret",
    "key",
    "auth",
    "passw",
    "pwd",
    "cookie",
    "credential",
    "signature",
)
#: Whole names that hold a credential without saying so: Azure SAS and similar ``?sig=``.
SECRET_NAMES = frozenset({"sig"})


def secret_name(name: str) -> bool:
    """True when a header or query parameter named ``name`` holds a credential (case-blind)."""
    lowered = name.lower()
    return lowered in SECRET_NAMES or any(part in lowered for part in SECRET_NAME_PARTS)


def redact_headers(headers: list[tuple[str, str]]) -> list[list[str]]:
    """``[name, value]`` pairs in the order given, the value of each ``secret_name`` header
    replaced by ``<redacted>`` (names kept: a replay still sees which headers were sent)."""
    return [[name, REDACTED if secret_name(name) else value] for name, value in headers]


def redact_query(target: str) -> str:
    """A request target (``/path?query``, as received) with the value of each query parameter
    whose name is a ``secret_name`` replaced by ``%3Credacted%3E``; everything else byte for
    byte (order, encoding, empty and bare parameters). A name is read percent-decoded
    (``api%5Fkey`` is ``api_key``); a parameter with no ``=`` has no value to mask."""
    path, sep, query = target.partition("?")
    if not sep or not query:
        return target
    query, hash_sep, fragment = query.partition("#")
    pieces = query.split("&")
    changed = False
    for i, piece in enumerate(pieces):
        name, eq, value = piece.partition("=")
        if eq and value and secret_name(urllib.parse.unquote_plus(name)):
            pieces[i] = f"{name}={REDACTED_IN_QUERY}"
            changed = True
    if not changed:
        return target
    return f"{path}?{'&'.join(pieces)}{hash_sep}{fragment}"
