"""The min-cut save sets (`value_cut.cut_save_set`, segment options "cut@t").

At a price of t FLOPs per byte, the cut's save set must be the exact minimum of recompute
FLOPs plus t times kept bytes, the whole program checkpointed: checked against every save
set of a small program, each priced by `SaveSetPricer` (the accounting every planner shares).
On the per-value MILP's test programs, the chain DP with the cut rungs must be within 5% of
the per-value optimum where a threshold on FLOPs per byte alone is not.
"""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jremat
from jremat._src.plan.planners.chain import ChainPlanner
from jremat._src.plan.planners.milp_values import PerValueMILP
from jremat._src.plan.planners.save_sets import SaveSetPricer
from jremat._src.plan.planners.segments import (
    CUT_LADDER,
    CUT_OPTIONS,
    DEFAULT_OPTIONS,
    distinct_options,
    option_pieces,
    saved_values,
)
from jremat._src.plan.planners.value_cut import MAX_PRICE, cut_save_set


def _small():
    """Two layers whose values differ in FLOPs per byte and in what their recompute reads
    (matmuls, gelu's chain, a reduction): 12 candidates."""

    def loss(params, x):
        w1, w2 = params
        h = jax.nn.gelu(x @ w1)
        y = jnp.tanh(h @ w2)
        return jnp.sum(y * y) / jnp.max(jnp.abs(y))

    keys = jax.random.split(jax.random.key(0), 3)
    params = (jax.random.normal(keys[0], (24, 32)), jax.random.normal(keys[1], (32, 24)))
    return loss, (params, jax.random.normal(keys[2], (16, 24)))


@pytest.fixture(scope="module")
def small():
    loss, args = _small()
    return jremat.trace(loss, *args)


def _objective(pricer: SaveSetPricer, price: float, saved) -> float:
    n = pricer.graph.num_nodes
    c = pricer.price(0, n, saved)
    return c.flops + price * (c.stored - pricer.facts(0, n).live_in)


@pytest.mark.parametrize("price", [0.1, 0.375, 1.5, 6.0, 24.0, 1e4])
def test_the_cut_is_the_exact_minimum_over_every_save_set(small, price):
    pricer = SaveSetPricer(small)
    n = small.num_nodes
    cands = pricer.facts(0, n).candidates
    assert 8 <= len(cands) <= 16, len(cands)
    best = min(
        _objective(pricer, price, [v for v, on in zip(cands, bits, strict=True) if on])
        for bits in itertools.product((False, True), repeat=len(cands))
    )
    saved = cut_save_set(small, price)
    assert all(small.values[v].saveable for v in saved)
    assert math.isclose(_objective(pricer, price, saved), best, rel_tol=1e-9, abs_tol=1e-6)


def test_the_cut_moves_from_recompute_to_save_as_the_price_falls(small):
    """The largest price saves nothing; a price near 0 saves
    every candidate the backward needs and recomputes nothing."""
    pricer = SaveSetPricer(small)
    n = small.num_nodes
    assert pricer.price(0, n, cut_save_set(small, MAX_PRICE)).kept == ()
    assert pricer.price(0, n, cut_save_set(small, 1e-9)).flops == 0.0
    kept = [sum(pricer.price(0, n, cut_save_set(small, t)).kept) for t in (1e-9, *CUT_LADDER)]
    assert kept[0] > 0 and kept[-1] < kept[0]


@pytest.mark.parametrize("price", [0, -1.0, math.inf, math.nan, "6", True, 1e7, 10**400])
def test_a_bad_price_is_refused_by_name(small, price):
    with pytest.raises(ValueError, match="price"):
        cut_save_set(small, price)


def test_numpy_prices_are_prices(small):
    assert cut_save_set(small, np.float32(6.0)) == cut_save_set(small, 6.0)
    assert cut_save_set(small, np.int64(2)) == cut_save_set(small, 2.0)


def test_the_largest_price_saves_only_what_must_be(small):
    """At `MAX_PRICE` no value is worth its bytes: the cut recomputes everything it can."""
    pricer = SaveSetPricer(small)
    assert pricer.price(0, small.num_nodes, cut_save_set(small, MAX_PRICE)).kept == ()


def test_a_program_without_equations_saves_nothing():
    graph = jremat.trace(lambda x: x, jnp.float32(2.0))
    assert graph.num_nodes == 0
    assert cut_save_set(graph, 1.0) == frozenset()


def test_the_cut_rungs_name_their_values_and_are_opt_in(small):
    assert not set(CUT_OPTIONS) & set(DEFAULT_OPTIONS)
    for name in distinct_options(small, CUT_OPTIONS):
        t = float(name.partition("@")[2])
        chosen = set(saved_values(small, 0, small.num_nodes, name))
        assert chosen == set(cut_save_set(small, t))


def _ladder_decoder():
    from tests.models import decoder

    m = decoder(depth=3)
    return m.loss, m.args


@pytest.mark.parametrize("fraction", [0.55, 0.7])
def test_with_the_cut_rungs_the_chain_dp_is_within_five_percent_of_the_per_value_optimum(
    fraction,
):
    """Issue 31's goal on a 3-layer decoder: where HiGHS proves the per-value optimum, the
    chain DP's plan with the cut rungs, priced value by value, is at most 5% above it
    (measured +1.05% and +2.70%; the default options +33.8% and +42.4%). At 0.85 it is
    +6.25% (docs/design.md#per-value-save-sets)."""
    loss, args = _ladder_decoder()
    graph = jremat.trace(loss, *args)
    chain = ChainPlanner(graph, max_cuts=16, options=(*DEFAULT_OPTIONS, *CUT_OPTIONS))
    pv = PerValueMILP(
        graph, cuts=chain.model.cuts, max_span=2, max_nodes=2_000, recompute_internal=True
    )
    budget = fraction * chain.no_remat_peak()
    found = chain.model.cheapest_segments(budget)
    assert found is not None
    peak, flops = pv.pricer.path_cost(option_pieces(graph, chain.model.cuts, found[1]))
    assert peak <= budget * (1 + 1e-9)
    sol = pv.solve(budget, start=found[1])
    assert sol is not None and sol.proven, fraction
    assert sol.objective <= flops * (1 + 1e-9)
    assert flops <= 1.05 * max(sol.objective, 1.0), (fraction, flops, sol.objective)
