"""reports.common.TemplateBytecode: Jinja2's compiled templates kept between processes, never stale, failing soft."""

from __future__ import annotations

import sys
from pathlib import Path

from jinja2 import Environment, FileSystemLoader, select_autoescape

from reports.common import TEMPLATES, TemplateBytecode, _template_bytecode_dirs, template_env


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
    monkeypatch.setenv("TRACELENS_CACHE_DIR", str(tmp_path / "tl"))
    monkeypatch.setattr(sys, "pycache_prefix", str(tmp_path / "prefix"))
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    (d1, w1), (d2, w2) = _template_bytecode_dirs()
    assert d1 == tmp_path / "prefix" / TEMPLATES.resolve().relative_to(TEMPLATES.resolve().anchor) and w1
    assert d2 == tmp_path / "tl" / "templates" and w2
    monkeypatch.setattr(sys, "pycache_prefix", None)
    monkeypatch.setattr(sys, "dont_write_bytecode", True)  # PYTHONDONTWRITEBYTECODE: read beside the templates only
    (d1, w1), _ = _template_bytecode_dirs()
    assert d1 == TEMPLATES / "__pycache__" and not w1


def test_the_report_environment_uses_it():
    assert isinstance(template_env().bytecode_cache, TemplateBytecode)
