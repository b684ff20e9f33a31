"""`jremat.auto` on Flax NNX modules and functions: state, gradients, RNG, memory, scans.

The held-out module (`Block`: Linear, GELU, Dropout, Linear, BatchNorm, residual) is planned
once with verification (`PLANNED`) and reused; `WHOLE` (verify=False: one whole-block
checkpoint, nothing compiled while planning) serves tests of exactness only. Gradients are
compared to within 1e-5 of each tree's largest gradient (f32).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jremat
from jremat._src.frontends import cache as plan_cache
from jremat._src.frontends.blocks import disabled
from jremat._src.plan.plan import KEEP, SAVE_NAMES, Plan, Segment

F32_TOL = 1e-5


class Block(nnx.Module):
    """A held-out residual block: x + BN(Linear(dropout(gelu(Linear(x))))); (B, D) -> (B, D)."""

    def __init__(self, d: int, rngs: nnx.Rngs, width: int = 64):
        self.up = nnx.Linear(d, width, rngs=rngs)
        self.drop = nnx.Dropout(0.2, rngs=rngs)
        self.down = nnx.Linear(width, d, rngs=rngs)
        self.bn = nnx.BatchNorm(d, momentum=0.8, rngs=rngs)

    def __call__(self, x):
        return x + self.bn(self.down(self.drop(nnx.gelu(self.up(x)))))


PLANNED = jremat.auto(Block, budget=0.4, max_rounds=1)
WHOLE = jremat.auto(Block, budget=0.4, verify=False, prevent_cse=False)


class NnxRemat(Block):
    __call__ = nnx.remat(Block.__call__)


class Model(nnx.Module):
    def __init__(self, block: type, rngs: nnx.Rngs):
        self.blocks = nnx.List([block(16, rngs) for _ in range(2)])
        self.head = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


X = jax.random.normal(jax.random.key(2), (128, 16))


def make(block):
    return Model(block, nnx.Rngs(params=0, dropout=1))


def loss_fn(model, x):
    return jnp.mean(model(x) ** 2)


@nnx.jit
def train_step(model, optimizer, x):
    loss, grads = nnx.value_and_grad(loss_fn)(model, x)
    optimizer.update(model, grads)
    return loss, grads


def assert_trees_close(got, want, tol=F32_TOL):
    got_leaves, want_leaves = jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    scale = max(float(jnp.max(jnp.abs(x))) for x in want_leaves)
    for g, w in zip(got_leaves, want_leaves, strict=True):
        np.testing.assert_allclose(
            np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=tol, atol=tol * scale
        )


def _run(block, steps=2):
    model = make(block)
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    out = [train_step(model, opt, X) for _ in range(steps)]
    return model, [float(loss) for loss, _ in out], out[-1][1]


@pytest.fixture(scope="module")
def reference():
    return _run(Block)


def test_state_gradients_rng_and_batch_stats_equal_undecorated(reference):
    model0, losses0, grads0 = reference
    model1, losses1, grads1 = _run(PLANNED)
    # the same state paths and class name: checkpoints load either way
    assert type(model1.blocks[0]).__name__ == "Block"
    assert jax.tree_util.tree_structure(nnx.state(model1)) == jax.tree_util.tree_structure(
        nnx.state(model0)
    )
    np.testing.assert_allclose(losses1, losses0, rtol=F32_TOL)
    assert losses1[1] < losses1[0]
    assert_trees_close(grads1, grads0)
    assert_trees_close(nnx.state(model1, nnx.Param), nnx.state(model0, nnx.Param))
    assert_trees_close(nnx.state(model1, nnx.BatchStat), nnx.state(model0, nnx.BatchStat))
    # dropout streams advanced exactly as without remat (two steps, two blocks)
    counts = nnx.state(model1, nnx.RngCount)
    jax.tree_util.tree_map(np.testing.assert_array_equal, counts, nnx.state(model0, nnx.RngCount))
    (plan,) = PLANNED.plan_cache.plans.values()
    assert plan.fingerprint and PLANNED.plan_cache.solves == 1


def three_kinds_plan(f, block, avals, ct_mask, spec, **kw):
    """A hand-made plan with every kind of segment: names saving two values, keep, and a
    built-in policy (stands in for `plan_block`; nothing compiled)."""
    n = block.num_nodes
    a, b = n // 3, 2 * n // 3
    outs = [o for node in block.nodes[:a] for o in node.outputs if block.values[o].is_float]
    segments = [
        Segment(0, a, SAVE_NAMES, outs[-2:]),
        Segment(a, b, KEEP),
        Segment(b, n, "dots_saveable"),
    ]
    return Plan(segments, block.fingerprint, n, solver="test").annotate(block)


def test_multi_segment_plans_are_exact(reference, monkeypatch):
    monkeypatch.setattr(plan_cache, "plan_block", three_kinds_plan)
    cls = jremat.auto(Block, budget=0.4)
    model1, losses1, grads1 = _run(cls)
    model0, losses0, grads0 = reference
    np.testing.assert_allclose(losses1, losses0, rtol=F32_TOL)
    assert_trees_close(grads1, grads0)
    assert_trees_close(nnx.state(model1, nnx.BatchStat), nnx.state(model0, nnx.BatchStat))
    (plan,) = cls.plan_cache.plans.values()
    assert [s.policy for s in plan.segments] == [SAVE_NAMES, KEEP, "dots_saveable"]


def test_equal_nnx_remat(reference):
    model0, losses0, grads0 = reference
    model1, losses1, grads1 = _run(NnxRemat)
    np.testing.assert_allclose(losses1, losses0, rtol=F32_TOL)
    assert_trees_close(grads1, grads0)
    assert_trees_close(nnx.state(model1, nnx.BatchStat), nnx.state(model0, nnx.BatchStat))


def test_compiled_memory_lower_than_undecorated_and_block_within_budget():
    model = make(PLANNED)

    def temp():
        step = nnx.jit(lambda m, x: nnx.value_and_grad(loss_fn)(m, x))
        return step.lower(model, X).compile().memory_analysis().temp_size_in_bytes

    with disabled():
        plain = temp()
    assert temp() < plain
    (plan,) = PLANNED.plan_cache.plans.values()
    assert plan.measured_temp_bytes <= 0.4 * plan.baseline_temp_bytes
    assert PLANNED.plan_cache.solves == 1


def test_function_taking_modules_with_static_argnums():
    @jremat.auto(budget=0.5, verify=False, static_argnums=(2,))
    def apply(block, x, twice):
        return block(block(x)) if twice else block(x)

    def plain(block, x, twice):
        return block(block(x)) if twice else block(x)

    results = []
    for f in (plain, apply):
        block = Block(16, nnx.Rngs(params=0, dropout=1))
        g = nnx.jit(nnx.grad(lambda b, x, f=f: jnp.sum(f(b, x, True) ** 2)))(block, X)
        results.append((g, nnx.state(block, nnx.BatchStat), nnx.state(block, nnx.RngCount)))
    assert_trees_close(results[1][0], results[0][0])
    assert_trees_close(results[1][1], results[0][1])
    jax.tree_util.tree_map(np.testing.assert_array_equal, results[1][2], results[0][2])
    assert len(apply.plan_cache.plans) == 1


def test_inside_nnx_scan_matches_undecorated():
    class Stack(nnx.Module):
        def __init__(self, block, rngs):
            @nnx.split_rngs(splits=3)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def create(rngs):
                return block(16, rngs)

            self.blocks = create(rngs)

        def __call__(self, x):
            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def body(x, block):
                return block(x)

            return body(x, self.blocks)

    results = []
    for block in (Block, WHOLE):
        stack = Stack(block, nnx.Rngs(params=0, dropout=1))
        loss, g = nnx.jit(nnx.value_and_grad(loss_fn))(stack, X)
        results.append((loss, g, nnx.state(stack, nnx.BatchStat), nnx.state(stack, nnx.RngCount)))
    assert results[0][1]["blocks"]["up"]["kernel"][...].shape == (3, 16, 64)
    for loss, g, stats, counts in results[1:]:
        np.testing.assert_allclose(loss, results[0][0], rtol=F32_TOL)
        assert_trees_close(g, results[0][1])
        assert_trees_close(stats, results[0][2])
        jax.tree_util.tree_map(np.testing.assert_array_equal, counts, results[0][3])


def test_a_second_batch_size_replans():
    cache = WHOLE.plan_cache
    before = cache.solves
    model = make(WHOLE)
    grad = nnx.jit(nnx.grad(loss_fn))
    for n in (32, 48, 32):
        grad(model, X[:n])
    assert cache.solves - before == 2


def test_errors():
    with pytest.raises(TypeError, match="module instance Block"):
        jremat.auto(Block(16, nnx.Rngs(0)))
    with pytest.raises(ValueError, match=r"names `self` \(position 0\).*self=0, x=1"):
        jremat.auto(Block, static_argnums=0)
    with pytest.raises(ValueError, match="linen lifting filters"):
        jremat.auto(Block, variables="params")

    @jremat.auto(budget=0.5, verify=False, static_argnums=(1,))
    def apply(block, x):  # a function: positions count its arguments from 0
        return block(x)

    with pytest.raises(
        ValueError, match=r"'x' \(position 1 of .*apply\).*array float32\[128, 16\]"
    ):
        apply(Block(16, nnx.Rngs(0)), X)


# -- the write-back touches only what the call changed (issue 47) -------------------------------
class Stateless(nnx.Module):
    """A block whose call changes no state (no RNG draws, no batch statistics)."""

    def __init__(self, d: int, rngs: nnx.Rngs, width: int = 64):
        self.up = nnx.Linear(d, width, rngs=rngs)
        self.norm = nnx.LayerNorm(width, rngs=rngs)
        self.down = nnx.Linear(width, d, rngs=rngs)

    def __call__(self, x):
        return x + self.down(nnx.gelu(self.norm(self.up(x))))


STATELESS = jremat.auto(Stateless, budget=0.5, verify=False)


def _closed_over_loss(graphdef, kind):
    """A loss whose model is merged under `value_and_grad` and called in a plain JAX loop or
    branch body (the model closed over, its variables at the outer trace level)."""

    def loss(state, xs):
        model = nnx.merge(graphdef, state)
        if kind == "scan":
            body = lambda c, x: (c + jnp.mean(model(x) ** 2), None)  # noqa: E731
            return jax.lax.scan(body, 0.0, xs)[0]
        if kind == "fori_loop":
            body = lambda i, c: c + jnp.mean(model(xs[i]) ** 2)  # noqa: E731
            return jax.lax.fori_loop(0, xs.shape[0], body, 0.0)
        return jax.lax.cond(
            xs[0, 0, 0] > -10.0, lambda x: jnp.mean(model(x) ** 2), lambda x: 0.0 * x.sum(), xs[0]
        )

    return loss


@pytest.mark.parametrize("kind", ["scan", "fori_loop", "cond"])
def test_module_closed_over_by_a_jax_loop_or_branch_body(kind):
    """An NNX module under `auto` called in a `lax.scan`/`fori_loop`/`cond` body, its
    parameters merged under `jax.value_and_grad` outside the body: the write-back leaves the
    parameters alone (before: `TraceContextError: Cannot mutate Param from a different trace
    level`), and value and gradients equal the undecorated module's."""
    xs = jax.random.normal(jax.random.key(3), (3, 64, 16))
    results = []
    for block in (Stateless, STATELESS):
        graphdef, state = nnx.split(block(16, nnx.Rngs(0)))
        results.append(jax.jit(jax.value_and_grad(_closed_over_loss(graphdef, kind)))(state, xs))
    (v0, g0), (v1, g1) = results
    np.testing.assert_allclose(v1, v0, rtol=F32_TOL)
    assert_trees_close(g1, g0)


