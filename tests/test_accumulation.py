"""Tests for `jremat.accumulate`, `has_updated`, `state_bytes` and `state_breakdown`."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jremat._src.training import accumulation
from jremat._src.training.accumulation import (
    accumulate,
    has_updated,
    lr_scale_factor,
    state_breakdown,
    state_bytes,
)
from jremat._src.training.microbatching import microbatch

B, D_IN, D_H = 16, 8, 16

OPTIMIZERS = {
    "sgd": lambda: optax.sgd(0.1),
    "adam": lambda: optax.adam(1e-2),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
}


def init_params(key, dtype=jnp.float32):
    k1, k2 = jax.random.split(key)
    return {
        "w1": (jax.random.normal(k1, (D_IN, D_H)) / np.sqrt(D_IN)).astype(dtype),
        "b1": jnp.zeros((D_H,), dtype),
        "w2": (jax.random.normal(k2, (D_H, 1)) / np.sqrt(D_H)).astype(dtype),
    }


def make_batch(key, b=B, dtype=jnp.float32):
    kx, ky = jax.random.split(key)
    return {
        "x": jax.random.normal(kx, (b, D_IN), dtype),
        "y": jax.random.normal(ky, (b,), dtype),
    }


def mean_loss(params, batch):
    h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    return jnp.mean(((h @ params["w2"])[:, 0] - batch["y"]) ** 2)


def chunks(batch, k):
    m = B // k
    return [jax.tree.map(lambda x, j=j: x[j * m : (j + 1) * m], batch) for j in range(k)]


def assert_tree_close(a, b, rtol, atol=0.0):
    """Leafwise allclose; ``atol`` is relative to the leaf's scale max(1, max|b|)."""

    def check(x, y):
        y = np.asarray(y, np.float64)
        scale = max(1.0, float(np.max(np.abs(y)))) if y.size else 1.0
        np.testing.assert_allclose(np.asarray(x, np.float64), y, rtol=rtol, atol=atol * scale)

    jax.tree.map(check, a, b)


@pytest.fixture(autouse=True)
def _reset_warn_once():
    accumulation._WARNED.clear()
    yield
    accumulation._WARNED.clear()


# ----------------------------------------------------------------------------
# accumulate == one large-batch step.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["accumulate4", "accumulate2_microbatch2"])
@pytest.mark.parametrize("opt_name", ["sgd", "adam", "adamw"])
def test_equals_large_batch_steps(opt_name, scheme):
    """3 updates of accumulate over 4 microbatches (or 2 x microbatch(2)) == 3 big steps."""
    k_acc, k_mb = (4, 1) if scheme == "accumulate4" else (2, 2)
    batches = [make_batch(jax.random.key(10 + i)) for i in range(3)]

    big = OPTIMIZERS[opt_name]()

    @jax.jit
    def big_step(p, s, b):
        g = jax.grad(mean_loss)(p, b)
        u, s = big.update(g, s, p)
        return optax.apply_updates(p, u), s

    acc = accumulate(OPTIMIZERS[opt_name](), k_acc)
    grad_fn = microbatch(mean_loss, k_mb)

    @jax.jit
    def micro_step(p, s, b):
        _, g = grad_fn(p, b)
        u, s = acc.update(g, s, p)
        return optax.apply_updates(p, u), s

    p_ref = p = init_params(jax.random.key(0))
    s_ref, s = big.init(p_ref), acc.init(p)
    for n, b in enumerate(batches):
        p_ref, s_ref = big_step(p_ref, s_ref, b)
        for j, mb in enumerate(chunks(b, k_acc)):
            p_before = p
            p, s = micro_step(p, s, mb)
            if j < k_acc - 1:  # no update until the k-th micro-step
                assert not bool(has_updated(s))
                jax.tree.map(np.testing.assert_array_equal, p, p_before)
        assert bool(has_updated(s))
        assert int(s.gradient_step) == n + 1 and int(s.mini_step) == 0
        rtol = 1e-6 if opt_name == "sgd" else 1e-5  # adam: sqrt(v) normalization noise
        assert_tree_close(p, p_ref, rtol=rtol, atol=1e-7)
    assert not np.allclose(p["w1"], init_params(jax.random.key(0))["w1"])  # it trained


