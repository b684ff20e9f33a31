"""Chain planner: dynamic programming over cut points and per-segment save sets.

Chen et al., "Training Deep Nets with Sublinear Memory Cost" (2016) cut a chain into sqrt(n)
segments and recompute each; Griewank & Walther's revolve (2000) and Rotor (Beaumont et al.,
"Optimal checkpointing for heterogeneous chains", 2019) solve the same chain problem optimally by
dynamic programming; Rockmate (Zhao et al., ICML 2023) adds per-block save sets. This planner is
that DP over the traced program's cut candidates: each segment is kept (no checkpoint) or
checkpointed with one of the save sets in `SAVE_OPTIONS` (nothing, dots without batch dims,
expensive results, all dots), and the peak is modelled as

    peak = max_i ( sum_{j <= i} stored_j  +  transient_i ),

the stores of every earlier segment plus what segment i's backward holds. JAX's built-in policies
applied per layer and sqrt(n) segmentations are points of this space, so the DP never
recomputes more than they do at the same predicted memory.
"""

from __future__ import annotations

import math

import numpy as np

from ..offload import OffloadCost
from ..plan import KEEP, SAVE_NAMES, Plan, Segment
from ..trace import Graph
from .candidates import (
    KEEP_OPTION,
    OFFLOAD_OPTIONS,
    SAVE_OPTIONS,
    SegmentTable,
    candidate_cuts,
    saved_values,
    segment_table,
)

GRID = 384  # memory buckets of the budgeted DP


def _options(t: SegmentTable, a: int, b: int):
    """(option name, stored, transient, cost) for segment (a, b) under every option; cost is
    recompute FLOPs plus offload transfers as FLOP-equivalents (`SegmentTable.cost`)."""
    for k, name in enumerate(t.options):
        yield name, t.stored[k, a, b], t.transient[k, a, b], t.cost[k, a, b]


def min_memory(t: SegmentTable) -> tuple[float, list[tuple[int, int, str]]]:
    """The segmentation with the smallest modelled peak (ties: fewest FLOPs). Exact DP."""
    m = len(t.cuts)
    best = [(math.inf, math.inf)] * m  # (peak of suffix, flops)
    choice: list[tuple[int, str] | None] = [None] * m
    best[m - 1] = (0.0, 0.0)
    for a in range(m - 2, -1, -1):
        for b in range(a + 1, m):
            for mode, stored, trans, fl in _options(t, a, b):
                peak = max(stored + trans, stored + best[b][0])
                cand = (peak, fl + best[b][1])
                if cand < best[a]:
                    best[a], choice[a] = cand, (b, mode)
    return best[0][0], _walk(choice, m)


