"""The per-value save ladder: which values of each layer are worth saving, value by value.

A checkpointed segment saves some of the values its backward needs and recomputes the rest.
Whether saving a value pays depends on what else is saved: `o @ wo`'s result and the
attention output `o` have the same bytes and FLOPs per byte, but the backward of the
projection reads `o` itself, and `o @ wo` is recomputed from `o` by one matmul, while
recomputing `o` redoes the attention. No per-value threshold (`segments.FPB_LADDER`)
separates them; the marginal cost of dropping each value from what is saved does.

`ladder_levels` ranks the values of each reference span (the model's layers and the glue
between them, `layer_segments`) by reverse greedy: start with every value the span's
backward needs saved (nothing recomputed), then repeatedly drop the value whose removal adds
the fewest recompute FLOPs per byte of kept values it frees, as `SaveSetPricer` prices the
span checkpointed (dependencies included: dropping a value may make its inputs needed, or
free others). A value's level is the fraction of the span's full kept bytes still saved just
before it is dropped, so "save every value of level <= f" is the greedy's save set once it
has freed all but a fraction f of the bytes: nested sets, one per rung, that the chain DP,
greedy and the MILP choose among per segment (`segments.SAVE_OPTIONS` "ladder<=f").

This is PyTorch's activation-memory knapsack (FLOPs per byte, `torch._functorch.partitioners`)
with each value's cost taken at the margin of the others, as in Checkmate's per-value program
(Jain et al. 2020), solved greedily per span. Repeated layers (the same equations, shapes and
wiring) are ranked once. docs/design.md#per-value-save-sets.
"""

from __future__ import annotations

from jremat._src.plan.planners.save_sets import SaveSetPricer
from jremat._src.trace.graph import Graph, is_literal
from jremat._src.trace.layers import layer_segments

_MEMO = "value_ladder_levels"


def _tiles(graph: Graph) -> list[tuple[int, int]]:
    """`layer_segments` with the glue between (and around) them as spans of their own."""
    out, pos = [], 0
    for s, e in layer_segments(graph):
        if s > pos:
            out.append((pos, s))
        out.append((s, e))
        pos = e
    if pos < graph.num_nodes:
        out.append((pos, graph.num_nodes))
    return out


def _signature(graph: Graph, start: int, end: int) -> tuple:
    """The span's equations, shapes and wiring relative to `start` (equal for repeated
    layers); inputs from outside the span by shape only."""
    sig = []
    for node in graph.nodes[start:end]:
        ins = []
        for x in node.inputs:
            if is_literal(x):
                ins.append(("lit",))
                continue
            p = graph.values[x].producer
            if start <= p < end:
                ins.append((p - start, graph.nodes[p].outputs.index(x)))
            else:
                ins.append(("in", graph.values[x].shape, graph.values[x].dtype))
        outs = tuple(
            (graph.values[o].shape, graph.values[o].dtype, _residual_rel(graph, o, start, end))
            for o in node.outputs
        )
        sig.append(
            (node.primitive, str(node.eqn.params.get("dimension_numbers")), outs, tuple(ins))
        )
    return tuple(sig)


def _residual_rel(graph: Graph, vid: int, start: int, end: int) -> tuple:
    """The nodes of the span (relative to `start`) that keep `vid` as a residual."""
    if "residual_keepers" not in graph.memo:
        graph.memo["residual_keepers"] = _res_keepers(graph)
    keepers = graph.memo["residual_keepers"].get(vid, ())
    return tuple(k - start for k in keepers if start <= k < end)


def _res_keepers(graph: Graph) -> dict[int, tuple[int, ...]]:
    out: dict[int, list[int]] = {}
    for node in graph.nodes:
        for v in node.residuals:
            out.setdefault(v, []).append(node.index)
    return {v: tuple(ks) for v, ks in out.items()}


def _rank_span(pricer: SaveSetPricer, start: int, end: int) -> dict[int, float]:
    """Reverse greedy over the span's candidates: value id -> its level (see the module)."""
    graph = pricer.graph
    saved = set(pricer.facts(start, end).candidates)
    cur = pricer.price(start, end, saved)
    full = sum(graph.values[v].nbytes for v in cur.kept)
    if full <= 0:
        return {}
    levels: dict[int, float] = {}
    while saved:
        kept_bytes = sum(graph.values[v].nbytes for v in cur.kept)
        best = None
        for v in sorted(saved):
            c = pricer.price(start, end, saved - {v})
            freed = kept_bytes - sum(graph.values[u].nbytes for u in c.kept)
            added = c.flops - cur.flops
            if freed <= 0 and added <= 0:
                key = (-1.0, 0.0, v)  # frees nothing and costs nothing: not kept anyway
            elif freed <= 0:
                key = (float("inf"), -freed, v)
            else:
                key = (added / freed, -freed, v)
            if best is None or key < best[0]:
                best = (key, v, c)
        _, v, cur = best
        levels[v] = kept_bytes / full
        saved.discard(v)
    return levels


def ladder_levels(graph: Graph) -> dict[int, float]:
    """Value id -> level in (0, 1] for the float values the reverse greedy ranks (module
    docstring); values no span's backward needs are absent. Memoized on the graph.

    Deterministic: ties break by value id, so the same program ranks the same in every
    process (plans name the values they save).
    """
    if _MEMO in graph.memo:
        return graph.memo[_MEMO]
    pricer = SaveSetPricer(graph)
    levels: dict[int, float] = {}
    ranked: dict[tuple, tuple[int, dict[int, float]]] = {}  # signature -> (start, levels)
    for start, end in _tiles(graph):
        sig = _signature(graph, start, end)
        if sig in ranked:  # a repeated layer: the same ranks, shifted
            start0, lv0 = ranked[sig]
            for v, lv in lv0.items():
                p = graph.values[v].producer
                o = graph.nodes[p].outputs.index(v)
                levels[graph.nodes[p - start0 + start].outputs[o]] = lv
            continue
        lv = _rank_span(pricer, start, end)
        ranked[sig] = (start, lv)
        levels.update(lv)
    graph.memo[_MEMO] = levels
    return levels
