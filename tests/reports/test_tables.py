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


def test_flags_read_as_words_not_python_booleans():
    df = pd.DataFrame({"step": [3, 4], "steady": [True, False], "note": pd.Series([True, None], dtype=object)})
    page = html_table(df, [("step", "step", "count"), ("steady", "steady state", "text"), ("note", "note", "name")])
    assert re.findall(r'<td class="text">([^<]*)</td>', page) == ["yes", "no"]
    assert 'title="yes">yes</td>' in page and "True" not in page and "False" not in page


def test_the_moe_tables_show_counts_without_decimals(site):
    from reports.moe import moe_context

    # the 4-GPU level-3 run with its routing counts; test_moe_browser.py shows the same analysis (conftest.py `site`)
    ctx = moe_context(site.analysis("ep4_L3_routing").moe())
    assert "24,576.0" not in ctx["layers_table"] and ">24,576<" in ctx["layers_table"]  # rows per grouped-GEMM call
    assert "24,576.0" not in ctx["summary_table"]  # tokens per layer


# ------------------------------------------------------------------------------------------------------------------
# html_table writes its HTML without Jinja2 (faster): the same bytes as the template it replaced, kept here with
# the cell formatting it rendered

_TEMPLATE = (
    '<table class="data"><thead><tr>{% for c in cols %}<th data-type="{{ "num" if c[2] in ("num","pct","count") else "text" }}">{{ c[1] }}</th>{% endfor %}</tr></thead>'
    "<tbody>{% for r in rows %}<tr>{% for kind, text, v, title in r %}"
    '<td class="{{ kind }}"{% if v is not none %} data-v="{{ v }}"{% endif %}{% if title %} title="{{ title }}"{% endif %}>{{ text }}</td>'
    "{% endfor %}</tr>{% endfor %}</tbody></table>"
    "{% if more %}<p class=\"note\">Showing {{ shown }} of {{ total }} rows; all rows are in the CSV/Parquet tables.</p>{% endif %}"
)


def _template_table(df, columns, max_rows=200):
    """html_table as it was: a cell tuple per value, rendered by the Jinja2 template above."""
    import math

    from jinja2 import Environment, select_autoescape

    from reports.common import _clean, _fmt
    from tracelens.names import display_many

    columns = list(columns)
    head = df.head(max_rows)
    shown = {col: display_many(["" if v is None else str(v) for v in head[col]])
             for col, _, kind in columns if kind == "kernel" and col in head}
    rows = []
    for i, rec in enumerate(head.to_dict("records")):
        cells = []
        for col, _, kind in columns:
            v = rec.get(col)
            if hasattr(v, "item"):
                v = v.item()
            if kind in ("num", "pct", "count"):
                if kind == "count":
                    digits = 0 if not isinstance(v, float) or not math.isfinite(v) or v == int(v) else 1
                else:
                    digits = 1 if kind == "pct" else (3 if isinstance(v, float) and abs(v) < 10 else 1)
                cells.append(("num", _fmt(v, digits), "" if v is None else str(_clean(v) if _clean(v) is not None else ""), None))
            elif kind == "kernel" and col in shown and v is not None:
                text, full = shown[col][i]
                cells.append(("name", text, full if text != full else None, full))
            else:  # (a flag as a word: the one change since the template)
                text = ("" if v is None or (isinstance(v, float) and math.isnan(v)) else ("yes" if v else "no")
                        if isinstance(v, bool) else str(v))
                cells.append((kind, text, None, text if kind == "name" and text else None))
        rows.append(cells)
    env = Environment(autoescape=select_autoescape(["html"], default_for_string=True))
    return env.from_string(_TEMPLATE).render(cols=columns, rows=rows, more=len(df) > max_rows,
                                             shown=min(len(df), max_rows), total=len(df))


def test_the_table_is_the_templates_byte_for_byte():
    import random

    import numpy as np

    rng = random.Random(37)
    alphabet = ["a", "<", ">", "&", '"', "'", "µ", " ", "&amp;", "–", "\n", "_ZN3foo3barEv", "void k<float>(int)"]

    def text():
        return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 5)))

    kinds = ["num", "pct", "count", "name", "text", "kernel"]
    for _ in range(300):
        n = rng.randint(0, 8)
        data = {
            "f": [rng.choice([0.0, 1.5, -3.25, 24576.0, 1e-9, 123456.789, float("nan"), float("inf")]) for _ in range(n)],
            "i": np.array([rng.randint(-5, 10**7) for _ in range(n)], dtype=np.int64),
            "b": [rng.random() < 0.5 for _ in range(n)],
            "s": [text() for _ in range(n)],
            "o": pd.Series([rng.choice([None, text(), 3, 2.5, np.int64(7), np.float64(0.125)]) for _ in range(n)], dtype=object),
            "c": pd.Categorical([rng.choice(["x<y", "a&b", "k"]) for _ in range(n)]),
        }
        df = pd.DataFrame(data)
        cols = [(rng.choice(list(data) + ["missing"]), text() or "h", rng.choice(kinds)) for _ in range(rng.randint(0, 6))]
        max_rows = rng.choice([200, 3, 0])
        assert html_table(df, cols, max_rows) == _template_table(df, cols, max_rows)
