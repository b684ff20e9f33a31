"""Cut-point candidates and per-segment costs shared by the planners.

A cut at position `p` falls between node `p - 1` and node `p`. The values crossing it are those
produced before `p` and consumed at or after `p` (or returned); good cuts are where few bytes
cross (Chen et al. 2016 cut at the articulation points of the chain).
"""

from __future__ import annotations

import bisect
import dataclasses
import re

import numpy as np

from ..trace import Graph, is_literal

_LAYER_PART = re.compile(r"^(?:\d+|.*_\d+)$")


def crossing_bytes(graph: Graph) -> np.ndarray:
    """`out[p]`: temp bytes of the values crossing cut position p, for p in 0..num_nodes."""
    n = graph.num_nodes
    delta = np.zeros(n + 2, dtype=np.float64)
    returned = {x for x in graph.outvars if not is_literal(x)}
    for v in graph.values:
        if v.producer < 0:
            continue
        cons = graph.consumers[v.id]
        last = n if v.id in returned else (cons[-1] if cons else v.producer)
        # crosses every cut p with producer < p <= last
        delta[v.producer + 1] += v.nbytes
        delta[last + 1] -= v.nbytes
    return np.cumsum(delta)[: n + 1]


def layer_keys(graph: Graph) -> list[str | None]:
    """Per node, the layer it belongs to, from the name stack (`.../h/3`, `.../Block_2`)."""
    keys: list[str | None] = []
    for node in graph.nodes:
        parts = node.name_stack.split("/") if node.name_stack else []
        key = None
        for i, p in enumerate(parts):
            if _LAYER_PART.match(p):
                key = "/".join(parts[: i + 1])
                break
        keys.append(key)
    return keys


def layer_spans(graph: Graph) -> list[tuple[int, int]]:
    """Contiguous `[start, end)` node ranges of the model's layers, found from name stacks.

    Nodes between layers (embeddings, heads, unnamed glue) belong to no span. Empty when the
    program carries no layer names.
    """
    keys = layer_keys(graph)
    spans: list[tuple[int, int]] = []
    seen: dict[str, int] = {}
    for i, k in enumerate(keys):
        if k is None:
            continue
        if spans and keys[spans[-1][0]] == k:
            spans[-1] = (spans[-1][0], i + 1)
        elif k in seen and spans and keys[spans[-1][0]] != k and seen[k] == len(spans) - 1:
            spans[-1] = (spans[-1][0], i + 1)
        else:
            seen[k] = len(spans)
            spans.append((i, i + 1))
    # glue between two parts of the same layer (a residual add outside the scope) joins it
    merged: list[tuple[int, int]] = []
    for s in spans:
        if merged and keys[merged[-1][0]] == keys[s[0]]:
            merged[-1] = (merged[-1][0], s[1])
        else:
            merged.append(s)
    return merged


def candidate_cuts(graph: Graph, max_cuts: int = 160) -> list[int]:
    """Cut positions the planners consider: layer boundaries plus low-crossing positions.

    Always includes 0 and `num_nodes`. Positions are local minima of `crossing_bytes`; when
    there are more than `max_cuts`, the cheapest in each of `max_cuts` equal windows are kept.
    """
    n = graph.num_nodes
    cross = crossing_bytes(graph)
    cuts = {0, n}
    for s, e in layer_spans(graph):
        cuts.update((s, e))
    interior = [
        p
        for p in range(1, n)
        if cross[p] <= cross[p - 1] and cross[p] <= cross[p + 1] and cross[p] < cross.max()
    ]
    budget = max(max_cuts - len(cuts), 0)
    if len(interior) > budget:
        windows = np.array_split(np.array(interior), max(budget, 1))
        interior = [int(w[np.argmin(cross[w])]) for w in windows if len(w)]
    cuts.update(interior)
    return sorted(cuts)


@dataclasses.dataclass
class SegmentTable:
    """Costs of every segment `[cuts[a], cuts[b])`, a < b, as `(m, m)` arrays.

    stored_keep / stored_remat: bytes kept from forward to backward by the segment when it is
    not checkpointed / checkpointed (its live-in values; plus its residuals when kept).
    transient_keep / transient_remat: extra bytes live while its backward runs (recomputed
    residuals; the cotangents crossing its two cuts).
    flops_remat: FLOPs its recompute costs (only equations whose results the backward needs).
    """

    cuts: list[int]
    stored_keep: np.ndarray
    stored_remat: np.ndarray
    transient_keep: np.ndarray
    transient_remat: np.ndarray
    flops_remat: np.ndarray


