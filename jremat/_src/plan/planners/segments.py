"""Cut-point candidates and the segment model the planners share (`SegmentTable`): each
segment's stored, transient and recompute costs under every save option.

Chen et al. 2016 cut at the articulation points of the chain; the model and its modelled
peak: docs/design.md#planners.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from jremat._src.plan.offload import OffloadCost
from jremat._src.plan.planners.value_cut import cut_save_set
from jremat._src.plan.planners.value_ladder import ladder_levels
from jremat._src.trace.cost_model import FUSIBLE
from jremat._src.trace.graph import Graph
from jremat._src.trace.layers import crossing_bytes, first_residual_use, float_crossing_bytes

KEEP_OPTION = "keep"


_DOTS = ("dot_general", "conv_general_dilated")


def _dot_source(graph: Graph, vid: int, depth: int = 1):
    """The dot/conv node `vid` is computed from, directly or through a short same-size
    elementwise chain (bias add, scaling, transpose); None otherwise.

    JAX's `dots_saveable` saves the dot's own result; jremat names the value XLA materializes
    (often `dot + bias`), which saves the same work.
    """
    size = int(np.prod(graph.values[vid].shape, dtype=np.int64))
    for _ in range(depth):
        p = graph.values[vid].producer
        if p < 0:
            return None
        node = graph.nodes[p]
        if node.primitive in _DOTS:
            return node
        if node.primitive not in FUSIBLE and node.primitive != "transpose":
            return None
        same = [
            x
            for x in node.inputs
            if isinstance(x, int)
            and graph.values[x].producer >= 0
            and int(np.prod(graph.values[x].shape, dtype=np.int64)) == size
        ]
        if len(same) != 1:
            return None
        vid = same[0]
    return None


def _is_dot(graph: Graph, vid: int) -> bool:
    return _dot_source(graph, vid) is not None


def _is_unbatched_dot(graph: Graph, vid: int) -> bool:
    node = _dot_source(graph, vid)
    if node is None:
        return False
    if node.primitive == "conv_general_dilated":
        return True
    return not node.eqn.params["dimension_numbers"][1][0]


def _is_expensive(graph: Graph, vid: int, flops_per_byte: float = 8.0) -> bool:
    node = _dot_source(graph, vid)
    if node is None:
        return False
    out_bytes = sum(graph.values[o].nbytes for o in node.outputs) or 1
    return node.flops / out_bytes >= flops_per_byte


def flops_per_byte(graph: Graph, vid: int) -> float:
    """FLOPs that recomputing value `vid` costs per byte of it: its dot/conv source's FLOPs
    (through a short same-size elementwise chain, as `dots_saveable` names it) or else its
    producer's, over the bytes that equation outputs. 0 for arguments and data movement."""
    node = _dot_source(graph, vid)
    if node is None:
        p = graph.values[vid].producer
        if p < 0:
            return 0.0
        node = graph.nodes[p]
    return node.flops / max(sum(graph.values[o].nbytes for o in node.outputs), 1)


def _fpb_at_least(tau: float) -> Callable[[Graph, int], bool]:
    return lambda g, v: g.values[v].saveable and flops_per_byte(g, v) >= tau


#: Thresholds (FLOPs per stored byte) of the per-value save sets: a segment under
#: "fpb>=t" saves every floating value whose recompute costs at least t FLOPs per byte (dots,
#: convs, reductions) and recomputes the rest, the ratio PyTorch's activation-memory knapsack
#: ranks values by. Values cluster
#: at powers of two (elementwise 0.25 for float32; a matmul's contraction size / 2: the
#: attention scores at head_dim / 2, projections at width / 2), so the thresholds sit
#: between them, a factor 4 apart. docs/design.md#per-value-save-sets.
FPB_LADDER = (0.375, 1.5, 6.0, 24.0, 96.0, 384.0)

#: Rungs of the marginal per-value ladder (`value_ladder.ladder_levels`): a segment under
#: "ladder<=f" saves the values the reverse greedy of its layer still saves once it has
#: dropped all but a fraction f of the bytes saving everything keeps, the values whose
#: recompute costs the most FLOPs per byte given what else is saved.
#: docs/design.md#per-value-save-sets.
MARGINAL_LADDER = (0.05, 0.1, 0.2, 0.3, 0.45, 0.6, 0.8)


def _level_at_most(f: float) -> Callable[[Graph, int], bool]:
    return lambda g, v: ladder_levels(g).get(v, 2.0) <= f


