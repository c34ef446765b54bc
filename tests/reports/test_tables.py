"""reports.common.html_table's number kinds (no browser)."""

from __future__ import annotations

import re

import pandas as pd

from reports.common import html_table


def _cells(page: str) -> list[str]:
    return re.findall(r'<td class="num"[^>]*>([^<]*)</td>', page)


def test_counts_are_whole_numbers_and_means_keep_one_decimal():
    # the MoE view's row counts are means over the profiled steps, floats: 24,576.0 rows read as a measurement
    df = pd.DataFrame({"rows": [24576.0, 6031.5, 12.0], "us": [2292.0, 3.25, 12.0]})
    page = html_table(df, [("rows", "rows / call", "count"), ("us", "µs", "num")])
    assert _cells(page) == ["24,576", "2,292.0", "6,031.5", "3.250", "12", "12.0"]
    assert page.count('data-type="num"') == 2  # both sort as numbers
    assert 'data-v="24576.0"' in page  # the value behind the cell is unchanged


def test_the_moe_tables_show_counts_without_decimals(site):
    from reports.moe import moe_context

    # the 4-GPU level-3 run with its routing counts; test_moe_browser.py shows the same analysis (conftest.py `site`)
    ctx = moe_context(site.analysis("ep4_L3_routing").moe())
    assert "24,576.0" not in ctx["layers_table"] and ">24,576<" in ctx["layers_table"]  # rows per grouped-GEMM call
    assert "24,576.0" not in ctx["summary_table"]  # tokens per layer
