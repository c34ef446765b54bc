"""Pipeline layouts: Megatron-style layout strings and an automatic balanced layout (no torch import).

A layout says which model pieces each pipeline stage holds. Stages are listed in *global* stage order
(stage 0 first), separated by ``|``; within a stage, pieces are in model order:

=========  =====================================================================================
``E``      the embedding (must be the first piece of stage 0)
``t``      one transformer layer; layers are numbered in the order they appear
``L``      the loss: final RMSNorm, LM head and cross-entropy (must be the last piece of the last stage)
``m``      a multi-token-prediction layer: part of Megatron's grammar, rejected here (no MTP in this model)
``|``      stage boundary
``(X)*n``  ``X`` repeated n times (X may contain ``|``; no nested parentheses)
``x*n``    the single character x repeated n times (also ``|*n``)
``,``      ignored (cosmetic), e.g. ``Et*3|(tt|)*29,m|L``
=========  =====================================================================================

This is the grammar of Megatron-LM's ``--pipeline-model-parallel-layout``: commas are removed, then
every ``(...)*n`` group is unrolled, then every ``x*n``; the result is split at ``|``. As in Megatron,
a group must be followed by ``*n`` and groups cannot nest. With ``pp`` ranks and ``vpp`` virtual
stages per rank the layout must have ``pp * vpp`` stages; under the usual (looped) placement stage
``s`` lives on pipeline rank ``s % pp`` (V-shaped schedules place it differently, see
``moespec.schedules``). Unlike Megatron, a stage may not be empty (a PyTorch pipeline stage
needs a module to run).

:func:`auto_layout` builds a layout when none is given: contiguous stages whose costs are as equal as
possible (the largest stage cost is minimal), from the per-layer cost model of :func:`layer_costs`
(active matmul parameters plus attention-score FLOPs per token, i.e. training FLOPs) or from measured
per-layer times. ``"uniform"`` is Megatron's default split: ``n_layers / (pp * vpp)`` layers per stage.

The trainer builds its stages from :func:`resolve_layout`; the analyzer reads layout strings from run
manifests with :func:`split_layout` and re-splits a run's pieces with :func:`resolve_layout` in the
what-if. Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass

from .params import attention_params, attention_score_flops, moe_active_params

PIECES = {"E": "embedding", "t": "transformer layer", "L": "loss (norm + LM head)", "m": "MTP layer"}
GRAMMAR_HINT = "pieces E t L (m), '|' between stages, (...)*n and x*n repeat, ',' ignored"
# Bounds that keep a layout string from eating memory or time: the unrolled layout (one character per
# piece or stage boundary) and the layout text itself; far above any real model (hundreds of layers).
MAX_UNROLLED = 1 << 20
MAX_COUNT_DIGITS = 9
# The automatic layout's dynamic program costs ~ stages x layers^2 steps; above this, ask for a string.
MAX_AUTO_WORK = 20_000_000  # ~4 s


class LayoutError(ValueError):
    """A layout that cannot be used; ``str(err)`` is one line (the config layer prefixes the key)."""


@dataclass(frozen=True)
class PipelineLayout:
    """Pieces per global stage, e.g. ``(("E", "t"), ("t", "t"), ("t", "L"))``."""

    stages: tuple[tuple[str, ...], ...]

    @property
    def n_stages(self) -> int:
        return len(self.stages)

    @property
    def stage_layers(self) -> list[list[int]]:
        """Transformer layer ids held by each stage (layers are numbered in layout order)."""
        out, nxt = [], 0
        for stage in self.stages:
            ids = []
            for piece in stage:
                if piece == "t":
                    ids.append(nxt)
                    nxt += 1
            out.append(ids)
        return out

    @property
    def stage_modules(self) -> list[list[str]]:
        """Module names per stage: ``embedding``, ``layer<i>``, ``loss``."""
        out = []
        for stage, ids in zip(self.stages, self.stage_layers):
            it = iter(ids)
            out.append(["embedding" if p == "E" else "loss" if p == "L" else f"layer{next(it)}" for p in stage])
        return out

    def to_string(self) -> str:
        """The unrolled layout string, e.g. ``Et|tt|tt|tL`` (parses back to the same layout)."""
        return "|".join("".join(stage) for stage in self.stages)

    def __str__(self) -> str:
        return self.to_string()


def _expand_groups(text: str) -> str:
    """Unroll every ``(X)*n`` (first pass of the grammar), never past :data:`MAX_UNROLLED` characters."""
    out, i, total = [], 0, 0
    while i < len(text):
        ch = text[i]
        if ch == ")":
            raise LayoutError(f"unmatched ')' at position {i}")
        if ch != "(":
            out.append(ch)
            total += 1
            i += 1
            continue
        close = text.find(")", i + 1)
        nested = text.find("(", i + 1)
        if close < 0:
            raise LayoutError(f"unmatched '(' at position {i}")
        if 0 <= nested < close:
            raise LayoutError(f"nested parentheses at position {nested} are not supported")
        body = text[i + 1:close]
        if not body:
            raise LayoutError(f"empty group '()' at position {i}")
        count, end = _read_count(text, close + 1)
        if count is None:
            raise LayoutError(f"the group at position {i} must be followed by '*<count>', e.g. (tt|)*3")
        total += len(body) * count
        _check_size(total)
        out.append(body * count)
        i = end
    return "".join(out)


def _check_size(n: int) -> None:
    if n > MAX_UNROLLED:
        raise LayoutError(f"unrolls to more than {MAX_UNROLLED} pieces (a repeat count is too large)")


def _read_count(text: str, i: int) -> tuple[int | None, int]:
    """``*<digits>`` at position i -> (count, position after it); (None, i) when absent."""
    if i >= len(text) or text[i] != "*":
        return None, i
    j = i + 1
    while j < len(text) and text[j].isdigit():
        j += 1
    if j == i + 1:
        raise LayoutError(f"'*' at position {i} of {_short(text)} must be followed by a count")
    if j - (i + 1) > MAX_COUNT_DIGITS:
        raise LayoutError(f"repeat count {text[i + 1:j][:12]}... at position {i + 1} is too large "
                          f"(the layout may unroll to at most {MAX_UNROLLED} pieces)")
    return int(text[i + 1:j]), j


def _short(text: str, n: int = 80) -> str:
    return repr(text) if len(text) <= n else repr(text[:n]) + f"... ({len(text)} characters)"


def _expand_chars(text: str) -> str:
    """Unroll every ``x*n`` (second pass of the grammar), never past :data:`MAX_UNROLLED` characters."""
    out, i, total = [], 0, 0
    while i < len(text):
        if text[i] == "*":
            raise LayoutError(f"'*' at position {i} of {_short(text)} has nothing to repeat")
        count, end = _read_count(text, i + 1)
        total += 1 if count is None else count
        _check_size(total)
        out.append(text[i] * (1 if count is None else count))
        i = end if count is not None else i + 1
    return "".join(out)


def split_layout(text: str) -> list[list[str]]:
    """Parse a layout string into pieces per stage, checking only the grammar (no model sizes)."""
    if not isinstance(text, str) or not text.strip():
        raise LayoutError(f"expected a non-empty layout string ({GRAMMAR_HINT})")
    if len(text) > MAX_UNROLLED:
        raise LayoutError(f"a layout string of {len(text)} characters is too long (at most {MAX_UNROLLED})")
    flat = _expand_chars(_expand_groups(text.strip().replace(",", "")))
    stages: list[list[str]] = [[]]
    for pos, ch in enumerate(flat):
        if ch == "|":
            stages.append([])
        elif ch in PIECES:
            stages[-1].append(ch)
        else:
            raise LayoutError(f"invalid character {ch!r} (unrolled layout {_short(flat)}; {GRAMMAR_HINT})")
    return stages


def parse_layout(text: str, n_layers: int, pp: int, vpp: int = 1) -> PipelineLayout:
    """Parse and validate a layout for a model of ``n_layers`` transformer layers on ``pp x vpp`` stages."""
    try:
        return _validated(split_layout(text), n_layers, pp, vpp)
    except LayoutError as err:
        raise LayoutError(f"{_short(text) if isinstance(text, str) else repr(text)[:80]}: {err}") from None


def _validated(stages: list[list[str]], n_layers: int, pp: int, vpp: int) -> PipelineLayout:
    want = pp * vpp
    if len(stages) != want:
        hint = f" (with pp={pp} it would mean vpp={len(stages) // pp})" if len(stages) % pp == 0 else ""
        raise LayoutError(f"{len(stages)} stages but pp*vpp = {pp}*{vpp} = {want}{hint}")
    flat = [p for s in stages for p in s]
    if "m" in flat:
        raise LayoutError("MTP layers ('m') are not supported: this model has no multi-token prediction")
    for i, s in enumerate(stages):
        if not s:
            raise LayoutError(f"stage {i} is empty (every stage needs at least one of E, t, L)")
    for piece, name in (("E", "embedding"), ("L", "loss")):
        if flat.count(piece) != 1:
            raise LayoutError(f"needs exactly one {piece!r} ({name}), found {flat.count(piece)}")
    if stages[0][0] != "E":
        where = next(i for i, s in enumerate(stages) if "E" in s)
        raise LayoutError(f"'E' (embedding) must be the first piece of stage 0, found in stage {where}")
    if stages[-1][-1] != "L":
        where = next(i for i, s in enumerate(stages) if "L" in s)
        raise LayoutError(f"'L' (loss) must be the last piece of the last stage ({len(stages) - 1}), "
                          f"found in stage {where}")
    n_t = flat.count("t")
    if n_t != n_layers:
        raise LayoutError(f"{n_t} transformer layers ('t') but n_layers={n_layers}")
    return PipelineLayout(tuple(tuple(s) for s in stages))


def layer_costs(cfg: dict) -> tuple[float, list[float], float]:
    """(embedding, per-layer, loss) cost of a training step per token, in FLOPs (fwd + bwd).

    A layer costs 6 x its active matmul parameters (attention projections, the dense FFN or the MoE
    gate + top-k routed + shared experts) plus causal attention scores ``3 * S * H * (d_qk + d_v)``; the
    loss costs ``6 * d * V`` (LM head); the embedding lookup is taken as free. Same model as
    ``moespec.params.model_flops_per_token``, split per piece.
    """
    d, V = cfg["d_model"], cfg["vocab_size"]
    dense_ffn = 3 * d * cfg["d_ff"]
    moe_active = moe_active_params(cfg)
    attn = 6.0 * attention_params(cfg) + attention_score_flops(cfg)
    layers = [attn + 6.0 * (dense_ffn if i < cfg["first_k_dense"] else moe_active) for i in range(cfg["n_layers"])]
    return 0.0, layers, 6.0 * d * V


def _min_max_partition(costs: list[float], n_parts: int) -> list[int]:
    """Split ``costs`` into ``n_parts`` contiguous non-empty parts minimising the largest part's sum.
    Returns the part sizes. Ties go to the split whose earlier parts are smallest (deterministic).
    O(parts x n^2), fine for hundreds of layers."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: minimal largest part when the first i items form k parts
    best = [[inf] * (n + 1) for _ in range(n_parts + 1)]
    cut = [[0] * (n + 1) for _ in range(n_parts + 1)]
    best[0][0] = 0.0
    for k in range(1, n_parts + 1):
        for i in range(k, n - (n_parts - k) + 1):
            for j in range(k - 1, i):
                v = max(best[k - 1][j], prefix[i] - prefix[j])
                if v < best[k][i] - 1e-9 * max(1.0, abs(v)):
                    best[k][i], cut[k][i] = v, j
    sizes, i = [], n
    for k in range(n_parts, 0, -1):
        j = cut[k][i]
        sizes.append(i - j)
        i = j
    return sizes[::-1]


