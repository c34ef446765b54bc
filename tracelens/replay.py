"""Op replay: a standalone PyTorch script that reruns one op of a trace on random data of the recorded
shapes, dtypes and strides, and prints its time next to the time in the trace.

    >>> import tracelens
    >>> from tracelens import replay
    >>> trace = tracelens.load("runs/demo/traces/rank0.json.gz")
    >>> cands = replay.candidates(trace)            # one row per (op, signature): time, count, reason if not replayable
    >>> call = replay.find_call(trace, "aten::mm", index=0)
    >>> replay.write_script(call, "replay/aten_mm_0.py")

The generated script imports only torch (never tracelens). It rebuilds every tensor argument with
``torch.empty_strided``-compatible storage (a random flat buffer viewed with the recorded strides, so
broadcast/overlapping strides work), integers in ``[0, smallest dimension of the float inputs)`` so that any
index is in range, scalars and lists from ``Concrete Inputs``; picks the op's overload from the schema whose
arguments match the recorded ones, passing keyword-only arguments by name; runs on CUDA when available,
else on the CPU (saying so); warms up, times a loop (CUDA events on the GPU, ``perf_counter`` on the CPU),
and prints one JSON line: op, shapes, dtypes, strides, device, measured_us, trace_us.

Which op owns a kernel: the outermost op on the kernel's launch stack that is replayable (so
``aten::linear`` rather than its ``aten::addmm``, ``aten::scaled_dot_product_attention`` rather than the
backend's ``_flash_attention_forward``); kernels with no replayable op above them belong to their innermost
op, listed with the reason it cannot be replayed. The trace time of an op call is the summed duration of
the GPU work it launched (inclusive), or its CPU duration in a trace without GPU activity.

torch is never imported here.
"""

from __future__ import annotations

import ast
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from . import perfmodels
from .analysis import calltree
from .errors import TraceError

# Kineto "Input type" -> torch dtype attribute name
DTYPES: dict[str, str] = {
    "c10::BFloat16": "bfloat16", "c10::Half": "float16", "float": "float32", "double": "float64",
    "long int": "int64", "long": "int64", "int": "int32", "short int": "int16", "short": "int16",
    "signed char": "int8", "unsigned char": "uint8", "bool": "bool", "unsigned int": "uint32",
    "unsigned short": "uint16", "unsigned long": "uint64",
    "c10::Float8_e4m3fn": "float8_e4m3fn", "c10::Float8_e5m2": "float8_e5m2",
    "c10::Float8_e4m3fnuz": "float8_e4m3fnuz", "c10::Float8_e5m2fnuz": "float8_e5m2fnuz",
    "c10::complex<float>": "complex64", "c10::complex<double>": "complex128",
}
SCALAR_TYPES = ("Scalar", "int", "float", "bool", "SymInt")
LIST_TYPES = ("ScalarList", "SymIntList", "IntList")
STRING_TYPES = ("std::string", "c10::string_view", "str", "string")

SDPA_OPS = frozenset({
    "aten::scaled_dot_product_attention", "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention",
})
# ops with a perf model do device work on their inputs; the attention backend kernels and backward ops
# need state the trace does not hold
_NOT_REPLAYED = {
    "aten::_flash_attention_forward": "backend attention kernel with varlen/RNG arguments: replay its "
                                       "aten::scaled_dot_product_attention caller",
    "aten::_efficient_attention_forward": "backend attention kernel with varlen/RNG arguments: replay its "
                                           "aten::scaled_dot_product_attention caller",
    "aten::_cudnn_attention_forward": "backend attention kernel: replay its aten::scaled_dot_product_attention caller",
}
DATA_DEPENDENT = frozenset({
    "aten::nonzero", "aten::nonzero_static", "aten::unique", "aten::_unique", "aten::_unique2",
    "aten::unique_consecutive", "aten::unique_dim", "aten::masked_select", "aten::item", "aten::_local_scalar_dense",
    "aten::repeat_interleave", "aten::bincount", "aten::histc", "aten::index_put_", "aten::_index_put_impl_",
    "aten::index", "aten::argwhere", "aten::equal", "aten::is_nonzero", "aten::allclose",
})
FAMILIES = "GEMM, grouped GEMM, SDPA, elementwise, norms, softmax, reductions, losses, embedding/indexing"


