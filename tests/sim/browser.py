"""Debian's headless Chromium driven by Playwright: the browser the pages are tested in (the
simulator's page, and the live dashboard against a running server)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = "/usr/bin/chromium"
LAUNCH_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """A headless Chromium for the module's tests."""
    if not Path(CHROMIUM).exists() or shutil.which(CHROMIUM) is None:
        pytest.fail(
            f"Chromium is required for this test and was not found at {CHROMIUM}; "
            "install Debian's package: apt-get install -y chromium"
        )
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("the 'playwright' package is required: pip install playwright")
    with sync_playwright() as playwright:
        instance = playwright.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS)
        try:
            yield instance
        finally:
            instance.close()
