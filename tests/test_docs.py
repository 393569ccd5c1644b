"""The README and the documentation site (``docs/``) say what the code does.

Checked here: the README stays short and opens with the two commands; every relative link in
the README resolves (file and anchor; MkDocs checks the site's own links when it builds); the
site builds strictly with the configuration reference generated from the settings class; and
every path, ``serve`` flag and ``CAPTURE_PROXY_*`` variable the pages name exists.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from markdown.extensions.toc import slugify

from capture_proxy.cli.parser import build_parser
from capture_proxy.config import ENV_NOT_SETTINGS, Settings

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
PAGES = sorted(DOCS.glob("*.md"))
TWO_COMMANDS = [
    "scripts/setup && .venv/bin/capture-proxy demo",
    "scripts/test",
]


def _hook() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "settings_reference", DOCS / "hooks" / "settings_reference.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _serve_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def _anchors(page: Path) -> set[str]:
    """The heading anchors MkDocs gives a page (Python-Markdown's toc slugify)."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {
        slugify(re.sub(r"[`*]", "", m.group(1)).strip(), "-")
        for m in re.finditer(r"^#{1,6} (.+)$", text, flags=re.M)
    }


def test_the_readme_is_short_and_opens_with_the_two_commands():
    text = README.read_text()
    assert len(text.splitlines()) < 150
    first_block = re.search(r"```bash\n(.*?)```", text, flags=re.S)
    # At the very top: the title, then the block.
    assert first_block is not None and text.startswith("# capture-proxy\n\n```bash\n")
    commands = [line.split("#")[0].strip() for line in first_block.group(1).splitlines()]
    assert commands == TWO_COMMANDS
    for script in ("scripts/setup", "scripts/test"):
        assert os.access(ROOT / script, os.X_OK), script
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert "demo" in sub.choices
    # The harness table: one row per harness, each with the capture path.
    rows = [line for line in text.splitlines() if line.startswith("| ") and "/ng-rollout/" in line]
    assert [r.split("|")[1].strip().split(" (")[0] for r in rows] == [
        "OpenCode",
        "Codex CLI",
        "Claude Code",
    ]


def test_every_readme_link_resolves_to_a_file_and_anchor():
    links = re.findall(r"\]\(([^)]+)\)", README.read_text())
    assert len(links) >= len(PAGES) - 1
    for link in links:
        assert not link.startswith(("http:", "https:", "/")), link
        target, _, anchor = link.partition("#")
        path = ROOT / target
        assert path.exists(), link
        if anchor:
            assert anchor in _anchors(path), link


def test_every_page_is_in_the_nav_and_nav_names_only_pages():
    nav = re.findall(r"^\s*- [^:]+: (\S+\.md)$", (ROOT / "mkdocs.yml").read_text(), flags=re.M)
    assert sorted(nav) == sorted(p.name for p in PAGES)


def test_the_reference_lists_every_setting_with_type_default_env_flag_and_description():
    rows = {row["name"]: row for row in _hook().reference_rows()}
    assert list(rows) == list(Settings.model_fields)
    for name, row in rows.items():
        assert row["env"] == f"CAPTURE_PROXY_{name.upper()}"
        assert row["type"] and row["default"], name
        assert row["description"], f"{name} has no description in capture_proxy/config/fields.py"
    assert rows["port"] == {
        "name": "port",
        "type": "integer (>= 0, <= 65535)",
        "default": "8080",
        "env": "CAPTURE_PROXY_PORT",
        "flag": "--port",
        "description": "listen port; 0: a free port",
    }
    assert rows["backend"]["default"] == "(required)"
    assert rows["store_synchronous"]["type"] == '"full" | "normal"'
    assert rows["max_request_body_bytes"]["default"] == "67108864 (64 MiB)"
    assert rows["captures_token"]["type"] == "secret string | None"
    assert rows["allow_unauthenticated_read_api"]["flag"] == "--insecure-read-api"
    assert rows["tokens_in_dialect"]["flag"] == "--tokens-in"
    assert rows["proxy_token"]["flag"] == "--proxy-token"  # issue 26: serve --help names it
    assert rows["allowed_hosts"]["flag"] == "--allowed-host"


