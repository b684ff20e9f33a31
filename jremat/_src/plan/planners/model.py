"""The segment model every planner plans on: one graph's cut candidates and segment costs.

A plan is a path of segments over the cut candidates, each kept (no checkpoint) or checkpointed
with one option of `SAVE_OPTIONS` / `OFFLOAD_OPTIONS` (the `SegmentTable`). Its modelled peak is

    peak = max_i ( sum_{j <= i} stored_j  +  transient_i ),

the stores of every earlier segment plus what segment i's backward holds, in bytes. The model
answers the questions all planners and the search share: calibration against compiled
programs (`calibrate`), prediction (`predict`, `segment_peaks`), the plan with the smallest
peak, the cheapest plan within a budget, and turning a segment choice into a `Plan`.

The two exact solvers are the dynamic programs over cut points of Chen et al., "Training Deep
Nets with Sublinear Memory Cost" (2016) and Beaumont et al., "Optimal checkpointing for
heterogeneous chains" (Rotor, 2019), with Rockmate's per-segment save sets (Zhao et al., ICML
2023). They live here, not in `chain`, because every planner's min-memory plan, the MILP's
incumbent and `jremat.plan`'s floor plans use them too.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import numbers
import os
from collections.abc import Callable

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from jremat._src.plan.offload import OffloadCost
from jremat._src.plan.plan import KEEP, SAVE_NAMES, Plan, Segment
from jremat._src.plan.planners.save_sets import saved_set_costs
from jremat._src.plan.planners.segments import (
    DEFAULT_OPTIONS,
    KEEP_OPTION,
    LADDER_OPTIONS,
    OFFLOAD_OPTIONS,
    SAVE_OPTIONS,
    SegmentTable,
    saved_values,
    segment_table,
)
from jremat._src.trace.graph import Graph
from jremat._src.trace.layers import candidate_cuts

#: A segment choice: `[(cut index a, cut index b, option name)]`, a path from the first cut
#: to the last.
Segments = list[tuple[int, int, str]]

GRID = 384  # memory buckets of the budgeted DP

#: Relative difference under which two costs (or peaks) are a tie, decided by order (the
#: smallest segment end, then the first option): float rounding, not the model, must not
#: decide between identical layers (a table built with an offload option summed them in
#: another order than one without, and greedy chose other segments; greedy.RATIO_TIE).
COST_TIE = 1e-9

#: Budget inflations tried after the DP (largest first) to undo its per-segment rounding.
INFLATIONS = (0.04, 0.02, 0.01)

#: Threads `SegmentModel.cheapest_segments` runs its independent DPs in (NumPy releases the
#: GIL in their array work: 1.6x on 2 CPUs). Each DP's result is its own, so the answer does
#: not depend on the count.
DP_THREADS = min(4, os.cpu_count() or 1)


def first_near_min(values: np.ndarray, axis: int) -> np.ndarray:
    """`np.argmin(values, axis)`, but the first index within `COST_TIE` (relative) of the
    minimum: sums of identical layers' costs that differ in the last bit are a tie."""
    lowest = values.min(axis=axis, keepdims=True)
    return np.argmax(values <= lowest + COST_TIE * np.abs(lowest), axis=axis)


def min_memory(t: SegmentTable) -> tuple[float, Segments]:
    """The segmentation with the smallest modelled peak in bytes (ties: fewest FLOPs). Exact
    DP over paths without two adjacent kept segments (see the note above `_bucket_dp`)."""
    m = len(t.cuts)
    # [state, cut]: the smallest peak (and its FLOPs) of the suffix from each cut, where state
    # 1 is "the segment before was kept" (the suffix must not start with a kept one)
    peak_of = np.full((2, m), math.inf)
    flops_of = np.full((2, m), math.inf)
    choice: list[list[tuple[int, str] | None]] = [[None] * m, [None] * m]
    peak_of[:, m - 1] = flops_of[:, m - 1] = 0.0
    for a in range(m - 2, -1, -1):
        # every segment (a, b) under every option: shape (b, option); a kept one continues in
        # state 1, the others in state 0
        stored, trans, fl = (x[:, a, a + 1 :].T for x in (t.stored, t.transient, t.cost))
        after = np.repeat(peak_of[0, a + 1 :, None], len(t.options), axis=1)
        after_fl = np.repeat(flops_of[0, a + 1 :, None], len(t.options), axis=1)
        after[:, 0], after_fl[:, 0] = peak_of[1, a + 1 :], flops_of[1, a + 1 :]
        peak = np.maximum(stored + trans, stored + after)
        flops = fl + after_fl
        for state in (0, 1):
            if state == 1:  # after a kept segment: no kept one
                peak, flops = peak[:, 1:], flops[:, 1:]
            # lexicographic (peak, FLOPs) minimum; ties (to COST_TIE): the smallest b, then the
            # first option
            lowest = peak.min() if peak.size else math.inf
            if not lowest < math.inf:
                continue
            near = np.where(peak <= lowest * (1 + COST_TIE), flops, math.inf)
            i, k = np.unravel_index(first_near_min(near.reshape(-1), axis=0), near.shape)
            if near[i, k] < math.inf:
                peak_of[state, a], flops_of[state, a] = lowest, near[i, k]
                choice[state][a] = (a + 1 + int(i), t.options[int(k) + state])
    segs = _walk(choice, m)
    return float(peak_of[0, 0]), absorb_free_checkpoints(t, segs, exact_peak(t, segs))


