"""Tests for jremat.microbatch against plain jax.value_and_grad references."""

from __future__ import annotations

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jremat._src.training import accumulation
from jremat._src.training.microbatching import microbatch

B, D_IN, D_H = 16, 8, 16


def init_params(key, d_in=D_IN, d_h=D_H, dtype=jnp.float32):
    k1, k2 = jax.random.split(key)
    return {
        "w1": (jax.random.normal(k1, (d_in, d_h)) / np.sqrt(d_in)).astype(dtype),
        "b1": jnp.zeros((d_h,), dtype),
        "w2": (jax.random.normal(k2, (d_h, 1)) / np.sqrt(d_h)).astype(dtype),
    }


def make_batch(key, b=B, d_in=D_IN, dtype=jnp.float32):
    kx, ky = jax.random.split(key)
    return {
        "x": jax.random.normal(kx, (b, d_in), dtype),
        "y": jax.random.normal(ky, (b,), dtype),
    }


def per_example(params, batch):
    h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    return ((h @ params["w2"])[:, 0] - batch["y"]) ** 2


def mean_loss(params, batch):
    return jnp.mean(per_example(params, batch))


def sum_loss(params, batch):
    return jnp.sum(per_example(params, batch))


def strided_split(tree, k):
    """Reference split: microbatch j holds rows j, j+k, j+2k, ... (documented order)."""
    return [jax.tree.map(lambda x, j=j: x[j::k], tree) for j in range(k)]


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
# Exactness of the reductions.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("reduction, fn", [("mean", mean_loss), ("sum", sum_loss)])
@pytest.mark.parametrize("k", [2, 8])
def test_mean_and_sum_equal_value_and_grad(reduction, fn, k):
    params = init_params(jax.random.key(0))
    batch = make_batch(jax.random.key(1))
    loss, grads = jax.jit(microbatch(fn, k, reduction=reduction))(params, batch)
    ref_loss, ref_grads = jax.value_and_grad(fn)(params, batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    assert_tree_close(grads, ref_grads, rtol=1e-5, atol=1e-7)
    assert jax.tree.structure(grads) == jax.tree.structure(params)


def test_weighted_uneven_masks_equal_full_batch():
    """Counts 3, 1, 0, 4 per microbatch: exact sum/count; mean of means is not."""
    k = 4
    params = init_params(jax.random.key(0))
    batch = make_batch(jax.random.key(1))
    mask = np.zeros(B, np.float32)
    # strided microbatches: j holds rows j, j+4, j+8, j+12
    mask[[0, 4, 8]] = 1  # microbatch 0: 3 positions
    mask[[1]] = 1  # microbatch 1: 1 position
    mask[[3, 7, 11, 15]] = 1  # microbatch 3: 4; microbatch 2: none
    batch["mask"] = jnp.asarray(mask)

    def weighted(params, b):
        return jnp.sum(per_example(params, b) * b["mask"]), jnp.sum(b["mask"])

    def full(params):
        return jnp.sum(per_example(params, batch) * batch["mask"]) / jnp.sum(batch["mask"])

    loss, grads = jax.jit(microbatch(weighted, k, reduction="weighted"))(params, batch)
    ref_loss, ref_grads = jax.value_and_grad(full)(params)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    assert_tree_close(grads, ref_grads, rtol=1e-5, atol=1e-7)

    # The naive alternative (mean of the microbatch means, empty ones skipped) differs.
    means = [
        float(jnp.sum(per_example(params, mb) * mb["mask"]) / jnp.sum(mb["mask"]))
        for mb in strided_split(batch, k)
        if float(jnp.sum(mb["mask"])) > 0
    ]
    assert abs(np.mean(means) - float(ref_loss)) > 1e-3 * abs(float(ref_loss))


def test_weighted_integer_counts_and_aux():
    params = init_params(jax.random.key(0))
    batch = make_batch(jax.random.key(1))
    batch["mask"] = (jnp.arange(B) % 3 == 0).astype(jnp.int32)

    def weighted(params, b):
        per = per_example(params, b)
        return (jnp.sum(per * b["mask"]), jnp.sum(b["mask"])), {"max": jnp.max(per)}

    (loss, aux), _ = microbatch(weighted, 2, reduction="weighted", has_aux=True)(params, batch)
    per = per_example(params, batch)
    np.testing.assert_allclose(loss, jnp.sum(per * batch["mask"]) / 6, rtol=1e-6)
    ref_aux = np.mean([float(jnp.max(per_example(params, mb))) for mb in strided_split(batch, 2)])
    np.testing.assert_allclose(aux["max"], ref_aux, rtol=1e-6)


@pytest.mark.parametrize("opt_name", ["sgd", "adam", "adamw"])
def test_training_steps_equal_large_batch(opt_name):
    """Three optimizer steps on microbatched grads equal three large-batch steps."""
    opt = {
        "sgd": optax.sgd(0.1),
        "adam": optax.adam(1e-2),
        "adamw": optax.adamw(1e-2, weight_decay=0.1),
    }[opt_name]
    datas = [make_batch(jax.random.key(10 + i)) for i in range(3)]

    def run(grad_fn):
        @jax.jit
        def step(p, s, b):
            _, g = grad_fn(p, b)
            u, s = opt.update(g, s, p)
            return optax.apply_updates(p, u), s

        p = init_params(jax.random.key(0))
        s = opt.init(p)
        for b in datas:
            p, s = step(p, s, b)
        return p

    got = run(microbatch(mean_loss, 4))
    ref = run(jax.value_and_grad(mean_loss))
    rtol = 1e-6 if opt_name == "sgd" else 1e-5  # adam: sqrt(v) normalization noise
    assert_tree_close(got, ref, rtol=rtol, atol=1e-7)
    init = init_params(jax.random.key(0))
    assert not np.allclose(got["w1"], init["w1"])  # it did train


# ----------------------------------------------------------------------------
# dtypes.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("acc_dtype", [None, jnp.bfloat16])
def test_bf16_params_accumulate_in_requested_dtype(acc_dtype):
    k = 4
    params = init_params(jax.random.key(0), dtype=jnp.bfloat16)
    batch = make_batch(jax.random.key(1), dtype=jnp.bfloat16)
    loss, grads = jax.jit(microbatch(mean_loss, k, accumulator_dtype=acc_dtype))(params, batch)
    assert loss.dtype == jnp.bfloat16
    assert all(g.dtype == jnp.bfloat16 for g in jax.tree.leaves(grads))

    # Reference: bf16 microbatch grads, summed in float32 (or bf16), / k, cast to bf16.
    parts = [jax.grad(mean_loss)(params, mb) for mb in strided_split(batch, k)]
    acc = jnp.float32 if acc_dtype is None else jnp.bfloat16
    ref = jax.tree.map(
        lambda *gs: (sum(g.astype(acc) for g in gs) / k).astype(jnp.bfloat16), *parts
    )
    bf16_eps = float(jnp.finfo(jnp.bfloat16).eps)
    assert_tree_close(grads, ref, rtol=bf16_eps, atol=1e-6)
    # and within bf16 precision of the float32 full-batch gradient
    ref32 = jax.grad(mean_loss)(
        jax.tree.map(lambda x: x.astype(jnp.float32), params),
        jax.tree.map(lambda x: x.astype(jnp.float32), batch),
    )
    assert_tree_close(grads, ref32, rtol=0.05, atol=0.02)


# ----------------------------------------------------------------------------
# aux.
# ----------------------------------------------------------------------------


def aux_loss(params, b):
    per = per_example(params, b)
    return jnp.mean(per), {"max": jnp.max(per), "n_big": jnp.sum(per > 0.5)}


@pytest.mark.parametrize("aux_reduction", ["stack", "last", "sum", {"max": "mean", "n_big": "sum"}])
def test_aux_reductions(aux_reduction):
    k = 4
    params = init_params(jax.random.key(0))
    batch = make_batch(jax.random.key(1))
    (loss, aux), grads = jax.jit(
        microbatch(aux_loss, k, has_aux=True, aux_reduction=aux_reduction)
    )(params, batch)
    ref_loss, ref_grads = jax.value_and_grad(mean_loss)(params, batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    assert_tree_close(grads, ref_grads, rtol=1e-5, atol=1e-7)

    per_mb = [aux_loss(params, mb)[1] for mb in strided_split(batch, k)]
    stacked = jax.tree.map(lambda *xs: np.stack(xs), *per_mb)
    if aux_reduction == "stack":
        assert aux["max"].shape == (k,)
        np.testing.assert_allclose(aux["max"], stacked["max"], rtol=1e-6)
        np.testing.assert_array_equal(aux["n_big"], stacked["n_big"])
    elif aux_reduction == "last":
        np.testing.assert_allclose(aux["max"], stacked["max"][-1], rtol=1e-6)
        np.testing.assert_array_equal(aux["n_big"], stacked["n_big"][-1])
    elif aux_reduction == "sum":
        np.testing.assert_allclose(aux["max"], stacked["max"].sum(), rtol=1e-6)
        assert int(aux["n_big"]) == int(jnp.sum(per_example(params, batch) > 0.5))
    else:
        np.testing.assert_allclose(aux["max"], stacked["max"].mean(), rtol=1e-6)
        assert aux["n_big"].dtype == stacked["n_big"].dtype
        assert int(aux["n_big"]) == int(jnp.sum(per_example(params, batch) > 0.5))


def test_extra_args_and_kwargs_are_broadcast():
    params = init_params(jax.random.key(0))
    batch = make_batch(jax.random.key(1))

    def scaled(params, b, scale, *, shift):
        return scale * mean_loss(params, b) + shift

    loss, grads = microbatch(scaled, 4)(params, batch, 3.0, shift=1.5)
    ref_loss, ref_grads = jax.value_and_grad(scaled)(params, batch, 3.0, shift=1.5)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    assert_tree_close(grads, ref_grads, rtol=1e-5, atol=1e-7)


def test_composes_with_jax_checkpoint():
    params = init_params(jax.random.key(0))
    batch = make_batch(jax.random.key(1))
    remat = jax.checkpoint(mean_loss, policy=jax.checkpoint_policies.nothing_saveable)
    loss, grads = jax.jit(microbatch(remat, 4))(params, batch)
    ref_loss, ref_grads = jax.value_and_grad(mean_loss)(params, batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    assert_tree_close(grads, ref_grads, rtol=1e-5, atol=1e-7)


# ----------------------------------------------------------------------------
# Memory.
# ----------------------------------------------------------------------------


def test_compiled_temp_falls_as_k_grows():
    params = init_params(jax.random.key(0), d_in=32, d_h=512)
    batch = make_batch(jax.random.key(1), b=256, d_in=32)
    temps = {}
    for k in (1, 4, 16):
        compiled = jax.jit(microbatch(mean_loss, k)).lower(params, batch).compile()
        temps[k] = compiled.memory_analysis().temp_size_in_bytes
    print("microbatch temp bytes by k:", temps)
    assert temps[1] > temps[4] > temps[16]
    # one (256, 512) float32 activation is 512 KiB; k=16 keeps far less than that
    assert temps[16] < 256 * 512 * 4


# ----------------------------------------------------------------------------
# BatchNorm.
# ----------------------------------------------------------------------------


class BNNet(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Dense(8)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        return nn.Dense(1)(nn.relu(x))[:, 0]


def test_batchnorm_batch_stats_mean_warns_once():
    k = 4
    model = BNNet()
    batch = make_batch(jax.random.key(1))
    variables = model.init(jax.random.key(0), batch["x"], train=False)
    params, stats = variables["params"], variables["batch_stats"]

    def loss_fn(params, b, stats):
        pred, upd = model.apply(
            {"params": params, "batch_stats": stats}, b["x"], train=True, mutable=["batch_stats"]
        )
        return jnp.mean((pred - b["y"]) ** 2), upd

    f = jax.jit(microbatch(loss_fn, k, has_aux=True))
    with pytest.warns(UserWarning, match="batch_stats"):
        (_, upd), _ = f(params, batch, stats)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        microbatch(loss_fn, 2, has_aux=True)(params, batch, stats)  # once: no second warning

    # Mean of the k running-mean updates = one update with the mean of the microbatch
    # means = the full-batch mean (equal microbatch sizes).
    h = batch["x"] @ params["Dense_0"]["kernel"] + params["Dense_0"]["bias"]
    expected = 0.9 * stats["BatchNorm_0"]["mean"] + 0.1 * jnp.mean(h, axis=0)
    np.testing.assert_allclose(upd["batch_stats"]["BatchNorm_0"]["mean"], expected, rtol=1e-5)
    # 'stack' returns each microbatch's update, in the documented strided order.
    (_, stacked), _ = microbatch(loss_fn, k, has_aux=True, aux_reduction="stack")(
        params, batch, stats
    )
    for j, mb in enumerate(strided_split(batch, k)):
        hj = mb["x"] @ params["Dense_0"]["kernel"] + params["Dense_0"]["bias"]
        np.testing.assert_allclose(
            stacked["batch_stats"]["BatchNorm_0"]["mean"][j],
            0.9 * stats["BatchNorm_0"]["mean"] + 0.1 * jnp.mean(hj, axis=0),
            rtol=1e-5,
            atol=1e-7,
        )


def test_batch_stats_in_params_warns():
    params = {"params": init_params(jax.random.key(0)), "batch_stats": {"m": jnp.zeros(3)}}

    def loss_fn(v, b):
        return mean_loss(v["params"], b) + 0.0 * jnp.sum(v["batch_stats"]["m"])

    with pytest.warns(UserWarning, match="GroupNorm/LayerNorm"):
        microbatch(loss_fn, 2)(params, make_batch(jax.random.key(1)))


# ----------------------------------------------------------------------------
# Bad input.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"num_microbatches": 0}, ValueError, "num_microbatches must be a positive int"),
        ({"num_microbatches": -2}, ValueError, "num_microbatches must be a positive int"),
        ({"num_microbatches": 2.0}, TypeError, "num_microbatches must be a positive int"),
        ({"num_microbatches": True}, TypeError, "num_microbatches"),
        ({"num_microbatches": jnp.float32(2)}, TypeError, "num_microbatches must be a positive"),
        ({"num_microbatches": jnp.array([2])}, TypeError, "num_microbatches must be a positive"),
        ({"num_microbatches": jnp.int32(0)}, ValueError, "num_microbatches must be a positive"),
        ({"reduction": "avg"}, ValueError, r"reduction must be one of \('mean', 'sum', 'wei"),
        ({"aux_reduction": "first"}, ValueError, "aux_reduction must be one of"),
        ({"has_aux": 1}, TypeError, "has_aux must be a bool"),
        ({"accumulator_dtype": jnp.int32}, TypeError, "accumulator_dtype .*floating dtype"),
        ({"accumulator_dtype": "f32x"}, TypeError, "accumulator_dtype .*floating dtype"),
    ],
)
def test_bad_arguments(kwargs, exc, match):
    args = {"num_microbatches": 2, **kwargs}
    with pytest.raises(exc, match=match):
        microbatch(mean_loss, args.pop("num_microbatches"), **args)


def test_bad_loss_fn():
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        microbatch("loss", 2)


@pytest.mark.parametrize(
    "batch, match",
    [
        (
            {"x": jnp.ones((6, D_IN)), "y": jnp.ones(6)},
            r"num_microbatches=4 must divide the batch size 6 .*accepted values: 1, 2, 3, 6",
        ),
        (
            {"x": jnp.ones((8, D_IN)), "y": jnp.ones(4)},
            r"same leading \(batch\) size; found sizes 4: batch\['y'\]; 8: batch\['x'\]",
        ),
        ({"x": jnp.ones((8, D_IN)), "y": jnp.ones(())}, r"batch\['y'\] is a scalar"),
        ({"x": jnp.ones((8, D_IN)), "y": 3.0}, r"batch\['y'\] is a scalar"),  # traced by jit
        ({}, "at least one array leaf"),
    ],
)
def test_bad_batch(batch, match):
    params = init_params(jax.random.key(0))
    with pytest.raises(ValueError, match=match):
        jax.jit(microbatch(mean_loss, 4))(params, batch)


def test_weighted_loss_fn_must_return_pair():
    params = init_params(jax.random.key(0))
    batch = make_batch(jax.random.key(1))
    with pytest.raises(TypeError, match=r"must return \(sum_of_losses, count\)"):
        microbatch(sum_loss, 2, reduction="weighted")(params, batch)
    with pytest.raises(TypeError, match="must return scalars"):
        microbatch(lambda p, b: (per_example(p, b), jnp.float32(1.0)), 2, reduction="weighted")(
            params, batch
        )


def test_loss_fn_must_return_scalar():
    params = init_params(jax.random.key(0))
    batch = make_batch(jax.random.key(1))
    with pytest.raises(TypeError, match=r"must return a scalar loss \(mean .*got shape \(8,\)"):
        microbatch(per_example, 2)(params, batch)
    with pytest.raises(TypeError, match="or \\(loss, aux\\) with has_aux=True"):
        microbatch(aux_loss, 2)(params, batch)


def test_has_aux_loss_fn_must_return_pair():
    params = init_params(jax.random.key(0))
    batch = make_batch(jax.random.key(1))
    with pytest.raises(
        TypeError, match=r"must return a pair \(value, aux\); got an array float32\[\]"
    ):
        microbatch(mean_loss, 2, has_aux=True)(params, batch)


def test_aux_reduction_prefix_mismatch_and_int_mean():
    params = init_params(jax.random.key(0))
    batch = make_batch(jax.random.key(1))
    with pytest.raises(ValueError, match="pytree prefix of the aux"):
        microbatch(aux_loss, 2, has_aux=True, aux_reduction={"max": "mean"})(params, batch)
    with pytest.raises(TypeError, match="aux_reduction='mean' needs floating-point"):
        microbatch(aux_loss, 2, has_aux=True)(params, batch)


def test_python_number_in_batch_outside_jit():
    params = init_params(jax.random.key(0))
    with pytest.raises(ValueError, match=r"batch\['y'\] is a float.*extra arguments"):
        microbatch(mean_loss, 2)(params, {"x": jnp.ones((8, D_IN)), "y": 3.0})


# -- explicit sharding (issue 47) --------------------------------------------------------------
def _explicit_mesh():
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (conftest.py sets 8 host devices)")
    return jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))


