"""MkDocs hook: the configuration reference, generated from the settings class at build time.

Owns the table between the markers ``<!-- settings-reference -->`` and
``<!-- /settings-reference -->`` in ``docs/configuration.md`` (committed, so the page reads as
Markdown in the repository; ``python docs/hooks/settings_reference.py`` regenerates it, a test
checks it is current, and the build writes it fresh): one row per field of
``capture_proxy.config.Settings`` with its type (and bounds), default, environment variable
(``CAPTURE_PROXY_<NAME>``), the ``serve`` flag that sets it (read from
``capture_proxy.cli.parser.build_parser``) and its description. It must not hold any
setting's facts itself: a fact about a setting belongs in the field's ``description``, so the
reference and the code cannot drift apart.

Hook API (MkDocs >= 1.4): ``on_page_markdown(markdown, page, config, files)``.
"""

from __future__ import annotations

import argparse
import html
import json
import types
import typing
from pathlib import Path
from typing import Any

from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

MARKER = "<!-- settings-reference -->"
END_MARKER = "<!-- /settings-reference -->"
PAGE = "configuration.md"

#: ``serve`` flags whose argparse dest is not the setting's name.
FLAG_DEST_TO_SETTING = {"insecure_read_api": "allow_unauthenticated_read_api"}
#: ``serve`` options that are not settings (they steer the command, not the proxy).
FLAGS_NOT_SETTINGS = frozenset({"help", "port_file", "read_only", "config"})

_NAMES = {
    str: "string",
    int: "integer",
    float: "number",
    bool: "boolean",
    Path: "path",
}


def type_name(annotation: Any) -> str:
    """A reader's name for a field's type: ``"full" | "normal"``, ``integer | None``,
    ``dict[string, path]``. Raises TypeError for a type it cannot name."""
    if annotation is type(None):
        return "None"
    if annotation in _NAMES:
        return _NAMES[annotation]
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is dict:
        return f"dict[{type_name(args[0])}, {type_name(args[1])}]"
    if origin is list:
        return f"list[{type_name(args[0])}]"
    if origin is tuple:
        return f"[{', '.join(type_name(a) for a in args)}]"
    name = getattr(annotation, "__name__", "")
    if name == "AnyHttpUrl":
        return "URL"
    if name == "SecretStr":
        return "secret string"
    raise TypeError(f"no reader's name for the type {annotation!r}")


def bounds(field: FieldInfo) -> str:
    """The field's numeric bounds as text (``0 <= value <= 65535``), or ``""``."""
    parts = []
    for item in field.metadata:
        for attr, op in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            value = getattr(item, attr, None)
            if value is not None:
                parts.append(f"{op} {value}")
    return ", ".join(parts)


def default_text(field: FieldInfo) -> str:
    """The default as it would be written in the TOML file, ``(required)`` or ``unset``."""
    if field.is_required():
        return "(required)"
    value = field.default_factory() if field.default_factory else field.default  # type: ignore[call-arg]
    if value is PydanticUndefined or value is None:
        return "unset"
    if isinstance(value, Path):
        return f'"{value}"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, int) and value >= 1024 * 1024 and value % (1024 * 1024) == 0:
        return f"{value} ({value // (1024 * 1024)} MiB)"
    return json.dumps(value)


def serve_flags(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Setting name -> the ``capture-proxy serve`` flag that sets it. Raises ValueError for a
    serve option that is neither a setting nor listed in ``FLAGS_NOT_SETTINGS``."""
    from capture_proxy.config import Settings

    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    serve = sub.choices["serve"]
    flags: dict[str, str] = {}
    for action in serve._actions:
        if action.dest in FLAGS_NOT_SETTINGS:
            continue
        setting = FLAG_DEST_TO_SETTING.get(action.dest, action.dest)
        if setting not in Settings.model_fields:
            raise ValueError(f"serve option {action.option_strings} sets no setting")
        flags[setting] = max(action.option_strings, key=len)
    return flags


def reference_rows() -> list[dict[str, str]]:
    """One row per setting, in the class's order: name, type, default, env, flag,
    description (every value a plain string; ``flag`` may be empty)."""
    from capture_proxy.cli.parser import build_parser
    from capture_proxy.config import Settings

    flags = serve_flags(build_parser())
    rows = []
    for name, field in Settings.model_fields.items():
        kind = type_name(field.annotation)
        limits = bounds(field)
        rows.append(
            {
                "name": name,
                "type": f"{kind} ({limits})" if limits else kind,
                "default": default_text(field),
                "env": f"CAPTURE_PROXY_{name.upper()}",
                "flag": flags.get(name, ""),
                "description": field.description or "",
            }
        )
    return rows


def reference_html() -> str:
    """The reference as an HTML table (cells hold ``|`` and ``<``, which a Markdown table
    would misread)."""
    head = ("setting", "type", "default", "environment", "serve flag", "description")
    lines = [
        '<table class="settings-reference">',
        "<thead><tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr></thead>",
        "<tbody>",
    ]
    for row in reference_rows():
        code = ("name", "type", "default", "env", "flag")
        cells = [
            f"<code>{html.escape(row[k])}</code>" if row[k] and k in code else html.escape(row[k])
            for k in ("name", "type", "default", "env", "flag", "description")
        ]
        lines.append(
            f'<tr id="setting-{row["name"]}">' + "".join(f"<td>{c}</td>" for c in cells) + "</tr>"
        )
    lines += ["</tbody>", "</table>"]
    return "\n".join(lines)


def with_reference(markdown: str) -> str:
    """``markdown`` with the table between ``MARKER`` and ``END_MARKER`` made fresh (the
    committed page holds it too, so it reads as Markdown in the repository). Raises ValueError
    when the page lost its marker."""
    if MARKER not in markdown:
        raise ValueError(f"{PAGE} lost its marker {MARKER}")
    head, _, rest = markdown.partition(MARKER)
    tail = rest.partition(END_MARKER)[2] if END_MARKER in rest else rest
    return f"{head}{MARKER}\n{reference_html()}\n{END_MARKER}{tail}"


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if page.file.src_uri != PAGE:
        return markdown
    try:
        # The built page keeps no markers: they are for the committed file.
        fresh = with_reference(markdown)
        return fresh.replace(MARKER + "\n", "").replace("\n" + END_MARKER, "")
    except ValueError as exc:
        from mkdocs.exceptions import PluginError

        raise PluginError(str(exc)) from exc


if __name__ == "__main__":
    # Regenerate the committed table: python docs/hooks/settings_reference.py
    page = Path(__file__).resolve().parent.parent / PAGE
    page.write_text(with_reference(page.read_text()))