def within_budget(
    t: SegmentTable, budget: float, round_up: bool = True
) -> tuple[float, Segments] | None:
    """Lowest cost (recompute FLOPs, plus offload transfers as FLOP-equivalents) with modelled
    peak <= budget bytes; None when infeasible.

    Suffix DP over (cut, memory left) with the memory axis in GRID buckets (stores rounded up,
    so a plan it returns is within budget in the model). With `round_up=False` stores are
    rounded down instead: the DP is then optimistic and its plan must be checked exactly.
    """
    frontier = _bucket_dp(t, budget, round_up)
    return None if frontier is None else frontier.plan_at(GRID)


class _Frontier:
    """The suffix DP's tables over the memory levels of one budget: `cost[L]`, the cheapest
    plan from the first cut with L buckets (of `q` bytes) left, non-increasing in L, and the
    choices to walk it (`plan_at`): `arg_b[state, a, L]`, `arg_mode[state, a, L]`, state 1
    after a kept segment (see the note above `_bucket_dp`)."""

    def __init__(self, t, q, cost, arg_b, arg_mode, round_up):
        self.t, self.q, self.cost = t, q, cost
        self.arg_b, self.arg_mode, self.round_up = arg_b, arg_mode, round_up

    def plan_at(self, level: int) -> tuple[float, Segments] | None:
        total = self.cost[level]
        if not np.isfinite(total):
            return None
        t, q, m = self.t, self.q, len(self.t.cuts)
        segs, a, state = [], 0, 0
        while a < m - 1:
            b, k = int(self.arg_b[state, a, level]), int(self.arg_mode[state, a, level])
            stored = t.stored[k, a, b]
            segs.append((a, b, t.options[k]))
            level -= int(
                math.ceil(stored / q - 1e-9) if self.round_up else math.floor(stored / q + 1e-9)
            )
            a, state = b, int(k == 0)
        return float(total), segs


# Neither DP puts a kept segment right after a kept one. Two adjacent kept segments are one
# program region with no checkpoint between them: `SegmentModel.to_plan` merges them and
# `predict` prices the table's entry for the merged span, whose stores omit the values that
# cross the inner cut without being residuals and whose transient omits that cut's cotangents
# and working set. Priced apart, the DP returned plans predicted up to 0.8% over its budget
# (tests/models.py's decoder at 0.54). The merged span is an entry of its own, so forbidding
# the pair loses no plan. Hence a state per cut: 1 after a kept segment, else 0.


def _dominated(fl: np.ndarray, shift: np.ndarray, need: np.ndarray) -> np.ndarray:
    """`out[b, k]`: checkpointed option k of segment end b is dominated by an earlier
    checkpointed option k' < k of the same end, with no more cost, stored buckets and
    first level (arrays of shape (end, option), option 0 kept). Such a row never wins
    `_bucket_dp`'s choice: the suffix it leads to is the same state and end, so its candidate
    is no cheaper at any level, and ties go to the earlier option. Options that select the
    same values inside a segment (most do, on short segments) are dropped so."""
    f, s, n = fl[:, 1:], shift[:, 1:], need[:, 1:]
    k = f.shape[1]
    dom = (
        (f[:, :, None] <= f[:, None, :])
        & (s[:, :, None] <= s[:, None, :])
        & (n[:, :, None] <= n[:, None, :])
    )  # [b, k', k]: k' no worse than k
    earlier = np.tri(k, k=-1, dtype=bool).T  # [k', k]: k' < k
    out = np.zeros(fl.shape, dtype=bool)
    out[:, 1:] = (dom & earlier).any(axis=1)
    return out


