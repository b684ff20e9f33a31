"""Sharding (docs/design.md#sharding) without a mesh: spec propagation rules, per-device bytes,
argument errors. The SPMD cases are in `test_sharding_8dev.py`."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import jremat
from jremat._src.base import sharding
from jremat._src.trace import sharding as propagation

AXES = {"data": 2, "model": 4}


def _eqn(fn, *shapes, index=0):
    """The `index`-th equation of `fn` traced on float32 zeros of `shapes`."""
    jaxpr = jax.make_jaxpr(fn)(*(jnp.zeros(s) for s in shapes))
    return jaxpr.jaxpr.eqns[index]


def _out(eqn, *specs):
    in_shapes = [tuple(v.aval.shape) for v in eqn.invars]
    out_shapes = [tuple(v.aval.shape) for v in eqn.outvars]
    return propagation.propagate(eqn, list(specs), in_shapes, out_shapes)


def test_dot_general_keeps_batch_and_free_dims_and_sums_contracting():
    e = _eqn(lambda x, w: x @ w, (8, 16), (16, 32))
    # column parallel: rows over data, columns over model
    assert _out(e, (("data",), ()), ((), ("model",))) == [(("data",), ("model",))]
    # row parallel: the contracting dimension is sharded -> the output is summed, unsharded
    assert _out(e, ((), ("model",)), (("model",), ())) == [((), ())]
    b = _eqn(lambda q, k: jnp.einsum("bqd,bkd->bqk", q, k), (4, 8, 16), (4, 8, 16))
    assert _out(b, (("data",), (), ("model",)), (("data",), (), ("model",))) == [
        (("data",), (), ())
    ]
    # an axis may shard one output dimension only
    assert _out(e, (("model",), ()), ((), ("model",))) == [(("model",), ())]


def test_shape_ops_move_specs():
    t = _eqn(lambda x: x.T, (8, 16))
    assert _out(t, (("data",), ("model",))) == [(("model",), ("data",))]
    r = _eqn(lambda x: x.reshape(8, 4, 4), (8, 16))
    assert _out(r, (("data",), ("model",))) == [(("data",), ("model",), ())]
    merge = _eqn(lambda x: x.reshape(32), (8, 4))
    assert _out(merge, (("data",), ())) == [(("data",),)]
    bc = _eqn(lambda x: jnp.broadcast_to(x, (3, 8, 16)), (8, 16))
    assert _out(bc, (("data",), ())) == [((), ("data",), ())]
    red = _eqn(lambda x: x.sum(1), (8, 16))
    assert _out(red, (("data",), ("model",))) == [(("data",),)]
    ew = _eqn(lambda x, y: x * y, (8, 16), (8, 16))
    assert _out(ew, None, (("data",), ())) == [(("data",), ())]
    sl = _eqn(lambda x: x[:, :3], (8, 16))
    assert _out(sl, (("data",), ("model",))) == [(("data",), ())]
    cum = _eqn(lambda x: jax.lax.cumsum(x, axis=1), (8, 16))  # no rule: same-shape input's
    assert _out(cum, (("data",), ("model",))) == [(("data",), ("model",))]
    one = jax.sharding.NamedSharding(
        jax.make_mesh((1,), ("model",), axis_types=(jax.sharding.AxisType.Auto,)), P(None, "model")
    )
    con = _eqn(lambda x: jax.lax.with_sharding_constraint(x, one), (8, 16))
    assert _out(con, (("data",), ())) == [((), ("model",))]


def test_per_device_bytes_round_up_uneven_shards():
    assert propagation.per_device_nbytes(8 * 16 * 4, (8, 16), (("data",), ("model",)), AXES) == (
        4 * 4 * 4
    )
    # 6 rows over 4 devices: XLA pads to 2 rows each
    assert propagation.per_device_nbytes(6 * 4, (6,), (("model",),), AXES) == 2 * 4
    assert propagation.per_device_nbytes(100, (25,), None, AXES) == 100


def test_unsharded_trace_is_unchanged():
    def loss(w, x):
        return jnp.mean(jnp.tanh(x @ w) ** 2)

    g = jremat.trace(loss, jnp.ones((4, 4)), jnp.ones((8, 4)))
    assert g.mesh_axes == {}
    assert all(v.spec is None and v.nbytes == v.global_nbytes for v in g.values)


def test_in_shardings_errors_name_the_argument_and_forms():
    def loss(w, x):
        return jnp.mean(x @ w)

    args = (jnp.ones((4, 4)), jnp.ones((8, 4)))
    with pytest.raises(ValueError, match=r"in_shardings must match the 2 positional.*got a seq"):
        jremat.measure(loss, *args, in_shardings=(P(),))
    with pytest.raises(TypeError, match=r"in_shardings\[1\] is str 'data'; accepted: a Named"):
        jremat.plan(loss, *args, budget=0.5, in_shardings=(None, "data"))
    with pytest.raises(ValueError, match="no mesh is known: pass mesh="):
        jremat.measure(loss, *args, in_shardings=(None, P("data")))
    with pytest.raises(ValueError, match=r"in_shardings\[0\] is not a pytree prefix"):
        jremat.measure(loss, *args, in_shardings=([P(), P()], None))


def test_in_shardings_axis_the_mesh_lacks_names_it_and_the_mesh_axes():
    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    args = (jnp.ones((4, 4)), jnp.ones((8, 4)))
    expected = (
        "in_shardings[1] is the PartitionSpec P('model',), which names mesh axis 'model' "
        "that the mesh lacks: its axes are {'data': 1}."
    )
    calls = {
        "plan": lambda: jremat.plan(
            _never_traced, *args, budget=0.5, in_shardings=(P(), P("model")), mesh=mesh
        ),
        "measure": lambda: jremat.measure(
            _never_traced, *args, in_shardings=(None, P(("data", "model"))), mesh=mesh
        ),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError) as info:
            call()
        msg = str(info.value)
        if name == "plan":
            assert msg.startswith(expected), msg
        assert "'model'" in msg and "{'data': 1}" in msg and "in_shardings[1]" in msg, msg
    with jax.set_mesh(mesh):  # the ambient mesh is checked the same way
        with pytest.raises(ValueError, match=r"names mesh axis 'model' that the mesh lacks"):
            jremat.measure(_never_traced, *args, in_shardings=P("model"))


def _never_traced(w, x):
    raise AssertionError("traced: the argument should have been rejected first")


@pytest.mark.parametrize("mesh", ["data", ("data", 2), 8])
def test_mesh_that_is_not_a_mesh_is_a_type_error_naming_mesh(mesh):
    args = (jnp.ones((4, 4)), jnp.ones((8, 4)))
    calls = {
        "plan": lambda: jremat.plan(_never_traced, *args, budget=0.5, mesh=mesh),
        "plan+spec": lambda: jremat.plan(
            _never_traced, *args, budget=0.5, in_shardings=P(), mesh=mesh
        ),
        "measure": lambda: jremat.measure(_never_traced, *args, mesh=mesh),
        "auto": lambda: jremat.auto(_never_traced, budget=0.5, mesh=mesh),  # no call needed
        "auto()": lambda: jremat.auto(budget=0.5, mesh=mesh),
    }
    for name, call in calls.items():
        with pytest.raises(TypeError) as info:
            call()
        msg = str(info.value)
        assert msg.startswith(f"mesh is {type(mesh).__name__} {mesh!r}; accepted: "), (name, msg)
        assert "a jax.sharding.Mesh" in msg and "or None" in msg, (name, msg)


def _mesh_warnings(record):
    return [w for w in record if "was given, but no PartitionSpec" in str(w.message)]


def test_mesh_without_in_shardings_warns_that_it_has_no_effect():
    def loss(w, x):
        return jnp.mean(jnp.tanh(x @ w) ** 2)

    args = (jnp.ones((4, 4)), jnp.ones((8, 4)))
    mesh = sharding.make_mesh({"data": 1})  # Auto axis type, as jax.jit's default
    plain = jremat.measure(loss, *args)
    for call in (
        lambda: jremat.measure(loss, *args, mesh=mesh),
        lambda: jremat.plan(loss, *args, budget=1.0, mesh=mesh),
        lambda: jremat.auto(loss, budget=1.0, mesh=mesh)(*args),
    ):
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            call()
        (w,) = _mesh_warnings(record)
        assert w.category is RuntimeWarning
        assert "mesh={'data': 1} was given" in str(w.message) and "in_shardings=" in str(w.message)
        assert w.filename == __file__  # attributed to the caller, not to jremat
    # the mesh changes nothing: the step is measured as without it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert jremat.measure(loss, *args, mesh=mesh).temp_bytes == plain.temp_bytes
    # a PartitionSpec that refers to the mesh: no warning
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        m = jremat.measure(loss, *args, in_shardings=(None, P("data")), mesh=mesh)
    assert not _mesh_warnings(record) and m.num_devices == 1


def test_auto_checks_in_shardings_form_when_decorating():
    forms = "accepted: a NamedSharding, a PartitionSpec"
    with pytest.raises(TypeError, match=rf"^in_shardings is int 42; {forms}"):
        jremat.auto(_never_traced, budget=0.5, in_shardings=42)
    with pytest.raises(TypeError, match=rf"^in_shardings is str 'data'; {forms}"):
        jremat.auto(budget=0.5, in_shardings="data")
    with pytest.raises(TypeError, match=rf"^in_shardings\[1\]\['w'\] is int 3; {forms}"):
        jremat.auto(_never_traced, budget=0.5, in_shardings=(None, {"w": 3}))
    # plan and measure raise the same TypeError (before, a ValueError about the arity)
    with pytest.raises(TypeError, match=rf"^in_shardings is int 42; {forms}"):
        jremat.measure(_never_traced, jnp.ones((4, 4)), jnp.ones((8, 4)), in_shardings=42)
    # accepted forms pass decoration; matching the arguments is for the first call
    jremat.auto(_never_traced, budget=0.5, in_shardings=(None, {"w": P(), "b": None}))


def test_a_mesh_too_big_for_the_devices_says_how_to_get_more():
    n = jax.device_count()
    with pytest.raises(ValueError, match=rf"needs {2 * n} devices; this process has {n}"):
        sharding.make_mesh({"data": 2 * n})
