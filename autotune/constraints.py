"""Space constraints: a small expression language, parsed with :mod:`ast` and run by a tree walker.

A constraint (``constraints:`` in a space file) is a Python-syntax expression over the knobs, ``fixed``
and the resolved trainer config, e.g. ``n_layers % (pp * vpp) == 0`` or
``not (grouped_gemm_backend == 'loop' and sync_free_level >= 2)``. It is never given to ``eval``:
:func:`compile_constraint` accepts only the constructs below and :func:`evaluate` walks the checked tree
itself, so a constraint can read values and compute with them, nothing else.

Allowed:
    names                   knob, ``fixed`` and trainer config keys (looked up when evaluated)
    literals                numbers, strings, ``True`` ``False`` ``None``; lists and tuples of allowed
                            expressions (``[]``, ``(1, 2)``)
    comparisons             ``== != < <= > >=``, chained (``1 <= pp <= 8``); ``in`` / ``not in``;
                            ``is`` / ``is not`` against ``None`` only
    logic                   ``and or not``, ``x if cond else y``
    arithmetic on numbers   ``+ - * / // %`` and ``**`` with an exponent of at most 64 in magnitude;
                            unary ``-`` and ``+``; integer results beyond +-2**128 are an error
    calls                   ``min max`` (several numbers, or one list; ``default=`` for an empty one),
                            ``abs len sum any all int float bool`` of one argument

Everything else (attribute access, subscripts, other calls, comprehensions, lambdas, f-strings, walrus,
starred arguments, sets and dicts, bit operations) is rejected by :func:`compile_constraint` with a
:class:`ConstraintError` naming the construct. With no loops and no way to build large values, the work
of one evaluation is bounded by the length of the expression (at most ``MAX_CHARS`` characters, nested at
most ``MAX_DEPTH`` levels) times the size of the config values it reads.
"""

from __future__ import annotations

import ast
import functools
import math
import operator
from typing import Any, Callable

MAX_CHARS = 2000  # characters of one constraint
MAX_DEPTH = 64  # nesting of the expression tree
MAX_POW = 64  # largest |exponent| of `**`
MAX_INT = 2**128  # larger integer results are an error (no multi-megabyte integers from `10**10**...`)

_BINOPS: dict[type, tuple[str, Callable[[Any, Any], Any]]] = {
    ast.Add: ("+", operator.add), ast.Sub: ("-", operator.sub), ast.Mult: ("*", operator.mul),
    ast.Div: ("/", operator.truediv), ast.FloorDiv: ("//", operator.floordiv), ast.Mod: ("%", operator.mod),
    ast.Pow: ("**", operator.pow),
}
_CMPOPS: dict[type, Callable[[Any, Any], bool]] = {
    ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
    ast.Gt: operator.gt, ast.GtE: operator.ge,
    ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b,
    ast.Is: operator.is_, ast.IsNot: operator.is_not,
}
_FUNCS = ("min", "max", "abs", "len", "sum", "any", "all", "int", "float", "bool")
# names of constructs for the error message (the rest: the node's class name, e.g. "Lambda")
_CONSTRUCT = {
    ast.Attribute: "attribute access (`.`)", ast.Subscript: "subscripts (`[...]`)",
    ast.ListComp: "comprehensions", ast.SetComp: "comprehensions", ast.DictComp: "comprehensions",
    ast.GeneratorExp: "comprehensions", ast.Lambda: "lambda", ast.NamedExpr: "assignment (`:=`)",
    ast.JoinedStr: "f-strings", ast.FormattedValue: "f-strings", ast.Starred: "starred arguments (`*`)",
    ast.Set: "set displays (`{...}`)", ast.Dict: "dict displays (`{...}`)", ast.Await: "await",
    ast.Yield: "yield", ast.YieldFrom: "yield", ast.Slice: "slices",
    ast.BitAnd: "bit operations", ast.BitOr: "bit operations", ast.BitXor: "bit operations",
    ast.LShift: "bit operations", ast.RShift: "bit operations", ast.Invert: "bit operations",
    ast.MatMult: "the `@` operator",
}


class ConstraintError(ValueError):
    """A constraint that is not in the language (when compiled) or cannot be evaluated (when run)."""


