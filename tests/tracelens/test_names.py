"""tracelens.names (demangling, shortening, terminal safety), tracelens.progress, and where the CLI uses them."""

from __future__ import annotations

import gzip
import json
import re

import pytest
from click.testing import CliRunner

from tracelens import names as N
from tracelens import progress
from tracelens.cli import main

from ..conftest import MOE_GROUPED, MOE_LOOP, raw_events

# a name any Itanium demangler gives the same way (c++filt and __cxa_demangle agree on it)
STD = ("_ZNSt6vectorIiSaIiEE9push_backERKi", "std::vector<int, std::allocator<int> >::push_back(int const&)")


@pytest.fixture(autouse=True)
def _fresh_cache():
    N._cache.clear()
    yield
    N._cache.clear()


def test_demangle_with_cxxfilt_and_libstdcxx(monkeypatch):
    if N._cxxfilt([STD[0]]) is None:
        pytest.skip("no c++filt here")
    assert N.demangle(STD[0]) == STD[1]
    N._cache.clear()
    monkeypatch.setattr(N, "_cxxfilt", lambda names: None)  # no binutils: libstdc++ through ctypes
    if N._libstdcxx() is not None:
        assert N.demangle(STD[0]) == STD[1]
    N._cache.clear()
    monkeypatch.setattr(N, "_cxa_demangle", lambda names: None)  # neither: the pure-Python outline
    assert N.demangle(STD[0]) == "std::vector<…>"


def test_other_strings_unchanged():
    evil = "</script><img src=x onerror=alert(1)>"
    assert N.demangle_many(["aten::mm", evil, "", "_Z", "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(x)"]) == [
        "aten::mm", evil, "", "_Z", "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(x)"]
    assert N.short_name(evil * 3) == evil * 3  # not a C++ symbol: never cut
    assert N.display_name("aten::<b onmouseover=alert(1)>evil</b>" * 3)[1] == "aten::<b onmouseover=alert(1)>evil</b>" * 3


def test_real_cutlass_kernels():
    """The grouped-GEMM kernels of the real H200 trace are mangled and 1,269-1,335 characters long; no
    demangler here reads them, the outline names them and the title keeps the mangled name."""
    mangled = sorted({e["name"] for e in raw_events(MOE_GROUPED) if str(e.get("name", "")).startswith("_Z")})
    assert len(mangled) == 3 and all(len(m) > 1200 for m in mangled)
    shown = N.display_many(mangled)
    for m, (text, title) in zip(mangled, shown):
        assert text == "cutlass::device_kernel<…>"
        assert title.startswith("cutlass::device_kernel<at::cuda::detail::enable_3x_kernel_for_sm9x") and m in title


def test_short_name():
    full = ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, std::array<char*, 1ul> >"
            "(int, at::native::FillFunctor<float>, std::array<char*, 1ul>)")
    assert N.short_name(full) == "at::native::vectorized_elementwise_kernel<…>(…)"
    assert N.short_name("void (anonymous namespace)::softmax_warp_forward<float, float, float, 10, false, false>(float*, float const*, int)") \
        == "(anonymous namespace)::softmax_warp_forward<…>(…)"
    assert N.short_name("void f<int>(int)") == "void f<int>(int)"  # short enough: as it is


@pytest.mark.parametrize("raw,shown", [
    ("aten::mm\x1b[2J\x1b[31m", "aten::mm\\x1b[2J\\x1b[31m"),        # clear screen, colour
    ("k\x1b]0;owned\x07", "k\\x1b]0;owned\\x07"),                      # window title (OSC)
    ("a\u202eb", "a\\u202eb"),                                         # right-to-left override
    ("a\rb\nc\td\x7f\x9b", "a\\x0db\\x0ac\\x09d\\x7f\\x9b"),          # CR, LF, TAB, DEL, C1 CSI
    ("µs · ≈ GEMM 😀", "µs · ≈ GEMM 😀"),                              # printable text stays
])
def test_for_terminal(raw, shown):
    assert N.for_terminal(raw) == shown
    assert not re.search(r"[\x00-\x1f\x7f-\x9f]", N.for_terminal(raw))