def auto_layout(cfg: dict, pp: int, vpp: int = 1, costs: list[float] | None = None) -> PipelineLayout:
    """A balanced layout for ``cfg`` on ``pp * vpp`` stages.

    ``costs``: ``n_layers`` per-layer costs (e.g. measured ms per layer), or ``n_layers + 2`` values
    ``[embedding, layer 0, ..., layer n-1, loss]``; default :func:`layer_costs`. The embedding is charged
    to stage 0 and the loss to the last stage; every stage gets at least one transformer layer.
    """
    n_stages, n_layers = pp * vpp, cfg["n_layers"]
    if n_layers < n_stages:
        raise LayoutError(f"an automatic layout needs at least one transformer layer per stage: n_layers={n_layers} "
                          f"< pp*vpp = {pp}*{vpp} = {n_stages} (give pipeline_layout explicitly)")
    if n_stages * n_layers * n_layers > MAX_AUTO_WORK:
        raise LayoutError(f"an automatic layout of {n_layers} layers on {n_stages} stages is too large to search "
                          "(give pipeline_layout explicitly, or \"uniform\")")
    if costs is None:
        e_cost, per_layer, l_cost = layer_costs(cfg)
    elif len(costs) == n_layers:
        e_cost, per_layer, l_cost = 0.0, [float(c) for c in costs], 0.0
    elif len(costs) == n_layers + 2:
        e_cost, per_layer, l_cost = float(costs[0]), [float(c) for c in costs[1:-1]], float(costs[-1])
    else:
        raise LayoutError(f"layer costs must have n_layers={n_layers} or n_layers+2={n_layers + 2} values "
                          f"(embedding, layers, loss), got {len(costs)}")
    if any(c < 0 for c in [e_cost, l_cost, *per_layer]):
        raise LayoutError("layer costs must be >= 0")
    # fold the embedding into the first layer and the loss into the last for the partition
    folded = list(per_layer)
    folded[0] += e_cost
    folded[-1] += l_cost
    sizes = _min_max_partition(folded, n_stages)
    stages, nxt = [], 0
    for s, size in enumerate(sizes):
        pieces = (["E"] if s == 0 else []) + ["t"] * size + (["L"] if s == n_stages - 1 else [])
        stages.append(tuple(pieces))
        nxt += size
    return PipelineLayout(tuple(stages))


