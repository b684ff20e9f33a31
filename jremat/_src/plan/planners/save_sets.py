"""What one segment costs under any save set, value by value, in the segment model's terms.

`segments.segment_table` prices each segment `[start, end)` under a few save options (a
predicate on value ids). This module prices it under an arbitrary set of saved value ids,
with the same accounting (docs/design.md#planners), so that per-value planners (the per-value
MILP, DTR) and the option planners (chain, greedy, the segment MILP) are priced by one formula:

  stored    = live-in bytes + kept bytes
  transient = internal residual bytes - kept bytes + cotangent bytes at both cuts
              + working set (the larger crossing at the two cuts)
  flops     = FLOPs of the equations the segment's backward recomputes

An equation is recomputed iff one of its unsaved outputs is needed: a residual of an equation
in the segment, or the input of a recomputed equation (JAX's partial evaluation drops the
rest). A saved value is kept iff it is needed (otherwise JAX drops it). A kept segment (no
checkpoint) stores its live-in and internal residual bytes and holds cotangents and working
set. For a save set equal to an option's selection, `SaveSetPricer.price` reproduces that
option's `segment_table` entry exactly (tests/test_milp_values.py).

Both a kept and a checkpointed segment have `stored + transient = live_in + internal +
boundary`, whatever the save set: the set moves bytes between the segment's own backward and
the stores every later segment's backward sees.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Collection, Iterable, Sequence

import numpy as np

from jremat._src.plan.plan import KEEP, SAVE_NAMES, Plan, Segment
from jremat._src.trace.graph import Graph
from jremat._src.trace.layers import crossing_bytes, first_residual_use, float_crossing_bytes

#: A priced path: `[(start, end, saved)]` node ranges tiling the program, each kept
#: (`saved` None) or checkpointed saving the value ids `saved`.
Pieces = list[tuple[int, int, "tuple[int, ...] | None"]]


@dataclasses.dataclass(frozen=True)
class SaveSetCost:
    """The segment model's costs of one segment.

    Attributes:
      stored: bytes kept from the forward to the backward pass.
      transient: bytes live while the segment's backward runs besides the stores.
      flops: FLOPs its backward recomputes.
      recomputed: node indices it recomputes (ascending).
      kept: saved value ids its backward needs (ascending); the rest of a save set is dropped.
    """

    stored: float
    transient: float
    flops: float
    recomputed: tuple[int, ...] = ()
    kept: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class SegmentFacts:
    """What a segment `[start, end)` costs whatever it saves (bytes).

    Attributes:
      start, end: node range.
      live_in: bytes of values produced before `start` and read inside the segment.
      internal: residual bytes produced and first needed inside it, plus its control-flow
        nodes' internal residual bytes (scan stacks).
      boundary: cotangent bytes at both cuts plus the working set (larger crossing of the two).
      needed: node indices that a checkpoint saving nothing recomputes (a superset of what
        any save set recomputes).
      candidates: float value ids produced inside whose saving can matter: residuals of a
        node inside, or inputs of a node in `needed`.
    """

    start: int
    end: int
    live_in: float
    internal: float
    boundary: float
    needed: tuple[int, ...]
    candidates: tuple[int, ...]


class SaveSetPricer:
    """Prices segments of one graph under any save set (see the module docstring).

    Args:
      graph: a traced program (`jremat.trace`).
      recompute_internal: True (default, what JAX does, and `segment_table`'s accounting):
        a node with internal residual bytes (`Node.internal_bytes`: a custom_jvp's or a
        scan's own residuals) is always recomputed in a checkpointed segment (its internal
        residuals cannot be saved by name, and its own backward needs them), so its FLOPs
        are charged and its inputs needed. False: the older accounting, where such a node
        moves them to the transient bytes but costs FLOPs only when one of its outputs is
        needed (kept to measure what the difference does).
    """

    def __init__(self, graph: Graph, recompute_internal: bool = True):
        self.graph = graph
        self.recompute_internal = recompute_internal
        # value id -> first node keeping it as residual: XLA's (`residuals`: a kept segment's
        # bytes), and JAX's VJP rules' (`vjp_residuals`: what a checkpointed one recomputes)
        self.res_first, self.vjp_first = first_residual_use(graph)
        self._cross = crossing_bytes(graph)
        self._float_cross = float_crossing_bytes(graph)
        internal = [float(nd.internal_bytes) for nd in graph.nodes]
        self._internal_cum = np.concatenate([[0.0], np.cumsum(internal)])
        self._facts: dict[tuple[int, int], SegmentFacts] = {}

    def _check_range(self, start: int, end: int) -> None:
        n = self.graph.num_nodes
        if not (0 <= start < end <= n):
            raise ValueError(f"need 0 <= start < end <= {n} (nodes); got start={start}, end={end}")

    def _needed(self, start: int, end: int, saved) -> list[int]:
        """Nodes of `[start, end)` the backward recomputes when the values in `saved` (a
        container of value ids) are saved, descending."""
        g, out, need = self.graph, [], set()
        for i in range(end - 1, start - 1, -1):
            if self.recompute_internal and g.nodes[i].internal_bytes:
                need.add(i)
                out.append(i)
                continue
            for o in g.nodes[i].outputs:
                if o in saved:
                    continue
                if self.vjp_first.get(o, end) < end or any(
                    c < end and c in need for c in g.consumers[o]
                ):
                    need.add(i)
                    out.append(i)
                    break
        return out

    def _is_needed_value(self, v: int, end: int, need) -> bool:
        return self.vjp_first.get(v, end) < end or any(
            c < end and c in need for c in self.graph.consumers[v]
        )

    def facts(self, start: int, end: int) -> SegmentFacts:
        """The save-set-independent costs of `[start, end)`; raises ValueError for a range
        outside `0 <= start < end <= num_nodes`."""
        self._check_range(start, end)
        key = (start, end)
        if key in self._facts:
            return self._facts[key]
        g = self.graph
        live_in = 0.0
        for v in g.values:
            if 0 <= v.producer < start:
                cons = g.consumers[v.id]
                k = bisect.bisect_left(cons, start)
                if k < len(cons) and cons[k] < end:
                    live_in += v.nbytes
        internal = self._internal_cum[end] - self._internal_cum[start]
        needed = self._needed(start, end, ())
        need = set(needed)
        candidates = []
        for node in g.nodes[start:end]:
            for o in node.outputs:
                r = self.res_first.get(o)
                if r is not None and r < end:
                    internal += g.values[o].nbytes  # produced here, first kept here
                if g.values[o].saveable and self._is_needed_value(o, end, need):
                    candidates.append(o)
        boundary = (
            self._float_cross[start]
            + self._float_cross[end]
            + max(self._cross[start], self._cross[end])
        )
        f = SegmentFacts(
            start, end, live_in, float(internal), float(boundary), tuple(sorted(need)),
            tuple(candidates),
        )  # fmt: skip
        self._facts[key] = f
        return f

    def keep(self, start: int, end: int) -> SaveSetCost:
        """Costs of `[start, end)` kept (no checkpoint: every residual stored)."""
        f = self.facts(start, end)
        return SaveSetCost(f.live_in + f.internal, f.boundary, 0.0)

    def price(self, start: int, end: int, saved: Iterable[int]) -> SaveSetCost:
        """Costs of `[start, end)` checkpointed, saving the value ids `saved`.

        Ids produced outside the segment, or not needed by its backward, cost nothing (JAX
        drops them). Raises ValueError for a bad range or an id that is no value of the graph.
        """
        f = self.facts(start, end)
        g = self.graph
        saved = set(saved)
        bad = [v for v in saved if not (isinstance(v, int | np.integer) and 0 <= v < len(g.values))]
        if bad:
            raise ValueError(f"saved: {sorted(map(repr, bad))} are not value ids of the graph")
        need_desc = self._needed(start, end, saved)
        need = set(need_desc)
        kept = sorted(
            v
            for v in saved
            if start <= g.values[v].producer < end and self._is_needed_value(v, end, need)
        )
        kept_bytes = float(sum(g.values[v].nbytes for v in kept))
        flops = float(sum(g.nodes[i].flops for i in reversed(need_desc)))
        return SaveSetCost(
            f.live_in + kept_bytes,
            f.internal - kept_bytes + f.boundary,
            flops,
            tuple(reversed(need_desc)),
            tuple(kept),
        )

    def piece(self, start: int, end: int, saved: Iterable[int] | None) -> SaveSetCost:
        """Costs of one piece of a path: `keep` where `saved` is None, else `price`."""
        return self.keep(start, end) if saved is None else self.price(start, end, saved)

    def path_cost(self, pieces: Pieces) -> tuple[float, float]:
        """(modelled peak in bytes, recompute FLOPs) of a path `[(start, end, saved or None
        for kept)]` by the segment model's peak formula `max_i (sum_{j <= i} stored_j +
        transient_i)`, a run of adjacent kept pieces priced as the one kept segment the plan
        makes of it (`merge_kept_pieces`). Raises ValueError when the pieces do not tile
        `[0, num_nodes)`."""
        pos, running, peak, flops = 0, 0.0, 0.0, 0.0
        for start, end, saved in merge_kept_pieces(pieces):
            if start != pos:
                raise ValueError(f"pieces: segment [{start}, {end}) does not start at {pos}")
            c = self.piece(start, end, saved)
            running += c.stored
            peak = max(peak, running + c.transient)
            flops += c.flops
            pos = end
        if pos != self.graph.num_nodes:
            raise ValueError(f"pieces: end at node {pos}, not at {self.graph.num_nodes}")
        return peak, flops


def merge_kept_pieces(pieces: Pieces) -> Pieces:
    """`pieces` with each run of adjacent kept pieces (`saved` None) made one: no checkpoint
    lies between them, so the program runs them as one kept segment (the segment model's
    `merge_kept` for value-id paths)."""
    out: Pieces = []
    for start, end, saved in pieces:
        if saved is None and out and out[-1][2] is None and out[-1][1] == start:
            out[-1] = (out[-1][0], end, None)
        else:
            out.append((start, end, saved))
    return out


def pieces_plan(pricer: SaveSetPricer, pieces: Pieces, solver: str, recompute_flops: float) -> Plan:
    """A priced path as a `Plan` labelled `solver`: checkpointed pieces as policy "names"
    segments saving their value ids, adjacent kept pieces merged (`merge_kept_pieces`), the
    predicted bytes and FLOPs of each segment and of the plan from `pricer`
    (`recompute_flops`: the plan's objective as its planner states it)."""
    g, out, running, peak = pricer.graph, [], 0.0, 0.0
    for start, end, saved in merge_kept_pieces(pieces):
        c = pricer.piece(start, end, saved)
        running += c.stored
        peak = max(peak, running + c.transient)
        policy = KEEP if saved is None else SAVE_NAMES
        out.append(
            Segment(start, end, policy, list(saved or ()), int(c.stored), int(c.transient), c.flops)
        )
    return Plan(
        out,
        g.fingerprint,
        g.num_nodes,
        solver=solver,
        predicted_temp_bytes=int(peak),
        recompute_flops=recompute_flops,
    )


def save_set_cost(graph: Graph, start: int, end: int, saved: Sequence[int]) -> SaveSetCost:
    """Costs (bytes, FLOPs) of segment `[start, end)` of `graph` checkpointed saving the value
    ids `saved`: `SaveSetPricer(graph).price(start, end, saved)` (build the pricer once to
    price many sets of one graph)."""
    return SaveSetPricer(graph).price(start, end, saved)


def saved_set_costs(
    graph: Graph, spans: Sequence[tuple[int, int, Collection[int]]]
) -> list[tuple[float, float, float]]:
    """(stored bytes, transient bytes, recompute FLOPs) of checkpointed segments that save any
    set of values by name, priced as `segment_table` prices a save option's segment.

    `segment_table` prices the save sets its options' predicates select; a planner that
    chooses values one by one (DTR's evictions, `dtr.py`) needs the same three numbers for a
    save set no option names. The entries equal the table's wherever the set is an option's
    (`saved_values`) and the span's ends are cuts (tests/test_planners_exhaustive.py).

    Args:
      spans: `(start, end, saved value ids)` per segment, node ranges `[start, end)` that do
        not overlap; ids produced outside their own segment are ignored (a segment's inputs
        are stored whatever it names).

    Returns:
      One `(stored, transient, flops)` per span, in order.

    Raises:
      ValueError: when a span is empty, reversed or out of `[0, num_nodes]`, or spans overlap.
    """
    n = graph.num_nodes
    owner = np.full(n, -1)
    for i, (start, end, _) in enumerate(spans):
        if not 0 <= start < end <= n:
            raise ValueError(f"spans[{i}] = [{start}, {end}) is not a node range of [0, {n}]")
        if (owner[start:end] >= 0).any():
            raise ValueError(f"spans[{i}] = [{start}, {end}) overlaps another span")
        owner[start:end] = i
    pricer = SaveSetPricer(graph)
    return [
        (c.stored, c.transient, c.flops)
        for c in (pricer.price(start, end, saved) for start, end, saved in spans)
    ]
