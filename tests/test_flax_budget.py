"""A decorated Flax block's budget, checked on the compiled training step of a model built from it.

For a block, a budget bounds its *kept bytes*: what the block holds from its forward to its
backward pass while the rest of the model runs (docs/design.md#flax-blocks). In a stack of
identical blocks each block adds its kept bytes to the step's temp, so the per-block growth of
the real step's compiled temp (`jit(value_and_grad(loss))` of the model's training loss, deep
stack minus shallow stack, over the blocks added) is the kept bytes as that program holds them.
With every block decorated at budget f, that growth must be at most f times the undecorated
stack's growth, as a function's compiled temp must be at most f times its unrematerialized
temp. Gradients are those of the undecorated model.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jremat

BUDGET = 0.5
DEPTHS = (2, 4)
WIDTH, HIDDEN, BATCH = 16, 64, 256
X = jax.random.normal(jax.random.key(2), (BATCH, WIDTH))


def _assert_close(got, want, tol=1e-5):
    scale = max(float(jnp.max(jnp.abs(w))) for w in jax.tree.leaves(want))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol * scale)


# -- linen -----------------------------------------------------------------------------------
class LinenBlock(nn.Module):
    """x + Dense(gelu(Dense(LayerNorm(x)))); (B, D) -> (B, D)."""

    @nn.compact
    def __call__(self, x):
        h = nn.gelu(nn.Dense(HIDDEN)(nn.LayerNorm()(x)))
        return x + nn.Dense(x.shape[-1])(h)


LINEN_PLANNED = jremat.auto(LinenBlock, budget=BUDGET, max_rounds=1)


class LinenStack(nn.Module):
    block: type
    depth: int

    @nn.compact
    def __call__(self, x):
        for i in range(self.depth):
            x = self.block(name=f"block{i}")(x)
        return nn.Dense(4)(x)


def _linen_step(block, depth):
    """(compiled temp bytes of the training step, gradients) of a `depth`-block stack."""
    model = LinenStack(block, depth)
    params = jax.jit(model.init)(jax.random.key(0), X)["params"]

    def loss(params, x):
        return jnp.mean(model.apply({"params": params}, x) ** 2)

    return jremat.measure(loss, params, X).temp_bytes, jax.grad(loss)(params, X)


def test_linen_stack_keeps_at_most_the_budget_per_block():
    plain = {d: _linen_step(LinenBlock, d) for d in DEPTHS}
    planned = {d: _linen_step(LINEN_PLANNED, d) for d in DEPTHS}
    for d in DEPTHS:
        _assert_close(planned[d][1], plain[d][1])
    per_block = lambda t: (t[DEPTHS[1]][0] - t[DEPTHS[0]][0]) / (DEPTHS[1] - DEPTHS[0])  # noqa: E731
    assert per_block(plain) > 0
    assert per_block(planned) <= BUDGET * per_block(plain), (per_block(planned), per_block(plain))
    (plan,) = LINEN_PLANNED.plan_cache.plans.values()
    assert plan.measured_temp_bytes <= BUDGET * plan.baseline_temp_bytes


# -- NNX -------------------------------------------------------------------------------------
class NnxBlock(nnx.Module):
    """x + Linear(gelu(Linear(LayerNorm(x)))); (B, D) -> (B, D)."""

    def __init__(self, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)
        self.up = nnx.Linear(WIDTH, HIDDEN, rngs=rngs)
        self.down = nnx.Linear(HIDDEN, WIDTH, rngs=rngs)

    def __call__(self, x):
        return x + self.down(nnx.gelu(self.up(self.norm(x))))


NNX_PLANNED = jremat.auto(NnxBlock, budget=BUDGET, max_rounds=1)


class NnxStack(nnx.Module):
    def __init__(self, block: type, depth: int, rngs: nnx.Rngs):
        self.blocks = nnx.List([block(rngs) for _ in range(depth)])
        self.head = nnx.Linear(WIDTH, 4, rngs=rngs)

    def __call__(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _nnx_loss(model, x):
    return jnp.mean(model(x) ** 2)


def _nnx_step(block, depth):
    model = NnxStack(block, depth, nnx.Rngs(0))
    step = nnx.jit(lambda m, x: nnx.value_and_grad(_nnx_loss)(m, x))
    temp = step.lower(model, X).compile().memory_analysis().temp_size_in_bytes
    return temp, nnx.state(step(model, X)[1], nnx.Param)


def test_nnx_stack_keeps_at_most_the_budget_per_block():
    plain = {d: _nnx_step(NnxBlock, d) for d in DEPTHS}
    planned = {d: _nnx_step(NNX_PLANNED, d) for d in DEPTHS}
    for d in DEPTHS:
        _assert_close(planned[d][1], plain[d][1])
    per_block = lambda t: (t[DEPTHS[1]][0] - t[DEPTHS[0]][0]) / (DEPTHS[1] - DEPTHS[0])  # noqa: E731
    assert per_block(plain) > 0
    assert per_block(planned) <= BUDGET * per_block(plain), (per_block(planned), per_block(plain))
    (plan,) = NNX_PLANNED.plan_cache.plans.values()
    assert plan.measured_temp_bytes <= BUDGET * plan.baseline_temp_bytes
