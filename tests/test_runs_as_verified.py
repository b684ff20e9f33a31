"""The program jremat verifies is the program that runs (issue 14): each test compiles the
caller's own step and checks *its* temp bytes against the budget."""

from __future__ import annotations

import warnings

import chex
import jax
import jax.numpy as jnp
import pytest
from models import mlp_chain

import jremat


@pytest.fixture(scope="module")
def chain():
    m = mlp_chain(depth=4, width=8, batch=256)
    return m.loss, m.args


@pytest.fixture(scope="module")
def no_cse(chain):
    """`auto(prevent_cse=False)` on the chain, planned once (with its warning)."""
    loss, args = chain
    f = jremat.auto(loss, budget=0.5, prevent_cse=False, solver="chain")
    with pytest.warns(RuntimeWarning, match="prevent_cse=False outside a lax.scan"):
        jax.eval_shape(jax.grad(f), *args)
    return f


def temp_bytes(step, *args) -> int:
    return jax.jit(step).lower(*args).compile().memory_analysis().temp_size_in_bytes


def only_plan(f) -> jremat.Plan:
    (p,) = f.plans.values()
    return p


# -- prevent_cse ------------------------------------------------------------------------------
def test_prevent_cse_false_at_top_level_runs_the_verified_program(chain, no_cse):
    """Outside a loop body XLA would merge the recompute into the forward pass (1.00x); jremat
    runs what it verified (prevent_cse=True) and says so."""
    loss, args = chain
    f = no_cse
    with pytest.warns(RuntimeWarning, match="prevent_cse=False outside a lax.scan"):
        got = temp_bytes(jax.grad(f), *args)
        grads = jax.grad(f)(*args)
    assert got <= only_plan(f).budget_temp_bytes
    chex.assert_trees_all_close(grads, jax.grad(loss)(*args), rtol=1e-5, atol=1e-7)

    r = jremat.rematerialize(loss, only_plan(f), prevent_cse=False)
    with pytest.warns(RuntimeWarning, match="prevent_cse=False"):
        assert temp_bytes(jax.grad(r), *args) <= only_plan(f).budget_temp_bytes


def test_prevent_cse_false_inside_a_scan_body_is_kept(chain, no_cse):
    loss, (params, x) = chain
    f = no_cse

    def body(carry, _):
        g = jax.grad(f)(params, carry)
        return carry, g[0]["w1"].sum()

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no prevent_cse warning inside the loop body
        jax.jit(lambda c: jax.lax.scan(body, c, None, length=2)).lower(x).compile()


# -- static and non-array arguments through the caller's jit -----------------------------------
def test_static_string_and_bool_through_the_callers_jit(chain):
    """`jax.jit(jax.grad(auto(loss)), static_argnums=...)`: a str and a bool arrive concrete
    and are closed over (planned per value, as jit specializes on them); the caller's compiled
    step holds the budget."""
    loss, args = chain

    def moded(params, x, mode, double):
        out = loss(params, x)
        out = out * 2.0 if double else out
        return out if mode == "mse" else out + 1.0

    f = jremat.auto(moded, budget=0.6, solver="chain", max_rounds=1)
    step = jax.jit(jax.grad(f), static_argnums=(2, 3))
    want = jax.jit(jax.grad(moded), static_argnums=(2, 3))
    # float32 rounding of a recomputed forward: atol about a few ulps of the largest entries
    chex.assert_trees_all_close(
        step(*args, "mse", True), want(*args, "mse", True), rtol=1e-5, atol=1e-7
    )
    p = only_plan(f)
    got = step.lower(*args, "mse", True).compile().memory_analysis().temp_size_in_bytes
    assert got <= p.budget_temp_bytes
    with pytest.raises(TypeError, match=r"argument 2 of moded is list .* neither an array nor"):
        jax.grad(f)(*args, ["mse"], True)
    with pytest.raises(TypeError, match=r"argument 0 of moded \(str 'x'\) is differentiated"):
        f("x", args[1], "mse", True)