# ----------------------------------------------------------------------------
# dtypes.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "param_dtype, acc_dtype",
    [
        (jnp.float32, jnp.float32),
        (jnp.bfloat16, jnp.float32),
        (jnp.bfloat16, jnp.bfloat16),
        (jnp.float16, jnp.float32),
    ],
)
def test_mixed_precision(param_dtype, acc_dtype):
    k, lr = 4, 0.5
    params = init_params(jax.random.key(0), dtype=param_dtype)
    grad_fn = jax.jit(jax.grad(mean_loss))
    grads = [
        grad_fn(params, mb) for mb in chunks(make_batch(jax.random.key(1), dtype=param_dtype), k)
    ]
    opt = accumulate(optax.sgd(lr), k, accumulator_dtype=acc_dtype)
    state = opt.init(params)
    assert all(a.dtype == acc_dtype for a in jax.tree.leaves(state.acc_grads))
    update = jax.jit(opt.update)
    for g in grads:
        u, state = update(g, state, params)
        assert all(a.dtype == acc_dtype for a in jax.tree.leaves(state.acc_grads))
        assert all(x.dtype == param_dtype for x in jax.tree.leaves(u))
    # Reference: mean of the gradients in the accumulator dtype, cast back, times -lr.
    ref = jax.tree.map(
        lambda *gs: (sum(x.astype(acc_dtype) for x in gs) / k).astype(param_dtype) * -lr,
        *grads,
    )
    eps = float(jnp.finfo(param_dtype).eps)
    if acc_dtype == jnp.float32:  # exact mean, one rounding to the parameter dtype
        assert_tree_close(u, ref, rtol=1e-6 if param_dtype == jnp.float32 else 2 * eps, atol=1e-7)
    else:  # Welford running mean rounded to bf16 at every micro-step: ~k ulps of the scale
        jax.tree.map(
            lambda x, y: np.testing.assert_allclose(
                np.asarray(x, np.float64),
                np.asarray(y, np.float64),
                atol=k * eps * float(jnp.max(jnp.abs(y.astype(jnp.float32)))),
            ),
            u,
            ref,
        )
    new_params = optax.apply_updates(params, u)
    assert all(x.dtype == param_dtype for x in jax.tree.leaves(new_params))


# ----------------------------------------------------------------------------
# Schedules, has_updated, skipping, LR scaling, reduction.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_learning_rate_schedule_counts_optimizer_updates(opt_name):
    k = 3
    schedule = lambda n: 0.1 * (n + 1)  # noqa: E731
    inner = optax.sgd(schedule) if opt_name == "sgd" else optax.adam(schedule)
    opt = accumulate(inner, k)
    params = {"w": jnp.zeros(2)}
    state = opt.init(params)
    update = jax.jit(opt.update)
    emitted = []
    for _ in range(3 * k):
        u, state = update({"w": jnp.ones(2)}, state, params)
        if bool(has_updated(state)):
            emitted.append(float(u["w"][0]))
        # the inner optimizer's step count only advances on updates
        counts = [
            int(x)
            for path, x in jax.tree_util.tree_flatten_with_path(state.inner_opt_state)[0]
            if getattr(path[-1], "name", None) == "count"
        ]
        assert counts and all(c == int(state.gradient_step) for c in counts)
    # constant gradient 1: sgd and adam (first moment/sqrt(second) = 1) both emit -lr(n)
    np.testing.assert_allclose(emitted, [-0.1, -0.2, -0.3], rtol=1e-4)


def test_every_k_schedule_and_linear_lr_scaling_follow_k():
    every_k = lambda step: jnp.where(step < 2, 1, 3)  # noqa: E731
    opt = accumulate(optax.sgd(1.0), every_k, lr_scaling="linear")
    params = {"w": jnp.zeros(())}
    state = opt.init(params)
    assert not bool(has_updated(state))
    pattern, emitted = [], []
    update = jax.jit(opt.update)
    for _ in range(2 + 2 * 3):
        u, state = update({"w": jnp.ones(())}, state, params)
        pattern.append(bool(has_updated(state)))
        if pattern[-1]:
            emitted.append(float(u["w"]))
    assert pattern == [True, True, False, False, True, False, False, True]
    assert emitted == [-1.0, -1.0, -3.0, -3.0]  # factor k / reference_k


