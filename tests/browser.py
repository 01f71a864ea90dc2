"""Headless Chromium through Playwright, for the tests of the HTML report and its screenshots.

Chromium on PATH (Debian's ``chromium``, as ``make chromium`` installs it, or Ubuntu's
``chromium-browser``) is driven by Playwright's own client (the
``testing`` extra); a test module asks for the ``browser`` fixture (one browser for the
module) and is skipped, naming what is missing, where either is absent. A page is opened
with :func:`open_page`, which records every console message and uncaught error.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from conftest import extra_reason

CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu"]
CHROMIUM_NAMES = ("chromium", "chromium-browser")  # as the Makefile's chromium target
CHROMIUM_MISSING = (
    "needs Chromium on PATH (chromium or chromium-browser: make chromium, or apt-get install "
    "chromium) for Playwright to drive"
)


def chromium_path() -> str | None:
    """The Chromium on PATH, by the first of :data:`CHROMIUM_NAMES` found."""
    return next((exe for name in CHROMIUM_NAMES if (exe := shutil.which(name))), None)


def launch(playwright: Any) -> Any:
    """Chromium, headless, as the tests and the screenshot script run it."""
    exe = chromium_path()
    if exe is None:
        raise FileNotFoundError(CHROMIUM_MISSING)
    return playwright.chromium.launch(executable_path=exe, args=CHROMIUM_ARGS)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """One headless Chromium for the test module; skipped, naming what is missing."""
    sync_api = pytest.importorskip("playwright.sync_api", reason=extra_reason("testing"))
    if chromium_path() is None:
        pytest.skip(CHROMIUM_MISSING)
    with sync_api.sync_playwright() as p:
        chromium = launch(p)
        try:
            yield chromium
        finally:
            chromium.close()


@dataclass
class Opened:
    """A page and what it said while loading: console messages (type, text) and errors."""

    page: Any
    console: list[tuple[str, str]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)

    @property
    def problems(self) -> list[str]:
        """Console errors and warnings, and uncaught exceptions."""
        said = [f"{kind}: {text}" for kind, text in self.console if kind in ("error", "warning")]
        return said + [f"uncaught: {e}" for e in self.errors]


def open_page(browser: Any, path: Path, *, width: int = 1400, height: int = 900) -> Opened:
    """``path`` (an HTML file) in a new page, loaded; console and errors recorded from the start."""
    page = browser.new_page(viewport={"width": width, "height": height})
    opened = Opened(page)
    page.on("console", lambda m: opened.console.append((m.type, m.text)))
    page.on("pageerror", lambda e: opened.errors.append(str(e)))
    page.on("request", lambda r: opened.requests.append(r.url))
    page.goto(path.resolve().as_uri(), wait_until="load")
    return opened


__all__ = [
    "CHROMIUM_ARGS",
    "CHROMIUM_MISSING",
    "CHROMIUM_NAMES",
    "Opened",
    "browser",
    "chromium_path",
    "launch",
    "open_page",
]
