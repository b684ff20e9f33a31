"""The per-value save sets: `segments.FPB_LADDER` (a segment saves the values whose recompute
costs at least t FLOPs per byte) and the marginal ladder (`value_ladder`: what a layer's
reverse greedy still saves). What they select, which rungs a graph keeps, what the rewritten
program keeps as residuals, and that the planners' plans with them are exact."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jremat
from jremat._src.base import compat as _compat
from jremat._src.compile.xla import xla_flops
from jremat._src.plan.plan import SAVE_NAMES
from jremat._src.plan.planners.model import SegmentModel
from jremat._src.plan.planners.save_sets import SaveSetPricer
from jremat._src.plan.planners.segments import (
    DEFAULT_OPTIONS,
    FPB_OPTIONS,
    LADDER_OPTIONS,
    MARGINAL_OPTIONS,
    SAVE_OPTIONS,
    distinct_options,
    flops_per_byte,
    saved_values,
)
from jremat._src.plan.planners.value_ladder import _rank_span, ladder_levels
from jremat._src.plan.rewrite import rematerialize, residual_name
from tests.models import assert_trees_close, decoder, layer_spans, tile_plan


@pytest.fixture(scope="module")
def model():
    return decoder(depth=2)


@pytest.fixture(scope="module")
def graph(model):
    with jremat.disabled():
        return jremat.trace(model.loss, *model.args)


def test_flops_per_byte_of_a_matmul_is_its_contraction_over_the_itemsize():
    """2*M*N*K FLOPs over M*N*4 bytes: K/2 for float32; elementwise values 1/4."""

    def loss(w, x):
        return jnp.sum(jnp.tanh(x @ w))

    graph = jremat.trace(loss, jnp.ones((64, 8)), jnp.ones((16, 64)))
    by_primitive = {
        graph.nodes[v.producer].primitive: flops_per_byte(graph, v.id)
        for v in graph.values
        if v.producer >= 0
    }
    assert by_primitive["dot_general"] == 64 / 2
    assert by_primitive["tanh"] == 0.25


def test_each_rung_saves_the_values_at_or_above_its_threshold(graph):
    ratios = {v.id: flops_per_byte(graph, v.id) for v in graph.values if v.producer >= 0}
    for name in FPB_OPTIONS:
        tau = float(name.split(">=")[1])
        got = set(saved_values(graph, 0, graph.num_nodes, name))
        want = {v for v, r in ratios.items() if r >= tau and graph.values[v].is_float}
        assert got == want, name


def test_rungs_selecting_what_an_earlier_option_selects_are_dropped(graph):
    kept = distinct_options(graph, tuple(SAVE_OPTIONS))
    assert kept[:4] == ["nothing", "dots_no_batch", "expensive", "dots"]  # JAX's, always
    sets = [frozenset(saved_values(graph, 0, graph.num_nodes, o)) for o in kept]
    assert len(set(sets)) == len(sets)
    # the decoder's attention scores (head_dim 4: 2 FLOPs per byte) split the ladder from
    # `dots`: some rung survives
    assert any(o in LADDER_OPTIONS for o in kept)
    # the planners' default table: the same pruning over `DEFAULT_OPTIONS`
    table = SegmentModel(graph).table
    assert table.options == ["keep", *distinct_options(graph, DEFAULT_OPTIONS)]


def test_a_rung_keeps_only_its_values_as_residuals_and_the_gradient_is_exact(model, graph):
    """Every layer checkpointed under one rung (each rung that saves something inside the
    layers): JAX keeps as named residuals only values of that rung's set, and the gradient
    equals the unrematerialized one."""
    rungs = [o for o in distinct_options(graph, tuple(SAVE_OPTIONS)) if o in LADDER_OPTIONS]
    flat = jax.tree_util.tree_leaves(model.args)
    avals = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in flat]
    treedef = jax.tree_util.tree_structure(model.args)
    diff = [_compat.is_float_dtype(x.dtype) for x in flat]
    want = jax.grad(model.loss)(*model.args)
    checked = 0
    for option in rungs:
        spans = [
            (s, e, SAVE_NAMES, saved_values(graph, s, e, option)) for s, e in layer_spans(graph)
        ]
        if not any(saved for *_, saved in spans):
            continue
        fn = rematerialize(model.loss, tile_plan(graph, spans))

        def flat_fn(*leaves, fn=fn):
            return fn(*jax.tree_util.tree_unflatten(treedef, leaves))

        kept = _compat.residual_names(flat_fn, avals, diff)
        allowed = {residual_name(v) for *_, saved in spans for v in saved}
        assert kept and kept <= allowed, (option, sorted(kept - allowed)[:5])
        assert_trees_close(jax.grad(fn)(*model.args), want, rtol=1e-5)
        checked += 1
    assert checked >= 2, rungs


def assert_more_options_lower_the_optimum(coarse: SegmentModel, fine: SegmentModel) -> None:
    """At 7 budgets between `coarse`'s floor and its unrematerialized peak, `fine` (a superset
    of its options) finds a plan never costlier, and a cheaper one at some budget."""
    lo = coarse.min_memory_plan("chain").predicted_temp_bytes
    hi = coarse.no_remat_peak()
    gains = []
    for f in np.linspace(0.05, 0.95, 7):
        budget = lo + f * (hi - lo)
        a, b = coarse.cheapest_segments(budget), fine.cheapest_segments(budget)
        assert b is not None and b[0] <= a[0] * (1 + 1e-9), (f, a[0], b[0])
        gains.append(b[0] < a[0] * (1 - 1e-6))
    assert any(gains)


def test_the_chain_dp_is_never_worse_with_the_ladder(graph):
    """The ladder only adds options: at every model budget the DP's optimum is at most what
    it is without them."""
    coarse = SegmentModel(graph, options=("nothing", "dots_no_batch", "expensive", "dots"))
    fine = SegmentModel(graph)
    assert_more_options_lower_the_optimum(coarse, fine)


@pytest.mark.parametrize("solver", ["chain", "greedy", "milp"])
def test_every_planner_chooses_rungs_and_its_plans_fit(graph, solver):
    """The chain DP, the greedy and the MILP all see the rungs: at some budget their plan
    takes one; every plan's modelled peak fits its model budget."""
    from jremat._src.plan.planners import PLANNERS

    kw = {"time_limit": None} if solver == "milp" else {}
    planner = PLANNERS[solver](graph, max_cuts=24, **kw)  # few cuts: a cheap MILP
    model, t = planner.model, planner.model.table
    lo = model.min_memory_plan(solver).predicted_temp_bytes
    hi = model.no_remat_peak()
    taken = set()
    for f in (0.2, 0.5, 0.8):
        budget = lo + f * (hi - lo)
        plan = planner.plan(budget)
        assert plan is not None
        # the peak as planned (before adjacent kept segments merge into one)
        assert plan.predicted_temp_bytes <= budget * (1 + 1e-9)
        segs = model.segments_of(plan)
        assert segs is not None
        taken |= {t.options[k] for *_, k in segs}
    assert taken & set(LADDER_OPTIONS), (solver, taken)