@pytest.mark.parametrize("make", [jnp.int32, np.array, np.int64], ids=["jnp", "np-0d", "np"])
def test_every_k_and_reference_k_as_0d_integer_arrays(make):
    """`every_k=jnp.int32(2)` (and `reference_k` alike) is the int 2: the same updates."""
    params = {"w": jnp.zeros(())}
    emitted = []
    for every_k, reference_k in ((2, 1), (make(2), make(1))):
        opt = accumulate(optax.sgd(1.0), every_k, lr_scaling="linear", reference_k=reference_k)
        state, out = opt.init(params), []
        for _ in range(4):
            u, state = opt.update({"w": jnp.ones(())}, state, params)
            out.append(float(u["w"]))
        emitted.append(out)
    assert emitted[0] == emitted[1] == [0.0, -2.0, 0.0, -2.0]


def test_every_k_traced_is_refused_by_name():
    """A traced `every_k` has no value when the optimizer is built: a TypeError naming it."""
    with pytest.raises(TypeError, match="every_k must be a concrete int"):
        jax.jit(lambda k: accumulate(optax.sgd(1.0), k).init({"w": jnp.zeros(())}))(2)


@pytest.mark.parametrize(
    "rule, k, reference_k, factor, opt_name",
    [
        ("linear", 4, 1, 4.0, "sgd"),
        ("sqrt", 4, 1, 2.0, "sgd"),
        ("linear", 8, 2, 4.0, "adamw"),
        ("sqrt", 8, 2, 2.0, "adamw"),
    ],
)
def test_lr_scaling_multiplies_updates(rule, k, reference_k, factor, opt_name):
    assert lr_scale_factor(k, rule, reference_k) == factor
    params = init_params(jax.random.key(0))
    grads = [jax.grad(mean_loss)(params, mb) for mb in chunks(make_batch(jax.random.key(1)), 8)]
    plain = accumulate(OPTIMIZERS[opt_name](), k)
    scaled = accumulate(OPTIMIZERS[opt_name](), k, lr_scaling=rule, reference_k=reference_k)
    s1, s2 = plain.init(params), scaled.init(params)
    update1, update2 = jax.jit(plain.update), jax.jit(scaled.update)
    for g in grads[:k]:
        u1, s1 = update1(g, s1, params)
        u2, s2 = update2(g, s2, params)
    assert bool(has_updated(s2))
    assert_tree_close(u2, jax.tree.map(lambda u: factor * u, u1), rtol=1e-6)
    # sgd: factor * lr is the effective learning rate on the mean gradient
    if opt_name == "sgd":
        mean = jax.tree.map(lambda *gs: sum(gs) / k, *grads[:k])
        assert_tree_close(u2, jax.tree.map(lambda m: -0.1 * factor * m, mean), rtol=1e-5, atol=1e-8)


def test_reduction_sum():
    opt = accumulate(optax.sgd(0.5), 3, reduction="sum")
    params = {"w": jnp.zeros(2)}
    state = opt.init(params)
    for g in (1.0, 2.0, 4.0):
        u, state = opt.update({"w": jnp.full(2, g)}, state, params)
    np.testing.assert_allclose(u["w"], [-3.5, -3.5])