def is_replayable_name(name: str) -> bool:
    """Ops of the replayable families: those with a perf model (device work on their inputs) and SDPA."""
    if name in _NOT_REPLAYED or name in DATA_DEPENDENT:
        return False
    if name.endswith("_backward") and "attention" in name:
        return False
    return name in SDPA_OPS or perfmodels.has_model(name)


def _loads(text: Any) -> list:
    if text is None or (isinstance(text, float) and math.isnan(text)) or text == "":
        return []
    v = json.loads(text) if isinstance(text, str) else text
    return v if isinstance(v, list) else []


def _scalar(text: str) -> Any:
    s = text.strip()
    if s in ("True", "true"):
        return True
    if s in ("False", "false"):
        return False
    if re.fullmatch(r"[-+]?\d+", s):
        return int(s)
    try:
        return float(s)
    except ValueError:
        return s


def build_args(name: str, dims: list, types: list, strides: list, concrete: list) -> list[dict]:
    """Argument specs for the script (JSON-able), or raise `TraceError` with the reason they cannot be built."""
    if not dims or not types:
        raise TraceError(None, "shapes not recorded (profile with record_shapes=True)")
    specs: list[dict] = []
    for i, typ in enumerate(types):
        d = dims[i] if i < len(dims) else []
        st = strides[i] if i < len(strides) else None
        cv = concrete[i] if i < len(concrete) else ""
        cv = cv if isinstance(cv, str) else json.dumps(cv)
        if typ in DTYPES:
            if not isinstance(d, list) or not all(isinstance(x, int) and x >= 0 for x in d):
                raise TraceError(None, f"argument {i}: tensor shape {d!r} not usable")
            if not (isinstance(st, list) and len(st) == len(d) and all(isinstance(x, int) and x >= 0 for x in st)):
                st = _contiguous(d)
            specs.append({"kind": "tensor", "shape": d, "stride": st, "dtype": DTYPES[typ]})
        elif typ in SCALAR_TYPES:
            if cv == "":
                raise TraceError(None, f"argument {i} ({typ}) value not recorded in Concrete Inputs")
            specs.append({"kind": "value", "value": _scalar(cv)})
        elif typ in LIST_TYPES:
            try:
                val = ast.literal_eval(cv) if cv else []  # Kineto writes Python reprs: [1, 2], [True, False]
            except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                raise TraceError(None, f"argument {i} ({typ}) {cv[:80]!r} is not a list") from None
            if not isinstance(val, (list, tuple)) or not all(_plain(x) for x in val):
                raise TraceError(None, f"argument {i} ({typ}) {cv[:80]!r} is not a list of numbers, booleans or None")
            specs.append({"kind": "value", "value": list(val)})
        elif typ in STRING_TYPES:
            specs.append({"kind": "value", "value": cv})
        elif typ == "":
            specs.append({"kind": "none"})
        else:
            raise TraceError(None, f"argument {i} has type {typ!r}, whose values the trace does not record")
    if name in ("aten::_grouped_mm", "aten::_scaled_grouped_mm"):
        _grouped_offsets(specs)
    return specs


def _plain(x: Any) -> bool:
    """A list element the script can take as JSON data: a number, a boolean or None (a nested list of those)."""
    if isinstance(x, (list, tuple)):
        return all(_plain(y) for y in x)
    return x is None or isinstance(x, (bool, int, float))


def _contiguous(shape: list[int]) -> list[int]:
    st, acc = [], 1
    for n in reversed(shape):
        st.append(acc)
        acc *= max(n, 1)
    return st[::-1]