def uniform_layout(n_layers: int, pp: int, vpp: int = 1) -> PipelineLayout:
    """Megatron's default: ``n_layers / (pp*vpp)`` layers per stage, E on stage 0, L on the last."""
    n_stages = pp * vpp
    if n_layers % n_stages:
        raise LayoutError(f"uniform layout: n_layers={n_layers} is not divisible by pp*vpp = {pp}*{vpp} = {n_stages}")
    per = n_layers // n_stages
    return PipelineLayout(tuple(tuple((["E"] if s == 0 else []) + ["t"] * per + (["L"] if s == n_stages - 1 else []))
                                for s in range(n_stages)))


def resolve_layout(cfg: dict) -> PipelineLayout:
    """The layout a config asks for: ``pipeline_layout`` as a string, ``"uniform"``, or null/``"auto"``
    (balanced by ``pipeline_layer_costs`` or the FLOP model)."""
    pp, vpp, spec = cfg["pp"], cfg["vpp"], cfg["pipeline_layout"]
    if spec is None or spec == "auto":
        return auto_layout(cfg, pp, vpp, cfg.get("pipeline_layer_costs"))
    if spec == "uniform":
        return uniform_layout(cfg["n_layers"], pp, vpp)
    return parse_layout(spec, cfg["n_layers"], pp, vpp)