@pytest.mark.parametrize("how", ["skip_non_finite", "should_skip_update_fn"])
def test_skip_non_finite_micro_steps(how):
    kwargs = (
        {"skip_non_finite": True}
        if how == "skip_non_finite"
        else {"should_skip_update_fn": optax.skip_not_finite}
    )
    opt = accumulate(optax.sgd(1.0), 2, **kwargs)
    params = {"w": jnp.zeros(2)}
    state = opt.init(params)
    update = jax.jit(opt.update)
    u, state = update({"w": jnp.array([1.0, 1.0])}, state, params)
    assert int(state.mini_step) == 1
    u, state = update({"w": jnp.array([jnp.nan, 5.0])}, state, params)  # dropped entirely
    assert int(state.mini_step) == 1 and not bool(has_updated(state))
    assert int(state.skip_state["num_not_finite"]) == 1
    np.testing.assert_array_equal(u["w"], [0.0, 0.0])
    u, state = update({"w": jnp.array([3.0, 3.0])}, state, params)
    assert bool(has_updated(state))
    np.testing.assert_allclose(u["w"], [-2.0, -2.0])  # mean over the 2 accepted steps

    # Without skipping, the NaN reaches the parameters.
    plain = accumulate(optax.sgd(1.0), 2)
    s = plain.init(params)
    _, s = plain.update({"w": jnp.array([jnp.nan, 5.0])}, s, params)
    u, s = plain.update({"w": jnp.array([3.0, 3.0])}, s, params)
    assert np.isnan(float(u["w"][0]))


def test_has_updated_finds_nested_state():
    opt = optax.chain(optax.clip_by_global_norm(1.0), accumulate(optax.sgd(1.0), 2))
    params = {"w": jnp.zeros(2)}
    state = opt.init(params)
    flags = []
    update = jax.jit(opt.update)
    for _ in range(4):
        _, state = update({"w": jnp.ones(2)}, state, params)
        flags.append(bool(jax.jit(has_updated)(state)))
    assert flags == [False, True, False, True]
    with pytest.raises(TypeError, match="exactly one"):
        has_updated(optax.adam(1e-3).init(params))
    with pytest.raises(TypeError, match="found 2"):
        has_updated((state, state))


def test_extra_args_pass_through():
    def update_fn(updates, state, params=None, *, scale):
        return jax.tree.map(lambda u: u * scale, updates), state

    inner = optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), update_fn)
    opt = accumulate(inner, 2)
    params = {"w": jnp.zeros(())}
    state = opt.init(params)
    _, state = opt.update({"w": jnp.ones(())}, state, params, scale=jnp.float32(3.0))
    u, state = opt.update({"w": 3 * jnp.ones(())}, state, params, scale=jnp.float32(3.0))
    assert float(u["w"]) == 6.0


# ----------------------------------------------------------------------------
# State size.
# ----------------------------------------------------------------------------

PARAMS_F32 = {"w": jnp.zeros((64, 32), jnp.float32), "b": jnp.zeros((32,), jnp.float32)}
P = 64 * 32 * 4 + 32 * 4  # 8320 bytes of float32 params


@pytest.mark.parametrize(
    "name, make, expected",
    [
        ("sgd", lambda: optax.sgd(0.1), 0),
        ("adam", lambda: optax.adam(1e-3), 4 + 2 * P),
        ("accumulate(sgd) f32 acc", lambda: accumulate(optax.sgd(0.1), 4), P + 8),
        ("accumulate(adam) f32 acc", lambda: accumulate(optax.adam(1e-3), 4), 4 + 3 * P + 8),
        (
            "accumulate(adam) bf16 acc",
            lambda: accumulate(optax.adam(1e-3), 4, accumulator_dtype=jnp.bfloat16),
            4 + 2 * P + P // 2 + 8,
        ),
        (
            "accumulate(adam) skip_non_finite",
            lambda: accumulate(optax.adam(1e-3), 4, skip_non_finite=True),
            4 + 3 * P + 8 + 1 + 4,  # + should_skip (bool) + num_not_finite (int32)
        ),
        # microbatch() keeps no state across steps: its cost is compile temp, not state
        ("microbatch + adam", lambda: optax.adam(1e-3), 4 + 2 * P),
    ],
)
def test_state_bytes_per_scheme(name, make, expected):
    opt = make()
    concrete = state_bytes(opt.init(PARAMS_F32))
    abstract = state_bytes(jax.eval_shape(opt.init, PARAMS_F32))
    print(f"state bytes {name}: {concrete}")
    assert concrete == abstract == expected


def test_state_breakdown_bf16_params():
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), PARAMS_F32)
    parts = state_breakdown(accumulate(optax.adam(1e-3), 4).init(params))
    # adam moments follow the bf16 params; the accumulator stays float32 by default
    assert parts == {
        "inner": 4 + P,
        "accumulator": P,
        "counters": 8,
        "skip": 0,
        "total": 4 + 2 * P + 8,
    }
    with pytest.raises(TypeError, match="MultiStepsState"):
        state_breakdown(optax.adam(1e-3).init(params))


