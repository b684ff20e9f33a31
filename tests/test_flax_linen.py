"""`jremat.auto` on Flax linen modules: paths, gradients, state, memory, scans, errors.

The held-out module (`Block`: LayerNorm, Dense, GELU, dropout, Dense, BatchNorm, residual) is
planned once with verification (`PLANNED`, a multi-segment plan) and reused by every test that
calls it with the same shapes; tests that only need the rewrite to be exact use
`verify=False` (one whole-block checkpoint, nothing compiled while planning). Gradients are
compared to within 1e-5 of each tree's largest gradient (f32): a Dense bias under BatchNorm
has a mathematically zero gradient whose float noise (1e-9) has no relative scale of its own.
"""

from __future__ import annotations

import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import errors as flax_errors

import jremat
from jremat._src.frontends import cache as plan_cache
from jremat._src.frontends.blocks import disabled
from jremat._src.plan.plan import KEEP, SAVE_NAMES, Plan, Segment

F32_TOL = 1e-5
KEYS = {"params": jax.random.key(0), "dropout": jax.random.key(1)}


class Block(nn.Module):
    """A held-out residual block: x + BN(Dense(dropout(gelu(Dense(LN(x)))))); (B, D) -> (B, D)."""

    width: int = 32

    @nn.compact
    def __call__(self, x, train: bool = True):
        h = nn.Dense(self.width)(nn.LayerNorm()(x))
        h = nn.Dropout(0.2, deterministic=not train)(nn.gelu(h))
        h = nn.Dense(x.shape[-1])(h)
        return x + nn.BatchNorm(use_running_average=not train, momentum=0.8)(h)


PLANNED = jremat.auto(Block, budget=0.4, static_argnums=(2,), max_rounds=1)
WHOLE = jremat.auto(Block, budget=0.4, static_argnames="train", verify=False)


class Model(nn.Module):
    """Two blocks and a head; `block` picks the block class. Blocks are named explicitly
    (`names`) where a model is compared with `nn.remat`, which renames auto-named blocks
    (`CheckpointBlock_0`) and so also changes their parameter paths and dropout streams."""

    block: type = Block
    names: bool = True

    @nn.compact
    def __call__(self, x, train: bool = True):
        for i in range(2):
            kw = {"name": f"block{i}"} if self.names else {}
            x = self.block(**kw)(x, train)
        return nn.Dense(4)(x)


X = jax.random.normal(jax.random.key(2), (64, 16))


def _init(model, x=X):
    return jax.jit(model.init)(KEYS, x)


def _loss(model):
    """A scalar loss over params and the input, with dropout and batch-norm updates."""

    def loss(params, x, stats):
        y, upd = model.apply(
            {"params": params, "batch_stats": stats},
            x,
            True,
            rngs={"dropout": jax.random.key(7)},
            mutable=["batch_stats"],
        )
        return jnp.mean(y**2), upd

    return loss


def _train(model, v, steps=2):
    """`steps` jitted optax SGD steps; returns (losses, last grads w.r.t. (params, x), params,
    batch_stats). (SGD: Adam would turn the noise-level gradient of a bias under BatchNorm
    into full-size steps.)"""
    opt = optax.sgd(0.1)
    grad_fn = jax.value_and_grad(_loss(model), argnums=(0, 1), has_aux=True)

    @jax.jit
    def step(params, stats, opt_state):
        (loss, upd), grads = grad_fn(params, X, stats)
        updates, opt_state = opt.update(grads[0], opt_state, params)
        return optax.apply_updates(params, updates), upd["batch_stats"], opt_state, loss, grads

    params, stats, state, losses = v["params"], v["batch_stats"], opt.init(v["params"]), []
    for _ in range(steps):
        params, stats, state, loss, grads = step(params, stats, state)
        losses.append(float(loss))
    return losses, grads, params, stats


def assert_trees_close(got, want, tol=F32_TOL):
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    scale = max(float(jnp.max(jnp.abs(x))) for x in jax.tree_util.tree_leaves(want))
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_allclose(
            np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=tol, atol=tol * scale
        )


@pytest.fixture(scope="module")
def variables():
    return _init(Model())


@pytest.fixture(scope="module")
def reference(variables):
    """The undecorated model's training run."""
    return _train(Model(), variables)


def _assert_runs_equal(got, want):
    np.testing.assert_allclose(got[0], want[0], rtol=F32_TOL)
    for g, w in zip(got[1:], want[1:], strict=True):  # grads, params, batch stats
        assert_trees_close(g, w)


