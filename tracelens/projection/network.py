"""The network model of the scale-out projection: collective times on GPUs over several nodes.

    >>> from tracelens.projection import network as N
    >>> net = N.network(intra=N.measured_intra(model), path="net.yaml", gpus_per_node=8)
    >>> net.all_to_all(256 * 2**20, n=16)          # ns: one all-to-all of a 256 MiB buffer over 16 ranks
    >>> net.collective("all_gather", 1 * 2**30, n=64, stride=8)
    >>> print(net.describe())                       # every figure and where it came from

Every figure carries its source: *measured* (from the profiled run's trace), *assumed* (a documented default) or
the file / flag that gave it.

* **Intra-node**: bus bandwidth per collective family, group size and message size, measured from the run's trace
  (`tracelens comm`'s transfer times, read by the what-if layout mechanism: `mechanisms.layout.Bandwidth`; a
  pipelined run without collectives: its p2p hand-offs, `mechanisms.pp_layout.link_bandwidth`). The measured bus
  bandwidth at the nearest message size already holds the latency of a message of that size: no separate intra-node
  latency is added. A 1-GPU run measures nothing: ``intra_node_busbw_gb_s`` (assumed 360 GB/s, NVLink 4 rings as
  nccl-tests measure them on H100 / H200 SXM) unless the file or a flag gives it.
* **Inter-node**: ``inter_node_gbps`` Gb/s per GPU (one NIC per GPU, rail-optimized: assumed 400 Gb/s InfiniBand
  NDR) x ``inter_node_efficiency`` (assumed 0.9 of the line rate reaches the collective), and
  ``inter_node_latency_us`` per message step (assumed 5 us).
* **Groups and nodes**: ``gpus_per_node`` consecutive ranks per node (assumed 8). A group of ``n`` ranks ``stride``
  apart has ``min(n, max(gpus_per_node // stride, 1))`` members per node and spans ``n / that`` nodes.
* **Hierarchical collectives** (alpha-beta): within a node, ``S (n-1)/n / busbw`` for a ring all-gather or
  reduce-scatter of an ``S``-byte buffer (twice the data for an all-reduce) at the measured bus bandwidth. Across
  ``k`` nodes of ``g`` members each: the intra-node phase over ``g`` ranks on the whole buffer, then the inter-node
  phase over ``k`` ranks on the ``S/g`` bytes each GPU is responsible for, on its own NIC: ring ``(k-1) alpha +
  (k-1)/k S/g / B`` (all-gather, reduce-scatter), all-reduce the faster of a ring ``2(k-1) alpha + 2(k-1)/k S/g / B``
  and a double binary tree ``2 ceil(log2 k) alpha + 2 S/g / B`` (reduce-scatter and all-gather inside the node
  around it). The phases run one after the other (an upper bound on NCCL, which pipelines them over channels).
* **All-to-all**: each GPU sends ``S/n`` to every member; the ``(g-1)/n`` share to on-node peers goes at the
  measured all-to-all bus bandwidth, the ``(n-g)/n`` share to off-node peers on its NIC, both at once: the slower
  of the two, plus one inter-node latency when the group spans nodes.
* **Point-to-point** (pipeline hand-offs): the measured link within a node, the NIC across nodes.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from .mechanisms.base import WhatIfError

# documented defaults (docs/whatif.md, "Scale-out projection and the planner"): every one is marked assumed
GPUS_PER_NODE = 8
INTER_NODE_GBPS = 400.0  # Gb/s per GPU: one 400 Gb/s NIC per GPU (InfiniBand NDR, rail-optimized)
INTER_NODE_EFFICIENCY = 0.9  # share of the line rate a collective reaches
INTER_NODE_LATENCY_US = 5.0  # per message step across nodes
INTRA_NODE_BUSBW_GB_S = 360.0  # NVLink 4 ring bus bandwidth (nccl-tests on H100 / H200 SXM), when nothing is measured

FIELDS = {  # file key -> (type, minimum exclusive, meaning)
    "gpus_per_node": (int, 0, "GPUs per node"),
    "inter_node_gbps": (float, 0, "inter-node bandwidth per GPU, Gb/s (line rate)"),
    "inter_node_efficiency": (float, 0, "share of the inter-node line rate a collective reaches (0-1]"),
    "inter_node_latency_us": (float, -1e-12, "inter-node latency per message step, us"),
    "intra_node_busbw_gb_s": (float, 0, "intra-node bus bandwidth, GB/s (default: measured from the run)"),
}

IntraLookup = Callable[[str, int, float], "tuple[float, str]"]  # (family, group size, bytes) -> (GB/s, source)


class NetworkError(WhatIfError):
    """A network description that cannot be used: one line naming the file or flag and the problem."""


@dataclass(frozen=True)
class Network:
    """Link figures and where each came from (``sources``: field -> "measured ...", "assumed", a file, a flag)."""

    gpus_per_node: int = GPUS_PER_NODE
    inter_node_gbps: float = INTER_NODE_GBPS
    inter_node_efficiency: float = INTER_NODE_EFFICIENCY
    inter_node_latency_us: float = INTER_NODE_LATENCY_US
    intra_node_busbw_gb_s: float | None = None  # None: the run's measured bandwidth (``intra``)
    intra: IntraLookup | None = field(default=None, compare=False, repr=False)
    intra_source: str = ""  # what ``intra`` measures, in words
    sources: dict = field(default_factory=dict, compare=False)

    # ------------------------------------------------------------------ links
    @property
    def inter_bytes_per_ns(self) -> float:
        """The NIC's bytes per ns for one GPU (Gb/s x efficiency / 8)."""
        return self.inter_node_gbps * self.inter_node_efficiency / 8.0

    @property
    def alpha_ns(self) -> float:
        return self.inter_node_latency_us * 1e3

    def intra_busbw(self, family: str, n: int, nbytes: float) -> tuple[float, str]:
        """(GB/s, source) of a collective of ``nbytes`` over ``n`` ranks inside one node."""
        if self.intra_node_busbw_gb_s is not None:
            return self.intra_node_busbw_gb_s, self.sources.get("intra_node_busbw_gb_s", "given")
        if self.intra is not None:
            return self.intra(family, n, nbytes)
        return INTRA_NODE_BUSBW_GB_S, "assumed"

    def span(self, n: int, stride: int = 1) -> tuple[int, int]:
        """(members per node, nodes) of a group of ``n`` ranks ``stride`` apart (consecutive ranks fill a node)."""
        per = min(n, max(self.gpus_per_node // max(stride, 1), 1))
        return per, math.ceil(n / per)

    # ------------------------------------------------------------------ collectives (ns)
    def _intra_ring(self, family: str, nbytes: float, g: int) -> float:
        if g <= 1 or nbytes <= 0:
            return 0.0
        bw, _ = self.intra_busbw(family, g, nbytes)
        return nbytes * (g - 1) / g / bw  # GB/s == bytes per ns

    def _inter_ring(self, nbytes: float, k: int, passes: int) -> float:
        """``passes`` ring passes (1: all-gather / reduce-scatter, 2: all-reduce) of ``nbytes`` over ``k`` nodes."""
        if k <= 1 or nbytes <= 0:
            return 0.0
        return passes * ((k - 1) * self.alpha_ns + (k - 1) / k * nbytes / self.inter_bytes_per_ns)

    def _inter_tree(self, nbytes: float, k: int) -> float:
        """Double binary tree all-reduce of ``nbytes`` over ``k`` nodes (reduce up, broadcast down, pipelined)."""
        if k <= 1 or nbytes <= 0:
            return 0.0
        return 2 * math.ceil(math.log2(k)) * self.alpha_ns + 2 * nbytes / self.inter_bytes_per_ns

    def collective(self, family: str, nbytes: float, n: int, stride: int = 1) -> float:
        """ns of one ring collective of an ``nbytes`` buffer (the all-gather's output, the reduce-scatter's input, the
        all-reduce's buffer) over ``n`` ranks ``stride`` apart: hierarchical when the group spans nodes (module
        docstring). ``family``: all_gather, reduce_scatter, all_reduce."""
        if family not in ("all_gather", "reduce_scatter", "all_reduce"):
            raise ValueError(f"no cost model for collective {family!r}")
        if n <= 1 or nbytes <= 0:
            return 0.0
        g, k = self.span(n, stride)
        if family == "all_reduce":
            inside = self._intra_ring("reduce_scatter", nbytes, g) + self._intra_ring("all_gather", nbytes, g) \
                if k > 1 else 2 * self._intra_ring("all_reduce", nbytes, g)
            return inside + min(self._inter_ring(nbytes / g, k, 2), self._inter_tree(nbytes / g, k))
        return self._intra_ring(family, nbytes, g) + self._inter_ring(nbytes / g, k, 1)

    def all_to_all(self, nbytes: float, n: int, stride: int = 1) -> float:
        """ns of one all-to-all in which each GPU sends an ``nbytes`` buffer (``nbytes / n`` to each member, itself
        included) over ``n`` ranks ``stride`` apart: the on-node share at the measured all-to-all bus bandwidth and
        the off-node share on the NIC at once (the slower decides), one inter-node latency when it spans nodes."""
        if n <= 1 or nbytes <= 0:
            return 0.0
        g, k = self.span(n, stride)
        on = nbytes * g / n  # the bytes for the on-node members, as an all-to-all over those g ranks
        t_on = self._intra_ring("all_to_all", on, g) if g > 1 else 0.0
        if k == 1:
            return t_on
        t_off = nbytes * (n - g) / n / self.inter_bytes_per_ns
        return max(t_on, t_off) + self.alpha_ns

    def p2p(self, nbytes: float, cross_node: bool) -> float:
        """ns of one point-to-point transfer (a pipeline hand-off): the NIC across nodes, else the measured link."""
        if nbytes <= 0:
            return 0.0
        if cross_node:
            return self.alpha_ns + nbytes / self.inter_bytes_per_ns
        bw, _ = self.intra_busbw("p2p", 2, nbytes)
        return nbytes / bw

    # ------------------------------------------------------------------ words
    def describe(self) -> list[str]:
        """One line per figure: its value and where it came from."""
        src = self.sources
        intra = (f"{self.intra_node_busbw_gb_s:g} GB/s bus bandwidth ({src.get('intra_node_busbw_gb_s', 'given')})"
                 if self.intra_node_busbw_gb_s is not None else
                 f"the run's measured bus bandwidth per collective, group size and message size ({self.intra_source})"
                 if self.intra is not None else f"{INTRA_NODE_BUSBW_GB_S:g} GB/s bus bandwidth (assumed: the run "
                 "measured no collective)")
        return [f"gpus per node: {self.gpus_per_node} ({src.get('gpus_per_node', 'assumed')})",
                f"intra-node: {intra}",
                (f"inter-node: {self.inter_node_gbps:g} Gb/s per GPU ({src.get('inter_node_gbps', 'assumed')}) x "
                f"{self.inter_node_efficiency:g} efficiency ({src.get('inter_node_efficiency', 'assumed')}) = "
                f"{self.inter_bytes_per_ns:.1f} GB/s per GPU, {self.inter_node_latency_us:g} us per message step "
                 f"({src.get('inter_node_latency_us', 'assumed')})"),
                ("collectives: hierarchical ring (all-gather, reduce-scatter; all-reduce the faster of ring and double "
                "binary tree across nodes), intra-node phase then inter-node phase on S/g bytes per GPU; all-to-all: "
                "the off-node share of the bytes on the NIC, the on-node share on the measured link, at once")]

    def as_dict(self) -> dict:
        return {"gpus_per_node": self.gpus_per_node, "inter_node_gbps": self.inter_node_gbps,
                "inter_node_efficiency": self.inter_node_efficiency,
                "inter_node_latency_us": self.inter_node_latency_us,
                "intra_node_busbw_gb_s": self.intra_node_busbw_gb_s,
                "intra_node": self.intra_source if self.intra is not None and self.intra_node_busbw_gb_s is None
                else None, "sources": dict(self.sources)}


def _checked(key: str, value, where: str) -> float | int:
    typ, low, meaning = FIELDS[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise NetworkError(f"{where}: {key}: expected a number ({meaning}), got {str(value)[:40]!r}")
    if typ is int and int(value) != value:
        raise NetworkError(f"{where}: {key}: expected a whole number ({meaning}), got {value!r}")
    if value <= low:
        raise NetworkError(f"{where}: {key}: must be > {max(low, 0):g} ({meaning}), got {value!r}")
    if key == "inter_node_efficiency" and value > 1:
        raise NetworkError(f"{where}: {key}: must be at most 1 ({meaning}), got {value!r}")
    return typ(value)


def read_network_file(path: str | Path) -> dict:
    """The fields of a network description (YAML or JSON mapping; keys in :data:`FIELDS`), checked: one line naming
    the file and the first problem otherwise."""
    from moespec.yaml_bounded import safe_load

    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise NetworkError(f"{p}: cannot read the network file ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise NetworkError(f"{p}: not a UTF-8 text file (byte {e.start}): a YAML or JSON network description "
                           "was expected") from None
    try:
        doc = json.loads(text) if p.suffix == ".json" else safe_load(text)
    except ValueError as e:
        raise NetworkError(f"{p}: not a JSON document ({' '.join(str(e).split())[:120]})") from None
    except Exception as e:  # a YAML syntax error: one line
        if type(e).__module__.startswith("yaml") or isinstance(e, RecursionError):
            raise NetworkError(f"{p}: not valid YAML ({' '.join(str(e).split())[:120]})") from None
        raise
    if not isinstance(doc, dict):
        raise NetworkError(f"{p}: expected a mapping of {', '.join(FIELDS)}")
    unknown = [k for k in doc if k not in FIELDS]
    if unknown:
        raise NetworkError(f"{p}: unknown field {str(unknown[0])[:40]!r} (fields: {', '.join(FIELDS)})")
    return {k: _checked(k, v, str(p)) for k, v in doc.items() if v is not None}


# The command-line flag of a field whose name is not the flag's (`--intra-node-busbw`, not `--intra-node-busbw-gb-s`)
_FLAGS = {"intra_node_busbw_gb_s": "--intra-node-busbw"}


def network(intra: IntraLookup | None = None, intra_source: str = "", path: str | Path | None = None,
            **flags) -> Network:
    """The network model: defaults (assumed), then the file's fields, then the flags (None: not given);
    ``intra`` is the run's measured intra-node bandwidth (see :func:`measured_intra`)."""
    unknown = [k for k in flags if k not in FIELDS]
    if unknown:
        raise NetworkError(f"unknown network field {unknown[0]!r}")
    vals: dict = {}
    sources: dict = {}
    if path is not None:
        for k, v in read_network_file(path).items():
            vals[k], sources[k] = v, str(path)
    for k, v in flags.items():
        if v is not None:
            flag = _FLAGS.get(k, "--" + k.replace("_", "-"))
            vals[k], sources[k] = _checked(k, v, flag), flag
    return replace(Network(intra=intra, intra_source=intra_source), **vals, sources=sources)


def measured_intra(model) -> tuple[IntraLookup | None, str]:
    """The run's measured intra-node bus bandwidth as a lookup (family, group size, bytes) -> (GB/s, source), and
    what it measures in words; (None, why) for a run without collectives or p2p (one GPU)."""
    from .mechanisms import pp_layout as PPL

    b = model.measured.get("layout")
    if (b is None or not len(b.bw.table)) and model.measured.get("pp_layout") is None:
        return None, "the run has no collective or p2p kernel"

    @functools.lru_cache(maxsize=4096)
    def lookup(family: str, n: int, nbytes: float) -> tuple[float, str]:
        return PPL.link_bandwidth(model, "all_to_all" if family == "p2p" else family, n, nbytes)

    if b is not None and len(b.bw.table):
        t = b.bw.table
        what = (f"{len(t)} collective sizes of {model.run}: "
                + ", ".join(f"{f} {t[t.family == f].busbw_gbps.min():.0f}-{t[t.family == f].busbw_gbps.max():.0f} GB/s"
                            for f in sorted(set(t.family))))
    else:
        what = model.measured["pp_layout"][1]
    return lookup, what
