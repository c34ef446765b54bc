"""Trace times are exact nanoseconds at every magnitude, the same through every decoder (issue 31 #15).

The rule (`tracelens/io/timestamps.py`): a `ts`/`dur` is its JSON text's exact decimal value times 1000,
rounded half to even; |value| >= 2**53 us is no time (the event is dropped). Every path is checked
against a reference computed here with `decimal` on the text: the compiled scanner, the msgspec path,
its vectorized and scalar text readers, and flow events. Then a real trace moved to an epoch clock (+1.7e15 us) with sub-ns digits
and exponent forms written into its JSON must give the same analysis as the original.
"""

from __future__ import annotations

import decimal
import gzip
import json
import re
from decimal import ROUND_HALF_EVEN, Decimal
from pathlib import Path

import msgspec
import numpy as np
import pyarrow as pa
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tracelens
from tracelens.io import kineto as K
from tracelens.io import timestamps as T
from tracelens.io.checks import UNREPRESENTABLE

from ..conftest import MOE_LOOP, NCCL_2RANK

PROPS = settings(max_examples=300, deadline=None, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.too_slow])


def reference_ns(text: str) -> int | None:
    """Exact nanoseconds of a JSON number of microseconds, rounded half to even; None past 2**53 us."""
    with decimal.localcontext() as c:
        c.prec, c.Emax, c.Emin = 64 + len(text), decimal.MAX_EMAX, decimal.MIN_EMIN
        d = Decimal(text)
        if abs(d) >= 2**53:
            return None
        return int((d * 1000).to_integral_value(rounding=ROUND_HALF_EVEN))


def _ref_or_marker(text: str) -> int:
    ns = reference_ns(text)
    return UNREPRESENTABLE if ns is None else ns


# ------------------------------------------------------------------------------ generated numbers

EPOCH_US = st.integers(1_600_000_000_000_000, 1_800_000_000_000_000)  # 2020-2027 in us since 1970
EDGES = st.sampled_from([0, 1, 2**40 - 1, 2**40, 2**41, 2**42 - 1, 2**42, 2**52 - 1, 2**52, 2**52 + 1,
                         2**53 - 2, 2**53 - 1, 2**53, 2**53 + 1, 9007199254740, 10**16, 10**17])
WHOLE = st.one_of(st.integers(0, 2**53 + 2), EPOCH_US, EDGES, st.integers(0, 10**6))
FRACTION = st.one_of(
    st.just(""),
    st.text("0123456789", min_size=1, max_size=3),  # what Kineto writes
    st.text("0123456789", min_size=4, max_size=14),
    # ties and the digits around them: .0005 -> 0 ns, .0015 -> 2 ns, .00050001 -> 1 ns
    st.sampled_from(["5", "0005", "0015", "0025", "9995", "4999999", "5000000001", "0004999", "00050000", "999",
                     "9999999", "0000001"]),
)


# The strategies a composite draws from are built once, here: a strategy built inside the draw (from_regex
# above all) is validated again on every draw, which took 3/4 of this file's time.
SIGN = st.sampled_from(["", "", "-"])
DIGITS = st.one_of(st.from_regex(r"[1-9][0-9]{0,20}", fullmatch=True),
                   st.sampled_from(["17", "1700000000000123456789", "90071992547409935", "5", "15"]))
EXPONENT = st.integers(-30, 20)
EXP_SIGN = st.sampled_from(["", "-"])
EXP_MARKER = st.sampled_from(["e", "E", "e+", "E-", "e-"])


@st.composite
def plain_numbers(draw) -> str:
    sign = draw(SIGN)
    whole, frac = draw(WHOLE), draw(FRACTION)
    return f"{sign}{whole}" + (f".{frac}" if frac else "")