def test_import_jremat_does_not_import_flax():
    code = "import sys, jremat; assert 'flax' not in sys.modules, sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_parameter_paths_unchanged():
    want = _init(Model(names=False))
    got = _init(Model(PLANNED, names=False))  # init is not planned
    assert "Block_0" in got["params"]  # not CheckpointBlock_0: checkpoints load either way
    jax.tree_util.tree_map(np.testing.assert_array_equal, got, want)
    renamed = jax.eval_shape(lambda: _init(Model(nn.remat(Block, static_argnums=(2,)), False)))
    assert "CheckpointBlock_0" in renamed["params"]
    assert PLANNED.__name__ == "Block" and PLANNED.__doc__ == Block.__doc__


def test_jitted_optax_train_step_gradients_and_state_equal_undecorated(variables, reference):
    got = _train(Model(PLANNED), variables)
    _assert_runs_equal(got, reference)
    assert got[0][1] < got[0][0]
    (plan,) = PLANNED.plan_cache.plans.values()
    assert sum(s.checkpointed for s in plan.segments) >= 1 and PLANNED.plan_cache.solves == 1


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


def test_multi_segment_plans_are_exact(variables, reference, monkeypatch):
    monkeypatch.setattr(plan_cache, "plan_block", three_kinds_plan)
    cls = jremat.auto(Block, budget=0.4, static_argnums=(2,))
    _assert_runs_equal(_train(Model(cls), variables), reference)
    (plan,) = cls.plan_cache.plans.values()
    assert [s.policy for s in plan.segments] == [SAVE_NAMES, KEEP, "dots_saveable"]


def test_equal_nn_remat(variables, reference):
    _assert_runs_equal(_train(Model(nn.remat(Block, static_argnums=(2,))), variables), reference)


def test_compiled_memory_lower_than_undecorated_and_block_within_budget(variables):
    def loss(model):
        f = _loss(model)
        return lambda params, x: f(params, x, variables["batch_stats"])[0]

    plain = jremat.measure(loss(Model()), variables["params"], X)
    remat = jremat.measure(loss(Model(PLANNED)), variables["params"], X)
    with disabled():  # the decorator switched off gives the undecorated program
        off = jremat.measure(loss(Model(PLANNED)), variables["params"], X)
    assert off.temp_bytes == plain.temp_bytes
    assert remat.temp_bytes < plain.temp_bytes
    (plan,) = PLANNED.plan_cache.plans.values()
    assert plan.measured_temp_bytes <= 0.4 * plan.baseline_temp_bytes  # the block's kept bytes
    assert PLANNED.plan_cache.solves == 1  # same shapes everywhere: planned once


def test_a_second_batch_size_replans(variables):
    cache = WHOLE.plan_cache
    before = cache.solves
    loss = _loss(Model(WHOLE))
    grad = jax.jit(jax.grad(lambda p, x: loss(p, x, variables["batch_stats"])[0]))
    for n in (32, 48, 32):
        grad(variables["params"], X[:n])
    assert cache.solves - before == 2
    sigs = list(cache.signatures.values())
    assert any("[32,16]" in s for s in sigs) and any("[48,16]" in s for s in sigs)


def test_inside_nn_scan_with_dropout_matches_undecorated():
    class Body(nn.Module):
        block: type

        @nn.compact
        def __call__(self, x, _):
            return self.block(name="block")(x, True), None

    def model(block):
        class Stack(nn.Module):
            @nn.compact
            def __call__(self, x):
                scan = nn.scan(
                    Body,
                    variable_axes={"params": 0, "batch_stats": 0},
                    split_rngs={"params": True, "dropout": True},
                    length=3,
                )
                return scan(block, name="layers")(x, None)[0]

        return Stack()

    v = model(Block).init(KEYS, X)
    assert v["params"]["layers"]["block"]["Dense_0"]["kernel"].shape == (3, 16, 32)

    def grads(m):
        def f(p, x):
            y, _ = m.apply(
                {**v, "params": p}, x, rngs={"dropout": jax.random.key(3)}, mutable=["batch_stats"]
            )
            return jnp.mean(y**2)

        return jax.jit(jax.grad(f, argnums=(0, 1)))(v["params"], X)

    want = grads(model(Block))
    # the same block program as outside the scan: PLANNED's plan is reused, not solved again
    solves = PLANNED.plan_cache.solves
    assert_trees_close(grads(model(PLANNED)), want)
    assert PLANNED.plan_cache.solves == solves


