"""Fixtures shared by the real-browser tests of the HTML pages."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    """Where a test's screenshots go: $TRACELENS_SCREENSHOTS (to look at them), else a temporary dir."""
    d = os.environ.get("TRACELENS_SCREENSHOTS")
    out = Path(d) if d else tmp_path_factory.mktemp("screenshots")
    out.mkdir(parents=True, exist_ok=True)
    return out
