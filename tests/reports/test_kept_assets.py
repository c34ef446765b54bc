"""What reports.common keeps between processes, derived from installed files: Jinja2's compiled templates
(`TemplateBytecode`) and plotly.js packed (`plotly_js_packed`): never stale, every failure soft."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from jinja2 import Environment, FileSystemLoader, select_autoescape

import reports.common as RC
from reports.common import TemplateBytecode, _asset_dirs, template_env


def _env(templates: Path, dirs: list[tuple[Path, bool]], settings: str = "autoescape=html") -> tuple[Environment, list]:
    """An environment over `templates` with the cache over `dirs`, and the list of the names it compiled."""
    env = Environment(loader=FileSystemLoader(str(templates)), autoescape=select_autoescape(["html"]),
                      bytecode_cache=TemplateBytecode(dirs, settings))
    compiled: list[str] = []
    compile_ = env.compile

    def counting(source, name=None, filename=None, raw=False, defer_init=False):
        compiled.append(name)
        return compile_(source, name, filename, raw, defer_init)

    env.compile = counting  # type: ignore[method-assign]
    return env, compiled


def _page(tmp_path: Path, text: str = "<p>{{ x }}</p>") -> Path:
    d = tmp_path / "templates"
    d.mkdir(exist_ok=True)
    (d / "page.html").write_text(text, encoding="utf-8")
    return d


def test_a_second_process_reads_the_bytecode_instead_of_compiling(tmp_path):
    templates, cache = _page(tmp_path), tmp_path / "cache"
    env, compiled = _env(templates, [(cache, True)])
    assert env.get_template("page.html").render(x="<a>") == "<p>&lt;a&gt;</p>"
    assert compiled == ["page.html"] and len(list(cache.glob("*.jinja2"))) == 1
    env2, compiled2 = _env(templates, [(cache, True)])  # (a fresh environment: what a new process has)
    assert env2.get_template("page.html").render(x="<a>") == "<p>&lt;a&gt;</p>"
    assert compiled2 == []


def test_an_edited_template_is_compiled_again_never_served_stale(tmp_path):
    templates, cache = _page(tmp_path), tmp_path / "cache"
    _env(templates, [(cache, True)])[0].get_template("page.html").render(x=1)
    _page(tmp_path, "<b>{{ x }}</b>")  # the same name, another source
    env, compiled = _env(templates, [(cache, True)])
    assert env.get_template("page.html").render(x=1) == "<b>1</b>" and compiled == ["page.html"]
    env, compiled = _env(templates, [(cache, True)])  # and the new bytecode replaced the old
    assert env.get_template("page.html").render(x=1) == "<b>1</b>" and compiled == []


def test_other_settings_or_another_jinja2_never_share_an_entry(tmp_path):
    templates, cache = _page(tmp_path), tmp_path / "cache"
    _env(templates, [(cache, True)])[0].get_template("page.html")
    env, compiled = _env(templates, [(cache, True)], settings="autoescape=off")
    env.get_template("page.html")
    assert compiled == ["page.html"] and len(list(cache.glob("*.jinja2"))) == 2
    keys = {TemplateBytecode([], "s").get_cache_key("page.html", "/f"), TemplateBytecode([], "t").get_cache_key("page.html", "/f"),
            TemplateBytecode([], "s").get_cache_key("page.html", "/g")}
    assert len(keys) == 3


def test_a_corrupt_or_truncated_entry_is_compiled_again_and_rewritten(tmp_path):
    templates, cache = _page(tmp_path), tmp_path / "cache"
    _env(templates, [(cache, True)])[0].get_template("page.html")
    (entry,) = cache.glob("*.jinja2")
    good = entry.read_bytes()
    for bad in (b"", b"garbage", good[: len(good) // 2], good[:12] + b"\x80\x04not a pickle"):
        entry.write_bytes(bad)
        env, compiled = _env(templates, [(cache, True)])
        assert env.get_template("page.html").render(x=2) == "<p>2</p>" and compiled == ["page.html"]
        assert entry.read_bytes() == good


def test_an_unwritable_directory_means_no_cache_or_the_next_one(tmp_path):
    templates = _page(tmp_path)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    nowhere = blocker / "cache"  # mkdir fails: its parent is a file
    env, compiled = _env(templates, [(nowhere, True)])
    assert env.get_template("page.html").render(x=3) == "<p>3</p>" and compiled == ["page.html"]
    env, compiled = _env(templates, [(nowhere, True)])  # nothing kept: compiled again, no error
    assert env.get_template("page.html").render(x=3) == "<p>3</p>" and compiled == ["page.html"]
    second = tmp_path / "second"
    _env(templates, [(nowhere, True), (second, True)])[0].get_template("page.html")
    env, compiled = _env(templates, [(nowhere, True), (second, True)])
    assert env.get_template("page.html").render(x=3) == "<p>3</p>" and compiled == []
    assert not list(tmp_path.glob(".*.tmp")) and not list(second.glob(".*"))  # no temporary file left behind


def test_a_read_only_place_is_read_and_never_written(tmp_path):
    templates, first, second = _page(tmp_path), tmp_path / "first", tmp_path / "second"
    _env(templates, [(first, True)])[0].get_template("page.html")  # as if written by an earlier process
    env, compiled = _env(templates, [(first, False), (second, True)])
    env.get_template("page.html")
    assert compiled == [] and not second.exists()
    (entry,) = first.glob("*.jinja2")
    entry.unlink()
    env, compiled = _env(templates, [(first, False), (second, True)])
    env.get_template("page.html")
    assert compiled == ["page.html"] and not list(first.glob("*.jinja2")) and len(list(second.glob("*.jinja2"))) == 1


def test_the_places_are_pythons_bytecode_directory_then_tracelenss_cache(tmp_path, monkeypatch):
    reports = Path(RC.__file__).resolve().parent
    monkeypatch.setenv("TRACELENS_CACHE_DIR", str(tmp_path / "tl"))
    monkeypatch.setattr(sys, "pycache_prefix", str(tmp_path / "prefix"))
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    (d1, w1), (d2, w2) = _asset_dirs("templates")
    assert d1 == tmp_path / "prefix" / reports.relative_to(reports.anchor) and w1
    assert d2 == tmp_path / "tl" / "templates" and w2
    monkeypatch.setattr(sys, "pycache_prefix", None)
    monkeypatch.setattr(sys, "dont_write_bytecode", True)  # PYTHONDONTWRITEBYTECODE: read beside the install only
    (d1, w1), (d2, w2) = _asset_dirs("assets")
    assert d1 == reports / "__pycache__" and not w1 and d2 == tmp_path / "tl" / "assets" and w2


def test_the_report_environment_uses_it():
    assert isinstance(template_env().bytecode_cache, TemplateBytecode)


# ------------------------------------------------------------------------------------------------- plotly.js packed


@pytest.fixture(autouse=True)
def _forget_packed():
    """The tests below pack fake bundles: what this process keeps of plotly.js packed is forgotten after each."""
    yield
    RC._plotly_js_packed.cache_clear()


def _packing(monkeypatch, places: list[tuple[Path, bool]], js: str = "var plotly = 1; // " + "x" * 5000) -> list[int]:
    """plotly_js_packed over `places` for the bundle `js` (as a fresh process has it), and the list of compressions."""
    import gzip

    RC._plotly_js_packed.cache_clear()
    monkeypatch.setattr(RC, "_packer", None)
    monkeypatch.setattr(RC, "plotly_js_bytes", lambda: js.encode())
    monkeypatch.setattr(RC, "_asset_dirs", lambda sub: places)
    calls: list[int] = []
    real = gzip.compress

    def counting(data, *a, **k):
        calls.append(len(data))
        return real(data, *a, **k)

    monkeypatch.setattr(gzip, "compress", counting)
    return calls


def _unpacked(text: str) -> str:
    import base64
    import gzip

    return gzip.decompress(base64.b64decode(text)).decode()


def test_plotly_is_packed_once_and_read_by_the_next_process(tmp_path, monkeypatch):
    places = [(tmp_path / "beside", True), (tmp_path / "cache", True)]
    calls = _packing(monkeypatch, places)
    first = RC.plotly_js_packed()
    assert len(calls) == 1 and len(list((tmp_path / "beside").glob("plotly-*.js.gz"))) == 1
    assert not (tmp_path / "cache").exists()  # (the first place took it)
    calls = _packing(monkeypatch, places)
    assert RC.plotly_js_packed() == first and calls == []
    assert _unpacked(first) == RC.plotly_js_bytes().decode()


def test_another_bundle_or_a_damaged_file_is_packed_again(tmp_path, monkeypatch):
    places = [(tmp_path / "beside", True)]
    _packing(monkeypatch, places)
    RC.plotly_js_packed()
    (kept,) = (tmp_path / "beside").glob("plotly-*.js.gz")
    calls = _packing(monkeypatch, places, js="var plotly = 2;")  # another plotly.js: another file
    assert _unpacked(RC.plotly_js_packed()) == "var plotly = 2;" and len(calls) == 1
    good = kept.read_bytes()
    for bad in (b"", good[:2], good[:-1], good[:-8] + b"\0" * 8, b"\x1f\x8b" + b"\0" * 40):
        kept.write_bytes(bad)
        calls = _packing(monkeypatch, places)
        assert _unpacked(RC.plotly_js_packed()) == RC.plotly_js_bytes().decode() and len(calls) == 1
        assert kept.read_bytes() == good  # and written whole again


def test_plotly_packing_fails_soft_and_honours_dont_write_bytecode(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    calls = _packing(monkeypatch, [(blocker / "x", True)])
    assert _unpacked(RC.plotly_js_packed()) == RC.plotly_js_bytes().decode() and len(calls) == 1  # no place: packed, no error
    calls = _packing(monkeypatch, [(tmp_path / "beside", False), (tmp_path / "cache", True)])
    RC.plotly_js_packed()
    assert not (tmp_path / "beside").exists() and len(list((tmp_path / "cache").glob("plotly-*.js.gz"))) == 1
    calls = _packing(monkeypatch, [(tmp_path / "beside", False), (tmp_path / "cache", True)])
    RC.plotly_js_packed()
    assert calls == []


def test_what_is_found_only_in_a_later_place_is_kept_in_the_first(tmp_path, monkeypatch):
    templates, first, second = _page(tmp_path), tmp_path / "first", tmp_path / "second"
    _env(templates, [(second, True)])[0].get_template("page.html")  # (another run's cache directory)
    env, compiled = _env(templates, [(first, True), (second, True)])
    env.get_template("page.html")
    assert compiled == [] and len(list(first.glob("*.jinja2"))) == 1
    _packing(monkeypatch, [(second, True)])
    RC.plotly_js_packed()
    calls = _packing(monkeypatch, [(first, True), (second, True)])
    RC.plotly_js_packed()
    assert calls == [] and len(list(first.glob("plotly-*.js.gz"))) == 1


def test_plotly_js_is_read_without_importing_plotly():
    import subprocess

    code = ("import sys; from reports.common import plotly_js_bytes; b = plotly_js_bytes(); "
            "print(len(b), 'plotly' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(RC.__file__).resolve().parents[1]).stdout.split()
    assert out[1] == "False"
    RC.plotly_js_bytes.cache_clear()
    assert RC.plotly_js_bytes() == RC.plotly_js().encode() and int(out[0]) == len(RC.plotly_js_bytes())