def test_every_serve_flag_sets_a_setting_or_is_named_as_not_one():
    flags = _hook().serve_flags(build_parser())
    options = {
        action.dest
        for action in _serve_parser()._actions
        if action.dest not in _hook().FLAGS_NOT_SETTINGS
    }
    assert len(flags) == len(options)
    assert set(flags) <= set(Settings.model_fields)


def test_the_site_builds_strictly_with_the_generated_reference(tmp_path: Path):
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    page = (tmp_path / "configuration" / "index.html").read_text()
    assert "settings-reference -->" not in page
    for name in Settings.model_fields:
        row = re.search(rf'<tr id="setting-{name}">(.*?)</tr>', page, flags=re.S)
        assert row is not None, name
        assert f"<code>CAPTURE_PROXY_{name.upper()}</code>" in row.group(1)
    assert not (tmp_path / "hooks").exists()


@pytest.mark.parametrize("page", [README, *PAGES], ids=lambda p: p.name)
def test_every_path_the_docs_name_exists(page: Path):
    text = page.read_text()
    named = re.findall(
        r"(?<![\w/.$-])((?:scripts|benchmarks|tests|configs|capture_proxy|harness_notes|docs)"
        r"/[\w./*{},-]*)",
        text,
    )
    for path in named:
        path = path.rstrip(".,")
        brace = re.search(r"\{([^}]*)\}", path)
        variants = (
            [path[: brace.start()] + v + path[brace.end() :] for v in brace.group(1).split(",")]
            if brace
            else [path]
        )
        for variant in variants:
            assert glob.glob(str(ROOT / variant)), f"{page.name} names {variant}"


@pytest.mark.parametrize("page", [README, *PAGES], ids=lambda p: p.name)
def test_every_serve_flag_the_docs_name_exists(page: Path):
    options = {s for a in _serve_parser()._actions for s in a.option_strings}
    text = page.read_text()
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    spans = re.findall(r"`([^`]*)`", prose) + re.findall(
        r"^.*capture-proxy serve.*$", text, flags=re.M
    )
    named = {
        flag
        for span in spans
        if re.search(r"(^|\s)serve\s", span)
        for flag in re.findall(r"(?<![\w-])--[a-z][a-z-]*", span.split("serve", 1)[1])
    }
    assert named - options == set(), page.name


@pytest.mark.parametrize("page", [README, *PAGES], ids=lambda p: p.name)
def test_every_environment_variable_the_docs_name_is_read(page: Path):
    known = {f"CAPTURE_PROXY_{n.upper()}" for n in Settings.model_fields} | ENV_NOT_SETTINGS
    named = set(re.findall(r"CAPTURE_PROXY_[A-Z0-9_]*[A-Z0-9]", page.read_text()))
    assert named - known == set(), page.name


def test_the_handoff_page_names_every_export_column_and_the_schema_metadata():
    from capture_proxy.core.export import SCHEMA, SCHEMA_METADATA

    text = (DOCS / "handoff.md").read_text()
    missing = [f.name for f in SCHEMA if f"`{f.name}`" not in text]
    assert missing == []
    assert "is empty" not in text
    for key, value in SCHEMA_METADATA.items():
        assert f'b"{key}": b"{value}"' in text


def test_the_development_page_names_every_extra():
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    text = (DOCS / "development.md").read_text()
    assert [e for e in extras if e != "test" and f"`[{e}]`" not in text] == []


def test_the_harnesses_page_names_where_the_recordings_are_and_what_replay_proxy_cannot_do():
    text = (DOCS / "harnesses.md").read_text()
    assert "`tests/fixtures/opencode/logs/`" in text
    assert (ROOT / "tests/fixtures/opencode/logs").is_dir()
    assert "cannot reproduce the recorded chains" in text


def test_the_committed_configuration_reference_is_current():
    """docs/configuration.md reads as Markdown in the repository: the table is committed and
    matches capture_proxy/config/fields.py (regenerate: python docs/hooks/settings_reference.py)."""
    text = (DOCS / "configuration.md").read_text()
    assert _hook().with_reference(text) == text
    assert '<tr id="setting-uncaptured_generation">' in text


def test_the_development_page_names_the_scripted_engines_model_and_its_404():
    from capture_proxy.scripted_engine.state import ScriptedEngineConfig

    text = (DOCS / "development.md").read_text()
    name = ScriptedEngineConfig().model_name
    assert f"It serves the model `{name}`" in text
    assert f'does not exist. Valid aliases:\n{name}.", "type": "NotFoundError"' in text
