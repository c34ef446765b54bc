"""Names from a trace, made fit to show: C++ kernel names demangled and shortened for a table cell, and
any trace-derived string made safe for a terminal.

    >>> demangle("_ZNSt6vectorIiSaIiEE9push_backERKi")
    'std::vector<int, std::allocator<int> >::push_back(int const&)'
    >>> short_name("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, std::array<char*, 1ul> >(int, at::native::FillFunctor<float>, std::array<char*, 1ul>)")
    'at::native::vectorized_elementwise_kernel<…>(…)'
    >>> for_terminal("aten::mm\\x1b[2J")
    'aten::mm\\\\x1b[2J'

Demangling uses, in order: the system's ``c++filt`` (binutils; all names of a table in one process),
libstdc++'s ``__cxa_demangle`` through ctypes, and a small pure-Python reader of the Itanium ABI that
gives the qualified name with ``<…>`` for template arguments (never wrong, only shorter; both demanglers
give up on the 1,300-character CUTLASS grouped-GEMM kernels of a real H200 trace). Nothing here
reaches the network. Standard library only.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import unicodedata
from functools import lru_cache
from typing import Iterable

# a mangled Itanium C++ name as it appears in a trace (CUDA kernels, ROCm kernels); nothing else is passed on
_MANGLED = re.compile(r"^_Z[A-Za-z0-9_.$]+$")
# a demangled C++ symbol: an optional return type "void ", a qualified identifier, then "<" or "("
_CXX = re.compile(r"^(?:void\s+)?(?:\(anonymous namespace\)::)?[A-Za-z_][\w:~]*(?:<|\()")
_cache: dict[str, tuple[str, bool]] = {}  # mangled -> (demangled or outline, whether it is the exact demangling)


def is_mangled(name: str) -> bool:
    return bool(_MANGLED.match(name or ""))


def demangle(name: str) -> str:
    """The demangled form of one C++ symbol; any other string comes back unchanged."""
    return demangle_many([name])[0]


def demangle_many(names: Iterable[str]) -> list[str]:
    """Demangle a batch (one ``c++filt`` process for every name not seen before)."""
    names = [n if isinstance(n, str) else str(n) for n in names]
    todo = sorted({n for n in names if n not in _cache and is_mangled(n)})
    if todo:
        out = _cxxfilt(todo) or _cxa_demangle(todo) or list(todo)
        for n, d in zip(todo, out):
            _cache[n] = (d, True) if d and d != n else (_itanium_outline(n), False)
    return [_cache[n][0] if n in _cache else n for n in names]


def _cxxfilt(names: list[str]) -> list[str] | None:
    exe = shutil.which("c++filt")
    if exe is None:
        return None
    try:
        r = subprocess.run([exe], input="\n".join(names) + "\n", capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    out = r.stdout.split("\n")[: len(names)]
    return out if r.returncode == 0 and len(out) == len(names) else None


@lru_cache(maxsize=1)
def _libstdcxx():
    import ctypes
    import ctypes.util

    lib = ctypes.util.find_library("stdc++")
    if not lib:
        return None
    try:
        dll = ctypes.CDLL(lib)
        fn = dll.__cxa_demangle
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_void_p
    fn.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_int)]
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.free.argtypes = [ctypes.c_void_p]
    return ctypes, fn, libc.free


def _cxa_demangle(names: list[str]) -> list[str] | None:
    try:
        found = _libstdcxx()
    except OSError:
        return None
    if found is None:
        return None
    ctypes, fn, free = found
    out = []
    for n in names:
        status = ctypes.c_int(0)
        p = fn(n.encode(), None, None, ctypes.byref(status))
        if status.value != 0 or not p:
            out.append(n)
            continue
        out.append(ctypes.string_at(p).decode("utf-8", "replace"))
        free(p)
    return out


def _itanium_outline(name: str) -> str:
    """The qualified name of a mangled symbol read from its leading <nested-name> or <source-name>,
    with the first template argument when it is itself a plain name and ``…`` for the rest; the name
    itself when it cannot be read. Used where neither c++filt nor libstdc++ demangles a name (very long
    CUTLASS kernels defeat both)."""
    s = name
    i = 3 if s.startswith("_ZL") else 2
    text, _ = _outline_name(s, i, depth=0)
    return text or name


def _outline_name(s: str, i: int, depth: int) -> tuple[str, int | None]:
    """(qualified name starting at s[i], index after it, or None where reading stopped early)."""
    parts: list[str] = []
    nested = i < len(s) and s[i] == "N"
    if nested:
        i += 1
        while i < len(s) and s[i] in "rVKRO":  # cv- and ref-qualifiers of a member function
            i += 1
    if s.startswith("St", i):
        parts.append("std")
        i += 2
    while i < len(s):
        m = re.match(r"\d+", s[i:])
        if m is None:
            break
        n = int(m.group())
        i += len(m.group())
        if n <= 0 or i + n > len(s):
            return "", None
        ident = s[i:i + n]
        parts.append("(anonymous namespace)" if ident.startswith("_GLOBAL__N") else ident)
        i += n
        if i < len(s) and s[i] == "I":
            first = ""
            if depth < 2 and i + 1 < len(s) and (s[i + 1] == "N" or s[i + 1].isdigit()):
                first, _ = _outline_name(s, i + 1, depth + 1)
            parts[-1] += f"<{first}, …>" if first else "<…>"
            return "::".join(parts), None
        if not nested:
            break
    if nested and i < len(s) and s[i] == "E":
        i += 1
    return "::".join(parts), i


def short_name(name: str, limit: int = 60) -> str:
    """A C++ symbol short enough for a table cell: template arguments and the parameter list become
    ``<…>`` and ``(…)`` (outermost level kept) and a ``void`` return type is dropped, when the name is
    longer than ``limit``. Anything that does not look like a C++ symbol comes back unchanged."""
    if len(name) <= limit or not _CXX.match(name):
        return name
    anon = "(anonymous namespace)"
    s = name.replace(anon, "\0")
    out: list[str] = []
    stack: list[str] = []
    for ch in s:
        if ch in "<(":
            if not stack:
                out.append(ch + "…" + (">" if ch == "<" else ")"))
            stack.append(ch)
        elif ch in ">)" and stack:
            stack.pop()
        elif not stack:
            out.append(ch)
    short = "".join(out).replace("\0", anon).strip()
    if short.startswith("void "):
        short = short[5:]
    return short or name


def display_name(name: str) -> tuple[str, str]:
    """(what a table cell shows, the full name for its hover title): demangled, then shortened."""
    return display_many([name])[0]


def display_many(names: Iterable[str]) -> list[tuple[str, str]]:
    """(shown, title) per name. The title is the full demangled name; where no demangler could read a
    mangled name, the readable outline followed by the mangled name itself."""
    names = [n if isinstance(n, str) else str(n) for n in names]
    out = []
    for n, f in zip(names, demangle_many(names)):
        exact = _cache.get(n, (n, True))[1]
        out.append((short_name(f), f if exact else f"{f}  [mangled: {n}]"))
    return out


# --------------------------------------------------------------------------- terminal

def _visible(ch: str) -> str:
    o = ord(ch)
    return f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}"


def for_terminal(s, keep_newlines: bool = False) -> str:
    """A trace-derived string safe to print: every control character (ESC, which starts every terminal
    escape sequence, the rest of C0 and C1, DEL, bidirectional overrides and other invisible format
    characters, line/paragraph separators) shown as visible ``\\xNN`` text, so a name cannot recolour,
    clear or retitle the terminal, nor hide text. ``keep_newlines`` leaves ``\\n``
    (and ``\\t``) alone, for a block of text built by this program."""
    s = str(s)
    if s.isprintable() and "\x1b" not in s:
        return s
    keep = "\n\t" if keep_newlines else ""
    return "".join(c if c in keep or (c.isprintable() and unicodedata.category(c) != "Cf") else _visible(c) for c in s)


__all__ = ["demangle", "demangle_many", "display_many", "display_name", "for_terminal", "is_mangled", "short_name"]