# -- degenerate programs ------------------------------------------------------------------------
@pytest.mark.parametrize("budget", [1.0, 0.5, 0.99])
def test_program_without_equations_runs_unchanged_at_one_and_raises_below(budget):
    """`lambda x: x` and a jit returning an input trace to no equations: nothing to keep or
    recompute. At budget 1.0 the function runs as written; below it no budget can be met,
    which is said (naming budget=1.0) rather than running it unchanged in silence."""
    x, y = jnp.float32(2.0), jnp.ones(3)
    for fn, args in [(lambda a: a, (x,)), (jax.jit(lambda a, b: a), (x, y))]:
        f = jremat.auto(fn, budget=budget)
        if budget < 1:
            with pytest.raises(jremat.InfeasibleBudgetError, match=r"no equations.*budget=1\.0"):
                jax.grad(f)(*args)
            with pytest.raises(jremat.InfeasibleBudgetError, match="nothing can be remat") as e:
                jremat.plan(fn, *args, budget=budget)
            assert e.value.smallest_reachable == 1.0
            continue
        chex.assert_trees_all_close(jax.grad(f)(*args), jax.grad(fn)(*args))
        p = only_plan(f)
        assert p.is_identity and p.num_nodes == 0 and p.segments == []
        assert jremat.Plan.from_json(p.to_json()) == p


def forward_only_loss(w, x):
    """A `while_loop` with a dynamic trip count: JAX has no reverse derivative of it."""
    n = jnp.sum(x > 0).astype(jnp.int32)
    _, y = jax.lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, jnp.tanh(c[1] @ w)), (0, x))
    return jnp.mean(y**2)


def test_program_without_reverse_derivative_runs_unchanged_at_budget_one():
    """Used only under `jax.linearize`, there is no backward pass to plan: budget 1.0 returns
    the function unchanged; a budget below 1 names the reason and budget=1.0."""
    w, x = jnp.eye(4) * 0.5, jnp.ones((2, 4))
    f = jremat.auto(forward_only_loss, budget=1.0)
    chex.assert_trees_all_close(
        jax.linearize(f, w, x)[1](w, x), jax.linearize(forward_only_loss, w, x)[1](w, x)
    )
    assert only_plan(f).is_identity
    # nothing can be rematerialized: the error of a program of no equations
    with pytest.raises(
        jremat.InfeasibleBudgetError, match=r"budget=0\.5 .*while_loop.*budget=1\.0"
    ):
        jremat.plan(forward_only_loss, w, x, budget=0.5)


# -- custom_jvp with a traced nondiff argument inside a scan -----------------------------------
def test_custom_jvp_nondiff_array_in_scan_is_named():
    import functools

    @functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
    def scaled(x, s):
        return jnp.tanh(x) * s

    @scaled.defjvp
    def _(s, primals, tangents):
        (x,), (t,) = primals, tangents
        return scaled(x, s), t * (1 - jnp.tanh(x) ** 2) * s

    def scanned(w, xs):
        def body(c, x):
            return scaled(c @ w, jnp.sum(x)), None

        c, _ = jax.lax.scan(body, jnp.ones((4, 8)), xs)
        return jnp.sum(c**2)

    f = jremat.auto(scanned, budget=0.7)
    with pytest.raises(
        TypeError, match=r"scanned uses a jax.custom_jvp inside a lax.scan.*nondiff"
    ):
        jax.grad(f)(jnp.eye(8) * 0.5, jnp.ones((6, 3)))


def _two_layer_mlp(n_layers=2):
    k = jax.random.split(jax.random.key(0), 5)
    params = [
        (jax.random.normal(k[i], (128, 256)) / 11, jax.random.normal(k[i + 2], (256, 128)) / 16)
        for i in range(n_layers)
    ]
    return params, jax.random.normal(k[4], (256, 128))


def _mlp_loss(params, x, n=None):
    for w1, w2 in params[:n]:
        x = x + jax.nn.gelu(x @ w1) @ w2
    return jnp.mean(x**2)


