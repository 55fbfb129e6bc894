"""A real headless Chromium (Debian's ``chromium`` package) driven by playwright, one for this package.

Playwright's own browser download is never used: the system browser is its executable. Each test
gets a fresh page; a screenshot of it is saved under the test's tmp dir when the test ends.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


@pytest.fixture(scope="package")
def browser() -> Iterator[Any]:
    """One Chromium for every browser test (each test still gets a fresh context and page): a
    launch costs about a second of the suite's CPU. Closed when this package's tests end, not the
    session's: playwright's sync API leaves its event loop running on the main thread while it is
    open, and a later test's ``asyncio.run`` then refuses to start (seen with tests/server after
    tests/web)."""
    if not os.path.exists(CHROMIUM):
        pytest.fail("chromium is not installed (apt-get install -y chromium; `make system-deps` does it)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield b
        b.close()


@pytest.fixture
def page(browser: Any, tmp_path: Path) -> Iterator[Any]:
    """A fresh browser page (its own sessionStorage); screenshot saved as ``tmp_path/page.png``."""
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    p = context.new_page()
    errors: list[str] = []
    p.on("pageerror", lambda e: errors.append(str(e)))
    yield p
    try:
        p.screenshot(path=str(tmp_path / "page.png"), full_page=True)
    finally:
        context.close()
    assert not errors, f"JavaScript errors on the page: {errors}"