# ------------------------------------------------------------- the marginal ladder


def test_marginal_rungs_are_nested(graph):
    """Each "ladder<=f" rung saves a subset of the next one's values (the reverse greedy
    drops values one at a time), and the lowest saves something."""
    sets = [set(saved_values(graph, 0, graph.num_nodes, o)) for o in MARGINAL_OPTIONS]
    assert sets[0]
    for a, b in itertools.pairwise(sets):
        assert a <= b


def test_repeated_layers_are_ranked_as_if_ranked_alone():
    """The decoder's layers repeat: their levels, copied from the first layer ranked, equal
    what the greedy gives each layer ranked on its own."""
    m = decoder(depth=3)
    with jremat.disabled():
        g = jremat.trace(m.loss, *m.args)
    levels = ladder_levels(g)
    pricer = SaveSetPricer(g)
    spans = layer_spans(g)
    assert len(spans) == 3
    for s, e in spans:
        alone = _rank_span(pricer, s, e)
        assert alone
        assert {v: levels[v] for v in alone} == alone, (s, e)


def _projection_chain(x, w1, w2, w3):
    """`h`, `o` and `p` are matmul results of the same bytes and FLOPs per byte; the backward
    reads `h` (the square's residual) and `o` (the projection's), but `p = o @ w3` only to
    recompute `y`, whose square's backward reads `y`."""
    h = x @ w1
    o = (h * h) @ w2
    p = o @ w3
    y = p + x
    return jnp.sum(y * y)