@pytest.mark.parametrize("budget", [0.5, 0.6])
def test_the_callers_grad_step_fits_as_well_as_value_and_grad(budget):
    """XLA schedules `jit(grad)` and `jit(value_and_grad)` of one plan apart (on this MLP under
    per-layer remat, jax 0.10: 1,048,576 vs 917,504 temp bytes): a plan is returned only where
    both steps fit, and the smallest budget an error states is one where both do."""
    params, x = _two_layer_mlp()
    f = jremat.auto(_mlp_loss, budget=budget)
    grad_base = temp_bytes(jax.grad(_mlp_loss), params, x)
    value_base = temp_bytes(jax.value_and_grad(_mlp_loss), params, x)
    try:
        grad_temp = temp_bytes(jax.grad(f), params, x)
    except jremat.InfeasibleBudgetError as e:
        assert e.smallest_reachable > budget
        again = jremat.auto(_mlp_loss, budget=e.smallest_reachable)
        grad_temp = temp_bytes(jax.grad(again), params, x)
        budget, f = e.smallest_reachable, again
    assert grad_temp <= budget * grad_base
    assert temp_bytes(jax.value_and_grad(f), params, x) <= budget * value_base
    assert only_plan(f).measured_temp_bytes >= grad_temp


def test_static_python_int_through_the_callers_jit():
    """A Python int the caller's jit keeps static (a slice bound here) is closed over and
    planned per value, like bools and strings."""
    params, x = _two_layer_mlp(3)
    f = jremat.auto(_mlp_loss, budget=0.7)
    for n in (3, 2):
        step = jax.jit(jax.grad(f), static_argnums=2)
        # the tolerance of this file's other comparisons with the unrematerialized step: the
        # rewrite's barrier on segment outputs changes XLA's fusions (float rounding, 4e-9
        # absolute on gradients of ~1e-4 here)
        chex.assert_trees_all_close(
            step(params, x, n),
            jax.jit(jax.grad(_mlp_loss), static_argnums=2)(params, x, n),
            rtol=1e-5,
            atol=1e-7,
        )
    assert len(f.plans) == 2


# -- the arguments the caller differentiates ---------------------------------------------------
def test_plans_the_arguments_the_callers_grad_differentiates(chain):
    """`jit(grad(auto(loss), argnums=1))`: the backward pass that runs is the one w.r.t. the
    input, so that is the one planned and verified (not argnums=0's)."""
    loss, (params, x) = chain
    f = jremat.auto(loss, budget=0.5, solver="chain", max_rounds=1)
    step = jax.grad(f, argnums=1)
    got = temp_bytes(step, params, x)
    p = only_plan(f)
    assert p.baseline_temp_bytes == pytest.approx(
        temp_bytes(jax.grad(loss, argnums=1), params, x), rel=0.01
    )
    assert got <= p.budget_temp_bytes
    chex.assert_trees_all_close(
        jax.jit(step)(params, x), jax.grad(loss, argnums=1)(params, x), rtol=1e-5, atol=1e-7
    )


def test_argnums_given_and_the_caller_differentiating_others_raises(chain):
    loss, (params, x) = chain
    f = jremat.auto(loss, budget=0.5, argnums=0)
    with pytest.raises(ValueError, match=r"argnums=0.*argument\(s\) \(1,\).*argnums=1"):
        jax.eval_shape(jax.grad(f, argnums=1), params, x)
    with pytest.raises(ValueError, match=r"argnums=\(0, 1\)"):
        jax.eval_shape(jax.grad(f, argnums=(0, 1)), params, x)
    assert f.plans == {}


def test_given_argnums_with_an_argument_of_a_jit_inside_the_callers_grad(chain):
    """`grad(lambda w: jit(lambda x: f(w, x))(x * w.sum()))`: the input is a value of the inner
    jit's trace, differentiated through it by the grad outside, which cannot be seen at the
    call; the argnums=(0, 1) given is what runs, so it is planned, not refused."""
    loss, (params, x) = chain
    f = jremat.auto(loss, budget=1.0, argnums=(0, 1), verify=False)

    def outer(loss_fn):
        return lambda p: jax.jit(lambda x2: loss_fn(p, x2))(x * jax.tree.leaves(p)[0].sum())

    chex.assert_trees_all_close(jax.grad(outer(f))(params), jax.grad(outer(loss))(params))
    # plan keys: (signature, static arguments, argnums, vmaps)
    assert [k[2] for k in f.plans] == [(0, 1)]