def test_for_terminal_keeps_newlines_of_a_block():
    assert N.for_terminal("a\x1b[1m\nb\tc", keep_newlines=True) == "a\\x1b[1m\nb\tc"


def _evil_trace(tmp_path):
    doc = json.loads(gzip.decompress(MOE_LOOP.read_bytes()))
    for e in doc["traceEvents"]:
        if e.get("cat") == "kernel":
            e["name"] = "\x1b[2J\x1b]0;pwned\x07" + e["name"]
        if e.get("cat") == "cpu_op" and e.get("name") in ("aten::to", "aten::mm"):
            e["name"] = e["name"] + "\x1b[31mRED"
    p = tmp_path / "evil.json"
    p.write_text(json.dumps(doc))
    return p


@pytest.mark.parametrize("cmd", [["host"], ["analyze", "--no-report", "--no-tables"], ["roofline"]])
def test_cli_never_prints_escape_sequences(tmp_path, cmd):
    p = _evil_trace(tmp_path)
    r = CliRunner().invoke(main, cmd + [str(p)] + (["-o", str(tmp_path / "o")] if cmd[0] == "analyze" else []))
    assert r.exit_code == 0, r.output
    assert "\x1b" not in r.output and "\x07" not in r.output
    if cmd[0] == "host":
        assert "aten::to\\x1b[31mRED" in r.output  # shown, visibly


def test_cli_diff_never_prints_escape_sequences(tmp_path):
    p = _evil_trace(tmp_path)
    r = CliRunner().invoke(main, ["diff", str(MOE_LOOP), str(p), "--top", "50"])
    assert r.exit_code == 0, r.output
    assert "\x1b" not in r.output and "\\x1b[2J" in r.output


def test_progress_only_on_a_terminal(monkeypatch):
    assert progress.wanted(True) and not progress.wanted(False)
    monkeypatch.setattr("sys.stderr.isatty", lambda: True, raising=False)
    monkeypatch.setattr("sys.stdout.isatty", lambda: True, raising=False)
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("TRACELENS_PROGRESS", raising=False)
    assert progress.wanted()
    for k, v in (("CI", "true"), ("CI", "1"), ("TRACELENS_PROGRESS", "0")):
        monkeypatch.setenv(k, v)
        assert not progress.wanted()
        monkeypatch.delenv(k)
    monkeypatch.setattr("sys.stdout.isatty", lambda: False, raising=False)  # `tracelens ... > file`
    assert not progress.wanted()
    assert progress.bar(total=3, desc="x").disable


def test_open_without_a_browser_says_where(tmp_path, monkeypatch, capsys):
    from tracelens import cli

    monkeypatch.delenv("DISPLAY", raising=False)
    monkeypatch.delenv("WAYLAND_DISPLAY", raising=False)
    monkeypatch.setattr("sys.platform", "linux")
    page = tmp_path / "r.html"
    page.write_text("x")
    cli._open_report(page)
    msg = capsys.readouterr().err
    assert msg.strip() == f"no browser available: open {page.resolve().as_uri()} yourself"


def test_sweep_noise_per_trial():
    """The sweep page's repeat noise: s.e. % per trial from metrics.noise, ±2 s.e. whiskers on the chart."""
    from types import SimpleNamespace

    from reports import sweep as S

    trials = [{"id": 1, "status": "ok", "objective": 1000.0, "knobs": {"a": 1}, "metrics": {"noise": 0.004}},
              {"id": 2, "status": "ok", "objective": 1200.0, "knobs": {"a": 2}, "metrics": {"noise": 0.0}},
              {"id": 3, "status": "failed", "objective": None, "knobs": {"a": 3}, "metrics": {"noise": 0.01},
               "reason": "oom"}]
    df = S.trials_frame(trials, "tps")
    assert df["se_pct"].tolist()[0] == pytest.approx(0.4) and df["se_pct"].isna().tolist()[1:] == [True, True]
    figs = S._figures(df, [], SimpleNamespace(objective="tps", knobs={"a": [1, 2, 3]}))
    err = figs["plot-trials"]["data"][0]["error_y"]
    assert err["array"] == pytest.approx([2 * 1000 * 0.004, 0.0, 0.0]) and err["visible"] is True