def _grouped_offsets(specs: list[dict]) -> None:
    """``offs`` of a grouped GEMM holds data (cumulative group ends) the trace does not record: split the
    grouped dimension evenly (2D x 3D: rows of the first operand; 2D x 2D: the shared K; 3D x 2D: columns
    of the second)."""
    if len(specs) < 3 or specs[2].get("kind") != "tensor":
        return
    a, b = specs[0].get("shape", []), specs[1].get("shape", [])
    if len(a) == 2 and len(b) == 3:
        total = a[0]
    elif len(a) == 2 and len(b) == 2:
        total = a[1]
    elif len(a) == 3 and len(b) == 2:
        total = b[1]
    else:
        return
    specs[2]["fill"] = "offsets"
    specs[2]["total"] = total


def why_not(name: str, dims: list, types: list) -> str | None:
    """The reason an op cannot be replayed, or None."""
    n = name.lower()
    if n.startswith(("c10d::", "nccl", "gloo", "rccl")) or "record_param_comms" in n or "all_reduce" in n \
            or "allreduce" in n or "all_to_all" in n or "alltoall" in n or "all_gather" in n:
        return "collective: needs a process group and its peers"
    if name in DATA_DEPENDENT:
        return "data-dependent: its output shape or control flow depends on tensor values the trace does not hold"
    if "attention" in n and "backward" in n:
        return "attention backward: needs the forward's saved log-sum-exp and RNG state"
    if name in _NOT_REPLAYED:
        return _NOT_REPLAYED[name]
    if not name.startswith("aten::"):
        return "not an aten op (custom op, autograd node or annotation): no schema to rebuild it from"
    if not dims or not types:
        return "shapes not recorded (profile with record_shapes=True)"
    if not is_replayable_name(name):
        return f"not in the replayable families ({FAMILIES})"
    return None


# ------------------------------------------------------------------------------------ trace side


def _tables(trace) -> tuple[pd.DataFrame, pd.DataFrame]:
    tree = calltree.build_tree(trace.events, trace.tree_rows)
    gpu = calltree.gpu_events(trace.events)
    if len(gpu):
        gpu = calltree.attribute_gpu(gpu, tree, calltree.steps_table(tree))
    return tree, gpu


def _parent_op(tree: pd.DataFrame) -> np.ndarray:
    """Row label of the op enclosing each row's op (-1 at the top), indexed by row position."""
    labels = tree.index
    parent = tree["parent"].to_numpy()
    inner = tree["inner_op"].to_numpy()
    ppos = labels.get_indexer(parent)
    return np.where((parent >= 0) & (ppos >= 0), inner[np.maximum(ppos, 0)], -1)


def _owners_and_times(tree: pd.DataFrame, gpu: pd.DataFrame) -> tuple[pd.Series, pd.Series]:
    """(inclusive GPU ns per op row, owner op row of each GPU event's time)."""
    labels = tree.index
    parent_op = _parent_op(tree)
    is_op = tree["kind"].to_numpy() == calltree.KIND_OP
    names = tree["name"].astype(str).to_numpy()
    replayable = np.array([is_op[i] and is_replayable_name(n) for i, n in enumerate(names)], dtype=bool)
    incl = np.zeros(len(tree), dtype=np.float64)
    if gpu.empty:
        return pd.Series(incl, index=labels), pd.Series(dtype=np.int64)
    g = gpu[gpu["op_row"] >= 0]
    cur = labels.get_indexer(g["op_row"].to_numpy())
    ok = cur >= 0
    cur, dur = cur[ok], g["dur"].to_numpy()[ok].astype(np.float64)
    start = cur.copy()
    owner = np.full(len(cur), -1, dtype=np.int64)
    for _ in range(512):
        alive = cur >= 0
        if not alive.any():
            break
        np.add.at(incl, cur[alive], dur[alive])
        owner = np.where(alive & replayable[np.maximum(cur, 0)], cur, owner)  # outermost replayable so far
        nxt = parent_op[np.maximum(cur, 0)]
        cur = np.where(alive, labels.get_indexer(nxt), -1)
        cur = np.where(alive & (nxt >= 0), cur, -1)
    owner = np.where(owner >= 0, owner, start)
    return pd.Series(incl, index=labels), pd.Series(labels.to_numpy()[owner], index=g.index[ok])


