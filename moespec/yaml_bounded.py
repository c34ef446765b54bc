"""The one YAML loader for everything users hand the project: trainer configs and ``--set`` values,
autotune space files, ``tracelens whatif --set``. Plain YAML only (PyYAML's ``SafeLoader``: no
``!!python`` tags), and bounded: a document whose aliases would expand it beyond :data:`MAX_NODES`
nodes or :data:`MAX_SCALAR_CHARS` characters of scalars is rejected before any Python object is built.

Why: YAML anchors and aliases share a node, so a few hundred bytes (``a: &a [x, x, ...]``,
``b: &b [*a, *a, ...]``, ... the "billion laughs") describe a value with 10**9 leaves. PyYAML builds it
cheaply, as shared references, but everything that walks it afterwards (``repr`` in an error message,
``json.dumps``, ``copy.deepcopy``, validation) does the whole expanded work and runs out of memory.
Counting the expanded size of the composed node graph (each node once, memoized) costs time linear in
the document, and also rejects a node that contains itself through an alias (a recursive document).

Every rejection is a ``yaml.YAMLError`` with ``problem`` and ``problem_mark`` like PyYAML's own errors
(:class:`YAMLBoundError` for the bounds), so callers that already turn YAML errors into one line keep
doing so; a scalar PyYAML cannot convert (an integer of more than 4,300 digits, the date 2001-02-30),
which PyYAML lets through as a bare ``ValueError``, is one too. Pure stdlib + PyYAML, importable
without torch.
"""

from __future__ import annotations

import reprlib
from typing import Any

import yaml
from yaml.constructor import ConstructorError
from yaml.error import MarkedYAMLError
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

MAX_NODES = 1_000_000  # nodes once aliases are expanded (a 1 MiB list of numbers has ~500,000)
MAX_SCALAR_CHARS = 16 * 2**20  # characters of all scalars once aliases are expanded


class YAMLBoundError(MarkedYAMLError):
    """A document beyond the bounds (expansion through aliases, or an alias cycle)."""


def safe_load(text: str | bytes, max_nodes: int = MAX_NODES, max_scalar_chars: int = MAX_SCALAR_CHARS) -> Any:
    """``yaml.safe_load`` with the expansion bound; raises ``yaml.YAMLError`` (incl. :class:`YAMLBoundError`)."""
    loader = _BoundedLoader(text)
    loader.bounds = (max_nodes, max_scalar_chars)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


class _BoundedLoader(yaml.SafeLoader):
    bounds = (MAX_NODES, MAX_SCALAR_CHARS)

    def compose_document(self) -> Node:
        node = super().compose_document()
        check_expansion(node, *self.bounds)
        return node

    def construct_object(self, node: Node, deep: bool = False) -> Any:
        # PyYAML lets a scalar's own ValueError through (an integer of more than 4,300 digits, the date
        # 2001-02-30): make it a YAML error at the node, like the rest
        try:
            return super().construct_object(node, deep)
        except ValueError as e:
            raise ConstructorError(None, None, f"cannot read the value {short_repr(getattr(node, 'value', ''), 40)} "
                                   f"({' '.join(str(e).split())[:120]})", node.start_mark) from None


def check_expansion(root: Node, max_nodes: int = MAX_NODES, max_scalar_chars: int = MAX_SCALAR_CHARS) -> tuple[int, int]:
    """(nodes, scalar characters) of the document under ``root`` with every alias expanded; raises
    :class:`YAMLBoundError` beyond either bound or on a node that contains itself. Iterative (no
    recursion limit), each distinct node visited once."""
    done: dict[int, tuple[int, int]] = {}
    on_path: set[int] = set()
    stack: list[tuple[Node, bool]] = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        key = id(node)
        if isinstance(node, ScalarNode):
            done[key] = (1, len(node.value))
        elif not expanded:
            if key in done:
                continue
            if key in on_path:  # reached again below itself: `&a [*a]`
                raise YAMLBoundError(None, None, "an alias refers to a node that contains it (a recursive "
                                     "document); not allowed", node.start_mark)
            on_path.add(key)
            stack.append((node, True))
            stack.extend((c, False) for c in _children(node) if id(c) not in done)
        else:
            on_path.discard(key)
            n, c = 1, 0
            for child in _children(node):
                cn, cc = done[id(child)]
                n, c = n + cn, c + cc
            done[key] = (n, c)
            if n > max_nodes or c > max_scalar_chars:
                what = f"{n:,} nodes (at most {max_nodes:,})" if n > max_nodes else \
                    f"{c:,} characters of values (at most {max_scalar_chars:,})"
                raise YAMLBoundError(None, None, f"aliases (*name) expand this value to {what}: a \"billion "
                                     "laughs\" document? Write the values out, or use fewer aliases",
                                     node.start_mark)
    return done[id(root)]


def _children(node: Node) -> list[Node]:
    if isinstance(node, SequenceNode):
        return node.value
    if isinstance(node, MappingNode):
        return [x for pair in node.value for x in pair]
    return []


_repr = reprlib.Repr()
_repr.maxlevel, _repr.maxstring, _repr.maxother = 3, 60, 60
_repr.maxlist = _repr.maxtuple = _repr.maxdict = _repr.maxset = 8


def short_repr(value: Any, limit: int = 80) -> str:
    """``repr`` of a value read from YAML, for an error message: cut while it is built (at most 8 items
    per level, 3 levels; ``reprlib``), then to ``limit`` characters, so a huge value costs nothing."""
    text = _repr.repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