class Constraint:
    """A checked constraint: call :meth:`evaluate` with the names it may read."""

    __slots__ = ("text", "_tree")

    def __init__(self, text: str, tree: ast.Expression):
        self.text, self._tree = text, tree

    def evaluate(self, names: dict[str, Any]) -> Any:
        try:
            return _eval(self._tree.body, names)
        except ConstraintError:
            raise
        except (TypeError, ValueError, ZeroDivisionError, OverflowError, RecursionError) as e:
            raise ConstraintError(f"{type(e).__name__}: {e}") from None


@functools.lru_cache(maxsize=1024)
def compile_constraint(text: str) -> Constraint:
    """Parse and check one constraint; a :class:`ConstraintError` (one line) names what is not allowed.
    A syntax error is a :class:`SyntaxError`, left to the caller to word."""
    if len(text) > MAX_CHARS:
        raise ConstraintError(f"{len(text)} characters (at most {MAX_CHARS})")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (RecursionError, MemoryError):
        raise ConstraintError(f"nested too deeply (at most {MAX_DEPTH} levels)") from None
    except ValueError as e:  # e.g. a NUL character (a SyntaxError from Python 3.12 on)
        raise SyntaxError(str(e)) from None
    _check(tree.body)
    return Constraint(text, tree)


def _check(root: ast.AST) -> None:
    stack = [(root, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ConstraintError(f"nested too deeply (at most {MAX_DEPTH} levels)")
        kids: list[ast.AST] = []
        if isinstance(node, ast.Constant):
            if not (node.value is None or isinstance(node.value, (bool, int, float, str))):
                raise ConstraintError(f"{type(node.value).__name__} literals: not allowed")
        elif isinstance(node, ast.Name):
            if node.id.startswith("__"):
                raise ConstraintError(f"the name {node.id!r}: not allowed (dunder names)")
        elif isinstance(node, (ast.List, ast.Tuple)):
            kids = list(node.elts)
        elif isinstance(node, ast.BoolOp):
            kids = list(node.values)
        elif isinstance(node, ast.UnaryOp):
            if not isinstance(node.op, (ast.Not, ast.USub, ast.UAdd)):
                raise ConstraintError(f"{_construct(node.op)}: not allowed")
            kids = [node.operand]
        elif isinstance(node, ast.BinOp):
            if type(node.op) not in _BINOPS:
                raise ConstraintError(f"{_construct(node.op)}: not allowed")
            kids = [node.left, node.right]
        elif isinstance(node, ast.Compare):
            for op, right in zip(node.ops, node.comparators):
                if type(op) not in _CMPOPS:
                    raise ConstraintError(f"the comparison {type(op).__name__}: not allowed")
                if isinstance(op, (ast.Is, ast.IsNot)) and not (_is_none(right) or _is_none(node.left)):
                    raise ConstraintError("`is` / `is not` other than against None: not allowed (use == / !=)")
            kids = [node.left, *node.comparators]
        elif isinstance(node, ast.IfExp):
            kids = [node.test, node.body, node.orelse]
        elif isinstance(node, ast.Call):
            if not isinstance(node.func, ast.Name):
                raise ConstraintError(f"{_construct(node.func)}: not allowed")
            fname = node.func.id
            if fname not in _FUNCS:
                raise ConstraintError(f"calling {fname!r}: not allowed (callable: {' '.join(_FUNCS)})")
            if any(isinstance(a, ast.Starred) for a in node.args):
                raise ConstraintError("starred arguments (`*`): not allowed")
            for kw in node.keywords:
                if kw.arg != "default" or fname not in ("min", "max"):
                    raise ConstraintError(f"the keyword argument {kw.arg or '**'!r} of {fname}: not allowed"
                                          " (only min and max take default=)")
            n = len(node.args)
            if (fname in ("min", "max") and n < 1) or (fname not in ("min", "max") and n != 1):
                raise ConstraintError(f"{fname} takes {'at least one' if fname in ('min', 'max') else 'one'} "
                                      f"argument, got {n}")
            kids = [*node.args, *(kw.value for kw in node.keywords)]
        else:
            raise ConstraintError(f"{_construct(node)}: not allowed")
        stack.extend((k, depth + 1) for k in kids)


def _construct(node: ast.AST) -> str:
    return _CONSTRUCT.get(type(node), f"the construct {type(node).__name__}")


def _is_none(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value is None


def _number(v: Any, what: str) -> int | float:
    if not isinstance(v, (int, float)):  # bool is an int, as in Python
        raise ConstraintError(f"{what} needs numbers, got {type(v).__name__} {_short(v)}")
    return v


def _bounded(v: Any) -> Any:
    if isinstance(v, int) and abs(v) > MAX_INT:
        raise ConstraintError("an integer beyond +-2**128")
    if isinstance(v, complex):  # (-8) ** 0.5
        raise ConstraintError(f"a complex number ({v!r})")
    return v


def _short(v: Any) -> str:
    text = repr(v) if not isinstance(v, (list, tuple, dict)) or len(v) <= 8 else f"<{type(v).__name__} of {len(v)}>"
    return text if len(text) <= 60 else text[:60] + "..."


def _eval(node: ast.AST, names: dict[str, Any]) -> Any:
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        if node.id not in names:
            raise ConstraintError(f"NameError: name {node.id!r} is not a knob, a fixed key or a trainer config key")
        return names[node.id]
    if isinstance(node, ast.List):
        return [_eval(e, names) for e in node.elts]
    if isinstance(node, ast.Tuple):
        return tuple(_eval(e, names) for e in node.elts)
    if isinstance(node, ast.BoolOp):
        is_and = isinstance(node.op, ast.And)
        v: Any = None
        for sub in node.values:
            v = _eval(sub, names)
            if bool(v) != is_and:  # `and` stops at the first false value, `or` at the first true one
                return v
        return v
    if isinstance(node, ast.UnaryOp):
        v = _eval(node.operand, names)
        if isinstance(node.op, ast.Not):
            return not v
        v = _number(v, "unary -" if isinstance(node.op, ast.USub) else "unary +")
        return -v if isinstance(node.op, ast.USub) else +v
    if isinstance(node, ast.BinOp):
        sym, fn = _BINOPS[type(node.op)]
        a, b = _number(_eval(node.left, names), sym), _number(_eval(node.right, names), sym)
        if sym == "**" and abs(b) > MAX_POW:
            raise ConstraintError(f"an exponent of {_short(b)} (at most {MAX_POW} in magnitude)")
        return _bounded(fn(a, b))
    if isinstance(node, ast.Compare):
        left = _eval(node.left, names)
        for op, right_node in zip(node.ops, node.comparators):
            right = _eval(right_node, names)
            if not _CMPOPS[type(op)](left, right):
                return False
            left = right
        return True
    if isinstance(node, ast.IfExp):
        return _eval(node.body, names) if _eval(node.test, names) else _eval(node.orelse, names)
    if isinstance(node, ast.Call):
        return _call(node.func.id, [_eval(a, names) for a in node.args],
                     {kw.arg: _eval(kw.value, names) for kw in node.keywords})
    raise ConstraintError(f"{_construct(node)}: not allowed")  # unreachable after _check


def _call(name: str, args: list[Any], kwargs: dict[str, Any]) -> Any:
    if name in ("min", "max"):
        items = args[0] if len(args) == 1 else args
        if not isinstance(items, (list, tuple)):
            raise ConstraintError(f"{name} of one argument needs a list, got {type(items).__name__}")
        if not items:
            if "default" in kwargs:
                return kwargs["default"]
            raise ConstraintError(f"{name} of an empty list (give default=)")
        for x in items:
            _number(x, name)
        return (min if name == "min" else max)(items)
    (x,) = args
    if name == "abs":
        return abs(_number(x, "abs"))
    if name == "len":
        if not isinstance(x, (list, tuple, str, dict)):
            raise ConstraintError(f"len needs a list or a string, got {type(x).__name__}")
        return len(x)
    if name == "sum":
        if not isinstance(x, (list, tuple)):
            raise ConstraintError(f"sum needs a list, got {type(x).__name__}")
        return _bounded(sum(_number(e, "sum") for e in x))
    if name in ("any", "all"):
        if not isinstance(x, (list, tuple)):
            raise ConstraintError(f"{name} needs a list, got {type(x).__name__}")
        return (any if name == "any" else all)(x)
    if name == "int":
        if isinstance(x, str) and len(x) > 40:
            raise ConstraintError(f"int of a string of {len(x)} characters")
        if isinstance(x, float) and not math.isfinite(x):
            raise ConstraintError(f"int of {x!r}")
        return _bounded(int(x)) if isinstance(x, (int, float, str)) else _number(x, "int")
    if name == "float":
        if isinstance(x, str) and len(x) > 40:
            raise ConstraintError(f"float of a string of {len(x)} characters")
        return float(x) if isinstance(x, (int, float, str)) else _number(x, "float")
    return bool(x)  # "bool"
