"""Headless Chromium for the viewer tests: Debian's package (scripts/install-browser), driven
by Playwright for Python through ``executable_path`` (never ``playwright install``)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")
#: As root, offline, with nothing reaching out: the flags this machine needs.
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
#: Bounded waits (ms) for navigation and selectors.
TIMEOUT_MS = 15_000


@dataclass
class Console:
    """Console errors and uncaught page errors seen while the pages ran."""

    errors: list[str] = field(default_factory=list)


@asynccontextmanager
async def chromium_page(viewport: tuple[int, int] = (1400, 900)) -> AsyncIterator[tuple]:
    """``(page, console)`` in a fresh profile (its own --user-data-dir), closed after."""
    if not CHROMIUM.exists():
        pytest.skip("chromium is not installed (scripts/install-browser)")
    playwright_api = pytest.importorskip("playwright.async_api")
    console = Console()
    profile = tempfile.mkdtemp(prefix="viewer-chromium-")
    try:
        async with playwright_api.async_playwright() as pw:
            context = await pw.chromium.launch_persistent_context(
                profile,
                executable_path=str(CHROMIUM),
                headless=True,
                args=FLAGS,
                viewport={"width": viewport[0], "height": viewport[1]},
            )
            try:
                page = context.pages[0] if context.pages else await context.new_page()
                page.set_default_timeout(TIMEOUT_MS)
                page.on(
                    "console",
                    lambda m: console.errors.append(m.text) if m.type == "error" else None,
                )
                page.on("pageerror", lambda exc: console.errors.append(str(exc)))
                yield page, console
            finally:
                await context.close()
    finally:
        shutil.rmtree(profile, ignore_errors=True)