def _bucket_dp(t: SegmentTable, budget: float, round_up: bool) -> _Frontier | None:
    """`within_budget`'s DP, every memory level kept; None when the budget is not positive.
    Two states per cut: any segment may start there (0), or, after a kept segment, only a
    checkpointed one (1)."""
    m = len(t.cuts)
    if budget <= 0:
        return None
    q = budget / GRID
    width = GRID + 1  # memory levels 0..GRID buckets
    levels = np.arange(width) * q  # memory available at each bucket
    levels[-1] = budget  # GRID * (budget / GRID) may round below the budget itself
    inf = np.inf
    # F[state, b, L], the cheapest suffix from cut b in `state` with L buckets left, sits after
    # `width` columns of inf, so F[state, b, L - s] for every level L (inf where L < s) is one
    # contiguous window
    padded = np.full((2, m, 2 * width), inf)
    padded[:, m - 1, width:] = 0.0
    windows = sliding_window_view(padded, width, axis=2)  # [s, b, o] = padded[s, b, o : o + width]
    arg_b = np.full((2, m, width), -1, dtype=np.int32)
    arg_mode = np.zeros((2, m, width), dtype=np.int8)
    cols = np.arange(width)
    for a in range(m - 2, -1, -1):
        # every segment (a, b) under every option at once: shape (b, option, memory level)
        bs = np.arange(a + 1, m)
        stored, trans, fl = (x[:, a, a + 1 :].T for x in (t.stored, t.transient, t.cost))
        finite = np.isfinite(stored)
        stored_q = np.where(finite, stored, 0) / q
        rnd = np.ceil(stored_q - 1e-9) if round_up else np.floor(stored_q + 1e-9)
        shift = np.where(finite, np.minimum(rnd, width), width).astype(np.int64)
        need = np.searchsorted(levels, stored + trans)  # the first level that holds the segment
        # only (b, option) pairs that fit at some level and that no earlier checkpointed
        # option of the same b dominates, in (b, option) order
        rows_b, rows_k = np.nonzero((need <= GRID) & ~_dominated(fl, shift, need))
        if not len(rows_b):
            continue
        # F[next state, b, L - shift]: after a kept segment (option 0) the next is state 1
        # (fancy indexing copies: the candidates are built in place)
        cand = windows[(rows_k == 0).astype(np.int64), bs[rows_b], width - shift[rows_b, rows_k]]
        cand += fl[rows_b, rows_k][:, None]
        cand[cols < need[rows_b, rows_k][:, None]] = inf
        checkpointed = rows_k != 0
        for state in (0, 1):
            if state == 1:  # after a kept segment: the kept rows out, in place (no copy)
                if not checkpointed.any():
                    continue
                cand[~checkpointed] = inf
            # ties: the smallest b, then the first option
            first = first_near_min(cand, axis=0)
            best = cand[first, cols]
            finite = np.isfinite(best)
            padded[state, a, width:] = best
            arg_b[state, a] = np.where(finite, bs[rows_b[first]], -1)
            # where nothing fits: the first row the state allows, as before the kept rows
            # were masked rather than dropped (never walked: `plan_at` follows finite costs)
            fallback = rows_k[np.argmax(checkpointed)] if state else rows_k[0]
            arg_mode[state, a] = np.where(finite, rows_k[first], fallback)
    return _Frontier(t, q, padded[0, 0, width:].copy(), arg_b, arg_mode, round_up)


def exact_peak(t: SegmentTable, segs: Segments) -> float:
    """The modelled peak of `segs` in bytes, without the DP's memory buckets."""
    running, peak = 0.0, 0.0
    for a, b, option in segs:
        k = t.option_index(option)
        running += t.stored[k, a, b]
        peak = max(peak, running + t.transient[k, a, b])
    return peak


def merge_kept(segs: Segments) -> Segments:
    """`segs` with every run of adjacent kept segments made one (the plan `SegmentModel.to_plan`
    makes of them, and the form the DPs return: see the note above `_bucket_dp`)."""
    return _merge_runs(
        [(a, b, option) for a, b, option in segs],
        lambda seg: seg[2] == KEEP_OPTION,
        lambda prev, seg: (prev[0], seg[1], KEEP_OPTION),
    )


