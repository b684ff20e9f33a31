"""Losses returning `(loss, aux)` (issue 14): `auto`, `plan`, `rematerialize` and `microbatch`
take `has_aux=True` and budget the step that computes both; the caller's own compiled
`jit(value_and_grad(f, has_aux=True))` is checked against the budget."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import pytest
from models import F32_RTOL, assert_trees_close, mlp_chain

import jremat

BUDGET = 0.5


@pytest.fixture(scope="module")
def chain():
    """A 4-layer chain whose loss also returns metrics and a per-layer statistic."""
    m = mlp_chain(depth=4, width=8, batch=256)
    params, x = m.args

    def loss(params, x):
        stats = []
        for i, p in enumerate(params):
            with jax.named_scope(f"layer_{i}"):
                x = x + jnp.tanh(x @ p["w1"]) @ p["w2"]
                stats.append(jnp.mean(x, axis=0))  # e.g. updated batch statistics
        value = jnp.mean(x**2)
        return value, {"stats": stats, "max": jnp.max(jnp.abs(x))}

    return loss, (params, x)


def step_temp_bytes(f, args) -> int:
    step = jax.jit(jax.value_and_grad(f, has_aux=True))
    return step.lower(*args).compile().memory_analysis().temp_size_in_bytes


@pytest.fixture(scope="module")
def reference(chain):
    """((loss, aux), grads) and the compiled temp bytes of the unrematerialized step."""
    loss, args = chain
    return jax.value_and_grad(loss, has_aux=True)(*args), step_temp_bytes(loss, args)


def check_runs_as_verified(f, plan, args, reference):
    """Loss, aux and gradients equal the unrematerialized ones, and the caller's compiled step
    is within the plan's budget, whose baseline is the unrematerialized step with its aux."""
    expected, baseline_temp = reference
    assert_trees_close(jax.value_and_grad(f, has_aux=True)(*args), expected, F32_RTOL)
    assert plan.baseline_temp_bytes == baseline_temp
    assert step_temp_bytes(f, args) <= plan.budget_temp_bytes < baseline_temp


@pytest.fixture(scope="module")
def aux_plan(chain):
    loss, args = chain
    return jremat.plan(loss, *args, budget=BUDGET, has_aux=True, solver="chain", max_rounds=1)


def test_plan_and_rematerialize_with_aux(chain, aux_plan, reference):
    loss, args = chain
    f = jremat.rematerialize(loss, aux_plan, has_aux=True)
    check_runs_as_verified(f, aux_plan, args, reference)


def test_auto_with_aux(chain, aux_plan, reference):
    loss, args = chain
    f = jremat.auto(loss, budget=BUDGET, has_aux=True, solver="chain", max_rounds=1)
    jax.eval_shape(jax.value_and_grad(f, has_aux=True), *args)  # plans at the first call
    (p,) = f.plans.values()
    assert p.fingerprint == aux_plan.fingerprint
    check_runs_as_verified(f, p, args, reference)


def test_microbatch_of_auto_with_aux(chain, reference):
    """`microbatch(..., has_aux=True)` runs an `auto` loss with aux in its loop body (the cost
    model's plan: what is checked here is the pairing, not the budget)."""
    loss, (params, x) = chain
    f = jremat.auto(loss, budget=BUDGET, has_aux=True, solver="chain", verify=False)
    got = jremat.microbatch(f, 2, has_aux=True)(params, x)
    assert_trees_close(got, jremat.microbatch(loss, 2, has_aux=True)(params, x), F32_RTOL)


def test_a_pair_without_has_aux_names_it(chain):
    loss, args = chain
    with pytest.raises(TypeError, match="has_aux=True"):
        jremat.plan(loss, *args, budget=BUDGET)
    with pytest.raises(TypeError, match="has_aux=True"):
        jax.grad(lambda *a: jremat.auto(loss, budget=BUDGET)(*a)[0])(*args)


def test_has_aux_checks_its_output_and_its_type(chain, aux_plan):
    loss, args = chain
    scalar = lambda *a: loss(*a)[0]  # noqa: E731
    with pytest.raises(TypeError, match=r"has_aux=True, fn must return a pair \(loss, aux\)"):
        jremat.plan(scalar, *args, budget=BUDGET, has_aux=True)
    with pytest.raises(TypeError, match="has_aux must be a bool"):
        jremat.auto(loss, budget=BUDGET, has_aux="yes")
    with pytest.raises(TypeError, match="has_aux must be a bool"):
        jremat.rematerialize(loss, aux_plan, has_aux=1)


# -- measure, compare, plan_training -----------------------------------------------------------
def test_measure_with_aux_measures_the_step_that_computes_both(chain, reference):
    loss, args = chain
    step = jax.jit(jax.value_and_grad(loss, has_aux=True)).lower(*args).compile()
    m = jremat.measure(loss, *args, has_aux=True)
    assert m.temp_bytes == reference[1] == step.memory_analysis().temp_size_in_bytes
    cost = step.cost_analysis()
    assert m.flops == cost["flops"] + cost["transcendentals"]
    with pytest.raises(TypeError, match="has_aux"):
        jremat.measure(loss, *args)  # a pair without has_aux names it


def test_compare_with_aux(chain, reference):
    loss, args = chain
    c = jremat.compare(
        loss, *args, policies=["nothing_saveable"], budgets=(), has_aux=True, progress=False
    )
    base, remat = c.rows
    assert base.temp_bytes == reference[1]  # no remat: the step with its aux
    assert remat.ok and remat.temp_bytes < base.temp_bytes
    assert remat.max_grad_diff < 1e-5


def test_plan_training_with_aux(chain, reference):
    """One microbatch without remat fits: the chosen step is `jit(value_and_grad(loss,
    has_aux=True))`; two microbatches average the aux (microbatch's aux_reduction)."""
    loss, args = chain
    expected, _ = reference
    step = jax.jit(jax.value_and_grad(loss, has_aux=True)).lower(*args).compile()
    mem = step.memory_analysis()
    footprint = (
        mem.argument_size_in_bytes
        + mem.output_size_in_bytes
        - mem.alias_size_in_bytes
        + mem.temp_size_in_bytes
    )
    tp = jremat.plan_training(loss, *args, budget=footprint, candidates=[1], has_aux=True)
    assert (tp.num_microbatches, tp.plan, tp.compiled_footprint_bytes) == (1, None, footprint)
    assert_trees_close(tp.value_and_grad(*args), expected, F32_RTOL)
    two = jremat.plan_training(
        loss, *args, budget=footprint, candidates=[2], remat_budgets=(), has_aux=True
    )
    (value, aux), grads = jax.jit(two.value_and_grad)(*args)
    chex.assert_trees_all_close((value, grads), (expected[0][0], expected[1]), rtol=1e-4, atol=1e-6)
    assert jax.tree.structure(aux) == jax.tree.structure(expected[0][1])
