"""Bubble arithmetic: the seed's example (PP=16, GA=16: 48.4 %, VPP=6: 13.5 %) and GA derivation."""

import math
import subprocess
import sys

import pytest

from tracelens.analysis.bubble import bubble_ratio, gradient_accumulation
from tracelens.errors import TraceError


def test_seed_example():
    assert round(100 * bubble_ratio("1f1b", 16, 16), 1) == 48.4
    assert round(100 * bubble_ratio("vpp", 16, 16, 6), 1) == 13.5
    assert bubble_ratio("zb1p", 16, 16) == pytest.approx(15 / (48 + 15))
    assert bubble_ratio("zbv", 4, 8) == 0.0 and math.isnan(bubble_ratio("zbv", 16, 16))
    assert bubble_ratio("gpipe", 1, 4) == 0.0


def test_ga_from_global_tokens():
    assert gradient_accumulation(4 * 1024 * 1024, 4096, 1, 64, pp=4) == (64, 16)
    with pytest.raises(TraceError, match="not divisible"):
        gradient_accumulation(1 << 20, 4096, 1, 10, pp=4)
    with pytest.raises(TraceError, match="not a multiple"):
        gradient_accumulation(1000, 4096, 1, 64, pp=16)
    with pytest.raises(TraceError, match="unknown schedule"):
        bubble_ratio("nope", 4, 4)


def test_cli():
    p = subprocess.run([sys.executable, "-m", "tracelens", "bubble", "--pp", "16", "--vpp", "6", "--ga", "16"],
                       capture_output=True, text=True)
    assert p.returncode == 0 and "48.4%" in p.stdout and "13.5%" in p.stdout


def test_cli_ga_and_global_tokens_together_is_one_line():
    """Both given: --ga won and the global batch (here GA 4, not 8) was silently not used, exit 0."""
    p = subprocess.run([sys.executable, "-m", "tracelens", "bubble", "--pp", "4", "--ga", "8", "--global-tokens", "4096",
                        "--seq", "512", "--world", "8"], capture_output=True, text=True, check=False)
    assert p.returncode == 2 and p.stdout == "" and "Traceback" not in p.stderr
    assert p.stderr == "tracelens: error: bubble: give --ga or --global-tokens (which derives the GA), not both\n"
