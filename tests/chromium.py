"""The browser that tests drive: Debian's chromium through Playwright's Python package, never a
downloaded browser (scripts/chromium.sh installs it; CI always runs it)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")


def browser_missing() -> str | None:
    """Why a browser check cannot run here (None: it can). Under CI it must."""
    if not CHROMIUM.exists():
        return f"{CHROMIUM} is missing (install it with scripts/chromium.sh)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright package is missing (pip install -e '.[dev]')"
    return None


def require_browser() -> None:
    """Skip the calling test without a browser, or fail it under CI=true."""
    missing = browser_missing()
    if missing is None:
        return
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"a browser check cannot be skipped under CI=true: {missing}")
    pytest.skip(missing)