def _merge_runs(items: list, kept: Callable, join: Callable) -> list:
    """`items` with every run of adjacent items that are `kept` folded into one, left to right,
    by `join(merged so far, next)` (`merge_kept`, and `SegmentModel.to_plan` on its `Segment`s)."""
    out: list = []
    for item in items:
        if out and kept(item) and kept(out[-1]):
            out[-1] = join(out[-1], item)
        else:
            out.append(item)
    return out


def _join_kept(prev: Segment, seg: Segment) -> Segment:
    """Two adjacent kept `Segment`s as one (`SegmentModel.to_plan`): their stores summed, the
    larger transient."""
    prev.end = seg.end
    prev.stored_bytes += seg.stored_bytes
    prev.transient_bytes = max(prev.transient_bytes, seg.transient_bytes)
    return prev


def absorb_free_checkpoints(t: SegmentTable, segs: Segments, limit: float) -> Segments:
    """`segs` with each checkpointed segment that recomputes nothing (cost 0) next to a kept
    one made part of it, where the merged path's modelled peak stays within `limit` bytes.

    Such a checkpoint buys nothing, but the DPs take it on a tie: with no kept segment right
    after a kept one (see the note above `_bucket_dp`), a kept run followed by a cost-free
    checkpoint (the scalar loss at the end, say) ties the run kept to the end, and the earlier
    cut wins the tie. It would compile to another program than the plain one it equals.
    """
    segs = list(segs)
    changed = True
    while changed:
        changed = False
        for i, (a, b, option) in enumerate(segs):
            k = t.option_index(option)
            if option == KEEP_OPTION or t.cost[k, a, b] != 0:
                continue
            near = [j for j in (i - 1, i + 1) if 0 <= j < len(segs) and segs[j][2] == KEEP_OPTION]
            if not near:
                continue
            trial = merge_kept([*segs[:i], (a, b, KEEP_OPTION), *segs[i + 1 :]])
            if exact_peak(t, trial) <= limit:
                segs, changed = trial, True
                break
    return segs


def _walk(choice, m: int) -> Segments:
    """The path `min_memory`'s choices give from the first cut (state 0, then state 1 after a
    kept segment)."""
    segs, a, state = [], 0, 0
    while a < m - 1:
        b, mode = choice[state][a]
        segs.append((a, b, mode))
        a, state = b, int(mode == KEEP_OPTION)
    return segs


def check_model_budget(model_budget, unbounded: Callable[[], float]) -> float:
    """A planner's `model_budget` (bytes) as a float: a Python or NumPy real number, or a
    0-d NumPy or JAX array of one; +inf (an int too large for a float included) as
    `unbounded()` (the unrematerialized peak: no plan within an infinite budget is cheaper
    than recomputing nothing).

    Raises:
      TypeError: not a real number (a bool, None, a string, an array of another shape or
        dtype included).
      ValueError: NaN.
    """
    if isinstance(model_budget, bool | np.bool_):
        budget = None
    elif isinstance(model_budget, numbers.Real):
        try:
            budget = float(model_budget)
        except OverflowError:  # an int beyond float's range
            budget = math.inf if model_budget > 0 else -math.inf
    elif hasattr(model_budget, "__array__") and np.ndim(model_budget) == 0:
        value = np.asarray(model_budget)
        budget = float(value) if value.dtype.kind in "iuf" else None
    else:
        budget = None
    if budget is None:
        raise TypeError(
            "model_budget must be a number of bytes (an int or float, or a 0-d array of "
            f"one); got {type(model_budget).__name__} {model_budget!r}"
        )
    if math.isnan(budget):
        raise ValueError("model_budget must be a number of bytes; got nan")
    return unbounded() if budget == math.inf else budget