#: Exchange rates (FLOPs per stored byte) of the min-cut save sets, a factor 4 apart like
#: `FPB_LADDER` and one rung further at each end: a segment under "cut@t" saves the values of
#: `value_cut.cut_save_set(graph, t)` its backward needs, the set that minimises recompute
#: FLOPs plus t times saved bytes over the whole program, dependencies included.
#: docs/design.md#per-value-save-sets.
CUT_LADDER = (0.09375, 0.375, 1.5, 6.0, 24.0, 96.0, 384.0, 1536.0)


def _in_cut(price: float) -> Callable[[Graph, int], bool]:
    return lambda g, v: v in cut_save_set(g, price)


#: Save sets a checkpointed segment may choose (Rotor/Rockmate-style options per segment):
#: name -> predicate on a value id. "nothing", "dots" and "dots_no_batch" are JAX's
#: nothing_saveable, dots_saveable and dots_with_no_batch_dims_saveable restricted to the values
#: the backward pass needs; "expensive" keeps results costing >= 8 FLOPs per stored byte;
#: "fpb>=t", "ladder<=f" and "cut@t" the per-value ladders (`FPB_LADDER`, `MARGINAL_LADDER`,
#: `CUT_LADDER`; `segment_table` drops a rung that selects the same values as an option
#: before it on the graph at hand).
SAVE_OPTIONS: dict[str, Callable[[Graph, int], bool]] = {
    "nothing": lambda g, v: False,
    "dots_no_batch": _is_unbatched_dot,
    "expensive": _is_expensive,
    "dots": _is_dot,
    **{f"fpb>={tau:g}": _fpb_at_least(tau) for tau in FPB_LADDER},
    **{f"ladder<={f:g}": _level_at_most(f) for f in MARGINAL_LADDER},
    **{f"cut@{t:g}": _in_cut(t) for t in CUT_LADDER},
}

#: The per-value ladders' option names (`segment_table` may drop them per graph; the others
#: always stay: JAX's policies map onto them).
FPB_OPTIONS = tuple(f"fpb>={tau:g}" for tau in FPB_LADDER)
MARGINAL_OPTIONS = tuple(f"ladder<={f:g}" for f in MARGINAL_LADDER)
CUT_OPTIONS = tuple(f"cut@{t:g}" for t in CUT_LADDER)
LADDER_OPTIONS = (*FPB_OPTIONS, *MARGINAL_OPTIONS, *CUT_OPTIONS)

#: The options the planners take unless given others: every `SAVE_OPTIONS` entry but the
#: marginal ladder and the min-cut rungs. Both lower the model's optimum (GPT-2 at 0.85:
#: 11.2 -> 4.9 MFLOPs with the cut rungs, the per-value MILP's proven optimum), but
#: `jremat.plan`'s search returned worse compiled plans with them: their plans compile
#: further above the calibrated model than the options' (docs/design.md#per-value-save-sets).
#: Pass `options=` to use them.
DEFAULT_OPTIONS = tuple(
    o for o in SAVE_OPTIONS if o not in MARGINAL_OPTIONS and o not in CUT_OPTIONS
)


def distinct_options(graph: Graph, options: Sequence[str]) -> list[str]:
    """`options` without the `LADDER_OPTIONS` rungs that select, on `graph`, the same
    floating values as an option before them (the same segment costs; the DPs' work grows
    with the number of options)."""
    seen: list[frozenset[int]] = []
    out = []
    produced = [v.id for v in graph.values if v.producer >= 0 and v.saveable]
    for name in options:
        pred = SAVE_OPTIONS.get(OFFLOAD_OPTIONS.get(name, name))
        chosen = frozenset(v for v in produced if pred(graph, v)) if pred else None
        if name in LADDER_OPTIONS and chosen in seen:
            continue
        if chosen is not None and name not in OFFLOAD_OPTIONS:
            seen.append(chosen)
        out.append(name)
    return out


#: Host-offload options: name -> the `SAVE_OPTIONS` entry whose values the segment offloads
#: to pinned host memory instead of saving them on the device (`jremat.OffloadCost`). Planners
#: consider them only when given an `OffloadCost`.
OFFLOAD_OPTIONS: dict[str, str] = {"offload_dots": "dots"}


