#!/usr/bin/env python3
"""Tile a real multi-rank run into many ranks (for the many-rank benchmark and tests).

Replica j of a K-rank source run becomes ranks K*j .. K*j+K-1 of an N-rank world: each file's
distributedInfo (rank, world_size, pg_config), its events' process-group names and ranks, and the peers
named in `nccl:send/recv a->b` annotations are rewritten, so every replica is its own set of process
groups and rank ids are distinct and consistent (file name = distributedInfo rank). With several source
runs, replica j copies run j % len(runs).

With --target-mb every source rank is first tiled in time to about that size (as
benchmarks/scale_trace.py does: copy c shifted by c * period, ids offset, profiler steps renumbered),
with one period and one copy count for all ranks of a run, so the ranks' steps stay aligned.

    python benchmarks/tile_ranks.py tests/fixtures/h200_ep2_run/L0_loop/traces /tmp/ranks64 --ranks 64 --target-mb 200
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import sys
import tempfile
from pathlib import Path

import msgspec

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from scale_trace import _STEP, _load, _max_id, shifted_copy  # noqa: E402

_PG_NAME = re.compile(rb'("Process Group Name": ?")([^"]*)(")')
_PG_RANKS = re.compile(rb'("Process Group Ranks": ?")\[([0-9, ]*)\](")')
_PEERS = re.compile(rb'("name": ?"nccl:[a-zA-Z_]*[^"]*?)(\d+)(\s*(?:->|<-)\s*)(\d+)')


def _rank_files(src: str | os.PathLike) -> list[Path]:
    p = Path(src)
    if p.is_file():
        return [p]
    if (p / "traces").is_dir():
        p = p / "traces"
    files = sorted((f for f in p.iterdir() if f.name.endswith((".json", ".json.gz"))),
                   key=lambda f: int(re.search(r"rank[-_]?(\d+)", f.name).group(1)))
    if not files:
        raise SystemExit(f"{src}: no rank trace files")
    return files


def tile_time(files: list[Path], out_dir: Path, target_mb: float) -> list[Path]:
    """Tile every rank of one run in time to about target_mb each, with one period and copy count."""
    docs = [_load(str(f)) for f in files]
    spans, timed_all, meta_all = [], [], []
    for doc in docs:
        events = doc.pop("traceEvents")
        timed = [e for e in events if e.get("ph") != "M" and "ts" in e]
        timed_all.append(timed)
        meta_all.append([e for e in events if not (e.get("ph") != "M" and "ts" in e)])
        spans.append((min(float(e["ts"]) for e in timed), max(float(e["ts"]) + float(e.get("dur", 0) or 0) for e in timed)))
    t0 = min(s for s, _ in spans)
    period = round((max(e for _, e in spans) - t0) * 1.05 + 10.0, 3)
    enc = msgspec.json.Encoder()
    one = max(sum(len(enc.encode(e)) + 1 for e in timed) for timed in timed_all)
    copies = max(1, int(target_mb * 1e6 / one))
    outs = []
    for f, doc, timed, meta in zip(files, docs, timed_all, meta_all):
        id_step = _max_id(timed) + 1
        steps = {int(m.group(2)) for e in timed if (m := _STEP.match(str(e.get("name", ""))))}
        step_span = (max(steps) - min(steps) + 1) if steps else 0
        out = out_dir / (f.name[:-3] if f.name.endswith(".gz") else f.name)
        with open(out, "wb") as fh:
            head = enc.encode(doc)[:-1]
            fh.write(head + (b',"traceEvents":[' if len(head) > 1 else b'"traceEvents":['))
            fh.write(b",".join(enc.encode(e) for e in meta))
            first = not meta
            for c in range(copies):
                buf = [enc.encode(shifted_copy(e, c, period, id_step, step_span)) for e in timed]
                fh.write((b"" if first else b",") + b",".join(buf))
                first = False
            fh.write(b"]}")
        outs.append(out)
    return outs


def _read(path: Path) -> bytes:
    data = path.read_bytes()
    return gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data


def rewrite(data: bytes, k: int, j: int, world: int) -> bytes:
    """One rank file of replica j (K = k ranks per replica) with its ranks and groups renamed."""
    def rank(r: int) -> int:
        return k * j + r

    m = re.search(rb'"distributedInfo": ?\{', data[: 1 << 20]) or re.search(rb'"distributedInfo": ?\{', data)
    if m is None:
        raise SystemExit("a source file has no distributedInfo")
    start = m.end() - 1
    text = data[start:start + (1 << 16)].decode("utf-8", "replace")
    info, used = json.JSONDecoder().raw_decode(text)
    end = start + len(text[:used].encode("utf-8"))
    info["rank"] = rank(int(info["rank"]))
    info["world_size"] = world
    for pg in info.get("pg_config") or []:
        pg["pg_name"] = f"{pg['pg_name']}.r{j}"
        pg["ranks"] = [rank(int(r)) for r in pg.get("ranks") or []]
    data = data[:start] + json.dumps(info).encode() + data[end:]
    data = _PG_NAME.sub(lambda m: m.group(1) + m.group(2) + b".r" + str(j).encode() + m.group(3), data)
    data = _PG_RANKS.sub(lambda m: m.group(1) + b"[" + b", ".join(
        str(rank(int(x))).encode() for x in m.group(2).split(b",") if x.strip()) + b"]" + m.group(3), data)
    return _PEERS.sub(lambda m: m.group(1) + str(rank(int(m.group(2)))).encode() + m.group(3)
                      + str(rank(int(m.group(4)))).encode(), data)


def tile_ranks(sources: list[str | os.PathLike], n_ranks: int, out_dir: str | os.PathLike,
               target_mb: float | None = None, gz: bool = False) -> list[Path]:
    """Write n_ranks rank files (rank<N>.json[.gz]) into out_dir from the source runs; returns them."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    runs = [_rank_files(s) for s in sources]
    k = len(runs[0])
    if any(len(r) != k for r in runs) or n_ranks % k:
        raise SystemExit(f"every source run needs the same rank count, dividing --ranks ({n_ranks})")
    written = []
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        templates = []
        for i, files in enumerate(runs):
            if target_mb:
                d = Path(tmp) / f"run{i}"
                d.mkdir()
                files = tile_time(files, d, target_mb)
            templates.append(files)
        for j in range(n_ranks // k):
            for r, f in enumerate(templates[j % len(templates)]):
                data = rewrite(_read(f), k, j, n_ranks)
                path = out / f"rank{k * j + r}.json{'.gz' if gz else ''}"
                if gz:
                    with gzip.open(path, "wb", compresslevel=1) as fh:
                        fh.write(data)
                else:
                    path.write_bytes(data)
                written.append(path)
                del data
    return written


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sources", nargs="+", help="source runs (run dir, its traces/ dir, or a dir of rank files)")
    ap.add_argument("out")
    ap.add_argument("--ranks", type=int, required=True)
    ap.add_argument("--target-mb", type=float, default=None, help="tile each rank in time to about this size (MB)")
    ap.add_argument("--gz", action="store_true", help="write .json.gz")
    a = ap.parse_args(argv)
    files = tile_ranks(a.sources, a.ranks, a.out, a.target_mb, a.gz)
    total = sum(f.stat().st_size for f in files)
    print(f"{a.out}: {len(files)} rank files, {total / 1e6:.1f} MB on disk", file=sys.stderr)


if __name__ == "__main__":
    main()