def test_the_marginal_ladder_saves_only_what_pays_given_the_rest():
    """The issue's case (`x @ w1` against `o @ wo`): no FLOPs-per-byte threshold separates the
    projection `p` from `h` and `o`; the marginal ladder does. Saving `p` frees nothing once
    `y` is saved and spares one matmul once `o` is, so no rung saves it, while every rung
    that saves anything saves one of `h`, `o`, `y`."""
    d = 32
    args = [jnp.ones((16, d))] + [jnp.eye(d) * 0.5 for _ in range(3)]
    g = jremat.trace(_projection_chain, *args)
    h, o, p = [n.outputs[0] for n in g.nodes if n.primitive == "dot_general"]
    y = next(n.outputs[0] for n in g.nodes if n.primitive == "add")
    assert flops_per_byte(g, h) == flops_per_byte(g, o) == flops_per_byte(g, p)
    for name in FPB_OPTIONS:
        got = set(saved_values(g, 0, g.num_nodes, name))
        assert (h in got) == (o in got) == (p in got), name
    rungs = [set(saved_values(g, 0, g.num_nodes, name)) for name in MARGINAL_OPTIONS]
    assert not any(p in r for r in rungs)
    assert all(r & {h, o, y} for r in rungs if r)
    assert any(rungs)


def test_the_marginal_rungs_lower_the_dps_optimum(graph):
    """With the marginal rungs the DP's optimum is never above the threshold ladder's alone,
    and below it at some budget."""
    base = ("nothing", "dots_no_batch", "expensive", "dots", *FPB_OPTIONS)
    coarse = SegmentModel(graph, options=base)
    fine = SegmentModel(graph, options=(*base, *MARGINAL_OPTIONS))
    assert_more_options_lower_the_optimum(coarse, fine)


def _anchored_chain(w, x):
    return jnp.sum(jnp.sin(jnp.tanh(x @ w)))


def test_saving_an_anchor_still_recomputes_what_the_vjp_rules_read():
    """h = x @ w saved by name, tanh(h) not: XLA's residual is anchored on h (the fused chain
    is recomputed from it), but tanh's and sin's VJP rules read tanh's output, so the
    checkpointed segment recomputes tanh in the backward pass. The pricer charges it (the
    anchored accounting charged 0 and the marginal rungs bought such sets as free), the
    compiled step does at least that much extra work, and the gradient is exact."""
    w = jax.random.normal(jax.random.key(0), (64, 256)) / 8
    x = jax.random.normal(jax.random.key(1), (512, 64))
    g = jremat.trace(_anchored_chain, w, x)
    dot, tanh, sin, _ = g.nodes
    (h,), (t,) = dot.outputs, tanh.outputs
    assert tanh.residuals == sin.residuals == (h,)  # XLA's storage: anchored
    assert tanh.vjp_residuals == sin.vjp_residuals == (t,)  # what the rules read
    cost = SaveSetPricer(g).price(0, g.num_nodes, {h})
    assert cost.recomputed == (tanh.index,) and cost.flops == tanh.flops > 0
    assert cost.kept == (h,)

    fn = rematerialize(_anchored_chain, tile_plan(g, [(0, g.num_nodes, SAVE_NAMES, [h])]))

    def flops(f):
        return xla_flops(jax.jit(jax.grad(f)).lower(w, x).compile())

    assert flops(fn) - flops(_anchored_chain) >= cost.flops
    assert_trees_close(jax.grad(fn)(w, x), jax.grad(_anchored_chain)(w, x), rtol=1e-5)