@dataclasses.dataclass
class SegmentTable:
    """Costs of every segment `[cuts[a], cuts[b])`, a < b, under every option.

    `options[0]` is "keep" (no checkpoint: every residual kept); the others are checkpointed
    segments saving the values their `SAVE_OPTIONS` predicate selects. Arrays have shape
    `(len(options), m, m)`:
      stored: bytes kept from forward to backward (live-in values, saved or kept residuals);
      transient: extra bytes live while the segment's backward runs (recomputed residuals,
        cotangents crossing its two cuts, working set);
      flops: FLOPs its recompute costs (only equations whose results the backward needs and
        that are not saved).
      offloaded: bytes it offloads to pinned host memory (0 except under `OFFLOAD_OPTIONS`).
      cost: what the planners minimise, FLOPs: `flops` plus the transfer time of `offloaded`
        as FLOP-equivalents (`OffloadCost.transfer_flops`); equals `flops` without offload.
      offload: the `OffloadCost` the table was built with, or None.
    An offload option's values leave the device: `stored` holds only the live-in values, and
    they come back for the segment's backward pass, so `transient` holds them again (the same
    memory as recomputing everything, with the recompute FLOPs of saving them).
    """

    cuts: list[int]
    options: list[str]
    stored: np.ndarray
    transient: np.ndarray
    flops: np.ndarray
    offloaded: np.ndarray | None = None
    cost: np.ndarray | None = None
    offload: OffloadCost | None = None

    def __post_init__(self) -> None:
        if self.offloaded is None:
            self.offloaded = np.zeros_like(self.flops)
        if self.cost is None:
            self.cost = self.flops

    def option_index(self, name: str) -> int:
        return self.options.index(name)


def _dominance(m: int, items) -> np.ndarray:
    """`out[a, b]` = sum of weights w over items (pa, rb, w) with pa >= a and rb < b."""
    grid = np.zeros((m, m + 1))
    for pa, rb, w in items:
        grid[pa, rb + 1] += w
    grid = np.cumsum(grid[::-1], axis=0)[::-1]
    return np.cumsum(grid, axis=1)[:, :m]


def _first_needed(graph: Graph, saved: Callable[[int], bool], vjp_first: dict[int, int]):
    """f[i]: the earliest node index whose backward needs node i's recompute (inf: never).

    A segment ending at e recomputes node i iff f[i] < e, whatever its start: node i is needed
    when one of its unsaved outputs is a residual of a node before e, or feeds a node before e
    that is itself needed (JAX's partial evaluation drops the rest). A node with internal
    residuals (a custom_jvp's, a scan's stacks: `Node.internal_bytes`) is always recomputed in
    a checkpointed segment, f[i] = i: no name reaches inside it, and its own backward needs
    them (`SaveSetPricer`'s accounting, the same).
    """
    n = graph.num_nodes
    f = np.full(n, np.inf)
    for i in range(n - 1, -1, -1):
        if graph.nodes[i].internal_bytes:
            f[i] = i
            continue
        best = np.inf
        for o in graph.nodes[i].outputs:
            if saved(o):
                continue
            best = min(best, vjp_first.get(o, np.inf))
            for c in graph.consumers[o]:
                if f[c] < best:
                    best = f[c]
        f[i] = best
    return f


