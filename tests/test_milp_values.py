"""The per-value MILP (`milp_values`) as the reference optimum, and the pricing it rests on.

Pricing (`save_sets.SaveSetPricer`): for every save option of `SAVE_OPTIONS` and every
segment of two small programs, pricing the option's selected values reproduces
`segment_table`'s stored, transient and FLOPs exactly (same formula, one per value).

The MILP against an answer known independently: on tiny programs, every save set of every
segment (2^candidates each, priced by `SaveSetPricer`), over every path of segments, is
enumerated (`ValueReference`); dominated choices of one segment (no less stored, no less
stored + transient, no fewer FLOPs) are dropped first, which cannot change an optimum of the
peak formula. The MILP, with and without the chain DP's warm start, must reach exactly that
optimum, proven, and its solution priced again must fit the budget.

Against the option planners (the MILP over the same cuts is a superset of their space): its
optimum is at most the segment model's brute-force optimum (test_planners_exhaustive's
`Reference`), strictly below it somewhere on the mix; chain and greedy are compared with it
(the gap, recorded in `CHAIN_GAP` / the xfail reasons).

Node limits only (no time limits); the MILP solves here prove optimality within them.
"""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_planners_exhaustive import CASES, MAX_CUTS, Reference, _residual_mlp

import jremat
from jremat._src.plan.plan import KEEP, SAVE_NAMES
from jremat._src.plan.planners.chain import ChainPlanner
from jremat._src.plan.planners.greedy import choose
from jremat._src.plan.planners.milp import MILPPlanner
from jremat._src.plan.planners.milp_values import PerValueMILP
from jremat._src.plan.planners.save_sets import SaveSetPricer, save_set_cost
from jremat._src.plan.planners.segments import (
    SAVE_OPTIONS,
    option_pieces,
    saved_values,
    segment_table,
)
from jremat._src.trace.layers import candidate_cuts

#: Node limit of every MILP solve here: far above what these programs take to prove.
NODES = 20_000
#: Largest number of save sets `ValueReference` enumerates for one segment.
MAX_SETS = 2**14


def _light4():
    """4 named layers (tanh, relu, sin, tanh), hidden 12: few candidates per segment, so
    every save set of every multi-layer segment can be enumerated."""
    return _residual_mlp((jnp.tanh, jax.nn.relu, jnp.sin, jnp.tanh), hidden=12, seed=2)


def _gelu3():
    """3 named layers (tanh, gelu, sigmoid), hidden 12: gelu's chain of elementwise values
    gives one layer 9 candidates."""
    return _residual_mlp((jnp.tanh, jax.nn.gelu, jax.nn.sigmoid), hidden=12, seed=2)


#: name -> (program, max_span): the light MLP with its cuts chosen (segments of up to three
#: cut intervals), the gelu MLP on its fixed layer segmentation (max_span 1).
VALUE_CASES = {"light4": (_light4, 3), "gelu3": (_gelu3, 1)}


def _pareto(points: list[tuple[float, float, float]]) -> list[tuple[float, float, float]]:
    """The (stored, transient, flops) triples no other triple dominates in (stored, stored +
    transient, flops)."""
    keys = sorted({(s, s + t, f) for s, t, f in points})
    out = []
    for k in keys:
        if not any(o[0] <= k[0] and o[1] <= k[1] and o[2] <= k[2] for o in out):
            out.append(k)
    return [(s, st - s, f) for s, st, f in out]