@dataclass
class OpCall:
    """One recorded call of an op: its arguments and its time in the trace."""

    name: str
    rank: int
    index: int                 # the call's position among this op's calls in the trace (rank, time order)
    input_dims: list
    input_types: list
    input_strides: list
    concrete_inputs: list
    trace_us: float
    clock: str                 # "gpu": inclusive GPU time of the work it launched; "cpu": its CPU duration
    source: str = ""
    reason: str | None = None  # why it cannot be replayed (None: replayable)
    args: list = field(default_factory=list)

    @property
    def replayable(self) -> bool:
        return self.reason is None


def _call_from_row(tree, ev, label, incl_ns, has_gpu, index, source) -> OpCall:
    r = tree.loc[label]
    get = lambda col: _loads(ev.at[label, col]) if col in ev.columns else []  # noqa: E731
    dims, types, strides, conc = get("input_dims"), get("input_types"), get("input_strides"), get("concrete_inputs")
    name = str(r["name"])
    t_us = (float(incl_ns.get(label, 0.0)) if has_gpu else float(r["dur"])) / 1e3
    call = OpCall(name, int(r["rank"]), index, dims, types, strides, conc, t_us, "gpu" if has_gpu else "cpu", source)
    call.reason = why_not(name, dims, types)
    if call.reason is None:
        try:
            call.args = build_args(name, dims, types, strides, conc)
        except TraceError as e:
            call.reason = e.problem
    return call


def find_call(trace, name: str, index: int = 0) -> OpCall:
    """The ``index``-th call (rank, then time order) of op ``name``; `TraceError` when there is none."""
    tree, gpu = _tables(trace)
    ops = tree[(tree["kind"] == calltree.KIND_OP) & (tree["name"].astype(str) == name)]
    src = _source(trace)
    if ops.empty:
        known = tree.loc[tree["kind"] == calltree.KIND_OP, "name"].astype(str).value_counts().index[:8]
        raise TraceError(src, f"replay: no op named {name!r} in the trace (most frequent: {', '.join(known)})")
    ops = ops.sort_values(["rank", "ts"], kind="mergesort")
    if not 0 <= index < len(ops):
        raise TraceError(src, f"replay: {name} has {len(ops)} call(s); --index {index} is out of range")
    incl, _ = _owners_and_times(tree, gpu)
    return _call_from_row(tree, trace.events, ops.index[index], incl, not gpu.empty, index, src)


def _source(trace) -> str:
    files = [r.path for r in getattr(trace, "ranks", [])]
    if files:
        return str(files[0]) if len(files) == 1 else str(Path(str(files[0])).parent)
    return "trace"


