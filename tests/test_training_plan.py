"""plan_training: picks microbatches / remat so the compiled train step fits a byte budget."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jremat
from jremat._src.base.args import abstract_args
from jremat._src.training import training_plan
from jremat._src.training.training_plan import _measure, _value_and_grad


def _mlp(depth: int = 6, width: int = 16, batch: int = 128, mult: int = 4):
    """Residual tanh MLP regression; activations (batch x 4*width per layer) dominate temp."""
    keys = jax.random.split(jax.random.key(0), 2 * depth + 2)
    params = [
        {
            "w1": jax.random.normal(keys[2 * i], (width, mult * width)) * width**-0.5,
            "w2": jax.random.normal(keys[2 * i + 1], (mult * width, width))
            * (mult * width) ** -0.5,
        }
        for i in range(depth)
    ]
    batch_ = {
        "x": jax.random.normal(keys[-1], (batch, width)),
        "y": jax.random.normal(keys[-2], (batch, width)),
    }

    def loss(params, b):
        x = b["x"]
        for i, p in enumerate(params):
            with jax.named_scope(f"layer_{i}"):
                x = x + jnp.tanh(x @ p["w1"]) @ p["w2"]
        return jnp.mean((x - b["y"]) ** 2)

    return loss, params, batch_


@pytest.fixture(scope="module")
def mlp():
    return _mlp()


def test_fits_budget_the_plain_step_exceeds(mlp):
    loss, params, batch = mlp
    opt = optax.adam(1e-3)
    state = jax.eval_shape(opt.init, params)
    args = abstract_args((params, state, batch))
    plain_fp, _, _ = _measure(_value_and_grad(loss, 1, None), opt, args)
    budget = int(plain_fp * 0.7)
    tp = jremat.plan_training(loss, params, batch, budget=budget, optimizer=opt)
    assert plain_fp > budget
    assert tp.compiled_footprint_bytes <= budget
    assert tp.num_microbatches > 1 or tp.plan is not None
    assert tp.alternatives[0]["k"] == 1 and tp.alternatives[0]["remat_budget"] is None
    assert tp.alternatives[0]["footprint_bytes"] == plain_fp and not tp.alternatives[0]["fits"]
    fits = [a for a in tp.alternatives if a["fits"]]
    assert tp.flops == min(a["flops"] for a in fits)
    # the chosen configuration, recompiled independently, has the reported footprint
    fp, _, _ = _measure(tp.value_and_grad, opt, args)
    assert fp == tp.compiled_footprint_bytes
    with pytest.warns(DeprecationWarning, match="compiled_footprint_bytes"):
        assert tp.predicted_footprint_bytes == fp  # the deprecated name of the same figure

    loss_v, grads = jax.jit(tp.value_and_grad)(params, batch)
    ref_v, ref_g = jax.value_and_grad(loss)(params, batch)
    np.testing.assert_allclose(loss_v, ref_v, rtol=1e-5)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_g), strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5 * float(jnp.abs(r).max()))


def test_generous_budget_keeps_plain_step(mlp):
    loss, params, batch = mlp
    tp = jremat.plan_training(loss, params, batch, budget="1GiB")
    assert tp.num_microbatches == 1 and tp.plan is None and len(tp.alternatives) == 1


def test_budget_below_everything_raises(mlp):
    loss, params, batch = mlp
    with pytest.raises(jremat.InfeasibleBudgetError, match="smallest compiled footprint") as e:
        jremat.plan_training(
            loss, params, batch, budget=1000, candidates=[1, 4], remat_budgets=(0.5,)
        )
    assert e.value.budget == 1000
    assert e.value.smallest_reachable > 1000


@pytest.mark.parametrize("compile_budget", [3, None])
def test_a_fraction_refused_under_an_int_compile_budget_leaves_the_smaller_ones(
    mlp, monkeypatch, compile_budget
):
    """Under an int compile budget a remat fraction may be refused for want of compiles alone
    (its first plan missed, no compile left to correct it) where a smaller fraction's first
    plan fits: the smaller fractions are still planned, and a train step that fits is found.
    Without a limit a refusal states a floor above the smaller fractions: they are skipped."""
    loss, params, batch = mlp
    opt = optax.sgd(1e-3)
    args = abstract_args((params, jax.eval_shape(opt.init, params), batch))
    plain_fp, _, _ = _measure(_value_and_grad(loss, 1, None), opt, args)
    real, asked = training_plan.solve, []

    def solve(prog, spec, **kw):
        asked.append(spec.raw)
        if spec.raw == 0.6:  # the refusal a search cut short by its compile budget gives
            raise jremat.InfeasibleBudgetError(
                "budget=0.6 is not known to hold", budget=0.6, smallest_reachable=1.0,
                smallest_reachable_bytes=0,
            )  # fmt: skip
        return real(prog, spec, **{**kw, "compile_budget": None})

    monkeypatch.setattr(training_plan, "solve", solve)
    budget = int(plain_fp * 0.9)
    kw = dict(budget=budget, optimizer=opt, candidates=[1], remat_budgets=(0.6, 0.5))
    if compile_budget is None:
        with pytest.raises(jremat.InfeasibleBudgetError, match="remat budgets \\[0.6, 0.5\\]"):
            jremat.plan_training(loss, params, batch, compile_budget=None, **kw)
        assert asked == [0.6]
        return
    tp = jremat.plan_training(loss, params, batch, compile_budget=compile_budget, **kw)
    assert asked == [0.6, 0.5]
    assert tp.plan is not None and tp.plan.budget == 0.5
    assert tp.compiled_footprint_bytes <= budget < plain_fp


def test_fraction_budget_is_rejected(mlp):
    loss, params, batch = mlp
    with pytest.raises(ValueError, match="fraction"):
        jremat.plan_training(loss, params, batch, budget=0.5)


def test_bad_aux_reduction_is_rejected_before_any_compile(mlp):
    """Also where one microbatch fits (where the reduction is never used)."""
    loss, params, batch = mlp
    with pytest.raises(ValueError, match="aux_reduction must be one of"):
        jremat.plan_training(
            lambda p, b: (loss(p, b), {}),
            params,
            batch,
            budget=10**12,
            has_aux=True,
            aux_reduction="meen",
        )


def test_bad_candidate_is_rejected(mlp):
    loss, params, batch = mlp
    with pytest.raises(ValueError, match="divid"):
        jremat.plan_training(loss, params, batch, budget="1MiB", candidates=[3])


def test_plans_a_step_on_an_explicit_mesh():
    """Issue 47: `plan_training` on a batch sharded over `jax.make_mesh`'s Explicit axes
    (under `jax.set_mesh`): the microbatched candidates compile (before: a ShardingTypeError
    from the batch split for every k), the chosen step fits the per-device byte budget that
    the plain step exceeds, and its gradients equal the plain ones."""
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (conftest.py sets 8 host devices)")
    from jax.sharding import PartitionSpec as P

    loss, params0, batch0 = _mlp(batch=8192)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    with jax.set_mesh(mesh):
        params = jax.device_put(params0, P())
        batch = jax.device_put(batch0, P("data"))
        plain_fp, _, _ = _measure(_value_and_grad(loss, 1, None), None, (params, batch))
        budget = int(plain_fp * 0.7)
        tp = jremat.plan_training(
            loss, params, batch, budget=budget, candidates=(1, 2, 4), remat_budgets=()
        )
        assert tp.num_microbatches > 1 and tp.compiled_footprint_bytes <= budget < plain_fp
        loss_v, grads = jax.jit(tp.value_and_grad)(params, batch)
    ref_v, ref_g = jax.value_and_grad(loss)(params0, batch0)
    np.testing.assert_allclose(loss_v, ref_v, rtol=1e-5)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_g), strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5 * float(jnp.abs(r).max()))