class ValueReference:
    """Brute force over save sets: every path over `cuts`, each segment kept (any span; never
    right after a kept one: a kept run is one segment, as the plan runs it) or checkpointed
    (at most `max_span` intervals) with every subset of its candidates, priced by
    `SaveSetPricer(graph, internal)`."""

    def __init__(self, name: str, internal: bool):
        make, self.max_span = VALUE_CASES[name]
        loss, args = make()
        self.internal = internal
        self.graph = jremat.trace(loss, *args)
        self.cuts = candidate_cuts(self.graph, MAX_CUTS)
        pricer = SaveSetPricer(self.graph, internal)
        m = len(self.cuts)
        self.choices, self.keeps = {}, {}
        for a, b in itertools.combinations(range(m), 2):
            s, e = self.cuts[a], self.cuts[b]
            keep = pricer.keep(s, e)
            self.keeps[a, b] = (keep.stored, keep.transient, 0.0)
            if b - a > self.max_span:
                continue
            cands = pricer.facts(s, e).candidates
            assert 2 ** len(cands) <= MAX_SETS, (name, a, b, len(cands))
            points = []
            for bits in itertools.product((False, True), repeat=len(cands)):
                c = pricer.price(s, e, [v for v, on in zip(cands, bits, strict=True) if on])
                points.append((c.stored, c.transient, c.flops))
            self.choices[a, b] = _pareto(points)
        self.peaks, self.costs = self._enumerate(0, m, 0.0, 0.0, 0.0)
        self.smallest_peak = float(self.peaks.min())
        keep = pricer.keep(0, self.graph.num_nodes)
        self.no_remat_peak = keep.stored + keep.transient

    def _enumerate(self, a, m, running, peak, total, kept=False):
        if a == m - 1:
            return np.array([peak]), np.array([total])
        peaks, costs = [], []
        for b in range(a + 1, m):
            options = [(p, False) for p in self.choices.get((a, b), ())]
            options += [] if kept else [(self.keeps[a, b], True)]
            for (s, t, f), keeps in options:
                p, c = self._enumerate(
                    b, m, running + s, max(peak, running + s + t), total + f, keeps
                )
                peaks.append(p)
                costs.append(c)
        return np.concatenate(peaks), np.concatenate(costs)

    def opt(self, budget: float) -> float:
        fits = self.peaks <= budget
        return float(self.costs[fits].min()) if fits.any() else math.inf

    def budgets(self) -> list[float]:
        lo, hi = self.smallest_peak, self.no_remat_peak
        return [lo * (1 - 1e-6)] + [lo + f * (hi - lo) for f in (0.0, 0.1, 0.3, 0.5, 0.8, 1.0)]


@pytest.fixture(
    scope="module",
    params=[(n, i) for n in sorted(VALUE_CASES) for i in (False, True)],
    ids=lambda p: p[0] + ("+internal" if p[1] else ""),
)
def vref(request) -> ValueReference:
    return ValueReference(*request.param)


def _milp(vref: ValueReference, **kw) -> PerValueMILP:
    return PerValueMILP(
        vref.graph,
        cuts=vref.cuts,
        max_span=vref.max_span,
        max_nodes=NODES,
        recompute_internal=vref.internal,
        **kw,
    )


@pytest.fixture(scope="module", params=sorted(CASES))
def ref(request) -> Reference:
    return Reference(request.param)


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(abs(a), abs(b), 1.0)


# ------------------------------------------------------------------------------ pricing


def test_pricing_reproduces_the_segment_table(ref):
    """Every option's selection, and a kept segment, priced value by value: exactly the
    table's entries, for every segment over the case's cuts (all options of `SAVE_OPTIONS`,
    whatever the case's planners use)."""
    g = ref.graph
    t = segment_table(g, ref.table.cuts, tuple(SAVE_OPTIONS))
    pricer = SaveSetPricer(g)  # its default accounting is the table's (recompute_internal)
    m = len(t.cuts)
    for a, b in itertools.combinations(range(m), 2):
        s, e = t.cuts[a], t.cuts[b]
        keep = pricer.keep(s, e)
        assert (keep.stored, keep.transient, keep.flops) == (
            t.stored[0, a, b],
            t.transient[0, a, b],
            t.flops[0, a, b],
        ), (a, b)
        for k, name in enumerate(t.options[1:], start=1):
            everywhere = [v.id for v in g.values if SAVE_OPTIONS[name](g, v.id)]
            got = pricer.price(s, e, everywhere)
            want = (t.stored[k, a, b], t.transient[k, a, b], t.flops[k, a, b])
            assert (got.stored, got.transient, got.flops) == want, (name, a, b, got, want)
            # what a plan names (the float values the option selects inside) prices the same
            assert pricer.price(s, e, saved_values(g, s, e, name)) == got
            # stored + transient does not depend on the save set
            assert got.stored + got.transient == keep.stored + keep.transient
    assert save_set_cost(g, 0, g.num_nodes, []) == pricer.price(0, g.num_nodes, [])


def test_pricing_rejects_bad_input(ref):
    pricer = SaveSetPricer(ref.graph)
    n = ref.graph.num_nodes
    with pytest.raises(ValueError, match="start=3, end=3"):
        pricer.price(3, 3, [])
    with pytest.raises(ValueError, match=f"end <= {n}"):
        pricer.keep(0, n + 1)
    with pytest.raises(ValueError, match="saved:.*not value ids"):
        pricer.price(0, n, [len(ref.graph.values)])
    with pytest.raises(ValueError, match="pieces: end at node"):
        pricer.path_cost([(0, 1, None)])
    with pytest.raises(ValueError, match="cuts must ascend"):
        PerValueMILP(ref.graph, cuts=[0, 5, 5, n])
    with pytest.raises(ValueError, match="max_span must be >= 1"):
        PerValueMILP(ref.graph, max_span=0)


