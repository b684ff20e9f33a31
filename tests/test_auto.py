"""The decorator `jremat.auto` on plain loss functions: its forms, one plan per argument
signature, gradients equal to the undecorated function's (with and without `jax.jit`), and
errors for bad keywords. (Budgets met on the test models: `test_plan.py`; Flax targets:
`test_flax_linen.py`, `test_flax_nnx.py`.)"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from models import SOLVER

import jremat


def _loss(p, x):
    """Three residual MLP layers: small, but with activations worth rematerializing."""
    for i in range(3):
        with jax.named_scope(f"layer_{i}"):
            x = x + jnp.tanh(x @ p[0]) @ p[1]
    return jnp.mean(x**2)


W = (jnp.ones((8, 32)) / 8 + jnp.arange(256.0).reshape(8, 32) / 2**15, jnp.ones((32, 8)) / 32)
X = jnp.linspace(-1, 1, 256 * 8).reshape(256, 8)

#: A budget the cost model reaches with a plan that is not the identity (so the gradients
#: below go through checkpointed segments). The tests plan with `verify=False` (the cost
#: model's plan, no verification compiles): what is checked here does not depend on how the
#: plan was chosen; verified plans of `jremat.auto` are tested in `test_plan.py`.
BUDGET = 0.7
OPTIONS = dict(budget=BUDGET, solver=SOLVER, verify=False)


def _count_plans(wrapped, monkeypatch) -> list:
    """Record each signature `wrapped` plans (its plan cache's `get`, called once per new
    signature)."""
    calls = []
    cache = wrapped.plan_cache
    get = cache.get

    def counting_get(graph, *args, **kwargs):
        calls.append(graph.fingerprint)
        return get(graph, *args, **kwargs)

    monkeypatch.setattr(cache, "get", counting_get)
    return calls


# -- forms ------------------------------------------------------------------------------------
def test_decorator_without_parentheses():
    @jremat.auto
    def loss(w, x):
        """doc"""
        return _loss(w, x)

    assert loss.__name__ == "loss" and loss.__doc__ == "doc" and loss.plans == {}
    assert callable(loss.plan_cache.get)


def test_decorator_with_parentheses_and_direct_call():
    @jremat.auto(**OPTIONS)
    def loss(w, x):
        return _loss(w, x)

    direct = jremat.auto(_loss, **OPTIONS)
    assert loss.__name__ == "loss" and direct.__name__ == "_loss"
    assert loss.plans == {} and direct.plans == {}  # nothing planned before the first call
    want = _loss(W, X)
    np.testing.assert_allclose(loss(W, X), want, rtol=1e-6)
    np.testing.assert_allclose(direct(W, X), want, rtol=1e-6)
    ((p1,), (p2,)) = loss.plans.values(), direct.plans.values()
    assert p1.budget == p2.budget == BUDGET
    assert p1.segments == p2.segments  # the same options: the same plan


# -- planning once per signature ------------------------------------------------------------------
def test_plans_once_per_signature_and_again_for_a_new_shape(monkeypatch):
    wrapped = jremat.auto(_loss, **OPTIONS)
    planned = _count_plans(wrapped, monkeypatch)
    wrapped(W, X)
    # other values, same shapes and dtypes: the plan is reused
    wrapped(jax.tree.map(lambda a: 2 * a, W), X + 1)
    jax.grad(wrapped)(W, X)  # under a transformation too: only shapes count
    assert len(planned) == 1 and len(wrapped.plans) == 1
    wrapped(W, X[:64])  # a new batch size: planned again
    assert len(planned) == 2 and len(wrapped.plans) == 2
    assert planned[0] != planned[1]  # a different program
    wrapped(W, X)  # back to the first signature: no new plan
    wrapped(W, X[:64] * 3)
    assert len(planned) == 2 and len(wrapped.plans) == 2
    wrapped(W, X.astype(jnp.bfloat16))  # a new dtype: a new signature
    assert len(planned) == 3 and len(wrapped.plans) == 3


# -- gradients ---------------------------------------------------------------------------------
_WRAPPED: dict[str, object] = {}


def _planned_wrapper():
    """`jremat.auto(_loss, **OPTIONS)`, planned once for all variants: for the step they run,
    which differentiates both arguments."""
    if "w" not in _WRAPPED:
        wrapped = jremat.auto(_loss, **OPTIONS)
        jax.eval_shape(jax.value_and_grad(wrapped, argnums=(0, 1)), W, X)
        (p,) = wrapped.plans.values()
        assert not p.is_identity  # the gradients go through checkpointed segments
        _WRAPPED["w"] = wrapped
    return _WRAPPED["w"]


class AutoGradientsTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_gradients_equal_the_undecorated_functions(self):
        wrapped = _planned_wrapper()
        value_and_grad = self.variant(jax.value_and_grad(wrapped, argnums=(0, 1)))
        v, g = value_and_grad(W, X)
        v0, g0 = jax.value_and_grad(_loss, argnums=(0, 1))(W, X)
        chex.assert_trees_all_close(v, v0, rtol=1e-5)
        chex.assert_trees_all_close(g, g0, rtol=1e-5, atol=1e-7)
        assert len(wrapped.plans) == 1  # the variant reused the plan

    @chex.variants(with_jit=True, without_jit=True)
    def test_first_call_under_the_variant_plans_from_shapes(self):
        """The first call may come under `jit`/`grad` (tracers): planning uses shapes only."""
        wrapped = jremat.auto(_loss, **OPTIONS)
        g = self.variant(jax.grad(wrapped))(W, X)
        chex.assert_trees_all_close(g, jax.grad(_loss)(W, X), rtol=1e-5, atol=1e-7)
        assert len(wrapped.plans) == 1


# -- errors --------------------------------------------------------------------------------------
BAD_KEYWORDS = [
    ({"budjet": 0.4}, TypeError, "budjet"),  # a misspelt keyword
    ({"budget": 1.5}, ValueError, "budget"),
    ({"budget": "lots"}, ValueError, "budget"),
    ({"verify": "yes"}, TypeError, "verify"),
    ({"max_rounds": 0}, ValueError, "max_rounds"),
    ({"max_rounds": 2.0}, TypeError, "max_rounds"),
    ({"solver": "magic"}, ValueError, "solver"),
    ({"offload": "yes"}, TypeError, "offload"),
    ({"mesh": 3}, TypeError, "mesh"),
    ({"in_shardings": 5}, TypeError, "in_shardings"),
]


@pytest.mark.parametrize(
    "kwargs, exc, name",
    BAD_KEYWORDS,
    ids=[f"{next(iter(k))}={v!r}" for k, *_ in BAD_KEYWORDS for v in k.values()],
)
def test_bad_keyword_is_named_in_the_error(kwargs, exc, name):
    """Raised when the function is decorated (before any call), naming the keyword."""
    with pytest.raises(exc, match=name):
        jremat.auto(**kwargs)(_loss)  # as a decorator
    with pytest.raises(exc, match=name):
        jremat.auto(_loss, **kwargs)


def test_keyword_arguments_at_call_time_are_refused_with_the_functions_name():
    wrapped = jremat.auto(_loss, **OPTIONS)
    with pytest.raises(TypeError, match="_loss.*keyword"):
        wrapped(W, x=X)
    assert wrapped.plans == {}


def test_disabled_runs_a_decorated_function_as_written_and_plans_nothing():
    """`jremat.disabled()` switches `auto` off on plain functions too: the call is the
    undecorated function's (same value and gradients) and no plan is made; outside the
    context the same wrapper plans as usual."""
    wrapped = jremat.auto(_loss, **OPTIONS)
    with jremat.disabled():
        chex.assert_trees_all_close(wrapped(W, X), _loss(W, X))
        chex.assert_trees_all_close(jax.grad(wrapped)(W, X), jax.grad(_loss)(W, X))
    assert len(wrapped.plans) == 0
    wrapped(W, X)
    assert len(wrapped.plans) == 1
