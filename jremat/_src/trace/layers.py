"""A program's layers from its name stack (`h/3`, `layers_4`, `Block_2`) or, without names,
from its calls and repeated blocks; the bytes crossing each cut position, and the cut
candidates the planners consider
(docs/design.md#tracing-and-the-cost-model)."""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np

from jremat._src.base.compat import CHECKPOINT_PRIMITIVES, subjaxprs
from jremat._src.trace.graph import Graph, is_literal

_LAYER_PART = re.compile(r"^(?:\d+|.*_\d+)$")


def first_residual_use(graph: Graph) -> tuple[dict[int, int], dict[int, int]]:
    """Value id -> the first node that keeps it as a residual: by XLA's anchored residuals
    (`Node.residuals`: what a kept segment stores) and by what the VJP rules read
    (`Node.vjp_residuals`: what a checkpointed segment recomputes unless saved)."""
    res_first: dict[int, int] = {}
    vjp_first: dict[int, int] = {}
    for node in graph.nodes:
        for v in node.residuals:
            res_first.setdefault(v, node.index)
        for v in node.vjp_residuals:
            vjp_first.setdefault(v, node.index)
    return res_first, vjp_first


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


def float_crossing_bytes(graph: Graph) -> np.ndarray:
    """`out[p]`: bytes of the floating values crossing cut position p (their cotangents are
    live in the backward there), for p in 0..num_nodes."""
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


def layer_keys(graph: Graph) -> list[str | None]:
    """Per node, the layer it belongs to (None: glue between layers).

    Layers come from the first source that splits the program into at least two of them:
    the name stack (`.../h/3`, `.../Block_2`: named scopes, Flax module paths); else the
    user's own functions, from the call structure JAX records (`call_keys`) or from the same
    sequence of primitives run again (`repeat_keys`), whichever covers more FLOPs. So a
    program without names still has its blocks as layers: per-layer recipes then include
    "checkpoint each call of the user's block" (docs/design.md#layers-without-names).
    """
    if "layer_keys" not in graph.memo:
        keys, source = name_keys(graph), "names"
        if len(_spans(keys)) < 2:
            found = [
                (k, src)
                for k, src in ((call_keys(graph), "calls"), (repeat_keys(graph), "repeats"))
                if len(_spans(k)) >= 2
            ]
            keys, source = [None] * graph.num_nodes, None
            if found:  # the first on ties
                keys, source = max(found, key=lambda ks: _covered_flops(graph, ks[0]))
        graph.memo["layer_keys"], graph.memo["layer_source"] = keys, source
    return list(graph.memo["layer_keys"])


def layer_source(graph: Graph) -> str | None:
    """Where `layer_keys` found the layers: "names", "calls", "repeats", or None (none)."""
    if len(layer_spans(graph)) < 2:
        return None
    return graph.memo["layer_source"]


def name_keys(graph: Graph) -> list[str | None]:
    """Per node, the layer named in its name stack (`.../h/3`, `.../Block_2`), or None."""
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


def call_keys(graph: Graph) -> list[str | None]:
    """Per node, the call (`jit`-decorated function, `closed_call`) it was inlined from, as
    `name@position` paths (`Node.calls`), or None for nodes outside every call.

    Calls nest (a jitted block calls the jitted `jax.nn.silu`; a jitted loss holds every
    block): of the call depths that split the program into two calls or more, the one whose
    calls cover the most FLOPs, the shallowest on ties. A call without a contraction
    (`jax.image.resize`, `jax.nn.silu` alone) is glue, not a layer. Plain Python functions
    leave no call in the jaxpr: `repeat_keys` finds those.
    """
    depth = max((len(n.calls) for n in graph.nodes), default=0)
    best: tuple[float, list[str | None]] = (-1.0, [None] * graph.num_nodes)
    for d in range(1, depth + 1):
        keys = ["/".join(n.calls[:d]) if len(n.calls) >= d else None for n in graph.nodes]
        heavy = {k for k, n in zip(keys, graph.nodes, strict=True) if n.primitive in CONTRACTIONS}
        keys = [k if k in heavy else None for k in keys]
        if len(_spans(keys)) >= 2 and _covered_flops(graph, keys) > best[0]:
            best = (_covered_flops(graph, keys), keys)
    return best[1]


#: A repeated pattern is taken as the user's block when it covers at least this fraction of
#: the equations the most covering pattern does (`repeat_keys`).
REPEAT_COVERAGE = 0.75
#: Primitives that make a repeated sequence a block worth a layer (it holds real compute).
CONTRACTIONS = frozenset({"dot_general", "conv_general_dilated"})