def within_budget(
    t: SegmentTable, budget: float
) -> tuple[float, list[tuple[int, int, str]]] | None:
    """Lowest cost (recompute FLOPs, plus offload transfers as FLOP-equivalents) with modelled
    peak <= budget bytes; None when infeasible.

    Suffix DP over (cut, memory left) with the memory axis in GRID buckets (stores rounded up,
    so a plan it returns is within budget in the model).
    """
    m = len(t.cuts)
    if budget <= 0:
        return None
    q = budget / GRID
    levels = np.arange(GRID + 1) * q  # memory available at each bucket
    inf = np.inf
    F = np.full((m, GRID + 1), inf)
    F[m - 1, :] = 0.0
    arg_b = np.full((m, GRID + 1), -1, dtype=np.int32)
    arg_mode = np.zeros((m, GRID + 1), dtype=np.int8)
    K = len(t.options)
    cols = np.arange(GRID + 1)
    for a in range(m - 2, -1, -1):
        # every segment (a, b) under every option at once: shape (b, option, memory level)
        bs = np.arange(a + 1, m)
        stored, trans, fl = (x[:, a, a + 1 :].T for x in (t.stored, t.transient, t.cost))
        finite = np.isfinite(stored)
        shift = np.where(finite, np.ceil(np.where(finite, stored, 0) / q - 1e-9), GRID + 1)
        idx = cols[None, None, :] - shift[:, :, None].astype(np.int64)
        ok = (idx >= 0) & (levels[None, None, :] >= (stored + trans)[:, :, None])
        rest = F[bs[:, None, None], np.maximum(idx, 0)]
        cand = np.where(ok, fl[:, :, None] + rest, inf).reshape(len(bs) * K, GRID + 1)
        first = np.argmin(cand, axis=0)  # ties: the smallest b, then the first option
        F[a] = cand[first, cols]
        arg_b[a] = np.where(np.isfinite(F[a]), bs[first // K], -1)
        arg_mode[a] = first % K
    if not np.isfinite(F[0, GRID]):
        return None
    segs, a, level = [], 0, GRID
    while a < m - 1:
        b, k = int(arg_b[a, level]), int(arg_mode[a, level])
        mode, stored, _, _ = list(_options(t, a, b))[k]
        segs.append((a, b, mode))
        level -= int(math.ceil(stored / q - 1e-9))
        a = b
    return float(F[0, GRID]), segs


#: Budget inflations tried after the DP (largest first) to undo its per-segment rounding.
INFLATIONS = (0.04, 0.02, 0.01)


def _exact_peak(t: SegmentTable, segs) -> float:
    """The modelled peak of `[(a, b, option)]`, without the DP's memory buckets."""
    running, peak = 0.0, 0.0
    for a, b, option in segs:
        k = t.option_index(option)
        running += t.stored[k, a, b]
        peak = max(peak, running + t.transient[k, a, b])
    return peak


def _walk(choice, m):
    segs, a = [], 0
    while a < m - 1:
        b, mode = choice[a]
        segs.append((a, b, mode))
        a = b
    return segs


def to_plan(graph: Graph, t: SegmentTable, segs, solver: str = "chain") -> Plan:
    """Turn DP output `[(a, b, option)]` into a `Plan` with per-segment predictions.

    Adjacent kept segments are merged (no checkpoint boundary between them).
    """
    out: list[Segment] = []
    running, peak, flops, host = 0.0, 0.0, 0.0, 0.0
    for a, b, option in segs:
        k = t.option_index(option)
        stored, trans, fl = t.stored[k, a, b], t.transient[k, a, b], t.flops[k, a, b]
        running += stored
        peak = max(peak, running + trans)
        flops += fl
        start, end = t.cuts[a], t.cuts[b]
        if option == KEEP_OPTION:
            if out and out[-1].policy == KEEP:
                prev = out[-1]
                prev.end = end
                prev.stored_bytes += int(stored)
                prev.transient_bytes = max(prev.transient_bytes, int(trans))
                continue
            out.append(Segment(start, end, KEEP, [], int(stored), int(trans), 0.0))
            continue
        saved = saved_values(graph, start, end, option)
        seg = Segment(start, end, SAVE_NAMES, saved, int(stored), int(trans), float(fl))
        if option in OFFLOAD_OPTIONS:
            seg.saved, seg.offloaded = [], saved
            host += t.offloaded[k, a, b]
        out.append(seg)
    plan = Plan(
        out,
        graph.fingerprint,
        graph.num_nodes,
        solver=solver,
        predicted_temp_bytes=int(peak),
        recompute_flops=flops,
        offloaded_bytes=int(host),
    )
    if host and t.offload is not None:
        c = t.offload
        plan.notes.append(
            f"offload: {int(host):,} bytes to pinned host and back, "
            f"{c.transfer_seconds(host) * 1e3:.3g} ms at {c.host_bandwidth:.3g} bytes/s, "
            f"charged as {c.transfer_flops(host):.4g} FLOPs at {c.device_flops:.3g} FLOP/s"
        )
    return plan


class ChainPlanner:
    """Plans for one graph at many budgets (the segment table is built once).

    Args:
      graph: a traced program (`jremat.trace`).
      max_cuts: how many cut candidates the DP considers (O(max_cuts^2 x GRID) work).
      options: the save options (`SAVE_OPTIONS` names) a checkpointed segment may take.
      offload: an `OffloadCost` adds the `OFFLOAD_OPTIONS` (values offloaded to pinned host
        memory, charged their transfer time); None (default): no offload.
    """

    name = "chain"

    def __init__(
        self,
        graph: Graph,
        max_cuts: int = 160,
        options=tuple(SAVE_OPTIONS),
        offload: OffloadCost | None = None,
    ):
        self.graph = graph
        self.offload = offload
        if offload is not None:
            options = (*options, *[o for o in OFFLOAD_OPTIONS if o not in options])
        self.table = segment_table(graph, candidate_cuts(graph, max_cuts), options, offload)
        self._min = None

    def min_memory_plan(self) -> Plan:
        """The plan with the smallest modelled peak."""
        if self._min is None:
            _, segs = min_memory(self.table)
            self._min = to_plan(self.graph, self.table, segs, self.name)
        return self._min

    def no_remat_peak(self) -> float:
        """Modelled peak of the unrematerialized program (one kept segment)."""
        m = len(self.table.cuts)
        return float(self.table.stored[0, 0, m - 1] + self.table.transient[0, 0, m - 1])

    def predict(self, plan: Plan) -> float | None:
        """Modelled peak of any plan whose cuts are candidates and whose policies map to an
        option (`keep`, saved names, or a built-in the options mirror); None otherwise (also
        for plans that rematerialize scans, which the segment model does not describe)."""
        if plan.scans:
            return None  # loop rematerialization is not in the segment model
        t = self.table
        index = {c: i for i, c in enumerate(t.cuts)}
        builtin = {
            "nothing_saveable": "nothing",
            "dots_saveable": "dots",
            "dots_with_no_batch_dims_saveable": "dots_no_batch",
        }
        running, peak = 0.0, 0.0
        for seg in plan.segments:
            a, b = index.get(seg.start), index.get(seg.end)
            if a is None or b is None:
                return None
            if seg.policy == KEEP:
                option = KEEP_OPTION
            elif seg.policy == SAVE_NAMES and seg.offloaded and not seg.saved:
                option = "offload_dots"
            elif seg.policy == SAVE_NAMES and not seg.saved:
                option = "nothing"
            else:
                option = builtin.get(seg.policy)
            if option not in t.options:
                return None
            k = t.option_index(option)
            running += t.stored[k, a, b]
            peak = max(peak, running + t.transient[k, a, b])
        return peak

    def plan(self, model_budget: float) -> Plan | None:
        """Lowest-cost plan (`SegmentTable.cost`: FLOPs, with offload transfers) whose modelled
        peak is <= `model_budget` bytes, or None."""
        found = within_budget(self.table, model_budget)
        if found is None:
            return None
        best_cost, best_segs = found
        # The DP rounds every segment's stores up to a 1/GRID bucket, losing up to one bucket
        # per segment. Solving at slightly inflated budgets and keeping the cheapest result
        # whose exact peak still fits recovers most of that loss.
        for inflate in INFLATIONS:
            again = within_budget(self.table, model_budget * (1 + inflate))
            if again is None or again[0] >= best_cost:
                continue
            if _exact_peak(self.table, again[1]) <= model_budget:
                best_cost, best_segs = again
                break
        return to_plan(self.graph, self.table, best_segs, self.name)