def candidates(trace) -> pd.DataFrame:
    """One row per (op, signature) that owns time in the trace: op, input dims/types, count, total and mean
    trace time (us), clock (gpu/cpu), replayable, reason, and the label of its first call (``first``).

    With GPU activity, owners are the outermost replayable ops on the kernels' launch stacks (else the
    innermost op, with its reason); without, every op that no replayable op encloses, timed on the CPU.
    """
    tree, gpu = _tables(trace)
    ev = trace.events
    incl, owner = _owners_and_times(tree, gpu)
    has_gpu = not gpu.empty
    if has_gpu:
        rows = pd.Index(np.unique(owner.to_numpy()))
    else:
        is_op = tree["kind"].to_numpy() == calltree.KIND_OP
        names = tree["name"].astype(str).to_numpy()
        repl = np.array([is_op[i] and is_replayable_name(n) for i, n in enumerate(names)], dtype=bool)
        parent_op = _parent_op(tree)
        # drop ops enclosed by a replayable op (their time is inside it)
        enclosed = np.zeros(len(tree), dtype=bool)
        cur = tree.index.get_indexer(parent_op)
        for _ in range(512):
            alive = cur >= 0
            if not alive.any():
                break
            enclosed |= alive & repl[np.maximum(cur, 0)]
            nxt = parent_op[np.maximum(cur, 0)]
            cur = np.where(alive & (nxt >= 0), tree.index.get_indexer(nxt), -1)
        keep = is_op & ~enclosed & (tree["input_dims"].astype(str).to_numpy() != "")
        rows = tree.index[keep]
    if not len(rows):
        return pd.DataFrame(columns=["op", "input_dims", "input_types", "count", "trace_us", "mean_us", "clock",
                                     "replayable", "reason", "first", "index"])

    def col(c):
        return (ev.loc[rows, c].astype(object).where(ev.loc[rows, c].notna(), "").astype(str).to_numpy()
                if c in ev.columns else np.full(len(rows), "", dtype=object))

    t = pd.DataFrame({
        "label": rows, "op": tree.loc[rows, "name"].astype(str).to_numpy(), "rank": tree.loc[rows, "rank"].to_numpy(),
        "ts": tree.loc[rows, "ts"].to_numpy(),
        "input_dims": col("input_dims"), "input_types": col("input_types"),
        "input_strides": col("input_strides"), "concrete_inputs": col("concrete_inputs"),
        "us": (incl.loc[rows].to_numpy() if has_gpu else tree.loc[rows, "dur"].to_numpy().astype(float)) / 1e3,
    })
    # call index of each row among all calls of its op (rank, time order), for `--op NAME --index K`
    all_ops = tree[tree["kind"] == calltree.KIND_OP]
    all_ops = all_ops[all_ops["name"].astype(str).isin(set(t["op"]))].sort_values(["rank", "ts"], kind="mergesort")
    order = all_ops.groupby(all_ops["name"].astype(str), sort=False).cumcount()
    t["index"] = order.reindex(t["label"]).to_numpy()
    keys = ["op", "input_dims", "input_types", "input_strides", "concrete_inputs"]
    t = t.sort_values(["rank", "ts"], kind="mergesort")
    agg = t.groupby(keys, sort=False).agg(count=("us", "size"), trace_us=("us", "sum"), first=("label", "first"),
                                          index=("index", "first")).reset_index()
    agg["mean_us"] = agg["trace_us"] / agg["count"]
    agg["clock"] = "gpu" if has_gpu else "cpu"
    reasons = []
    for r in agg.itertuples(index=False):
        reason = why_not(r.op, _loads(r.input_dims), _loads(r.input_types))
        if reason is None:
            try:
                build_args(r.op, _loads(r.input_dims), _loads(r.input_types), _loads(r.input_strides),
                           _loads(r.concrete_inputs))
            except TraceError as e:
                reason = e.problem
        reasons.append(reason)
    agg["reason"] = reasons
    agg["replayable"] = agg["reason"].isna()
    return agg.sort_values("trace_us", ascending=False, kind="mergesort").reset_index(drop=True)


def top_calls(trace, n: int) -> tuple[list[OpCall], pd.DataFrame]:
    """The first call of each of the ``n`` op signatures with the most trace time, and the candidates table."""
    cands = candidates(trace)
    tree, gpu = _tables(trace)
    incl, _ = _owners_and_times(tree, gpu)
    src = _source(trace)
    calls = [_call_from_row(tree, trace.events, int(r.first), incl, not gpu.empty, int(r.index), src)
             for r in cands.head(n).itertuples(index=False)]
    for c, r in zip(calls, cands.head(n).itertuples(index=False)):
        c.trace_us = float(r.mean_us)  # mean over the signature's calls: a steadier reference than one call
    return calls, cands


# ------------------------------------------------------------------------------------ the script