# ------------------------------------------------------------------------------ the MILP


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
def test_per_value_milp_equals_exhaustive_search(vref, warm):
    milp = _milp(vref, warm_start=warm)
    for budget in vref.budgets():
        want = vref.opt(budget)
        sol = milp.solve(budget)
        if want == math.inf:
            assert sol is None, budget
            continue
        assert sol is not None, (budget, want)
        assert sol.proven, (budget, sol.gap, sol.status)
        assert _close(sol.objective, want), (budget, sol.objective, want)
        peak, flops = milp.pricer.path_cost(sol.pieces)  # priced again, independently
        assert peak <= budget and (peak, flops) == (sol.peak, sol.objective)


def test_per_value_plan_is_a_plan_of_named_saves(vref):
    """`plan` turns the solution into "names" segments saving the kept ids (kept segments
    merged), with the solution's FLOPs and peak; JSON round trip."""
    milp = _milp(vref)
    budget = vref.budgets()[2]
    plan = milp.plan(budget)
    sol = milp.last
    assert plan.solver == "milp_values" and plan.recompute_flops == sol.objective
    assert plan.predicted_temp_bytes == int(sol.peak)
    assert [s.start for s in plan.segments][0] == 0 and plan.segments[-1].end == plan.num_nodes
    named = {(s, e): saved for s, e, saved in sol.pieces if saved is not None}
    for seg in plan.segments:
        assert seg.policy in (KEEP, SAVE_NAMES)
        if seg.policy == SAVE_NAMES:
            assert tuple(seg.saved) == named[seg.start, seg.end]
    assert jremat.Plan.from_json(plan.to_json()).segments == plan.segments


def test_a_budget_every_kept_path_fits_needs_no_recompute(vref):
    milp = _milp(vref)
    assert milp.no_remat_peak() == vref.no_remat_peak
    kept = [(a, b, None) for a, b in itertools.pairwise(vref.cuts)]
    peak, _ = milp.pricer.path_cost(kept)
    assert milp.solve(peak).objective == 0.0


# ------------------------------------------------------------------ against the option planners


#: Fractions of the way from the smallest peak to the no-remat peak compared.
FRACTIONS = (0.0, 0.15, 0.3, 0.5, 0.7, 0.9)

#: The issue's goal: the chain DP within 5% of the per-value optimum where it is proven.
CHAIN_GAP = 0.05


def _priced(pricer: SaveSetPricer, t, segs, budget: float) -> float:
    """FLOPs of an option planner's `[(cut a, cut b, option)]` repriced value by value (the
    named saves its plan carries); inf for no plan. Asserts it fits the budget there too."""
    if segs is None:
        return math.inf
    peak, flops = pricer.path_cost(option_pieces(pricer.graph, t.cuts, segs))
    assert peak <= budget, (budget, peak, segs)
    return flops


def _compare(ref: Reference, internal: bool, fractions=FRACTIONS):
    """Per budget: (budget, segment model's optimum, per-value optimum, whether proven, the
    chain DP's FLOPs, greedy's FLOPs), all priced by the MILP's `SaveSetPricer` on the case's
    cuts (any span). The MILP runs cold (no warm start), so its optimum is its own."""
    milp = PerValueMILP(
        ref.graph, cuts=ref.table.cuts, max_nodes=NODES, warm_start=False,
        recompute_internal=internal,
    )  # fmt: skip
    chain = ChainPlanner(ref.graph, max_cuts=MAX_CUTS, options=ref.options)
    lo, hi = ref.smallest_peak, ref.no_remat_peak
    rows = []
    for budget in [lo + f * (hi - lo) for f in fractions]:
        sol = milp.solve(budget)
        found = chain.model.cheapest_segments(budget)
        rows.append(
            (
                budget,
                ref.opt(budget),
                sol.objective if sol else math.inf,
                bool(sol and sol.proven),
                _priced(milp.pricer, ref.table, found and found[1], budget),
                _priced(milp.pricer, ref.table, choose(ref.model, budget), budget),
            )
        )
    return rows


@pytest.fixture(scope="module")
def compared(ref):
    """`_compare` with the honest accounting (`recompute_internal=True`)."""
    return _compare(ref, internal=True)