def _moving_collectives(text: str) -> dict[str, int]:
    """Counts of the collectives that move data between devices (not the gradient
    all-reduce) in an optimized HLO module."""
    import re

    ops = ("all-gather", "all-to-all", "collective-permute", "reduce-scatter")
    return {op: n for op in ops if (n := len(re.findall(rf"\b{op}(?:-start)?\(", text)))}


@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("how", ["set_mesh", "sharded arrays"])
def test_microbatch_on_an_explicit_mesh_keeps_the_batch_sharding(k, how):
    """`jax.make_mesh`'s Explicit axes: the split states its output sharding (before: a
    ShardingTypeError from optax's reshape for every k, 1 included), each device keeps its
    rows (no collective moves the batch), values, gradients and the stacked aux equal the
    unsplit reference, and the gradients keep the parameters' sharding."""
    mesh = _explicit_mesh()
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    params = init_params(jax.random.key(0))
    batch = make_batch(jax.random.key(1), b=64)

    def loss(p, b):
        return mean_loss(p, b), {"rows": b["y"] * 2.0, "n": jnp.sum(b["y"] > 0)}

    f = microbatch(loss, k, has_aux=True, aux_reduction={"rows": "stack", "n": "sum"})
    ref_v, ref_g = jax.value_and_grad(mean_loss)(params, batch)

    def run():
        p = jax.device_put(params, NamedSharding(mesh, P()))
        b = jax.device_put(batch, NamedSharding(mesh, P("data")))
        step = jax.jit(f)
        return step(p, b), step.lower(p, b).compile().as_text()

    if how == "set_mesh":
        with jax.set_mesh(mesh):
            ((value, aux), grads), text = run()
    else:
        ((value, aux), grads), text = run()
    assert not _moving_collectives(text), _moving_collectives(text)
    np.testing.assert_allclose(value, ref_v, rtol=1e-5)
    assert_tree_close(grads, ref_g, rtol=1e-5, atol=1e-6)
    want = np.stack([np.asarray(batch["y"][j::k]) * 2.0 for j in range(k)])
    np.testing.assert_allclose(aux["rows"], want, rtol=1e-6)
    assert int(aux["n"]) == int(jnp.sum(batch["y"] > 0))
    assert not any(grads["w1"].sharding.spec)  # replicated, as the parameters


