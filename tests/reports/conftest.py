"""Fixtures shared by the real-browser tests of the HTML pages."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def shots() -> Path | None:
    """Where the tests' screenshots go: $TRACELENS_SCREENSHOTS, to look at them; None (no screenshots) when it is
    unset. A screenshot is for a person, never checked: a full page and each of its sections cost Chromium more
    time than every check of the page together (test_layout_browser.py: ~50 of its ~90 s), so a plain run
    takes none."""
    d = os.environ.get("TRACELENS_SCREENSHOTS")
    if not d:
        return None
    out = Path(d)
    out.mkdir(parents=True, exist_ok=True)
    return out
