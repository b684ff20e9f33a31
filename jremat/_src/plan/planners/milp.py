"""Exact planner: a mixed-integer program over segments and save sets, solved with HiGHS.

Checkmate (Jain et al., "Checkmate: Breaking the Memory Wall with Optimal Tensor
Rematerialization", MLSys 2020) on jremat's segment model: the reference optimum for the
heuristics. The program (no big-M) and why HiGHS proves it fast: docs/design.md#planners.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from jremat._src.plan.offload import OffloadCost
from jremat._src.plan.plan import Plan
from jremat._src.plan.planners.highs import mip_solver
from jremat._src.plan.planners.model import (
    OnSegmentModel,
    SegmentModel,
    Segments,
    exact_peak,
    merge_kept,
)
from jremat._src.plan.planners.segments import DEFAULT_OPTIONS
from jremat._src.trace.graph import Graph

#: Branch-and-bound nodes per solve by default: HiGHS proves the segment programs of
#: jremat's models optimal in far fewer (docs/design.md#planners); the limit bounds the
#: solve's work on larger ones without a clock.
DEFAULT_MAX_NODES = 500

#: A heuristic the MILP starts from: (model, budget in model bytes) -> segments or None.
Incumbent = Callable[[SegmentModel, float], Segments | None]


class MILPPlanner(OnSegmentModel):
    """Checkmate-style exact planner (HiGHS), see the module docstring.

    Args:
      graph: a traced program (`jremat.trace`).
      max_cuts: how many cut candidates the segment model considers.
      max_nodes: HiGHS's branch-and-bound node limit per solve (`mip_max_nodes`); None: no
        limit (solved to optimality, however long); default `DEFAULT_MAX_NODES`, or no limit
        when `time_limit` is given. A node limit, unlike a time limit, gives
        the same plan under any machine load: with one thread and a fixed seed the solve is
        deterministic, so every process of a multi-host job chooses the same plan.
      time_limit: HiGHS's time limit per solve, in seconds; None (default): none. A finite
        limit makes the plan depend on the machine's speed and load (only for benchmarks).
      max_span: how many cut intervals one segment may cover (fewer variables).
      incumbents: heuristics tried after the model's DP; the cheapest of their plans (the
        DP's on ties) starts the solve, so the MILP's answer is never worse than theirs.
      options: the save options (`SAVE_OPTIONS` names) a checkpointed segment may take
        (default `segments.DEFAULT_OPTIONS`).
      offload: an `OffloadCost` adds the offload options; None (default): no offload.

    Attributes:
      last_gap: HiGHS's relative optimality gap of the last solve.
      last_objective: the last plan's cost (FLOPs, with offload transfers).
    """

    name = "milp"

    def __init__(
        self,
        graph: Graph,
        max_cuts: int = 32,
        max_nodes: int | None | str = "default",
        time_limit: float | None = None,
        max_span: int = 24,
        incumbents: Sequence[Incumbent] = (),
        options=DEFAULT_OPTIONS,
        offload: OffloadCost | None = None,
    ):
        self.model = SegmentModel(graph, max_cuts, options, offload)
        self.offload = offload
        if max_nodes == "default":  # a caller's time limit alone (benchmarks, tests) decides
            max_nodes = None if time_limit is not None else DEFAULT_MAX_NODES
        self.max_nodes = max_nodes
        self.time_limit = time_limit
        self.max_span = max_span
        self.incumbents = tuple(incumbents)
        self.last_gap: float | None = None
        self.last_objective: float | None = None

    def plan(self, model_budget: float) -> Plan | None:
        """The lowest-cost plan (FLOPs, with offload transfers) whose modelled peak is <=
        `model_budget` bytes that HiGHS finds within `max_nodes` nodes, or None. Deterministic:
        one thread, a fixed random seed and no wall-clock limit (unless `time_limit` is set).
        Raises as `SegmentModel.checked_budget`."""
        import highspy

        model_budget = self.model.checked_budget(model_budget)
        if model_budget <= 0:  # the program's bytes are in units of it
            return None

        t = self.model.table
        m, K = len(t.cuts), len(t.options)
        # kept segments (option 0) of any span: no two are adjacent (the model's DPs' rule,
        # see model._bucket_dp), so a long kept run is one edge, not a chain of short ones
        edges = [
            (k, a, b)
            for a in range(m - 1)
            for b in range(a + 1, m)
            for k in range(K)
            if (k == 0 or b - a <= self.max_span)
            and t.stored[k, a, b] + t.transient[k, a, b] <= model_budget
        ]
        if not edges:
            return None
        E = len(edges)
        ek, ea, eb = np.asarray(edges, dtype=np.int64).T
        # x per edge, then S per cut: bytes stored before the cut over the budget (rows of
        # order 1: in bytes, HiGHS's absolute tolerances misjudged programs of ~1e11 bytes at a
        # budget equal to a plan's peak, returning None or a costlier plan)
        nvar = E + m
        cost = np.zeros(nvar)
        cost[:E] = t.cost[ek, ea, eb]
        start = self._warm_start(edges, model_budget)
        if start is not None and cost @ start <= 0:
            # no plan costs less than none recomputed (costs are FLOPs and transfer times,
            # >= 0): HiGHS would return the start unchanged, after building and solving the
            # root LP for nothing
            return self._as_plan(self._path(start, edges), 0.0, 0.0, "start costs nothing")
        csc, lo, hi = self._rows(edges, model_budget)
        upper = np.concatenate([np.ones(E), np.ones(m)])
        upper[E] = 0.0  # nothing is stored before the first cut
        lp = highspy.HighsLp()
        lp.num_col_, lp.num_row_ = nvar, len(lo)
        lp.col_cost_, lp.col_lower_, lp.col_upper_ = cost, np.zeros(nvar), upper
        lp.row_lower_, lp.row_upper_ = lo, hi
        lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
        lp.a_matrix_.start_, lp.a_matrix_.index_ = csc.indptr, csc.indices
        lp.a_matrix_.value_ = csc.data
        lp.integrality_ = [highspy.HighsVarType.kInteger] * E + [
            highspy.HighsVarType.kContinuous
        ] * m
        h = mip_solver(self.max_nodes, self.time_limit)
        h.passModel(lp)
        if start is not None:
            _set_start(h, start)
        h.run()
        info = h.getInfo()
        values = np.asarray(h.getSolution().col_value)
        feasible = info.primal_solution_status == 2 and len(values) == nvar  # 2: feasible
        if start is not None and (not feasible or cost @ values > cost @ start + 1e-6):
            values, feasible = start, True  # HiGHS did not improve on (or keep) the incumbent
        if not feasible:
            return None
        objective = float(cost @ values)
        segs = self._path(values, edges)
        if exact_peak(t, segs) > model_budget:
            # within HiGHS's feasibility tolerance but over the budget in bytes
            if start is None:
                return None
            segs, objective = self._path(start, edges), float(cost @ start)
        status = h.modelStatusToString(h.getModelStatus())
        return self._as_plan(segs, objective, float(info.mip_gap), status)

    def _as_plan(self, segs: Segments, objective: float, gap: float, status: str) -> Plan:
        """`segs` as this planner's plan, noting the solve's objective (FLOPs) and gap."""
        self.last_gap, self.last_objective = gap, objective
        plan = self.model.to_plan(segs, self.name)
        plan.notes.append(
            f"milp: objective {objective:.6g} FLOPs, optimality gap {gap:.3g} ({status})"
        )
        return plan

    def _rows(self, edges, model_budget: float):
        """The program's rows over the edge and S columns (see `plan`), built with numpy:
        (CSC matrix, row lower bounds, row upper bounds). Row order: one peak row per
        edge, then per cut its S row, its flow row and its kept row."""
        from scipy.sparse import coo_matrix

        t = self.model.table
        m, E = len(t.cuts), len(edges)
        ek, ea, eb = np.asarray(edges, dtype=np.int64).T
        stored = t.stored[ek, ea, eb] / model_budget
        peak = (t.stored[ek, ea, eb] + t.transient[ek, ea, eb]) / model_budget
        e = np.arange(E)
        cuts = np.arange(m)
        S, flow, kept = E, E + m, E + 2 * m  # first row of each block
        # S[a] + (stored + transient) x <= B, in units of B
        r = [e, e]
        c = [E + ea, e]
        v = [np.ones(E), peak]
        # S[c] - sum of stores of segments ending at or before c = 0
        r.append(S + cuts)
        c.append(E + cuts)
        v.append(np.ones(m))
        ends, cut = np.nonzero(eb[:, None] <= cuts[None, :])  # (edge, cut) with b <= cut
        r.append(S + cut)
        c.append(ends)
        v.append(-stored[ends])
        # flow: out - in = 1 at the source, -1 at the sink, else 0
        r += [flow + ea, flow + eb]
        c += [e, e]
        v += [np.ones(E), -np.ones(E)]
        # at most one kept segment ends or starts at each cut
        k0 = e[ek == 0]
        r += [kept + ea[k0], kept + eb[k0]]
        c += [k0, k0]
        v += [np.ones(len(k0)), np.ones(len(k0))]
        A = coo_matrix(
            (np.concatenate(v), (np.concatenate(r), np.concatenate(c))), shape=(E + 3 * m, E + m)
        ).tocsc()
        A.sum_duplicates()
        A.eliminate_zeros()  # zero stores or peaks: no entry, as the program always had
        A.sort_indices()
        lo = np.full(E + 3 * m, -np.inf)
        hi = np.zeros(E + 3 * m)
        hi[:E] = 1.0
        lo[S : S + m] = 0.0
        lo[flow : flow + m] = hi[flow : flow + m] = 0.0
        lo[flow], hi[flow] = 1.0, 1.0
        lo[flow + m - 1], hi[flow + m - 1] = -1.0, -1.0
        hi[kept : kept + m] = 1.0
        return A, lo, hi

    def _path(self, values: np.ndarray, edges) -> Segments:
        """The segments a solution's edge variables take, from the first cut to the last."""
        t = self.model.table
        by_start = {a: (k, b) for i, (k, a, b) in enumerate(edges) if values[i] > 0.5}
        segs, a = [], 0
        while a < len(t.cuts) - 1:
            k, b = by_start[a]
            segs.append((a, b, t.options[k]))
            a = b
        return segs

    def _warm_start(self, edges, model_budget: float) -> np.ndarray | None:
        """The best heuristic plan (the model's DP, then `incumbents`) as the MILP's first
        incumbent, so the MILP's answer is never worse than theirs; HiGHS then tries to
        improve it."""
        t = self.model.table
        index = {e: i for i, e in enumerate(edges)}
        found = self.model.cheapest_segments(model_budget)
        candidates = [found[1]] if found is not None else []
        for heuristic in self.incumbents:
            segs = heuristic(self.model, model_budget)
            if segs is not None:
                candidates.append(merge_kept(segs))  # the program's rule: no adjacent kept
        best, best_cost = None, np.inf
        for segs in candidates:
            x = np.zeros(len(edges) + len(t.cuts))
            running, cost = 0.0, 0.0
            for a, b, option in segs:
                k = t.option_index(option)
                i = index.get((k, a, b))
                if i is None:
                    break
                x[i] = 1.0
                # S at the cuts inside it, in units of the budget (as the program's rows)
                x[len(edges) + a : len(edges) + b] = running / model_budget
                running += t.stored[k, a, b]
                cost += t.cost[k, a, b]
            else:
                x[-1] = running / model_budget
                if cost < best_cost and exact_peak(t, segs) <= model_budget:
                    best, best_cost = x, cost
        return best


def _set_start(h, start: np.ndarray) -> None:
    """Give HiGHS `start` (a feasible solution, one value per column) as its first incumbent."""
    import highspy

    sol = highspy.HighsSolution()
    sol.col_value = list(start)
    sol.value_valid = True
    h.setSolution(sol)