def test_state_a_call_changes_is_still_written_back_in_a_scan_body():
    """Split/merge in a `lax.scan` body, the state carried: the call's RNG counts and batch
    statistics are written back (only they), equal to the undecorated module's, and the
    compiled step keeps less than the undecorated one."""
    xs = jax.random.normal(jax.random.key(4), (3, 128, 16))

    def run(block):
        graphdef, params, rest = nnx.split(block(16, nnx.Rngs(params=0, dropout=1)), nnx.Param, ...)

        def loss(params, rest, xs):
            def body(carry, x):
                total, rest = carry
                model = nnx.merge(graphdef, params, rest)
                total = total + jnp.mean(model(x) ** 2)
                return (total, nnx.split(model, nnx.Param, ...)[2]), None

            (total, rest), _ = jax.lax.scan(body, (0.0, rest), xs)
            return total, rest

        step = jax.jit(jax.value_and_grad(loss, has_aux=True))
        temp = step.lower(params, rest, xs).compile().memory_analysis().temp_size_in_bytes
        return step(params, rest, xs), temp

    ((v0, rest0), g0), temp0 = run(Block)
    ((v1, rest1), g1), temp1 = run(PLANNED)
    np.testing.assert_allclose(v1, v0, rtol=F32_TOL)
    assert_trees_close(g1, g0)
    stats = [nnx.State(r).filter(nnx.BatchStat) for r in (rest1, rest0)]
    assert_trees_close(*stats)
    jax.tree_util.tree_map(
        np.testing.assert_array_equal,
        nnx.State(rest1).filter(nnx.RngCount),
        nnx.State(rest0).filter(nnx.RngCount),
    )
    assert temp1 < temp0