def repeat_keys(graph: Graph, max_length: int = 96, max_patterns: int = 4) -> list[str | None]:
    """Per node, the occurrence of a repeated subgraph it belongs to (`repeat@<start>`), or
    None: the user's blocks when they are plain Python functions, which leave no trace in
    the jaxpr but the same equations run again.

    Nodes read as tokens (primitive, rank of the first output), so a block called at other
    shapes (a U-Net's levels) still repeats. A pattern is a token sequence of length 2 to
    `max_length` holding a contraction that occurs at least twice without overlap. Of the
    patterns covering at least `REPEAT_COVERAGE` of the most equations any covers, the
    shortest wins (a ResNet's block rather than its stage of two blocks), of those the one covering
    the most, then the one whose occurrences start where fewer bytes cross. Up to
    `max_patterns` patterns are taken, each on nodes the previous ones left. A pattern is
    then grouped where a block holds it several times (`_group_periodic`) and grown while
    every occurrence has the same equation next to it (`_extend`), so a block's cheap tail
    (the activation after its convolution) stays in the block.
    """
    n = graph.num_nodes
    keys: list[str | None] = [None] * n
    if n < 4:
        return keys
    vocab: dict[tuple[str, int], int] = {}
    tokens = np.array(
        [
            vocab.setdefault(
                (nd.primitive, len(graph.values[nd.outputs[0]].shape) if nd.outputs else -1),
                len(vocab),
            )
            for nd in graph.nodes
        ],
        dtype=np.int64,
    )
    heavy = np.concatenate([[0], np.cumsum([nd.primitive in CONTRACTIONS for nd in graph.nodes])])
    flops = np.concatenate([[0.0], np.cumsum([nd.flops for nd in graph.nodes])])
    cross = crossing_bytes(graph)
    taken = np.zeros(n + 1, dtype=np.int64)  # prefix count of nodes already in a pattern
    for _ in range(max_patterns):
        per_length: dict[int, tuple] = {}  # length -> (covered FLOPs, -crossing, starts)
        for length in range(2, min(max_length, n // 2) + 1):
            starts = np.arange(n - length + 1)
            ok = (heavy[starts + length] > heavy[starts]) & (
                taken[starts + length] == taken[starts]
            )
            if ok.sum() < 2:
                continue
            windows = np.lib.stride_tricks.sliding_window_view(tokens, length)[ok]
            starts = starts[ok]
            _, inverse, counts = np.unique(windows, axis=0, return_inverse=True, return_counts=True)
            order = np.argsort(inverse.reshape(-1), kind="stable")
            bounds = np.concatenate([[0], np.cumsum(counts)])
            for g in np.nonzero(counts >= 2)[0]:
                chosen: list[int] = []
                for s in starts[order[bounds[g] : bounds[g + 1]]]:
                    if not chosen or s >= chosen[-1] + length:
                        chosen.append(int(s))
                if len(chosen) < 2:
                    continue
                covered = float(sum(flops[s + length] - flops[s] for s in chosen))
                score = (covered, -float(sum(cross[s] for s in chosen)), chosen)
                if length not in per_length or score[:2] > per_length[length][:2]:
                    per_length[length] = score
        if not per_length:
            break
        # the shortest pattern covering nearly the most: a block, not a stage of blocks
        most = max(v[0] for v in per_length.values())
        length = min(k for k, v in per_length.items() if v[0] >= REPEAT_COVERAGE * most)
        chosen, length = _group_periodic(tokens, per_length[length][2], length)
        chosen, length = _extend(tokens, keys, chosen, length)
        for s in chosen:
            keys[s : s + length] = [f"repeat@{s}"] * length
        taken = np.concatenate([[0], np.cumsum([k is not None for k in keys])])
    return keys


def _group_periodic(tokens: np.ndarray, starts: list[int], length: int) -> tuple[list[int], int]:
    """Occurrences `starts` of a `length`-token pattern that each block holds `p` >= 2 times
    (a residual MLP block's two `mul, dot_general`; a ResNet block's two `norm, relu, conv`
    halves) grouped `p` at a time into the block: when the equations between the occurrences
    inside each group are the same in every group, and differ from every gap between groups.
    Unchanged when no such `p` divides the occurrences (a stage of blocks, evenly spaced, stays
    its blocks)."""
    k = len(starts)
    gaps = [
        tuple(tokens[a + length : b].tolist()) for a, b in zip(starts, starts[1:], strict=False)
    ]
    for p in range(2, k // 2 + 1):
        if k % p:
            continue
        inner = {tuple(gaps[i : i + p - 1]) for i in range(0, k, p)}
        between = [gaps[i - 1] for i in range(p, k, p)]
        if len(inner) == 1 and not set(between) & set(next(iter(inner))):
            return starts[::p], starts[p - 1] + length - starts[0]
    return starts, length


def _extend(
    tokens: np.ndarray, keys: list[str | None], starts: list[int], length: int
) -> tuple[list[int], int]:
    """Occurrences `starts` of a `length`-token pattern grown to the right, then the left,
    while every occurrence has the same token there, free (no key) and not reaching the
    next occurrence."""
    n = len(tokens)

    def free(j: int) -> bool:
        return 0 <= j < n and keys[j] is None

    while all(free(s + length) for s in starts) and all(
        a + length < b for a, b in zip(starts, starts[1:], strict=False)
    ):
        if len({int(tokens[s + length]) for s in starts}) != 1:
            break
        length += 1
    while all(free(s - 1) for s in starts) and all(
        b - 1 >= a + length for a, b in zip(starts, starts[1:], strict=False)
    ):
        if len({int(tokens[s - 1]) for s in starts}) != 1:
            break
        starts = [s - 1 for s in starts]
        length += 1
    return starts, length


def _spans(keys: list[str | None]) -> list[tuple[int, int]]:
    """Contiguous `[start, end)` runs of equal non-None keys; a key that resumes after other
    nodes (glue inside a layer) extends its run."""
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


def _covered_flops(graph: Graph, keys: list[str | None]) -> float:
    return float(sum(n.flops for n, k in zip(graph.nodes, keys, strict=True) if k is not None))


def layer_spans(graph: Graph) -> list[tuple[int, int]]:
    """Contiguous `[start, end)` node ranges of the model's layers (`layer_keys`).

    Nodes between layers (embeddings, heads, unnamed glue) belong to no span. Empty when no
    layers are found (no names, calls or repeated blocks).
    """
    return _spans(layer_keys(graph))


def candidate_cuts(graph: Graph, max_cuts: int = 160, layers: bool = True) -> list[int]:
    """Cut positions the planners consider: layer boundaries (unless `layers` is False) plus
    low-crossing positions.

    Always includes 0 and `num_nodes`. Positions are local minima of `crossing_bytes`; when
    there are more than `max_cuts`, the cheapest in each of `max_cuts` equal windows are kept.
    """
    n = graph.num_nodes
    cross = crossing_bytes(graph)
    cuts = {0, n}
    for s, e in layer_spans(graph) if layers else ():
        cuts.update((s, e))
    # a user's checkpoint is a block of its own: the bytes crossing its ends may equal the
    # crossing's maximum (a stack of checkpointed layers crosses only the layer input), which
    # no local minimum below would pick, and an outer checkpoint around it is what frees the
    # residuals its policy saves (`cost_model.policy_saved_bytes`)
    for node in graph.nodes:
        if node.primitive in CHECKPOINT_PRIMITIVES:
            cuts.update((node.index, node.index + 1))
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
    return _has_primitive(graph, "scan")


#: Equations whose bodies a nested-loop rewrite looks into for loops (`loops_inside`):
#: branches and nested jits run once per iteration of the loop around them.
PASS_THROUGH = ("cond", "pjit", "jit", "closed_call")


def loops_inside(jaxpr: Any) -> bool:
    """Whether a (closed) jaxpr runs a `scan` among its equations, or inside the bodies of
    its `PASS_THROUGH` equations (a `cond` branch, a nested jit)."""
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        name = eqn.primitive.name
        if name == "scan" or (
            name in PASS_THROUGH and any(loops_inside(j) for j in subjaxprs(eqn))
        ):
            return True
    return False


def has_checks(graph: Graph) -> bool:
    """Whether the program holds a `checkify.check` (`check` primitive), at any depth: it is
    traced inside the caller's `checkify.checkify`, and compiles only functionalized."""
    return _has_primitive(graph, "check")


def _has_primitive(graph: Graph, name: str) -> bool:
    """Whether an equation of primitive `name` is in the graph or in a body it holds."""

    def walk(eqns) -> bool:
        return any(
            e.primitive.name == name or any(walk(j.eqns) for j in subjaxprs(e)) for e in eqns
        )

    return walk([n.eqn for n in graph.nodes])


def sqrt_divisor(n: int) -> int:
    """The divisor of n closest to sqrt(n) (1 when n is prime)."""
    divisors = [d for d in range(2, n) if n % d == 0]
    return min(divisors, key=lambda d: abs(d - math.sqrt(n))) if divisors else 1


def layer_segments(graph: Graph, max_pseudo_layers: int = 16) -> list[tuple[int, int]]:
    """The model's layers as node ranges (`layer_spans`), or `flop_chunks` when none are
    found."""
    spans = layer_spans(graph)
    if len(spans) >= 2:
        return spans
    return flop_chunks(graph, max_pseudo_layers)


def flop_chunks(graph: Graph, max_pseudo_layers: int = 16) -> list[tuple[int, int]]:
    """About `max_pseudo_layers` equal-FLOP chunks between low-crossing cuts, covering every
    node (no glue left out)."""
    cuts = candidate_cuts(graph, max_cuts=4 * max_pseudo_layers, layers=False)
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
