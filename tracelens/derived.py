"""Derived tables of an analysis: a registry of entries, each computed at most once per analysis.

An entry is declared with its name, the function that computes it and its inputs: base tables (what
`tracelens.analyze` builds: `tree`, `gpu`, `timeline`, ...) and other entries. Declaration checks the
graph, so a mistake fails at import time with one line, not in the middle of an analysis:

    >>> REG = Registry(base=("gpu", "trace"))
    >>> @REG.entry("comm_kernels", inputs=("gpu", "trace"))
    ... def _comm_kernels(a): ...
    >>> @REG.entry("comm_instances", inputs=("comm_kernels", "trace"))
    ... def _instances(a, comm_kernels): ...

An input must be a base table or an entry declared before (entries are declared in dependency order,
so no cycle can form); an entry listing itself, a name declared twice or an unknown input raises
`DeclarationError`.

`Registry.bind(owner)` gives a `Derived`: the memo of one analysis. `derived[name]` computes the
entry's entry inputs first, then calls `fn(owner, **entry_inputs)` (the owner carries the base tables;
the entries it reads arrive as keyword arguments, already computed), keeps the value and returns it on
every later read. Nothing else writes into it: the analysis modules are pure functions of what they
are given. `Derived.put` records a value computed elsewhere (an offloaded child, `tracelens.offload`).

Flags an entry may declare:
    offload       its function is pure and its value pickles: it may run in a forked child
                  (`Analysis.summary` computes these beside the others)
    keep_errors   an exception is the entry's outcome: kept, and raised again on every read without
                  computing again (the step decomposition, which a trace may not support)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator


class DeclarationError(ValueError):
    """An entry declared with an unknown input, itself as an input, or a name already taken."""


@dataclass(frozen=True)
class Entry:
    name: str
    fn: Callable[..., Any]
    inputs: tuple[str, ...]  # base tables and entries, as declared
    offload: bool = False
    keep_errors: bool = False
    module: str = ""  # the module its computation lives in (imported on first use; `tracelens.analyzer.preload`)
    doc: str = ""

    def entry_inputs(self, registry: "Registry") -> tuple[str, ...]:
        """The inputs that are entries (computed and passed as keyword arguments)."""
        return tuple(i for i in self.inputs if i in registry.entries)


class Registry:
    """Entries by name, over a fixed set of base-table names."""

    def __init__(self, base: Iterable[str]):
        self.base = frozenset(base)
        self.entries: dict[str, Entry] = {}

    def entry(self, name: str, inputs: Iterable[str] = (), *, offload: bool = False,
              keep_errors: bool = False, module: str = "") -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Decorator declaring `fn(owner, **entry_inputs)` as entry `name` (see the module docstring)."""
        inputs = tuple(inputs)

        def declare(fn: Callable[..., Any]) -> Callable[..., Any]:
            self.declare(Entry(name, fn, inputs, offload=offload, keep_errors=keep_errors, module=module,
                               doc=(fn.__doc__ or "").strip().split("\n")[0]))
            return fn

        return declare

    def declare(self, e: Entry) -> None:
        if e.name in self.entries or e.name in self.base:
            raise DeclarationError(f"entry {e.name!r}: the name is already a {'base table' if e.name in self.base else 'declared entry'}")
        if e.name in e.inputs:
            raise DeclarationError(f"entry {e.name!r}: lists itself as an input (a cycle)")
        for i in e.inputs:
            if i not in self.base and i not in self.entries:
                raise DeclarationError(f"entry {e.name!r}: input {i!r} is neither a base table nor an entry declared "
                                       f"before it (entries are declared in dependency order, so none can form a cycle)")
        self.entries[e.name] = e

    def __getitem__(self, name: str) -> Entry:
        try:
            return self.entries[name]
        except KeyError:
            raise KeyError(f"no derived entry {name!r} (declared: {', '.join(self.entries)})") from None

    def __iter__(self) -> Iterator[Entry]:
        return iter(self.entries.values())

    def upstream(self, name: str) -> list[str]:
        """Every entry `name` needs, transitively, in an order that computes each after its inputs."""
        out: list[str] = []

        def visit(n: str) -> None:
            for i in self[n].entry_inputs(self):
                if i not in out:
                    visit(i)
            out.append(n)

        visit(name)
        return out

    def bind(self, owner: Any, values: dict[str, Any] | None = None) -> "Derived":
        return Derived(self, owner, values)


_ERROR = object()  # marks a kept exception in Derived.values


class Derived:
    """One analysis's entries: computed on first read, kept, shared by every reader."""

    def __init__(self, registry: Registry, owner: Any, values: dict[str, Any] | None = None,
                 after: Callable[[], None] | None = None):
        self.registry, self.owner = registry, owner
        self.values: dict[str, Any] = dict(values or {})
        self.after = after  # called after each computation (e.g. handing freed buffers back to the system)

    def __getitem__(self, name: str) -> Any:
        if name not in self.values:
            self._compute(name)
        v = self.values[name]
        if isinstance(v, tuple) and len(v) == 2 and v[0] is _ERROR:
            raise v[1]
        return v

    def __contains__(self, name: str) -> bool:
        """Whether the entry is computed (a kept exception counts)."""
        return name in self.values

    def outcome(self, name: str) -> Any:
        """The entry's value, or the exception it keeps (keep_errors), without raising it."""
        try:
            return self[name]
        except Exception as e:  # noqa: BLE001 - only a kept one reaches here for a keep_errors entry
            if self.registry[name].keep_errors and name in self.values:
                return e
            raise

    def put(self, name: str, value: Any) -> None:
        """Record a value computed elsewhere (an exception, for a keep_errors entry). Replacing a computed
        value is refused while an entry computed from it is kept (it would be stale)."""
        e = self.registry[name]
        if name in self.values:
            stale = [d for d in self.values if d != name and name in self.registry.upstream(d)]
            if stale:
                raise ValueError(f"entry {name!r}: cannot replace it, {', '.join(stale)} was computed from it")
        if isinstance(value, BaseException):
            if not e.keep_errors:
                raise TypeError(f"entry {name!r} does not keep errors")
            self.values[name] = (_ERROR, value)
        else:
            self.values[name] = value

    def _compute(self, name: str) -> None:
        e = self.registry[name]
        kwargs = {i: self[i] for i in e.entry_inputs(self.registry)}
        try:
            value = e.fn(self.owner, **kwargs)
        except Exception as exc:
            if not e.keep_errors:
                raise
            self.values[name] = (_ERROR, exc)
        else:
            self.values[name] = value
        if self.after is not None:
            self.after()

    def compute(self, names: Iterable[str]) -> dict[str, Any]:
        """The outcomes (value or kept exception) of `names`: what an offloaded child sends back."""
        return {n: self.outcome(n) for n in names}