def script_name(call: OpCall) -> str:
    base = re.sub(r"[^A-Za-z0-9]+", "_", call.name.replace("aten::", "")).strip("_") or "op"
    return f"replay_{base}_{call.index}.py"


_TEMPLATE = '''#!/usr/bin/env python3
"""Replay of one op recorded in a PyTorch profiler trace (which op, call, rank and trace: see SPEC below).

Generated by `tracelens replay`: rebuilds the op's inputs from the recorded shapes, dtypes and strides with
random values, runs it on CUDA when available (else the CPU), and prints one JSON line with the measured
time next to the trace's. Needs only torch.
    python {script} [--iters N] [--warmup N] [--cpu]
"""
import argparse
import json
import sys
import time

import torch

# Everything taken from the trace (op name, source path, recorded arguments) is data in this one JSON string,
# decoded at run time: no trace text is ever part of this script's code.
SPEC = json.loads({spec})
OP = SPEC["op"]
ARGS = SPEC["args"]
TRACE_US = SPEC["trace_us"]
TRACE_CLOCK = SPEC["trace_clock"]
NOTES = SPEC["notes"]


def storage_numel(shape, stride):
    if any(n == 0 for n in shape):
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(shape, stride))


def make_tensor(spec, device, int_high):
    dtype = getattr(torch, spec["dtype"])
    shape, stride = spec["shape"], spec["stride"]
    n = storage_numel(shape, stride)
    if spec.get("fill") == "offsets":  # grouped GEMM group ends: an even split of the grouped dimension
        groups = shape[0] if shape else 1
        flat = (torch.arange(1, groups + 1, dtype=torch.int64) * spec["total"] // groups).to(dtype)
    elif dtype == torch.bool:
        flat = torch.randint(0, 2, (n,), dtype=torch.bool)
    elif dtype.is_floating_point or dtype.is_complex:
        flat = torch.randn(n, dtype=torch.float32).to(dtype)
    else:  # indices: within the smallest dimension of the floating-point inputs, valid for any indexed dim
        flat = torch.randint(0, max(int_high, 1), (n,), dtype=torch.int64).to(dtype)
    flat = flat.to(device)
    return flat.as_strided(shape, stride)


def build(device):
    float_dims = [d for a in ARGS if a["kind"] == "tensor" and a["dtype"].startswith(("float", "bfloat", "complex"))
                  for d in a["shape"] if d > 0]
    int_high = min(float_dims) if float_dims else 2
    out = []
    for a in ARGS:
        if a["kind"] == "tensor":
            out.append(make_tensor(a, device, int_high))
        elif a["kind"] == "value":
            out.append(a["value"])
        else:
            out.append(None)
    return out


def _matches(schema, args):
    if len(schema.arguments) != len(args):
        return False
    for arg, val in zip(schema.arguments, args):
        t = str(arg.type)
        optional = t.startswith("Optional[")
        inner = t[len("Optional["):-1] if optional else t
        if val is None:  # an absent argument: any optional one, a Tensor? included
            if not optional:
                return False
            continue
        if isinstance(val, torch.Tensor) != (inner == "Tensor"):
            return False
    return True


def resolve(args):
    """(callable, positional args, keyword args): the overload whose schema matches the recorded arguments;
    keyword-only arguments are passed by name."""
    ns, name = OP.split("::", 1)
    packet = getattr(getattr(torch.ops, ns), name.split(".", 1)[0])  # a recorded overload suffix is dropped
    for ov in packet.overloads():
        fn = getattr(packet, ov)
        if _matches(fn._schema, args):
            pos = [v for a, v in zip(fn._schema.arguments, args) if not a.kwarg_only]
            kw = {{a.name: v for a, v in zip(fn._schema.arguments, args) if a.kwarg_only}}
            return fn, pos, kw
    return packet, list(args), {{}}


def sdpa_fallback(args):
    """Backend-specific attention ops exist on some devices only: run the same q, k, v through the generic op."""
    q, k, v = args[:3]
    causal = next((a for a in args[3:] if isinstance(a, bool)), False)
    return torch.ops.aten.scaled_dot_product_attention.default, [q, k, v], {{"is_causal": causal}}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--cpu", action="store_true", help="run on the CPU even when CUDA is available")
    opt = p.parse_args()
    device = "cuda" if torch.cuda.is_available() and not opt.cpu else "cpu"
    print(f"replay {{OP}} (call {{SPEC['index']}} on rank {{SPEC['rank']}} of {{SPEC['source']}}) on {{device}}"
          + ("" if device == "cuda" else " (no CUDA: CPU fallback, times not comparable)"), file=sys.stderr)
    torch.manual_seed(0)
    args = build(device)
    fn, pos, kw = resolve(args)
    notes = list(NOTES)
    try:
        try:
            fn(*pos, **kw)
        except (RuntimeError, NotImplementedError) as e:
            if "scaled_dot_product" not in OP:
                raise
            fn, pos, kw = sdpa_fallback(args)
            notes.append(f"{{OP}} unavailable on {{device}} ({{str(e).splitlines()[0][:120]}}); ran scaled_dot_product_attention")
            fn(*pos, **kw)
    except Exception as e:  # the op rejects these inputs on this device: say so, with the shapes built
        report(args, device, fn, None, notes + [f"error: {{type(e).__name__}}: {{str(e).splitlines()[0][:200]}}"])
        sys.exit(3)
    for _ in range(opt.warmup):
        fn(*pos, **kw)
    if device == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(opt.iters):
            fn(*pos, **kw)
        end.record()
        torch.cuda.synchronize()
        us = start.elapsed_time(end) * 1e3 / max(opt.iters, 1)
    else:
        t0 = time.perf_counter()
        for _ in range(opt.iters):
            fn(*pos, **kw)
        us = (time.perf_counter() - t0) * 1e6 / max(opt.iters, 1)
    report(args, device, fn, us, notes)


def report(args, device, fn, us, notes):
    print(json.dumps({{
        "op": OP, "overload": str(getattr(fn, "_overloadname", "")),
        "shapes": [list(a.shape) if isinstance(a, torch.Tensor) else None for a in args],
        "dtypes": [str(a.dtype).replace("torch.", "") if isinstance(a, torch.Tensor) else None for a in args],
        "strides": [list(a.stride()) if isinstance(a, torch.Tensor) else None for a in args],
        "device": device, "device_name": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "measured_us": None if us is None else round(us, 3), "trace_us": TRACE_US, "trace_clock": TRACE_CLOCK,
        "notes": notes,
    }}))


if __name__ == "__main__":
    main()
'''


def render_script(call: OpCall, script: str = "replay.py") -> str:
    """The standalone script's text for a replayable call (raises `TraceError` otherwise)."""
    if not call.replayable:
        raise TraceError(call.source, f"replay: {call.name} cannot be replayed: {call.reason}")
    notes = []
    if call.name in ("aten::_grouped_mm", "aten::_scaled_grouped_mm"):
        notes.append("group offsets are data the trace does not record: the grouped dimension is split evenly")
    spec = {"op": call.name, "index": call.index, "rank": call.rank, "source": call.source,
            "trace_us": round(call.trace_us, 3), "trace_clock": call.clock, "notes": notes, "args": call.args}
    # data goes in as data: one ASCII JSON document inside one Python string literal (repr escapes every quote,
    # backslash and line break), whatever the trace's op name, path or values hold
    text = json.dumps(spec, ensure_ascii=True, allow_nan=True)
    return _TEMPLATE.format(spec=repr(text), script=_safe_script_name(script))


def _safe_script_name(name: str) -> str:
    """The script's own file name for its usage line: shown in the docstring, so only plain characters."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name) or "replay.py"


def write_script(call: OpCall, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_script(call, path.name))
    return path