def segment_table(graph: Graph, cuts: list[int]) -> SegmentTable:
    m = len(cuts)
    n = graph.num_nodes
    cross = crossing_bytes(graph)
    float_cross = _float_crossing(graph)

    def bin_of(node_index: int) -> int:
        """Index of the segment-start cut at or below node_index."""
        return bisect.bisect_right(cuts, node_index) - 1

    # internal residuals: value v (temp) with producer p, first residual use r: counted in
    # [cuts[a], cuts[b]) iff cuts[a] <= p and r < cuts[b].
    first_res: dict[int, int] = {}
    internal_bytes = np.zeros(n)
    for node in graph.nodes:
        for v in node.residuals:
            if v not in first_res:
                first_res[v] = node.index
        internal_bytes[node.index] = node.internal_bytes
    resid = np.zeros((m, m + 1))
    for v, r in first_res.items():
        val = graph.values[v]
        if val.producer < 0:
            continue
        a = bin_of(val.producer)
        b = bin_of(r)
        resid[a, b + 1] += val.nbytes
    # R[a, b] = sum of bytes with producer-bin >= a and r-bin < b
    resid_cum = np.cumsum(resid[::-1], axis=0)[::-1]  # producer bin >= a
    resid_cum = np.cumsum(resid_cum, axis=1)  # r-bin < b  (column b+1 holds r-bin == b)
    node_internal_cum = np.concatenate([[0.0], np.cumsum(internal_bytes)])

    # live-in: values produced before cuts[a] whose next consumer at/after cuts[a] is < cuts[b]
    live_in = np.zeros((m, m))
    temps = [v for v in graph.values if v.producer >= 0 and graph.consumers[v.id]]
    for v in temps:
        cons = graph.consumers[v.id]
        a0 = bisect.bisect_right(cuts, v.producer)  # first start cut after the producer
        for a in range(a0, m):
            k = bisect.bisect_left(cons, cuts[a])
            if k == len(cons):
                break
            b = bisect.bisect_right(cuts, cons[k])  # segments ending after that consumer
            live_in[a, b:] += v.nbytes
    stored_keep = np.zeros((m, m))
    stored_remat = np.zeros((m, m))
    t_keep = np.zeros((m, m))
    t_remat = np.zeros((m, m))
    flops = np.zeros((m, m))
    node_flops = np.array([nd.flops for nd in graph.nodes])
    for b in range(1, m):
        needed = _needed_flops_prefix(graph, cuts[b], node_flops)
        for a in range(b):
            s, e = cuts[a], cuts[b]
            internal = resid_cum[a, b] + node_internal_cum[e] - node_internal_cum[s]
            cot = float_cross[s] + float_cross[e]
            work = max(cross[s], cross[e])
            stored_keep[a, b] = live_in[a, b] + internal
            stored_remat[a, b] = live_in[a, b]
            t_keep[a, b] = cot + work
            t_remat[a, b] = internal + cot + work
            flops[a, b] = needed[e] - needed[s]
    return SegmentTable(cuts, stored_keep, stored_remat, t_keep, t_remat, flops)


def _float_crossing(graph: Graph) -> np.ndarray:
    """Bytes of floating values crossing each cut: their cotangents are live in the backward."""
    n = graph.num_nodes
    delta = np.zeros(n + 2)
    for v in graph.values:
        if v.producer < 0 or not v.is_float:
            continue
        cons = graph.consumers[v.id]
        if not cons:
            continue
        delta[v.producer + 1] += v.nbytes
        delta[cons[-1] + 1] -= v.nbytes
    return np.cumsum(delta)[: n + 1]


def _needed_flops_prefix(graph: Graph, end: int, node_flops: np.ndarray) -> np.ndarray:
    """Prefix sums over nodes < end of the FLOPs a recompute ending at `end` must redo.

    A node is redone when one of its outputs is a residual of a node before `end`, or feeds a
    node before `end` that is redone. Nodes whose results only leave the segment are not
    (JAX's partial evaluation drops them). The flag does not depend on the segment start.
    """
    needed = np.zeros(end, dtype=bool)
    res_users: dict[int, int] = {}
    for node in graph.nodes[:end]:
        for v in node.residuals:
            res_users[v] = max(res_users.get(v, -1), node.index)
    for i in range(end - 1, -1, -1):
        node = graph.nodes[i]
        for o in node.outputs:
            if res_users.get(o, -1) >= i:
                needed[i] = True
                break
            if any(c < end and needed[c] for c in graph.consumers[o]):
                needed[i] = True
                break
    return np.concatenate([[0.0], np.cumsum(np.where(needed, node_flops[:end], 0.0))])