class SegmentModel:
    """The segment model of one graph (the table is built once, for plans at many budgets).

    Args:
      graph: a traced program (`jremat.trace`).
      max_cuts: how many cut candidates the DPs consider (O(max_cuts^2 x GRID) work).
      options: the save options (`SAVE_OPTIONS` names) a checkpointed segment may take
        (default `segments.DEFAULT_OPTIONS`).
      offload: an `OffloadCost` adds the `OFFLOAD_OPTIONS` (values offloaded to pinned host
        memory, charged their transfer time); None (default): no offload.

    Attributes:
      graph: the graph.
      offload: the `OffloadCost`, or None.
      raw_table: the `SegmentTable` in model bytes.
      table: `raw_table` scaled by `calibrate` (in compiled bytes), else `raw_table` itself.
      weights: the scales and offset `calibrate` fitted, or None.

    `calibrate` replaces `table` and `weights` (never mutates them), so `copy.copy` of a model
    is one whose calibration is independent of the original's.
    """

    def __init__(
        self,
        graph: Graph,
        max_cuts: int = 160,
        options=DEFAULT_OPTIONS,
        offload: OffloadCost | None = None,
    ):
        self.graph = graph
        self.offload = offload
        if offload is not None:
            options = (*options, *[o for o in OFFLOAD_OPTIONS if o not in options])
        self.raw_table = segment_table(graph, candidate_cuts(graph, max_cuts), options, offload)
        self.table = self.raw_table
        self.weights: dict[str, float] | None = None
        self._min: dict[str, Plan] = {}  # solver label -> min-memory plan, for `table`
        self._min_segs: Segments | None = None

    @property
    def cuts(self) -> list[int]:
        """The cut candidates (node positions)."""
        return self.raw_table.cuts

    def no_remat_peak(self) -> float:
        """Modelled peak in bytes of the unrematerialized program (one kept segment)."""
        m = len(self.table.cuts)
        return float(self.table.stored[0, 0, m - 1] + self.table.transient[0, 0, m - 1])

    def checked_budget(self, model_budget) -> float:
        """`check_model_budget` with +inf read as this model's unrematerialized peak."""
        return check_model_budget(model_budget, self.no_remat_peak)

    def min_memory_segments(self) -> Segments:
        """The segmentation with the smallest modelled peak (`min_memory`)."""
        if self._min_segs is None:
            self._min_segs = min_memory(self.table)[1]
        return self._min_segs

    def min_memory_plan(self, solver: str) -> Plan:
        """The plan with the smallest modelled peak, labelled `solver` (the same object for
        the same label until `calibrate` changes the table)."""
        if solver not in self._min:
            self._min = {**self._min, solver: self.to_plan(self.min_memory_segments(), solver)}
        return self._min[solver]

    def cheapest_segments(self, model_budget: float) -> tuple[float, Segments] | None:
        """(cost, segments) of the lowest cost (`SegmentTable.cost`: FLOPs, with offload
        transfers) whose modelled peak is <= `model_budget` bytes, or None. `within_budget`,
        corrected for its memory buckets. Raises as `checked_budget`."""
        model_budget = self.checked_budget(model_budget)
        t = self.table
        # Stores rounded down make the DP optimistic: a plan of it that fits exactly is at
        # least as good as the safe one, and reaches plans right at the budget. Its plans at
        # every memory level are candidates, cheapest first (a level of equal cost may hold
        # another plan, of less memory); and at a budget 1% lower, whose buckets fall
        # elsewhere. The cheapest candidate that fits exactly wins. The three DPs are
        # independent, so they run at once.
        deflations = (0.0, 0.01)
        with concurrent.futures.ThreadPoolExecutor(DP_THREADS) as pool:
            safe = pool.submit(within_budget, t, model_budget)
            optimistic_dps = [
                pool.submit(_bucket_dp, t, model_budget * (1 - d), False) for d in deflations
            ]
            found = safe.result()
            if found is None:
                return None
            optimistic_frontiers = [f.result() for f in optimistic_dps]
        best_cost = found[0]
        candidates = [found]
        tops = []  # per deflation: its top-level plan fits (None: none cheaper than the safe one)
        for optimistic in optimistic_frontiers:
            tops.append(None)
            for level in range(GRID, -1, -1) if optimistic is not None else ():
                if not optimistic.cost[level] < best_cost:
                    break
                again = optimistic.plan_at(level)
                fits = exact_peak(t, again[1]) <= model_budget
                if level == GRID:
                    tops[-1] = fits
                if fits:
                    candidates.append(again)
                    break
        # Unless a top-level optimistic plan settled it: the safe DP loses up to one bucket per
        # segment; solving at slightly inflated budgets and keeping the first cheaper result
        # that still fits recovers most of it (all solved at once, the first in order kept).
        if not (tops[0] or (tops[0] is False and tops[1])):
            with concurrent.futures.ThreadPoolExecutor(DP_THREADS) as pool:
                inflated = list(
                    pool.map(lambda x: within_budget(t, model_budget * (1 + x)), INFLATIONS)
                )
            for again in inflated:
                if again is None or again[0] >= best_cost:
                    continue
                if exact_peak(t, again[1]) <= model_budget:
                    candidates.append(again)
                    break
        cost, segs = min(candidates, key=lambda c: c[0])
        return cost, absorb_free_checkpoints(t, segs, model_budget)

    def cheapest_plan(self, model_budget: float, solver: str) -> Plan | None:
        """`cheapest_segments` as a `Plan` labelled `solver`, or None. Deterministic (no time
        limit): the same budget gives the same plan in a new call."""
        found = self.cheapest_segments(model_budget)
        return None if found is None else self.to_plan(found[1], solver)

    def to_plan(self, segs: Segments, solver: str) -> Plan:
        """Turn a segment choice into a `Plan` with per-segment predictions (bytes, FLOPs).

        Adjacent kept segments are merged (no checkpoint boundary between them).
        """
        graph, t = self.graph, self.table
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
                out.append(Segment(start, end, KEEP, [], int(stored), int(trans), 0.0))
                continue
            saved = saved_values(graph, start, end, option)
            seg = Segment(start, end, SAVE_NAMES, saved, int(stored), int(trans), float(fl))
            if option in OFFLOAD_OPTIONS:
                seg.saved, seg.offloaded = [], saved
                host += t.offloaded[k, a, b]
            out.append(seg)
        plan = Plan(
            _merge_runs(out, lambda seg: seg.policy == KEEP, _join_kept),
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

    def segments_of(self, plan: Plan) -> list[tuple[int, int, int]] | None:
        """`plan` as `[(cut a, cut b, option index)]` in this model's table: None when a cut
        is not a candidate, a segment's policy or saved names match no option, or the plan
        rematerializes scans (loop pieces are not in the segment model)."""
        if plan.scans:
            return None
        index = {c: i for i, c in enumerate(self.raw_table.cuts)}
        out = []
        for seg in plan.segments:
            a, b = index.get(seg.start), index.get(seg.end)
            option = self._option_of(seg)
            if a is None or b is None or option is None:
                return None
            out.append((a, b, self.raw_table.option_index(option)))
        return out

    def _option_of(self, seg: Segment) -> str | None:
        """The table option `seg` is (its policy, or its saved names), or None."""
        t = self.raw_table
        builtin = {
            "nothing_saveable": "nothing",
            "dots_saveable": "dots",
            "dots_with_no_batch_dims_saveable": "dots_no_batch",
        }
        if seg.policy == KEEP:
            option = KEEP_OPTION
        elif seg.policy == SAVE_NAMES and seg.offloaded and not seg.saved:
            option = "offload_dots"
        elif seg.policy == SAVE_NAMES and not seg.saved:
            option = "nothing"
        elif seg.policy == SAVE_NAMES:
            option = next(
                (
                    o
                    for o in t.options
                    if o in SAVE_OPTIONS
                    and saved_values(self.graph, seg.start, seg.end, o) == list(seg.saved)
                ),
                None,
            )
        else:
            option = builtin.get(seg.policy)
        return option if option in t.options else None

    def segment_costs(self, plan: Plan) -> list[tuple[float, float, float]] | None:
        """(stored bytes, transient bytes, cost) of each of `plan`'s segments in the
        (calibrated) table, for every plan `segments_of` describes and also for checkpointed
        segments saving a set of names no option selects (DTR's per-value save sets), priced
        by `saved_set_costs`. None when a cut is not a candidate, a segment offloads a set no
        option names, its policy is none of the table's, or the plan rematerializes scans.

        Calibration (`weights`) fits one store scale per option; a save set of no option's
        has its stores scaled by the mean scale of the table's save options and its
        transient as a checkpointed segment's (plus the offset).
        """
        if plan.scans:
            return None
        t = self.table
        index = {c: i for i, c in enumerate(t.cuts)}
        out: list[tuple[float, float, float] | None] = []
        free: list[tuple[int, int, list[int]]] = []  # segments priced by their own save sets
        for seg in plan.segments:
            a, b = index.get(seg.start), index.get(seg.end)
            if a is None or b is None:
                return None
            option = self._option_of(seg)
            if option is not None:
                k = t.option_index(option)
                out.append(
                    (float(t.stored[k, a, b]), float(t.transient[k, a, b]), float(t.cost[k, a, b]))
                )
            elif seg.policy == SAVE_NAMES and not seg.offloaded:
                out.append(None)
                free.append((seg.start, seg.end, list(seg.saved)))
            else:
                return None
        if free:
            stored_scale, trans_scale, offset = 1.0, 1.0, 0.0
            if self.weights is not None:
                scales = [
                    self.weights["fpb" if o in LADDER_OPTIONS else o]
                    for o in t.options
                    if o in SAVE_OPTIONS
                ]
                stored_scale = float(np.mean(scales)) if scales else 1.0
                trans_scale = self.weights["transient_checkpointed"]
                offset = self.weights["offset_bytes"]
            priced = iter(saved_set_costs(self.graph, free))
            for i, x in enumerate(out):
                if x is None:
                    stored, transient, flops = next(priced)
                    out[i] = (stored * stored_scale, transient * trans_scale + offset, flops)
        return out

    def predict(self, plan: Plan) -> float | None:
        """Modelled peak (calibrated bytes, see `calibrate`) of any plan `segment_costs`
        prices; None otherwise."""
        costs = self.segment_costs(plan)
        if costs is None:
            return None
        running, peak = 0.0, 0.0
        for stored, transient, _ in costs:
            running += stored
            peak = max(peak, running + transient)
        return peak

    def cost(self, plan: Plan) -> float | None:
        """Modelled cost of `plan` (`SegmentTable.cost`: recompute FLOPs plus offload
        transfers as FLOP-equivalents, summed over its segments) for any plan
        `segment_costs` prices; None otherwise."""
        costs = self.segment_costs(plan)
        return None if costs is None else float(sum(c for _, _, c in costs))

    def segment_peaks(self, segs: list[tuple[int, int, int]]) -> list[float]:
        """Modelled bytes live during each segment's backward pass (the stores of it and every
        earlier segment plus its transient), for `[(a, b, option index)]` from `segments_of`."""
        t = self.table
        running, out = 0.0, []
        for a, b, k in segs:
            running += t.stored[k, a, b]
            out.append(running + t.transient[k, a, b])
        return out

    def fit_unrematerialized(self, temp: float) -> float:
        """Fit the model to one compiled program, the unrematerialized one: the bytes kept
        segments store are scaled so that one kept segment (the program unchanged) has `temp`
        as its modelled peak; every other option's stores and every transient stay as
        modelled. Where XLA holds more than the model for the unrematerialized program, it
        is what kept segments store that it holds more of (on GPT-2 the full fit, `calibrate`,
        scales `keep` by 1.16 and the save options by 0.82-1.01), so the DP then weighs
        keeping a segment against checkpointing it in nearly compiled bytes, for the one
        compile the search makes anyway (docs/design.md#best-first-search).

        Args:
          temp: the unrematerialized program's compiled temp bytes (> 0).

        Returns:
          The scale of kept segments' stores, kept in [0.1, 10] like `calibrate`'s; the
          table is then the raw table so scaled (`weights` say so: the other scales 1, the
          offset 0).
        """
        t = self.raw_table
        keep, m = t.option_index(KEEP_OPTION), len(t.cuts)
        stored, transient = t.stored[keep, 0, m - 1], t.transient[keep, 0, m - 1]
        scale = float(np.clip((temp - transient) / max(stored, 1.0), 0.1, 10.0))
        scales = np.ones(len(t.options))
        scales[keep] = scale
        labels = [o for o in t.options if o not in LADDER_OPTIONS]
        if len(labels) < len(t.options):
            labels.append("fpb")
        self.weights = {
            **{o: 1.0 for o in labels},
            KEEP_OPTION: scale,
            "transient_kept": 1.0,
            "transient_checkpointed": 1.0,
            "offset_bytes": 0.0,
        }
        self.table = dataclasses.replace(t, stored=t.stored * scales[:, None, None])
        self._min, self._min_segs = {}, None
        return scale

    def calibrate(self, samples: list[tuple[Plan, float]], ridge: float = 0.3) -> bool:
        """Fit the cost model to compiled programs: one scale per save option on the bytes
        segments store, one on the transient bytes of a kept segment's backward, one on those
        of a checkpointed segment's backward (recompute included), and an offset in bytes
        (what XLA holds whatever the plan: fused temporaries, layout copies, the loss's own
        buffers).

        The features of a plan are, at its peak segment, the stored bytes of the segments up
        to it by option, that segment's transient bytes (kept or checkpointed) and a constant.
        The per-value rungs (`LADDER_OPTIONS`) share one store scale, `weights["fpb"]`.
        Compiled temp bytes are fitted as their weighted sum by least squares on relative
        error (scipy `lsq_linear`), with a ridge pulling every scale towards 1 and the offset
        towards 0; scales are kept in [0.1, 10] and the offset in [0, half the samples'
        median temp]. The fit runs twice: the second time each plan's peak segment is the one
        the first fit puts at the peak. The model's table is then the raw table scaled and
        offset, so later plans are made (and `predict` answers) in compiled bytes.

        Args:
          samples: (plan, compiled temp bytes) pairs; plans `segments_of` cannot describe
            are skipped.
          ridge: weight of the pull towards scales 1 and offset 0.

        Returns:
          Whether it fitted: False (table unchanged) with fewer than three distinct usable
          samples (non-finite or non-positive temps are skipped).
        """
        from scipy.optimize import lsq_linear

        t = self.raw_table
        K = len(t.options)
        keep = t.option_index(KEEP_OPTION)
        plans, ys = [], []
        for plan, temp in samples:
            segs = self.segments_of(plan)
            if segs is None or not np.isfinite(temp) or temp <= 0:
                continue
            plans.append(segs)
            ys.append(float(temp))
        if len({tuple(s) for s in plans}) < 3:  # three distinct plans at least
            return False
        unit = float(np.median(ys))  # the offset's feature: bytes of a typical sample
        # one store scale per option, but one for all the per-value rungs together: they are
        # one family, and few reference plans take any of them
        labels = [o for o in t.options if o not in LADDER_OPTIONS]
        if len(labels) < K:
            labels.append("fpb")
        group = np.array([labels.index("fpb" if o in LADDER_OPTIONS else o) for o in t.options])
        G = len(labels)

        def features(segs) -> np.ndarray:
            """One row per segment: stores so far by option, its transient (kept /
            checkpointed), the constant."""
            stored, rows = np.zeros(G), []
            for a, b, k in segs:
                stored[group[k]] += t.stored[k, a, b]
                trans = [t.transient[k, a, b], 0.0] if k == keep else [0.0, t.transient[k, a, b]]
                rows.append(np.concatenate([stored, trans, [unit]]))
            return np.array(rows)

        n = G + 3
        target = np.append(np.ones(n - 1), 0.0)
        # the offset is >= 0: added to every transient entry it shifts every modelled peak
        # alike, and a negative one could turn small transients negative, where the DP and
        # `predict` would disagree about the peak
        lo, hi = np.append(np.full(n - 1, 0.1), 0.0), np.append(np.full(n - 1, 10.0), 0.5)
        w = np.append(np.ones(n - 1), 0.0)
        per_plan = [features(s) for s in plans]
        for _ in range(2):  # the peak segment under the current scales, then refit
            A = np.array([f[np.argmax(f @ w)] for f in per_plan]) / np.array(ys)[:, None]
            fit = lsq_linear(
                np.vstack([A, ridge * np.eye(n)]),
                np.concatenate([np.ones(len(ys)), ridge * target]),
                bounds=(lo, hi),
            )
            w = fit.x
        offset = float(w[-1] * unit)
        names = [*labels, "transient_kept", "transient_checkpointed"]
        weights = dict(zip(names, map(float, w[:-1]), strict=True))
        weights["offset_bytes"] = offset
        self.weights = weights
        trans_scale = np.full(K, w[G + 1])
        trans_scale[keep] = w[G]
        self.table = dataclasses.replace(
            t,
            stored=t.stored * w[group][:, None, None],
            transient=t.transient * trans_scale[:, None, None] + offset,
        )
        self._min, self._min_segs = {}, None
        return True


class OnSegmentModel:
    """What every planner answers from its `SegmentModel` (`self.model`) under its `name`,
    and the constructor chain and greedy take as it is (dtr and milp take other keywords);
    chain, greedy, dtr and milp inherit it and differ in how they `plan`."""

    model: SegmentModel
    name: str

    def __init__(
        self,
        graph: Graph,
        max_cuts: int = 160,
        options=DEFAULT_OPTIONS,
        offload: OffloadCost | None = None,
    ):
        self.model = SegmentModel(graph, max_cuts, options, offload)
        self.offload = offload

    @property
    def table(self) -> SegmentTable:
        """The model's (calibrated) segment table."""
        return self.model.table

    def no_remat_peak(self) -> float:
        """Modelled peak in bytes without rematerialization."""
        return self.model.no_remat_peak()

    def min_memory_plan(self) -> Plan:
        """The model's plan with the smallest modelled peak."""
        return self.model.min_memory_plan(self.name)