@st.composite
def exponent_numbers(draw) -> str:
    """The same values and others in exponent form (JSON allows 1.7e15, 17E+14, 17e-1; both decoders read them)."""
    digits = draw(DIGITS)
    exp = draw(EXPONENT)
    sign = draw(EXP_SIGN)
    point = draw(st.integers(1, len(digits)))
    mantissa = digits[:point] + (f".{digits[point:]}" if point < len(digits) else "")
    marker = draw(EXP_MARKER)
    if marker.endswith("-"):
        exp = -abs(exp)
    elif marker.endswith("+"):
        exp = abs(exp)
    return f"{sign}{mantissa}{marker}{abs(exp) if marker[-1] in '+-' else exp}"


NUMBERS = st.one_of(plain_numbers(), plain_numbers(), exponent_numbers())


def test_the_reference_reads_the_nasty_ones_as_intended():
    assert reference_ns("1732662400123456.789") == 1732662400123456789  # 2**50.6 us: a double's step is 0.25 us
    assert reference_ns("9007199254740.993") == 2**53 + 1  # 2**53 + 1 ns: no double holds it
    assert reference_ns("0.0005") == 0 and reference_ns("0.0015") == 2 and reference_ns("-0.0015") == -2
    assert reference_ns("1.7e15") == 1_700_000_000_000_000_000
    assert reference_ns(str(2**53 - 1)) == (2**53 - 1) * 1000
    assert reference_ns(str(2**53)) is None and reference_ns(str(2**53 + 1)) is None


# ------------------------------------------------------------------------------ the text readers


@PROPS
@given(st.lists(NUMBERS, min_size=1, max_size=40))
def test_text_readers_give_the_reference(texts):
    want = [_ref_or_marker(t) for t in texts]
    assert [T.from_text(t) for t in texts] == want
    assert T.from_texts([t.encode() for t in texts], absent=-1).tolist() == want  # vectorized plain forms, scalar others
    raws = msgspec.json.decode(("[" + ",".join(texts) + "]").encode(), type=list[msgspec.Raw])
    assert T.from_texts(raws, absent=-1).tolist() == want  # as the msgspec path hands them


def test_text_readers_past_any_double():
    texts = ["1" + "0" * 400, "1e999999999999", "-1e999999999999", "1e-999999999999", "0e999999999999",
             "0." + "0" * 300 + "1", "1234.0005" + "0" * 200 + "1", "1234.0005" + "0" * 200,
             "1234.0015" + "0" * 200, "12." + "9" * 60, "-0", "-0.0004999"]
    want = [UNREPRESENTABLE, UNREPRESENTABLE, UNREPRESENTABLE, 0, 0, 0, 1234001, 1234000, 1234002, 13000, 0, 0]
    assert [T.from_text(t) for t in texts] == want
    assert T.from_texts([t.encode() for t in texts], absent=-1).tolist() == want


def test_absent_null_and_values_that_are_no_number():
    assert T.from_texts([b"", b"null", b"1.5", b""], absent=-7).tolist() == [-7, -7, 1500, -7]
    assert T.from_texts([b"", b""], absent=0).tolist() == [0, 0] and len(T.from_texts([], absent=0)) == 0
    for bad in (b'"12.5"', b"true", b"[1]", b'{"a": 1}'):
        with pytest.raises(ValueError, match="not a number"):
            T.from_texts([b"1", bad], absent=0)


def test_a_ts_that_is_no_number_is_one_line_naming_the_file(monkeypatch):
    for pure in (False, True):
        with pytest.raises(tracelens.TraceError) as e:
            _parse(b'{"traceEvents":[{"ph":"X","name":"a","pid":1,"tid":1,"ts":"12.5","dur":1}]}', pure, monkeypatch)
        assert str(e.value) == "times.json: malformed event: 'ts' is '\"12.5\"', not a number"
        with pytest.raises(tracelens.TraceError, match="1 complete events have no 'ts' timestamp"):
            _parse(b'{"traceEvents":[{"ph":"X","name":"a","pid":1,"tid":1,"ts":null,"dur":1},'
                   b'{"ph":"X","name":"b","pid":1,"tid":1,"ts":2}]}', pure, monkeypatch)


# ------------------------------------------------------------------------------ the decoders