def segment_table(
    graph: Graph,
    cuts: list[int],
    options: Sequence[str] = DEFAULT_OPTIONS,
    offload: OffloadCost | None = None,
) -> SegmentTable:
    """Build the `SegmentTable` of `graph` over `cuts` for the given save options.

    `options` may name `OFFLOAD_OPTIONS` only with `offload` (the transfer cost); raises
    ValueError for an unknown option or an offload option without it.
    """
    for name in options:
        if name in OFFLOAD_OPTIONS and offload is None:
            raise ValueError(f"option {name!r} needs offload=OffloadCost(...) (its cost)")
        if name not in SAVE_OPTIONS and name not in OFFLOAD_OPTIONS:
            known = ", ".join([*SAVE_OPTIONS, *OFFLOAD_OPTIONS])
            raise ValueError(f"unknown segment option {name!r}; known: {known}")
    options = distinct_options(graph, options)
    m = len(cuts)
    cross = crossing_bytes(graph)
    float_cross = float_crossing_bytes(graph)
    cut_arr = np.asarray(cuts)

    def bin_of(idx):
        return np.searchsorted(cut_arr, idx, side="right") - 1

    # kept (memory): what XLA stores, `residuals`; checkpointed (what is recomputed, which
    # saved values are kept): what JAX's VJP rules read, `vjp_residuals`
    res_first, vjp_first = first_residual_use(graph)
    internal_bytes = np.array([float(node.internal_bytes) for node in graph.nodes])
    temps = [(v, r) for v, r in res_first.items() if graph.values[v].producer >= 0]
    res_items = [
        (bin_of(graph.values[v].producer), bin_of(r), graph.values[v].nbytes) for v, r in temps
    ]
    resid = _dominance(m, res_items)  # residual bytes produced and used inside the segment
    node_internal_cum = np.concatenate([[0.0], np.cumsum(internal_bytes)])
    s_idx, e_idx = np.meshgrid(cut_arr, cut_arr, indexing="ij")
    internal = resid + node_internal_cum[e_idx] - node_internal_cum[s_idx]

    live_in = np.zeros((m, m))
    for v in graph.values:
        cons = graph.consumers[v.id]
        if v.producer < 0 or not cons:
            continue
        a0 = bisect.bisect_right(cuts, v.producer)
        for a in range(a0, m):
            k = bisect.bisect_left(cons, cuts[a])
            if k == len(cons):
                break
            live_in[a, bisect.bisect_right(cuts, cons[k]) :] += v.nbytes

    cot = float_cross[s_idx] + float_cross[e_idx]
    work = np.maximum(cross[s_idx], cross[e_idx])
    names = [KEEP_OPTION, *options]
    stored = np.zeros((len(names), m, m))
    transient = np.zeros((len(names), m, m))
    flops = np.zeros((len(names), m, m))
    stored[0] = live_in + internal
    transient[0] = cot + work
    node_flops = np.array([nd.flops for nd in graph.nodes])
    offloaded = np.zeros((len(names), m, m))
    for k, name in enumerate(options, start=1):
        pred = SAVE_OPTIONS[OFFLOAD_OPTIONS.get(name, name)]
        saved_cache: dict[int, bool] = {}

        def saved(v: int, pred=pred, cache=saved_cache) -> bool:
            if v not in cache:
                cache[v] = graph.values[v].saveable and bool(pred(graph, v))
            return cache[v]

        f = _first_needed(graph, saved, vjp_first)
        # a saved value is kept when the segment's backward needs it: as a residual, or as
        # the input of an equation the recompute redoes
        kept_items = []
        for v in graph.values:
            if v.producer < 0 or not saved(v.id):
                continue
            first = min([vjp_first.get(v.id, np.inf)] + [f[c] for c in graph.consumers[v.id]])
            if np.isfinite(first):
                kept_items.append((bin_of(v.producer), bin_of(int(first)), v.nbytes))
        kept = _dominance(m, kept_items)
        fin = np.isfinite(f)
        idx = np.nonzero(fin)[0]
        fl = _dominance(
            m, zip(bin_of(idx), bin_of(f[idx].astype(int)), node_flops[idx], strict=True)
        )
        if name in OFFLOAD_OPTIONS:  # on host between the passes, back for the backward
            stored[k] = live_in
            transient[k] = internal + cot + work
            offloaded[k] = kept
        else:
            stored[k] = live_in + kept
            transient[k] = internal - kept + cot + work
        flops[k] = fl
    upper = np.triu(np.ones((m, m), dtype=bool), k=1)
    for arr in (stored, transient, flops):
        arr[:, ~upper] = np.inf
    cost = flops if offload is None else flops + offloaded * offload.flops_per_byte
    return SegmentTable(cuts, names, stored, transient, flops, offloaded, cost, offload)


def saved_values(graph: Graph, start: int, end: int, option: str) -> list[int]:
    """Value ids a checkpointed segment `[start, end)` names as saveable under `option`: the
    values it produces that the option's predicate selects. JAX keeps those its backward
    pass needs (as residuals or recompute inputs) and drops the rest."""
    option = OFFLOAD_OPTIONS.get(option, option)
    if option not in SAVE_OPTIONS:
        return []
    pred = SAVE_OPTIONS[option]
    return [
        o
        for node in graph.nodes[start:end]
        for o in node.outputs
        if graph.values[o].saveable and pred(graph, o)
    ]


def option_pieces(
    graph: Graph, cuts: Sequence[int], segs
) -> list[tuple[int, int, tuple[int, ...] | None]]:
    """An option planner's choice `[(cut index a, cut index b, option name)]` over `cuts` (node
    positions) as `save_sets.Pieces`: kept segments as None, checkpointed ones as the values
    their plan names (`saved_values`), so `SaveSetPricer.path_cost` prices them value by
    value."""
    out = []
    for a, b, option in segs:
        start, end = cuts[a], cuts[b]
        saved = None if option == KEEP_OPTION else tuple(saved_values(graph, start, end, option))
        out.append((start, end, saved))
    return out