def test_microbatch_on_an_explicit_mesh_refuses_microbatches_the_devices_cannot_share():
    mesh = _explicit_mesh()
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    params = init_params(jax.random.key(0))
    batch = jax.device_put(make_batch(jax.random.key(1), b=64), NamedSharding(mesh, P("data")))
    with pytest.raises(ValueError, match=r"num_microbatches=16 leaves 4 rows.*accepted "
                       r"num_microbatches: 1, 2, 4, 8\."):  # fmt: skip
        jax.jit(microbatch(mean_loss, 16))(params, batch)


def test_accumulate_on_an_explicit_mesh_equals_one_big_step():
    """`jremat.accumulate` over `jremat.microbatch`ed micro-steps on an Explicit mesh: two
    accumulated micro-steps of 4 microbatches each give the update of one step over both
    batches."""
    mesh = _explicit_mesh()
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jremat._src.training.accumulation import accumulate

    params = jax.device_put(init_params(jax.random.key(0)), NamedSharding(mesh, P()))
    batches = [make_batch(jax.random.key(i), b=64) for i in (1, 2)]
    opt = accumulate(optax.sgd(0.1), 2)
    grad = microbatch(mean_loss, 4)

    @jax.jit
    def step(p, s, b):
        _, g = grad(p, b)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s

    with jax.set_mesh(mesh):
        p, s = params, opt.init(params)
        for b in batches:
            p, s = step(p, s, jax.device_put(b, NamedSharding(mesh, P("data"))))
    both = jax.tree.map(lambda *x: jnp.concatenate(x), *batches)
    want = jax.tree.map(
        lambda w, g: w - 0.1 * g, init_params(jax.random.key(0)), jax.grad(mean_loss)(
            init_params(jax.random.key(0)), both))  # fmt: skip
    assert_tree_close(p, want, rtol=1e-5, atol=1e-6)