def _document(pairs: list[tuple[str, str]], flow_ts: list[str]) -> bytes:
    events = [f'{{"ph":"X","cat":"cpu_op","name":"e{i}","pid":1,"tid":1,"ts":{ts},"dur":{dur}}}'
              for i, (ts, dur) in enumerate(pairs)]
    events += [f'{{"ph":"s","id":{i},"pid":1,"tid":1,"ts":{ts},"cat":"ac2g","name":"f"}}' for i, ts in enumerate(flow_ts)]
    return ('{"traceEvents":[' + ",".join(events) + "]}").encode()


def _parse(data: bytes, pure: bool, monkeypatch) -> K.ParsedTrace:
    with monkeypatch.context() as m:
        if pure:
            m.setenv("TRACELENS_PURE_PYTHON", "1")
        return K.parse_file("times.json", data=data, parallel=1)


@settings(PROPS, max_examples=150,  # monkeypatch: only in contexts
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(pairs=st.lists(st.tuples(NUMBERS, NUMBERS.map(lambda t: t.lstrip("-"))), min_size=1, max_size=60),
       flow_ts=st.lists(NUMBERS, max_size=5))
def test_every_decoder_gives_the_reference(pairs, flow_ts, monkeypatch):
    data = _document(pairs, flow_ts)
    want = {}
    for i, (ts, dur) in enumerate(pairs):
        t, d = reference_ns(ts), reference_ns(dur)
        if t is not None and d is not None:  # else dropped as unrepresentable
            want[f"e{i}"] = (t, d)
    want_flows = sorted(_ref_or_marker(t) for t in flow_ts)
    in_range = len(want) == len(pairs)
    for pure in (False, True):
        if not want:
            continue  # nothing timed is left: the file is refused (tested elsewhere)
        p = _parse(data, pure, monkeypatch)
        # the scanner takes every in-range document; one out of range goes to the msgspec path, which drops it
        assert p.meta["decoder"] == ("msgspec" if pure or not in_range else "compiled")
        got = dict(zip(p.events["name"].to_pylist(), zip(p.events["ts"].to_pylist(), p.events["dur"].to_pylist())))
        assert got == want
        assert sorted(p.flows["ts"].to_pylist()) == want_flows
    if in_range:  # the scanner itself, not only through the loader
        s = K.Scan(data)
        s.run(threads=1)
        assert s.error is None
        assert np.frombuffer(s.result["ts"], dtype=np.int64).tolist() == [want[f"e{i}"][0] for i in range(len(pairs))]
    elif pairs:
        s = K.Scan(data)
        s.run(threads=1)
        assert "out of range" in s.error


# ------------------------------------------------------------------------------ a real trace on an epoch clock

EPOCH_SHIFT_US = Decimal(1_700_000_000_000_000)  # 2023-11-14 in us since 1970: 2**50.6 us
_PLACEHOLDER = re.compile(r'"@@(\d+)@@"')


def _epoch_text(ns: int, k: int) -> str:
    """A JSON number for `ns` nanoseconds of microseconds, written in one of the forms writers use, with
    digits below the nanosecond that do not change it (less than half a nanosecond)."""
    whole, frac = divmod(ns, 1000)
    form = k % 5
    if form == 0:
        return f"{whole}.{frac:03d}"
    if form == 1:
        return f"{whole}.{frac:03d}0004999"  # +0.4999 ns: rounds back to ns
    if form == 2:
        return f"{ns}e-3"
    if form == 3:  # d.ddd...E+n
        digits = str(ns)
        return f"{digits[0]}{'.' + digits[1:] if len(digits) > 1 else ''}E{len(digits) - 4:+d}"
    return f"{whole}.{frac:03d}000000"


def _shift(src: Path, dst: Path) -> None:
    """`src` with every ts moved by EPOCH_SHIFT_US and every ts/dur rewritten in the raw JSON text."""
    with gzip.open(src, "rt") as f:
        doc = json.load(f, parse_float=Decimal)
    texts: list[str] = []
    for e in doc["traceEvents"]:
        for key, shift in (("ts", EPOCH_SHIFT_US), ("dur", 0)):
            v = e.get(key)
            if isinstance(v, (int, Decimal)) and not isinstance(v, bool):
                ns = (Decimal(v) + shift) * 1000
                assert ns == ns.to_integral_value(), "the fixture writes at most 3 decimals"
                e[key] = f"@@{len(texts)}@@"
                texts.append(_epoch_text(int(ns), len(texts)))
    text = _PLACEHOLDER.sub(lambda m: texts[int(m.group(1))], json.dumps(doc, default=str))
    dst.write_bytes(gzip.compress(text.encode()))


def _summary(path: Path, pure: bool, monkeypatch) -> dict:
    with monkeypatch.context() as m:
        if pure:
            m.setenv("TRACELENS_PURE_PYTHON", "1")
        s = tracelens.analyze(tracelens.load(path, cache=False, progress=False)).summary()
    for r in s["ranks"]:
        r.pop("file")  # the one thing that differs
    return s


@pytest.mark.parametrize("pure", [False, True], ids=["compiled", "msgspec"])
@pytest.mark.parametrize("fixture", [NCCL_2RANK, MOE_LOOP], ids=["nccl_2rank", "moe_loop"])
def test_a_trace_on_an_epoch_clock_gives_the_same_analysis(fixture, pure, tmp_path, monkeypatch):
    files = sorted(fixture.glob("*.json.gz")) if fixture.is_dir() else [fixture]
    shift_ns = int(EPOCH_SHIFT_US) * 1000
    for f in files:
        _shift(f, tmp_path / f.name)
        data = gzip.decompress((tmp_path / f.name).read_bytes())
        assert re.search(rb'"ts": \d{16}\.\d{10}[,}]', data) and re.search(rb'"ts": \d{19}e-3[,}]', data)
        moved = _parse(data, pure, monkeypatch)
        assert moved.meta["decoder"] == ("msgspec" if pure else "compiled")  # no silent fallback
        original = K.parse_file(f, parallel=1)
        assert moved.events.num_rows == original.events.num_rows
        # every time exactly the original's plus the shift (the rows keep their order: same times, same sort)
        assert np.array_equal(moved.events["ts"].to_numpy() - shift_ns, original.events["ts"].to_numpy())
        assert np.array_equal(moved.events["dur"].to_numpy(), original.events["dur"].to_numpy())
        assert moved.events["name"].equals(original.events["name"])
    base = _summary(fixture, pure, monkeypatch)
    assert base["ranks"] and base["ranks"][0]["gpu_busy_us"] > 0
    assert _summary(tmp_path if fixture.is_dir() else tmp_path / fixture.name, pure, monkeypatch) == base


def test_tables_cached_by_the_previous_loader_are_not_served(tmp_path, monkeypatch):
    # schema 6: the times changed on epoch clocks, so an entry the double-based loader wrote is stale
    from tracelens.io import cache

    path = tmp_path / "epoch.json"
    path.write_bytes(b'{"traceEvents":[{"ph":"X","cat":"kernel","name":"k","pid":0,"tid":7,'
                     b'"ts":1700000000000123.456,"dur":1.5}]}')
    parsed = K.parse_file(path)
    assert parsed.events["ts"].to_pylist() == [1700000000000123456]
    stale = K.ParsedTrace(parsed.path, parsed.events.set_column(
        parsed.events.column_names.index("ts"), "ts", pa.array([1700000000000123500])), parsed.flows, parsed.threads,
        parsed.meta)  # what the double gave: 1700000000000123.5 us
    with monkeypatch.context() as m:
        m.setattr(cache, "SCHEMA_VERSION", 5)  # the last double-based loader
        cache.store(stale, cache.key_of(str(path)), source=cache.source_of(path.read_bytes()))
        assert tracelens.load(path).events["ts"].tolist() == [1700000000000123500]  # served under its schema
    assert tracelens.load(path).events["ts"].tolist() == [1700000000000123456]
