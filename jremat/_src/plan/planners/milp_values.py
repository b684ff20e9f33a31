"""Reference planner: Checkmate's per-value integer program on the segment model, on HiGHS.

Checkmate (Jain et al., "Checkmate: Breaking the Memory Wall with Optimal Tensor
Rematerialization", MLSys 2020) decides value by value what the backward pass keeps; so does
PyTorch's min-cut partitioner. jremat's planners choose, per segment, one of a few save sets
(`segments.SAVE_OPTIONS`), so the segment MILP (`milp.py`) is the optimum of that coarse space
only. This program lets each checkpointed segment save any set of values, priced by the same
accounting (`save_sets`), so its optimum bounds what any save set could reach on the same cuts:
the reference the chain DP and greedy are measured against (tests/test_milp_values.py,
`benchmarks/heldout.py --per-value`). It is not a user-facing solver.

Variables, over cut positions `cuts` and segments (a, b) with b - a <= max_span (and a
given warm start's segments, whatever their span; kept segments of any span):
  x[a,b], y[a,b]  binary: the segment is taken kept / checkpointed (a path from cut 0 to the end)
  s[a,b,v]        binary: checkpointed (a, b) saves value v (a candidate of the segment)
  r[a,b,i]        in [0, 1]: checkpointed (a, b) recomputes node i (integral at the optimum:
                  its lower bounds below are integral once y and s are)
  S[c]            bytes stored before cut c

    min  sum flops_i r[a,b,i]
    s.t. flow over x + y
         r[i] + s[o] >= y        unsaved output o of i is a residual of a node before b
         r[i] + s[o] >= r[j]     ... or an input of node j < b that is recomputed
         s[v] <= y
         S[b] = S[b-1] + sum_a [(live_in + internal) x[a,b] + live_in y[a,b]
                                + sum_v bytes_v s[a,b,v]]
         S[a] + (live_in + internal + boundary) (x[a,b] + y[a,b]) <= B
         sum of x over the segments ending or starting at c <= 1   (no two adjacent kept:
                                 one kept run is one segment, as `pieces_plan` merges it)

A segment's own peak term `stored + transient` does not depend on its save set
(`save_sets`), so as in the segment MILP the peak row needs no big-M. A saved value the
backward does not need is charged as stored here but dropped when the solution is read back
(its producer is not recomputed for it), which never raises the priced peak; so the optimum is
that of every save set, priced by `SaveSetPricer`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jremat._src.plan.plan import Plan
from jremat._src.plan.planners.highs import mip_solver
from jremat._src.plan.planners.model import Segments, check_model_budget, within_budget
from jremat._src.plan.planners.save_sets import Pieces, SaveSetPricer, pieces_plan
from jremat._src.plan.planners.segments import option_pieces, segment_table
from jremat._src.trace.graph import Graph
from jremat._src.trace.layers import candidate_cuts

#: Branch-and-bound nodes per solve by default (HiGHS's `mip_max_nodes`): a deterministic
#: bound on the work; `PerValueSolution.proven` says whether the optimum was proven within it.
DEFAULT_MAX_NODES = 2000

#: HiGHS's relative gap at or below which an objective is called proven optimal.
PROVEN_GAP = 1e-6


@dataclasses.dataclass(frozen=True)
class PerValueSolution:
    """One solve of the per-value program.

    Attributes:
      pieces: the path `[(start, end, kept value ids or None for a kept segment)]`.
      objective: its recompute FLOPs, priced by `SaveSetPricer`.
      peak: its modelled peak, bytes, priced by `SaveSetPricer`.
      gap: HiGHS's relative optimality gap (0 when proven; 1 or more when it found only the
        warm start and no useful bound).
      status: HiGHS's model status, as text.
      warm_start: the recompute FLOPs of the chain DP's plan it started from (None: no start).
    """

    pieces: Pieces
    objective: float
    peak: float
    gap: float
    status: str
    warm_start: float | None

    @property
    def proven(self) -> bool:
        """Whether HiGHS proved `objective` optimal (gap <= `PROVEN_GAP`)."""
        return self.gap <= PROVEN_GAP


class PerValueMILP:
    """Checkmate-style per-value program on the segment model (see the module docstring).

    Args:
      graph: a traced program (`jremat.trace`).
      max_cuts: how many cut candidates (`candidate_cuts`) to choose segments from, when
        `cuts` is None.
      cuts: explicit cut positions (node indices, ascending, 0 and `num_nodes` included);
        with `max_span=1` a fixed segmentation (each segment kept or checkpointed with a
        per-value save set; a run of kept ones is one kept segment). None (default): the
        model's candidates.
      max_span: how many cut intervals a checkpointed segment may cover (the segments of a
        `start` given to `solve` are added whatever their span; kept segments may cover
        any); None: any.
      max_nodes: HiGHS's branch-and-bound node limit per solve; None: no limit. No time
        limit: with one thread and a fixed seed the solve is deterministic.
      warm_start: start HiGHS from an option plan on the same cuts (`solve`'s `start`, by
        default the chain DP's), so that the answer is never worse than it; False: HiGHS
        alone.
      recompute_internal: price as `SaveSetPricer(graph, recompute_internal)`: True
        (default, `segment_table`'s accounting and what JAX does) charges every node with
        internal residual bytes in a checkpointed segment; False is the older accounting.

    Raises:
      ValueError: `cuts` not ascending from 0 to `num_nodes`, or `max_span` < 1.

    Attributes:
      cuts: the cut positions.
      pricer: the `SaveSetPricer` every answer is priced by.
      last: the last `PerValueSolution`, or None.
      num_binaries: binaries of the last program built.
      last_nodes: branch-and-bound nodes HiGHS explored in the last solve.
    """

    name = "milp_values"

    def __init__(
        self,
        graph: Graph,
        max_cuts: int = 32,
        cuts: Sequence[int] | None = None,
        max_span: int | None = None,
        max_nodes: int | None = DEFAULT_MAX_NODES,
        warm_start: bool = True,
        recompute_internal: bool = True,
    ):
        n = graph.num_nodes
        if cuts is None:
            cuts = candidate_cuts(graph, max_cuts)
        cuts = [int(c) for c in cuts]
        if (
            cuts[:1] != [0]
            or cuts[-1] != n
            or any(b <= a for a, b in zip(cuts, cuts[1:], strict=False))
        ):
            raise ValueError(f"cuts must ascend strictly from 0 to num_nodes={n}; got {cuts}")
        if max_span is not None and max_span < 1:
            raise ValueError(f"max_span must be >= 1 (cut intervals) or None; got {max_span}")
        self.graph = graph
        self.cuts = cuts
        self.max_span = len(cuts) - 1 if max_span is None else max_span
        self.max_nodes = max_nodes
        self.warm_start = warm_start
        self.pricer = SaveSetPricer(graph, recompute_internal)
        self.last: PerValueSolution | None = None
        self.num_binaries = 0
        self.last_nodes = 0
        self._table = None

    def no_remat_peak(self) -> float:
        """Modelled peak in bytes of the unrematerialized program (one kept segment)."""
        c = self.pricer.keep(0, self.graph.num_nodes)
        return c.stored + c.transient

    # ---------------------------------------------------------------- the program

    def solve(self, model_budget: float, start: Segments | None = None) -> PerValueSolution | None:
        """The cheapest path (recompute FLOPs) whose modelled peak is <= `model_budget` bytes
        that HiGHS finds within `max_nodes` nodes, or None (none found: infeasible, or the
        limit was reached before any solution without a warm start).

        Args:
          model_budget: the budget, bytes of the segment model.
          start: with `warm_start`, the option plan `[(cut index a, cut index b, option)]` to
            start from (for instance `SegmentModel.cheapest_segments`' on the same cuts),
            whose segments join the program whatever their span; None (default): the chain
            DP's (`within_budget`) on these cuts within `max_span`.

        Raises:
          TypeError, ValueError: as `model.check_model_budget` (+inf is the unrematerialized
            peak).
        """
        import highspy
        from scipy.sparse import coo_matrix

        B = check_model_budget(model_budget, self.no_remat_peak)
        P, g = self.cuts, self.graph
        m = len(P)
        cols_cost: list[float] = []
        cols_hi: list[float] = []
        cols_int: list[bool] = []

        def col(cost: float, integer: bool, hi: float = 1.0) -> int:
            cols_cost.append(cost)
            cols_hi.append(hi)
            cols_int.append(integer)
            return len(cols_cost) - 1

        rows_i: list[int] = []
        rows_j: list[int] = []
        rows_v: list[float] = []
        row_lo: list[float] = []
        row_hi: list[float] = []

        def row(terms, lo: float, hi: float) -> None:
            r = len(row_lo)
            for j, v in terms:
                rows_i.append(r)
                rows_j.append(j)
                rows_v.append(v)
            row_lo.append(lo)
            row_hi.append(hi)

        inf = highspy.kHighsInf
        S = [col(0.0, False, 0.0 if c == 0 else B) for c in range(m)]
        if self.warm_start and start is None:
            found = within_budget(self._option_table(), B)
            start = None if found is None else found[1]
        extra = {(a, b) for a, b, _ in start or ()}
        # (a, b, x col, y col or None, {value: s col}, {node: r col}, facts); kept segments of
        # any span (no two adjacent, below: one kept run is one segment, as the plan runs it)
        edges = []
        for a in range(m - 1):
            for b in range(a + 1, m):
                f = self.pricer.facts(P[a], P[b])
                if f.live_in + f.internal + f.boundary > B:
                    continue
                if b - a > self.max_span and (a, b) not in extra:
                    edges.append((a, b, col(0.0, True), None, {}, {}, f))
                    continue
                x, y = col(0.0, True), col(0.0, True)
                s = {v: col(0.0, True) for v in f.candidates}
                r = {i: col(float(g.nodes[i].flops), False) for i in f.needed}
                edges.append((a, b, x, y, s, r, f))
        if not edges:
            return None
        for a, b, x, y, s, r, f in edges:
            row([(S[a], 1.0), (x, f.live_in + f.internal + f.boundary)], -inf, B)
            if y is None:
                continue
            row([(S[a], 1.0), (y, f.live_in + f.internal + f.boundary)], -inf, B)
            for sv in s.values():
                row([(sv, 1.0), (y, -1.0)], -inf, 0.0)
            for i, ri in r.items():
                if self.pricer.recompute_internal and g.nodes[i].internal_bytes:
                    row([(ri, 1.0), (y, -1.0)], 0.0, inf)  # its own residuals: recomputed
                    continue
                for o in g.nodes[i].outputs:
                    so = s.get(o)
                    base = [(ri, 1.0)] + ([(so, 1.0)] if so is not None else [])
                    if self.pricer.vjp_first.get(o, P[b]) < P[b]:
                        row([*base, (y, -1.0)], 0.0, inf)
                    for c in g.consumers[o]:
                        if c in r:
                            row([*base, (r[c], -1.0)], 0.0, inf)
        for c in range(1, m):  # S[c] = S[c-1] + stores of the segments ending at c
            terms = [(S[c], 1.0), (S[c - 1], -1.0)]
            for _, b, x, y, s, _, f in edges:
                if b != c:
                    continue
                terms += [(x, -(f.live_in + f.internal))]
                terms += [] if y is None else [(y, -f.live_in)]
                terms += [(sv, -float(g.values[v].nbytes)) for v, sv in s.items()]
            row(terms, 0.0, 0.0)
        for c in range(m):  # flow: out - in = 1 at the source, -1 at the sink, else 0
            terms = []
            for a, b, x, y, *_ in edges:
                if a == c:
                    terms += [(x, 1.0)] + ([] if y is None else [(y, 1.0)])
                if b == c:
                    terms += [(x, -1.0)] + ([] if y is None else [(y, -1.0)])
            want = 1.0 if c == 0 else (-1.0 if c == m - 1 else 0.0)
            row(terms, want, want)
        kept_at: dict[int, list[tuple[int, float]]] = {c: [] for c in range(1, m - 1)}
        for a, b, x, *_ in edges:
            for c in (a, b):
                kept_at.get(c, []).append((x, 1.0))
        for terms in kept_at.values():  # at most one kept segment ends or starts at each cut
            row(terms, -inf, 1.0)

        nvar, nrow = len(cols_cost), len(row_lo)
        A = coo_matrix((rows_v, (rows_i, rows_j)), shape=(nrow, nvar)).tocsc()
        A.sum_duplicates()
        lp = highspy.HighsLp()
        lp.num_col_, lp.num_row_ = nvar, nrow
        lp.col_cost_ = np.asarray(cols_cost)
        lp.col_lower_, lp.col_upper_ = np.zeros(nvar), np.asarray(cols_hi)
        lp.row_lower_, lp.row_upper_ = np.asarray(row_lo), np.asarray(row_hi)
        lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
        lp.a_matrix_.start_, lp.a_matrix_.index_ = A.indptr, A.indices
        lp.a_matrix_.value_ = A.data
        kinds = highspy.HighsVarType
        lp.integrality_ = [kinds.kInteger if i else kinds.kContinuous for i in cols_int]
        self.num_binaries = sum(cols_int)
        h = mip_solver(self.max_nodes)
        h.setOptionValue("mip_rel_gap", PROVEN_GAP)  # HiGHS stops at 1e-4 by default
        h.passModel(lp)
        start = self._start(start, B, edges, S, nvar) if self.warm_start and start else None
        if start is not None:
            sol = highspy.HighsSolution()
            sol.col_value = list(start[0])
            sol.value_valid = True
            h.setSolution(sol)
        h.run()
        info = h.getInfo()
        self.last_nodes = int(info.mip_node_count)
        values = np.asarray(h.getSolution().col_value)
        found = info.primal_solution_status == 2 and len(values) == nvar  # 2: feasible
        cost = np.asarray(cols_cost)
        gap = float(info.mip_gap) if found else np.inf
        if start is not None and (not found or cost @ values > start[1] + 1e-6 * abs(start[1])):
            values, found = start[0], True  # HiGHS did not improve on (or keep) the start
        if not found:
            return None
        pieces = []
        by_start = {}
        for a, b, x, y, s, _, _ in edges:
            if values[x] > 0.5:
                by_start[a] = (b, None)
            elif y is not None and values[y] > 0.5:
                by_start[a] = (b, [v for v, sv in s.items() if values[sv] > 0.5])
        a = 0
        while a < m - 1:
            b, saved = by_start[a]
            if saved is not None:  # only what the backward needs: the rest JAX drops
                saved = self.pricer.price(P[a], P[b], saved).kept
            pieces.append((P[a], P[b], saved))
            a = b
        peak, flops = self.pricer.path_cost(pieces)
        self.last = PerValueSolution(
            pieces,
            flops,
            peak,
            gap,
            h.modelStatusToString(h.getModelStatus()),
            None if start is None else start[1],
        )
        return self.last

    def _option_table(self):
        """The segment table of these cuts, segments over `max_span` removed (built once)."""
        if self._table is None:
            t = segment_table(self.graph, self.cuts)
            m = len(self.cuts)
            span = np.subtract.outer(np.arange(m), np.arange(m)).T  # b - a
            for arr in (t.stored, t.transient, t.flops):  # `cost` is `flops` without offload
                arr[1:, span > self.max_span] = np.inf  # segments the program does not have
            self._table = t
        return self._table

    def _start(self, segs: Segments, B: float, edges, S, nvar) -> tuple[np.ndarray, float] | None:
        """The option plan `segs`, priced by `pricer`, as a solution of the program and its
        FLOPs; None when it does not fit `B` bytes priced so (`recompute_internal` can keep
        more of its saved values) or a segment of it is no edge."""
        index = {(a, b): e for e in edges for a, b in [e[:2]]}
        pieces = option_pieces(self.graph, self.cuts, segs)
        if self.pricer.path_cost(pieces)[0] > B:
            return None
        x0 = np.zeros(nvar)
        running, flops = 0.0, 0.0
        for (a, b, _), (start, end, saved) in zip(segs, pieces, strict=True):
            e = index.get((a, b))
            if e is None:
                return None
            _, _, x, y, s, r, f = e
            for c in range(a, b):  # S at the segment's start and the cuts inside it
                x0[S[c]] = running
            if saved is not None and y is None:
                return None
            if saved is None:
                x0[x] = 1.0
                running += f.live_in + f.internal
                continue
            c = self.pricer.price(start, end, saved)
            x0[y] = 1.0
            for v in c.kept:
                x0[s[v]] = 1.0
            for i in c.recomputed:
                x0[r[i]] = 1.0
            running += c.stored
            flops += c.flops
        x0[S[-1]] = running
        return x0, flops

    # ---------------------------------------------------------------- as a plan

    def plan(self, model_budget: float) -> Plan | None:
        """`solve` as a `Plan` (policy "names" segments saving their kept value ids, kept
        segments merged), or None."""
        sol = self.solve(model_budget)
        if sol is None:
            return None
        plan = pieces_plan(self.pricer, sol.pieces, self.name, sol.objective)
        plan.notes.append(
            f"milp_values: objective {sol.objective:.6g} FLOPs, optimality gap {sol.gap:.3g} "
            f"({sol.status})"
        )
        return plan