# ----------------------------------------------------------------------------
# BatchNorm and bad input.
# ----------------------------------------------------------------------------


def test_batch_stats_in_params_warns_once():
    variables = {"params": {"w": jnp.zeros(2)}, "batch_stats": {"mean": jnp.zeros(2)}}
    opt = accumulate(optax.adamw(1e-3), 2)
    with pytest.warns(UserWarning, match="batch_stats.*weight decay"):
        opt.init(variables)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.init(variables)


@pytest.mark.parametrize(
    "args, kwargs, exc, match",
    [
        ((0,), {}, ValueError, r"every_k must be a positive int .*got 0"),
        ((-3,), {}, ValueError, r"every_k must be a positive int .*got -3"),
        ((2.0,), {}, TypeError, r"every_k must be a positive int or a callable"),
        ((jnp.float32(2),), {}, TypeError, r"every_k must be a positive int or a callable"),
        ((jnp.array([2]),), {}, TypeError, r"every_k must be a positive int or a callable"),
        ((jnp.int32(0),), {}, ValueError, r"every_k must be a positive int .*got 0"),
        ((True,), {}, TypeError, r"every_k must be a positive int .*got bool"),
        ((lambda s: 2.5,), {}, TypeError, r"must return an integer scalar"),
        ((lambda s: jnp.ones(2, jnp.int32),), {}, TypeError, r"must return an integer scalar"),
        ((lambda: 2,), {}, TypeError, r"must map an int32 scalar gradient_step"),
        ((2,), {"reduction": "avg"}, ValueError, r"reduction must be one of \('mean', 'sum'\)"),
        (
            (2,),
            {"accumulator_dtype": jnp.int32},
            TypeError,
            r"accumulator_dtype must be a floating",
        ),
        ((2,), {"accumulator_dtype": "f32x"}, TypeError, r"accumulator_dtype must be a floating"),
        ((2,), {"lr_scaling": "cubic"}, ValueError, r"lr_scaling must be None, 'linear' or 'sqrt'"),
        ((2,), {"reference_k": 0}, ValueError, r"reference_k must be a positive int"),
        (
            (2,),
            {"skip_non_finite": True, "should_skip_update_fn": optax.skip_not_finite},
            ValueError,
            "not both",
        ),
        ((2,), {"should_skip_update_fn": 3}, TypeError, "should_skip_update_fn must be a callable"),
    ],
)
def test_bad_arguments(args, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        accumulate(optax.sgd(0.1), *args, **kwargs)


def test_bad_optimizer_and_state():
    with pytest.raises(TypeError, match="optimizer must be an optax.GradientTransformation"):
        accumulate(optax.sgd, 2)
    opt = accumulate(optax.sgd(0.1), 2)
    with pytest.raises(TypeError, match="state must be the optax.MultiStepsState"):
        opt.update({"w": jnp.ones(2)}, optax.sgd(0.1).init({"w": jnp.ones(2)}))


def test_accumulator_reset_clears_a_non_finite_micro_step():
    """skip_non_finite=False: a NaN micro-step spoils its own window only; the reset selects
    zeros (optax.MultiSteps multiplies by 0, which keeps the NaN forever)."""
    opt = accumulate(optax.chain(optax.zero_nans(), optax.sgd(1.0)), 2)
    params = jnp.zeros(3)
    state = opt.init(params)
    grads = [jnp.full(3, jnp.nan), jnp.ones(3), jnp.ones(3), jnp.ones(3)]
    moved = []
    for g in grads:
        u, state = opt.update(g, state, params)
        assert np.isfinite(np.asarray(u)).all()
        params = optax.apply_updates(params, u)
        moved.append(np.asarray(params))
    assert np.isfinite(np.asarray(state.acc_grads)).all()
    np.testing.assert_allclose(moved[1], np.zeros(3))  # NaN window: zero_nans drops it
    np.testing.assert_allclose(moved[3], np.full(3, -1.0))  # next window moves by the mean