def test_per_value_optimum_is_at_most_the_segment_optimum(ref, compared):
    """The per-value space holds every option's save set: its optimum is never above the
    segment model's (brute force) or the segment MILP's, and the options' plans cost the same
    priced value by value as in the table; on the mix it is strictly below at some budget
    (measured: 22016 against 22272 FLOPs at 0.15, a layer saving part of gelu's chain)."""
    seg_milp = MILPPlanner(
        ref.graph, max_cuts=MAX_CUTS, max_nodes=NODES, incumbents=(), options=ref.options
    )
    below = 0
    for budget, seg_opt, pv, proven, chain, _ in compared:
        assert proven, budget
        assert pv <= seg_opt + 1e-9 * max(seg_opt, 1.0), (budget, pv, seg_opt)
        if seg_milp.plan(budget) is not None:
            assert pv <= seg_milp.last_objective + 1e-6, (budget, pv, seg_milp.last_objective)
        assert chain == math.inf or chain >= seg_opt - 1e-9 * max(seg_opt, 1.0)
        below += pv < seg_opt * (1 - 1e-9)
    if ref.name == "mix5":
        assert below >= 1


@pytest.mark.parametrize("planner", ["chain", "greedy"])
def test_within_five_percent_of_the_per_value_optimum(ref, compared, planner):
    """The issue's goal, where the per-value optimum is proven (all budgets here). Measured:
    the chain DP and greedy at most 1.16% over it (mix5 at 0.15: 22272 against 22016 FLOPs),
    equal elsewhere; at the smallest peak of mlp6 the chain DP's buckets find no plan."""
    col = 4 if planner == "chain" else 5
    for row in compared:
        budget, pv, proven, got = row[0], row[2], row[3], row[col]
        if not proven or got == math.inf:
            continue
        assert pv - 1e-9 * max(pv, 1.0) <= got <= (1 + CHAIN_GAP) * max(pv, 1.0), (budget, got, pv)


def test_a_given_start_joins_the_program_whatever_its_span():
    """On the layer segmentation alone (max_span 1) the MILP still holds the chain DP's
    longer segments when given its plan as `start`: never above it, and it starts there
    (on mlp6, whose chain plans merge layers at some budgets; mix5's never do)."""
    ref = Reference("mlp6")
    chain = ChainPlanner(ref.graph, max_cuts=MAX_CUTS, options=ref.options)
    milp = PerValueMILP(ref.graph, cuts=ref.table.cuts, max_span=1, max_nodes=NODES)
    lo, hi = ref.smallest_peak, ref.no_remat_peak
    long = 0
    for budget in [lo + f * (hi - lo) for f in FRACTIONS]:
        found = chain.model.cheapest_segments(budget)
        if found is None or all(b - a == 1 for a, b, _ in found[1]):
            continue
        long += 1
        sol = milp.solve(budget, start=found[1])
        assert sol.warm_start == pytest.approx(found[0], rel=1e-12), (budget, sol, found)
        assert sol.objective <= found[0] + 1e-9 * max(found[0], 1.0) and sol.peak <= budget
    assert long >= 1


def test_every_highs_solve_runs_without_the_heuristics_that_hang(ref, monkeypatch):
    """The segment MILP and the per-value MILP both solve through `highs.mip_solver`: one
    thread, seed 0, the node limit, and the root reduced-cost heuristic off (it ran over 10
    minutes, past the node and time limits, on a 6-layer MLP's segment MILP where the same
    solve without it takes 5 s: `tests/test_vmap.py`'s plan at 4 examples)."""
    import highspy

    from jremat._src.plan.planners import highs

    known = [o for o in highs.HANGING_HEURISTICS if hasattr(highspy.HighsOptions(), o)]
    seen = []
    run = highspy.Highs.run

    def recording_run(h):
        seen.append(
            {o: h.getOptionValue(o)[1] for o in ("threads", "random_seed", "mip_max_nodes")}
        )
        seen[-1].update({o: h.getOptionValue(o)[1] for o in known})
        return run(h)

    monkeypatch.setattr(highspy.Highs, "run", recording_run)
    budget = 0.5 * ref.model.no_remat_peak()
    MILPPlanner(ref.graph, max_cuts=MAX_CUTS, max_nodes=7, options=ref.options).plan(budget)
    PerValueMILP(ref.graph, max_cuts=MAX_CUTS, max_nodes=9).solve(budget)
    assert [s["mip_max_nodes"] for s in seen] == [7, 9]
    for s in seen:
        assert s["threads"] == 1 and s["random_seed"] == 0
        assert all(s[o] is False for o in known), s
