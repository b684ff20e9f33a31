"""Losses returning `(loss, aux)` (issue 14): `auto`, `plan`, `rematerialize` and `microbatch`
take `has_aux=True` and budget the step that computes both; the caller's own compiled
`jit(value_and_grad(f, has_aux=True))` is checked against the budget."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import pytest
from models import mlp_chain

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
    chex.assert_trees_all_close(jax.value_and_grad(f, has_aux=True)(*args), expected, rtol=1e-5)
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
    chex.assert_trees_all_close(got, jremat.microbatch(loss, 2, has_aux=True)(params, x), rtol=1e-5)


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
