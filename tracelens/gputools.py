"""Plain-Python helpers of the two GPU-side commands, `tracelens kernels tune` and `tracelens calibrate`:
argument parsing and the text tables they print.  No torch here: the measuring itself lives in
`kernels/` (`kernels.tune_table`, `kernels.calibrate`), which the CLI imports lazily inside the
command, so `import tracelens` stays free of torch.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from . import devices

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def parse_shape(text: str) -> tuple[int, int, int, int]:
    """``"T,K,N,E"`` (or with ``x`` between the numbers) -> (T, K, N, E): a grouped GEMM
    ``[T, K] x [E, K, N]``.  ``ValueError`` with a one-line message otherwise."""
    parts = text.replace("x", ",").replace("X", ",").split(",")
    try:
        vals = tuple(int(p) for p in parts)
    except ValueError:
        vals = ()
    if len(vals) != 4 or min(vals) < 1:
        raise ValueError(f"--shapes {text!r}: expected T,K,N,E (rows, K, N, experts: four positive integers)")
    return vals  # type: ignore[return-value]


def format_tune_rows(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """One line per (shape, pass, backend), winners marked with ``*``; errors in place of the time."""
    out = [f"{'pass':<4} {'T':>7} {'K':>6} {'N':>6} {'E':>4}  {'backend':<12} {'ms':>10} {'TFLOP/s':>8}"]
    for r in rows:
        if r.get("ms") is None:
            tail = f"{'-':>10} {'-':>8}  {(r.get('error') or 'not run')[:90]}"
        else:
            tail = f"{r['ms']:>10.4f} {r['tflops'] or 0:>8.3g}" + ("  *" if r.get("winner") else "")
        out.append(f"{r['pass']:<4} {r['T']:>7} {r['K']:>6} {r['N']:>6} {r['E']:>4}  {r['backend']:<12} {tail}")
    return out


def winners_by_shape(rows: Sequence[Mapping[str, Any]]) -> dict[tuple, dict[str, str]]:
    """(T, K, N, E) -> {pass: winning backend} from tune rows."""
    won: dict[tuple, dict[str, str]] = {}
    for r in rows:
        if r.get("winner"):
            won.setdefault((r["T"], r["K"], r["N"], r["E"]), {})[r["pass"]] = r["backend"]
    return won


_LABELS = (("bf16_tflops", "bf16 matmul", "TFLOP/s"), ("fp16_tflops", "fp16 matmul", "TFLOP/s"),
           ("tf32_tflops", "tf32 matmul", "TFLOP/s"), ("fp32_tflops", "fp32 matmul (no TF32)", "TFLOP/s"),
           ("hbm_tbps", "memory bandwidth", "TB/s"))


def format_ceilings(doc: Mapping[str, Any], memory: Mapping[str, float] | None = None) -> list[str]:
    """The measured ceilings, each beside the datasheet figure of the same device where one is known."""
    sheet = devices.lookup(str(doc.get("device", "")))
    out = [f"device: {doc.get('device')}" + (f" (datasheet: {sheet.device})" if sheet else "")]
    for key, label, unit in _LABELS:
        if key not in doc:
            continue
        ref = getattr(sheet, key, None) if sheet else None
        vs = f"  ({100 * doc[key] / ref:.0f}% of the datasheet's {ref:g})" if ref else ""
        out.append(f"  {label:<22} {doc[key]:>10.3f} {unit}{vs}")
    if memory:
        out.append(f"    (copy {memory['copy_tbps']:.3f} TB/s counting bytes read and written; read-only "
                   f"{memory['read_tbps']:.3f} TB/s)")
    return out
