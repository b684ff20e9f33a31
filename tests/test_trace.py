"""`jremat.trace` (`jremat._src.trace.graph`): values and their bytes, producers, residuals and
the program fingerprint, on small hand-written functions."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jremat
from jremat._src.trace.graph import ARG, CONST, is_literal

W = jnp.linspace(-1.0, 1.0, 64, dtype=jnp.float32).reshape(8, 8)
X = jnp.linspace(-2.0, 2.0, 128, dtype=jnp.float32).reshape(16, 8)
C = np.arange(32, dtype=np.float32).reshape(4, 8)  # captured: traced as a constant


def _small(w, x):
    """dot -> tanh -> sin -> dot with a captured constant -> sum."""
    h = x @ w
    t = jnp.tanh(h)
    s = jnp.sin(t)
    return jnp.sum(s @ C.T)


def _node(graph, primitive, nth=0):
    return [n for n in graph.nodes if n.primitive == primitive][nth]


def test_values_bytes_equal_aval_sizes():
    """Every value's bytes are its aval's size (elements x itemsize) for several dtypes, and
    each node's output values have its equation's output shapes and dtypes."""

    def f(params, x):
        h = jnp.tanh(x @ params["w"]).astype(jnp.bfloat16)  # bf16
        idx = jnp.argmax(h, axis=-1)  # int32
        pos = h > 0  # bool
        y = jnp.where(pos, h, 0).astype(jnp.float32) * idx[:, None].astype(jnp.float32)
        return jnp.mean(y * params["b"]) + jnp.float32(2.0) * jnp.sum(x)

    params = {"w": W, "b": jnp.ones((8,), jnp.float32)}
    g = jremat.trace(f, params, X)
    dtypes = {v.dtype for v in g.values}
    assert {"float32", "bfloat16", "int32", "bool"} <= dtypes
    for v in g.values:
        want = int(np.prod(v.shape, dtype=np.int64)) * np.dtype(v.dtype).itemsize
        assert v.nbytes == want == v.global_nbytes, v
        assert v.spec is None  # unsharded
        assert v.is_float == jnp.issubdtype(np.dtype(v.dtype), jnp.floating), v
    for n in g.nodes:
        for vid, var in zip(n.outputs, n.eqn.outvars, strict=True):
            assert g.values[vid].shape == tuple(var.aval.shape)
            assert g.values[vid].dtype == str(var.aval.dtype)
            assert g.values[vid].producer == n.index
    assert g.total_flops == sum(n.flops for n in g.nodes) > 0


def test_argument_and_constant_producers():
    g = jremat.trace(_small, W, X)
    # arguments: flattened in order, produced by ARG, not XLA temporaries
    assert [g.values[i].shape for i in g.invars] == [W.shape, X.shape]
    assert all(g.values[i].producer == ARG and not g.is_temp(i) for i in g.invars)
    assert g.diff_invars == [True, False]  # argnums=0
    # the captured constant: produced by CONST, its array kept in `consts`
    ((cid, const),) = g.consts.items()
    assert g.values[cid].producer == CONST and not g.is_temp(cid)
    np.testing.assert_array_equal(np.asarray(const), C.T)
    assert cid in _node(g, "dot_general", 1).inputs
    # everything else is produced by a node, in program order
    others = set(range(len(g.values))) - set(g.invars) - {cid}
    assert others and all(g.is_temp(v) for v in others)
    assert [n.index for n in g.nodes] == list(range(g.num_nodes))
    assert [n.primitive for n in g.nodes] == [
        "dot_general",
        "tanh",
        "sin",
        "dot_general",
        "reduce_sum",
    ]
    (out,) = g.outvars
    assert g.values[out].producer == g.num_nodes - 1 and g.values[out].shape == ()
    # consumers: each value lists the nodes reading it
    assert g.consumers[g.invars[0]] == [0]
    assert g.consumers[g.nodes[0].outputs[0]] == [1]


def test_literals_stay_literals():
    g = jremat.trace(lambda w, x: jnp.sum(x @ w * 3.0), W, X)
    mul = _node(g, "mul")
    assert any(is_literal(x) for x in mul.inputs)
    assert mul.residuals == ()  # scaling by a constant is linear: nothing kept


def test_jit_bodies_are_inlined():
    inner = jax.jit(lambda h: jnp.tanh(h) * 2.0)
    g = jremat.trace(lambda w, x: jnp.sum(inner(x @ w)), W, X)
    prims = [n.primitive for n in g.nodes]
    assert "tanh" in prims and not {"jit", "pjit", "closed_call"} & set(prims)


def test_residuals_of_a_small_function():
    g = jremat.trace(_small, W, X)
    w, x = g.invars
    (cid,) = g.consts
    dot1, tanh, sin, dot2, total = g.nodes
    (h,), (t,), (s,) = dot1.outputs, tanh.outputs, sin.outputs
    assert dot1.residuals == (x, w)  # a matmul keeps both operands
    # tanh keeps its output and sin its input, t; but tanh and sin are elementwise, so XLA
    # fuses them and recomputes t from h: both residuals are anchored on h
    assert tanh.residuals == (h,)
    assert sin.residuals == (h,)
    assert t not in {r for n in g.nodes for r in n.residuals}
    assert dot2.residuals == (s, cid)  # s feeds a matmul: it is materialized, kept as such
    assert total.residuals == ()  # a sum is linear
    # what the VJP rules themselves read (what a checkpointed segment recomputes from h):
    # tanh its output, sin its input
    assert (tanh.vjp_residuals, sin.vjp_residuals) == ((t,), (t,))
    assert dot1.vjp_residuals == (x, w) and total.vjp_residuals == ()

    # when tanh's output is materialized (two users), the output itself is the residual
    def two_users(w, x):
        t = jnp.tanh(x @ w)
        return jnp.sum(t @ w) + jnp.sum(t)

    g2 = jremat.trace(two_users, W, X)
    tanh2 = _node(g2, "tanh")
    assert tanh2.residuals == tanh2.outputs


def _other_program(w, x):
    h = x @ w
    return jnp.sum(jnp.cos(jnp.tanh(h)) @ C.T)  # `_small` with cos for sin


def test_fingerprint_is_stable_and_tells_programs_apart():
    a = jremat.trace(_small, W, X).fingerprint
    assert isinstance(a, str) and a
    # the same program traced again, from a fresh function object and from shapes only
    assert jremat.trace(_small, W, X).fingerprint == a
    assert jremat.trace(lambda w, x: _small(w, x), W, X).fingerprint == a
    structs = [jax.ShapeDtypeStruct(v.shape, v.dtype) for v in (W, X)]
    assert jremat.trace(_small, *structs).fingerprint == a
    # other values of the same shapes: the same program
    assert jremat.trace(_small, W * 2, X + 1).fingerprint == a
    # a different primitive, a different shape, a different dtype: different programs
    assert jremat.trace(_other_program, W, X).fingerprint != a
    assert jremat.trace(_small, W, X[:8]).fingerprint != a
    assert jremat.trace(_small, W, X.astype(jnp.bfloat16)).fingerprint != a


def _scan_program(body_op, power):
    def loss(ws, x):
        def body(h, w):
            return h + body_op(h @ w) ** power, None

        return jnp.sum(jax.lax.scan(body, x, ws)[0])

    return loss


def test_fingerprint_sees_loop_bodies_and_parameters():
    """Programs alike at the top level (one scan of the same shapes) but with another body, or
    another exponent (a parameter, not a primitive), are other programs: a plan saved for one
    must never be loaded for the other (the default on-disk plan cache keys by it)."""
    ws = jnp.ones((3, 16, 16))
    x = jnp.ones((4, 16))
    a = jremat.trace(_scan_program(jnp.sin, 2), ws, x).fingerprint
    assert jremat.trace(_scan_program(jnp.sin, 2), ws, x).fingerprint == a
    assert jremat.trace(_scan_program(jnp.cos, 2), ws, x).fingerprint != a
    assert jremat.trace(_scan_program(jnp.sin, 3), ws, x).fingerprint != a
    assert (
        jremat.trace(lambda w, x: _small(w, x) ** 3, W, X).fingerprint
        != jremat.trace(lambda w, x: _small(w, x) ** 2, W, X).fingerprint
    )


def test_trace_rejects_bad_arguments():
    with pytest.raises(TypeError, match="callable"):
        jremat.trace(42, W, X)
    with pytest.raises(ValueError):
        jremat.trace(_small, W, X, argnums=5)