def test_bf16_block_gradients_match():
    class Half(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.gelu(nn.Dense(32, dtype=jnp.bfloat16)(x))
            return x + nn.Dense(16, dtype=jnp.bfloat16)(h).astype(x.dtype)

    x = X.astype(jnp.bfloat16)
    v = Half().init(KEYS, x)

    def grads(cls):
        return jax.jit(
            jax.grad(
                lambda p, x: jnp.mean(cls().apply(p, x).astype(jnp.float32) ** 2), argnums=(0, 1)
            )
        )(v, x)

    want = grads(Half)
    assert_trees_close(grads(jremat.auto(Half, budget=0.5, verify=False)), want, tol=1e-2)


def test_method_decorator_and_setup_modules_keep_paths():
    class Mlp(nn.Module):
        def setup(self):
            self.up, self.down = nn.Dense(32), nn.Dense(16)

        @jremat.auto(budget=0.5, verify=False)
        def __call__(self, x):
            return self.down(nn.relu(self.up(x)))

    class Plain(Mlp):
        def __call__(self, x):
            return self.down(nn.relu(self.up(x)))

    v = Plain().init(KEYS, X)
    assert jax.tree_util.tree_structure(Mlp().init(KEYS, X)) == jax.tree_util.tree_structure(v)
    g = jax.jit(jax.grad(lambda p: jnp.sum(Mlp().apply(p, X) ** 2)))(v)
    assert_trees_close(g, jax.jit(jax.grad(lambda p: jnp.sum(Plain().apply(p, X) ** 2)))(v))


# -- errors ------------------------------------------------------------------------------------
def test_wrong_static_argnums_names_the_argument_and_self_counting():
    with pytest.raises(ValueError, match=r"names `self` \(position 0\).*x=1, train=2"):
        jremat.auto(Block, static_argnums=0)
    with pytest.raises(ValueError, match=r"out of range.*self=0, x=1, train=2"):
        jremat.auto(Block, static_argnums=(3,))
    with pytest.raises(ValueError, match="has no parameter 'training'"):
        jremat.auto(Block, static_argnames="training")
    # counting from the first argument after self (jax.checkpoint's habit) marks `x` static
    wrong = jremat.auto(Block, static_argnums=(1,), verify=False)
    with pytest.raises(
        ValueError,
        match=r"'x' \(position 1 of Block.__call__\).*array "
        r"float32\[64, 16\].*'train', is position 2",
    ):
        wrong().init(KEYS, X, True)


def test_decorating_neither_function_nor_module_is_a_type_error():
    for bad in (3, "Block", int, object()):
        with pytest.raises(TypeError, match="decorates a function"):
            jremat.auto(bad)
    with pytest.raises(TypeError, match="Module instance") as info:
        jremat.auto(Block())
    assert isinstance(info.value, flax_errors.TransformTargetError)  # as nn.remat raises


def test_core_errors_surface_unchanged(variables):
    # the same block program as PLANNED's: its compiles come from the session's XLA cache
    tiny = jremat.auto(Block, budget=0.01, static_argnums=(2,), max_rounds=1)
    with pytest.raises(jremat.InfeasibleBudgetError, match="smallest reachable budget"):
        Model(tiny).apply(variables, X, True, rngs=KEYS, mutable=["batch_stats"])
    with pytest.raises(ValueError, match="budget"):
        jremat.auto(Block, budget=2.5)


def test_undeclared_train_flag_and_methods_given_as_functions():
    """A bool `train` argument not declared static is static (it can only steer Python
    control flow); `methods=[Module.method]` names the method as `nn.remat` would."""

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, train):
            h = jnp.tanh(nn.Dense(16)(x))
            return nn.Dense(8)(h * 0.5 if train else h) + x

        def encode(self, x):
            return self(x, False)

    def net(block):
        class Net(nn.Module):
            @nn.compact
            def __call__(self, x, train=True):
                for _ in range(2):
                    x = block()(x, train)
                return jnp.mean(x**2)

        return Net()

    x = jnp.ones((8, 8))
    planned = net(jremat.auto(Block, budget=0.9, verify=False))
    v = planned.init(jax.random.key(0), x)
    got = jax.jit(jax.grad(lambda v, x: planned.apply(v, x, True)))(v, x)
    want = jax.grad(lambda v, x: net(Block).apply(v, x, True))(v, x)
    assert_trees_close(got, want)
    assert "encode" in jremat.auto(Block, budget=0.9, verify=False, methods=[Block.encode]).__dict__
    with pytest.raises(TypeError, match="methods must be None, a method name"):
        jremat.auto(Block, budget=0.9, methods=[3])
