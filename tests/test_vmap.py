"""`jremat.auto` under `jax.vmap` (issue 28): per-example gradients run the vmapped step, so
the plan is verified, and its budget measured, on that step at the real batch size and axes.
Each test compiles the caller's own step and checks *its* temp bytes against the budget."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
from models import mlp_chain

import jremat
from jremat._src.base.batching import batching_of

BUDGET = 0.5
RTOL = 1e-5

_M = mlp_chain(depth=6, width=8, batch=8 * 16)
LOSS = _M.loss  # a per-example loss: 16 rows of width 8 through 6 layers
PARAMS, XS = _M.args[0], _M.args[1].reshape(8, 16, 8)  # 8 examples


def auto(loss=LOSS):
    # one round of the search: these tests are of what is planned (the batched step), not of
    # how far the search gets below the budget (its own tests); it halves the file's time
    return jremat.auto(loss, budget=BUDGET, plan_dir=False, max_rounds=1)


def temp_bytes(step, *args) -> int:
    return jax.jit(step).lower(*args).compile().memory_analysis().temp_size_in_bytes


def assert_runs_within_budget(step_of, f, *args, loss=LOSS) -> jremat.Plan:
    """The caller's step `step_of(f)` compiles within BUDGET of `step_of(loss)` (no remat),
    and its plan's figures are those of the batched step, not of one example. The plan."""
    ran, unremat = temp_bytes(step_of(f), *args), temp_bytes(step_of(loss), *args)
    assert ran <= BUDGET * unremat, (ran, unremat, ran / unremat)
    (p,) = f.plans.values()
    assert not p.is_identity
    # measured on the batched step (one example's program is a few percent of it)
    assert p.baseline_temp_bytes >= 0.9 * unremat, (p.baseline_temp_bytes, unremat)
    assert p.measured_temp_bytes <= p.budget_temp_bytes <= BUDGET * p.baseline_temp_bytes
    return p


_PLANNED: dict[str, object] = {}


def per_example_wrapper():
    """`auto()` planned once for `vmap(grad)` over the 8 examples (shared by the variants)."""
    if "f" not in _PLANNED:
        f = auto()
        jax.eval_shape(jax.vmap(jax.grad(f), in_axes=(None, 0)), PARAMS, XS)
        _PLANNED["f"] = f
    return _PLANNED["f"]


def per_example_grads(h):
    return jax.vmap(jax.grad(h), in_axes=(None, 0))


class VmapTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_per_example_gradients_plan_the_vmapped_step(self):
        """`vmap(grad(auto_loss))` with unbatched parameters (in_axes=(None, 0)): gradients
        as without remat, and the step that runs within the budget of its own
        unrematerialized temp."""
        f = auto()  # planned at its first call, under the variant
        grads = self.variant(per_example_grads(f))(PARAMS, XS)
        want = self.variant(per_example_grads(LOSS))(PARAMS, XS)  # compiled alike
        chex.assert_trees_all_close(grads, want, rtol=RTOL, atol=1e-7)
        p = assert_runs_within_budget(per_example_grads, f, PARAMS, XS)
        assert any("under vmap(size=8, batch axis 0 of 1/13" in n for n in p.notes), p.notes

    @chex.variants(with_jit=True, without_jit=True)
    def test_vmap_of_value_and_grad(self):
        f = per_example_wrapper()
        step = lambda h: jax.vmap(jax.value_and_grad(h), in_axes=(None, 0))  # noqa: E731
        (v, g), (v0, g0) = (self.variant(step(h))(PARAMS, XS) for h in (f, LOSS))
        chex.assert_trees_all_close(v, v0, rtol=RTOL)
        chex.assert_trees_all_close(g, g0, rtol=RTOL, atol=1e-7)
        assert_runs_within_budget(step, f, PARAMS, XS)
        assert len(f.plans) == 1  # the same vmaps as vmap(grad): the same plan


def test_a_new_batch_size_is_a_new_plan():
    f = per_example_wrapper()
    half = XS[:4]
    grads, want = (jax.jit(per_example_grads(h))(PARAMS, half) for h in (f, LOSS))
    chex.assert_trees_all_close(grads, want, rtol=RTOL, atol=1e-7)
    assert len(f.plans) == 2
    small, large = sorted(f.plans.values(), key=lambda p: p.baseline_temp_bytes)
    assert small.baseline_temp_bytes < large.baseline_temp_bytes
    assert len(f.plan_cache.plans) == 2  # and a new key in the plan cache
    unremat = temp_bytes(per_example_grads(LOSS), PARAMS, half)
    assert temp_bytes(per_example_grads(f), PARAMS, half) <= BUDGET * unremat


def test_batch_axis_1_and_nested_vmaps():
    """Two vmaps (4 x 2 examples), the outer one over axis 1: planned for the 8 examples."""
    xs = XS.reshape(4, 2, 16, 8).transpose(1, 0, 2, 3)  # [2, 4, ...]: the outer batch on axis 1
    step = lambda h: jax.vmap(per_example_grads(h), in_axes=(None, 1))  # noqa: E731
    f = auto()
    grads, want = (jax.jit(step(h))(PARAMS, xs) for h in (f, LOSS))
    chex.assert_trees_all_close(grads, want, rtol=RTOL, atol=1e-7)
    p = assert_runs_within_budget(step, f, PARAMS, xs)
    assert any(
        "vmap(size=4, batch axis 1" in n and "vmap(size=2, batch axis 0" in n for n in p.notes
    )


def test_vmap_inside_grad():
    """`grad` of a vmapped mean: the step is the gradient of the batch's loss."""
    f = auto()
    step = lambda h: jax.grad(lambda p, x: jax.vmap(h, in_axes=(None, 0))(p, x).mean())  # noqa: E731
    grads, want = (jax.jit(step(h))(PARAMS, XS) for h in (f, LOSS))
    chex.assert_trees_all_close(grads, want, rtol=RTOL, atol=1e-7)
    assert_runs_within_budget(step, f, PARAMS, XS)


# -- which vmaps are seen (no compiles) ----------------------------------------------------------
def _seen(transform, *args):
    box = {}

    def probe(p, x):
        box["b"] = batching_of((p, x), (0,))
        return jnp.sum(p * x)

    jax.eval_shape(transform(probe), *args)
    return box["b"]


def test_batching_of_reads_sizes_axes_and_the_gradients_place():
    p, xs = jnp.ones(3), jnp.ones((4, 2, 3))
    b = _seen(lambda g: jax.vmap(jax.grad(g), in_axes=(None, 1)), p, xs)
    ((lv,),) = (b.levels,)
    assert (lv.size, lv.in_dims, lv.outside_grad) == (2, (None, 1), True)
    b = _seen(lambda g: jax.grad(lambda p, x: jax.vmap(g, (None, 0))(p, x[:, 0]).sum()), p, xs)
    assert [(lv.size, lv.in_dims, lv.outside_grad) for lv in b.levels] == [(4, (None, 0), False)]
    b = _seen(lambda g: jax.vmap(jax.vmap(jax.grad(g), (None, 0)), (None, 1)), p, xs)
    assert [(lv.size, lv.in_dims, lv.outside_grad) for lv in b.levels] == [
        (2, (None, 1), True),
        (4, (None, 0), True),
    ]
    assert b.global_args((jax.ShapeDtypeStruct((3,), jnp.float32),) * 2)[1].shape == (4, 2, 3)
    assert _seen(jax.grad, p, xs[0, 0]) is None
