"""A program's layers from its name stack (`h/3`, `layers_4`, `Block_2`), the bytes crossing
each cut position, and the cut candidates the planners consider
(docs/design.md#tracing-and-the-cost-model)."""

from __future__ import annotations

import math
import re

import numpy as np

from jremat._src.base.compat import subjaxprs
from jremat._src.trace.graph import Graph, is_literal

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


def has_scan(graph: Graph) -> bool:
    def walk(eqns) -> bool:
        return any(
            e.primitive.name == "scan" or any(walk(j.eqns) for j in subjaxprs(e)) for e in eqns
        )

    return walk([n.eqn for n in graph.nodes])


def sqrt_divisor(n: int) -> int:
    """The divisor of n closest to sqrt(n) (1 when n is prime)."""
    divisors = [d for d in range(2, n) if n % d == 0]
    return min(divisors, key=lambda d: abs(d - math.sqrt(n))) if divisors else 1


def layer_segments(graph: Graph, max_pseudo_layers: int = 16) -> list[tuple[int, int]]:
    """The model's layers as node ranges (from name stacks), or equal-FLOP chunks between
    low-crossing cuts when the program carries no layer names."""
    spans = layer_spans(graph)
    if len(spans) >= 2:
        return spans
    cuts = candidate_cuts(graph, max_cuts=4 * max_pseudo_layers)
    flops = [0.0]
    for node in graph.nodes:
        flops.append(flops[-1] + node.flops)
    total = flops[-1] or 1.0
    chosen = [0]
    for k in range(1, max_pseudo_layers):
        want = total * k / max_pseudo_layers
        c = min(cuts, key=lambda p: abs(flops[p] - want))
        if c > chosen[-1]:
            chosen.append(c)
    if graph.num_nodes > chosen[-1]:
        chosen.append(graph.num_nodes)
    return list(zip(chosen[:-1], chosen[1:], strict=True))
