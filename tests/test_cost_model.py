"""`jremat._src.trace.cost_model`: FLOPs of the compute-heavy primitives against XLA's own count,
and which primal values each primitive's VJP keeps (residual positions)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jremat
from jremat._src.trace import cost_model


def _eqn(fn, *args):
    """The single equation `fn(*args)` traces to."""
    (eqn,) = jax.make_jaxpr(fn)(*args).jaxpr.eqns
    return eqn


def _xla_flops(fn, *args) -> float:
    """XLA's `cost_analysis()` FLOPs plus transcendentals of `fn` compiled alone (jremat's
    compute figure, `xla.xla_flops`; a program with neither reports no key: 0)."""
    ca = jax.jit(fn).lower(*args).compile().cost_analysis()
    if isinstance(ca, (list, tuple)):  # older JAX: one dict per computation
        ca = ca[0]
    return float(ca.get("flops", 0.0) + ca.get("transcendentals", 0.0))


def _ones(*shape):
    return jnp.ones(shape, jnp.float32)


DOTS = {
    "matmul": (lambda a, b: a @ b, (_ones(6, 7), _ones(7, 5))),
    "matvec": (lambda a, b: a @ b, (_ones(6, 7), _ones(7))),
    "batched": (
        lambda a, b: jax.lax.dot_general(a, b, (((2,), (1,)), ((0,), (0,)))),
        (_ones(2, 3, 4), _ones(2, 4, 5)),
    ),
    "two_contracted": (
        lambda a, b: jax.lax.dot_general(a, b, (((1, 2), (0, 1)), ((), ()))),
        (_ones(3, 4, 5), _ones(4, 5, 6)),
    ),
    "einsum_heads": (
        lambda q, k: jnp.einsum("bqhd,bkhd->bhqk", q, k),
        (_ones(2, 5, 3, 4), _ones(2, 6, 3, 4)),
    ),
}


@pytest.mark.parametrize("case", list(DOTS))
def test_dot_general_flops_equal_xla(case):
    fn, args = DOTS[case]
    eqn = _eqn(fn, *args)
    assert eqn.primitive.name == "dot_general"
    assert cost_model.eqn_flops(eqn) == _xla_flops(fn, *args) > 0


def _conv(strides, padding, groups=1, dn=("NHWC", "HWIO", "NHWC"), dilation=None):
    def fn(x, w):
        return jax.lax.conv_general_dilated(
            x,
            w,
            strides,
            padding,
            rhs_dilation=dilation,
            dimension_numbers=dn,
            feature_group_count=groups,
        )

    return fn


CONVS = {
    "nhwc_valid": (_conv((1, 1), "VALID"), (_ones(2, 9, 9, 4), _ones(3, 3, 4, 6))),
    "nhwc_valid_groups": (_conv((1, 1), "VALID", 2), (_ones(2, 9, 9, 4), _ones(3, 3, 2, 6))),
    "nchw_strided": (
        _conv((2, 2), "VALID", dn=("NCHW", "OIHW", "NCHW")),
        (_ones(2, 4, 9, 9), _ones(6, 4, 3, 3)),
    ),
    "nhwc_1x1": (_conv((1, 1), "VALID"), (_ones(2, 5, 5, 4), _ones(1, 1, 4, 3))),
    "conv1d": (
        _conv((1,), "VALID", dn=("NWC", "WIO", "NWC")),
        (_ones(2, 11, 3), _ones(4, 3, 5)),
    ),
    "nhwc_dilated": (
        _conv((1, 1), "VALID", dilation=(2, 2)),
        (_ones(1, 9, 9, 2), _ones(3, 3, 2, 3)),
    ),
    # with padding XLA counts only the taps that fall on the input (60000 here, of 69984)
    "nhwc_same_padding": (_conv((1, 1), "SAME"), (_ones(2, 9, 9, 4), _ones(3, 3, 4, 6))),
    "nhwc_negative_padding": (
        _conv((1, 1), ((-1, 2), (1, -1))),
        (_ones(2, 9, 9, 4), _ones(3, 3, 4, 6)),
    ),
}


@pytest.mark.parametrize(
    "fn, args",
    list(CONVS.values()),
    ids=list(CONVS),
)
def test_conv_general_dilated_flops_equal_xla(fn, args):
    eqn = _eqn(fn, *args)
    assert eqn.primitive.name == "conv_general_dilated"
    assert cost_model.eqn_flops(eqn) == _xla_flops(fn, *args) > 0


#: Convolutions whose backward passes hold the window shapes the forward one does not: the
#: data gradient of a strided convolution is one over an input dilated by the stride, the
#: weight gradient one whose window is the output's cotangent.
GRAD_CONVS = {
    "strided_same": dict(window_strides=(2, 2), padding="SAME"),
    "strided_valid_dilated": dict(window_strides=(2, 1), padding="VALID", rhs_dilation=(1, 2)),
    "grouped_padded": dict(window_strides=(1, 1), padding=((2, 0), (1, 1)), feature_group_count=2),
    "transposed": dict(window_strides=(1, 1), padding=((1, 1), (2, 2)), lhs_dilation=(2, 2)),
}


@pytest.mark.parametrize("case", list(GRAD_CONVS))
def test_conv_flops_of_both_gradients_equal_xla(case):
    """Each convolution of a convolution's forward and backward passes, compiled alone,
    costs what the cost model counts."""
    kw = GRAD_CONVS[case]
    groups = kw.get("feature_group_count", 1)
    x, w = _ones(2, 4, 9, 7), _ones(6, 4 // groups, 3, 2)

    def loss(x, w):
        return jnp.sum(jax.lax.conv_general_dilated(x, w, **kw) ** 2)

    jaxpr = jax.make_jaxpr(jax.grad(loss, (0, 1)))(x, w).jaxpr
    convs = [e for e in jaxpr.eqns if e.primitive.name == "conv_general_dilated"]
    assert len(convs) == 3  # forward, data gradient, weight gradient
    for eqn in convs:
        args = [jnp.ones(v.aval.shape, v.aval.dtype) for v in eqn.invars]
        alone = lambda a, b, eqn=eqn: eqn.primitive.bind(a, b, **eqn.params)  # noqa: E731
        assert cost_model.eqn_flops(eqn) == _xla_flops(alone, *args) > 0, eqn.params


def test_elementwise_movement_and_reduction_flops():
    x = _ones(4, 6)
    assert cost_model.eqn_flops(_eqn(jnp.tanh, x)) == 24  # 1 per output element
    assert cost_model.eqn_flops(_eqn(lambda a: a * a, x)) == 24
    assert cost_model.eqn_flops(_eqn(lambda a: a.T, x)) == 0  # data movement
    assert cost_model.eqn_flops(_eqn(lambda a: jnp.reshape(a, (24,)), x)) == 0
    assert cost_model.eqn_flops(_eqn(lambda a: jnp.sum(a, 0), x)) == 18  # 24 folded into 6


#: Primitives whose count is not one per element: as XLA counts them on every backend.
COUNTED_APART = {
    "sum_rows": (lambda a: jnp.sum(a, 1), (4, 64)),
    "max_all": (jnp.max, (4, 64)),
    "prod": (lambda a: jnp.prod(a, 0), (4, 64)),
    "cube": (lambda a: a**3, (4, 64)),
    "pow_15": (lambda a: jax.lax.integer_pow(a, 15), (4, 64)),
    "pow_minus_3": (lambda a: jax.lax.integer_pow(a, -3), (4, 64)),
    "pow_1": (lambda a: jax.lax.integer_pow(a, 1), (4, 64)),
    "sigmoid": (jax.nn.sigmoid, (4, 64)),
    "sum_of_an_empty_axis": (lambda a: jnp.sum(a, 1), (4, 0, 3)),
    "general_reduce": (
        lambda a: jax.lax.reduce(a, 0.0, lambda x, z: x * 2 + z, (1, 2)),
        (2, 9, 9, 3),
    ),
    "general_tuple_reduce": (
        lambda a: jax.lax.reduce(
            (a, a), (0.0, 0.0), lambda x, z: (x[0] + z[0], jnp.maximum(x[1], z[1])), (1,)
        ),
        (2, 9, 9, 3),
    ),
    "general_reduce_window": (
        lambda a: jax.lax.reduce_window(a, 1.0, jax.lax.mul, (1, 3, 3, 1), (1, 2, 2, 1), "SAME"),
        (2, 9, 9, 3),
    ),
    "avg_pool": (
        lambda a: jax.lax.reduce_window(a, 0.0, jax.lax.add, (1, 2, 2, 1), (1, 2, 2, 1), "VALID"),
        (2, 9, 9, 3),
    ),
    "max_pool_same": (
        lambda a: jax.lax.reduce_window(
            a, -jnp.inf, jax.lax.max, (1, 3, 3, 1), (1, 2, 2, 1), "SAME"
        ),
        (2, 9, 9, 3),
    ),
}


@pytest.mark.parametrize("case", list(COUNTED_APART))
def test_fold_pow_and_expanded_flops_equal_xla(case):
    fn, shape = COUNTED_APART[case]
    x = jnp.linspace(0.1, 0.9, int(np.prod(shape))).reshape(shape)
    (eqn,) = [e for e in jax.make_jaxpr(fn)(x).jaxpr.eqns if e.primitive.name != "pjit"]
    assert cost_model.eqn_flops(eqn) == _xla_flops(fn, x), eqn


def test_scan_flops_are_body_flops_times_length():
    w = _ones(5, 5)

    def body(c, _):
        return jnp.tanh(c @ w), None

    fn = lambda c: jax.lax.scan(body, c, None, length=7)[0]  # noqa: E731
    c = _ones(3, 5)
    (eqn,) = [e for e in jax.make_jaxpr(fn)(c).jaxpr.eqns if e.primitive.name == "scan"]
    assert cost_model.eqn_flops(eqn) == 7 * (2 * 3 * 5 * 5 + 3 * 5)


X = jnp.linspace(0.1, 1.0, 12, dtype=jnp.float32).reshape(3, 4)
Y = jnp.linspace(1.0, 2.0, 12, dtype=jnp.float32).reshape(3, 4)
RESIDUALS = {
    # (function, args, (input positions kept, output positions kept))
    "tanh": (jnp.tanh, (X,), ((), (0,))),  # tanh' = 1 - tanh^2: needs its output
    "exp": (jnp.exp, (X,), ((), (0,))),
    "logistic": (jax.nn.sigmoid, (X,), ((), (0,))),
    "mul": (lambda a, b: a * b, (X, Y), ((0, 1), ())),  # each factor for the other's grad
    "div": (lambda a, b: a / b, (X, Y), ((0, 1), ())),
    "sin": (jnp.sin, (X,), ((0,), ())),  # needs its input
    "log": (jnp.log, (X,), ((0,), ())),
    "dot_general": (lambda a, b: a @ b, (X, Y.T), ((0, 1), ())),
    "integer_pow": (lambda a: a**3, (X,), ((0,), ())),
    "add": (lambda a, b: a + b, (X, Y), ((), ())),  # linear: needs nothing
    "sub": (lambda a, b: a - b, (X, Y), ((), ())),
    "neg": (lambda a: -a, (X,), ((), ())),
    "reduce_sum": (lambda a: jnp.sum(a, 1), (X,), ((), ())),
    "transpose": (lambda a: a.T, (X,), ((), ())),
    "mul_by_constant": (lambda a: a * 3.0, (X,), ((), ())),  # linear in its one float input
}


@pytest.mark.parametrize("prim", list(RESIDUALS))
def test_residual_positions(prim):
    fn, args, want = RESIDUALS[prim]
    eqn = _eqn(fn, *args)
    assert eqn.primitive.name == prim.removesuffix("_by_constant")
    assert cost_model.residual_positions(eqn) == want


def test_internal_residual_bytes_of_a_scan():
    """A scan keeps each iteration's residuals, stacked: length x body residual bytes."""
    w = _ones(5, 5)

    def body(c, _):
        return jnp.sin(c @ w), None

    fn = lambda c: jax.lax.scan(body, c, None, length=7)[0]  # noqa: E731
    c = _ones(3, 5)
    (eqn,) = [e for e in jax.make_jaxpr(fn)(c).jaxpr.eqns if e.primitive.name == "scan"]
    # per iteration: the carry and w (dot operands) and the dot's output (sin's input)
    per_iter = (3 * 5 + 5 * 5 + 3 * 5) * 4
    assert cost_model.internal_residual_bytes(eqn) == 7 * per_iter
    assert cost_model.internal_residual_bytes(_eqn(jnp.sin, X)) == 0  # not control flow
    np.testing.assert_equal(cost_model.jaxpr_residual_bytes(jax.make_jaxpr(jnp.sin)(X)), 48)


def test_a_nested_checkpoint_keeps_its_inputs_for_its_backward():
    """A user's `jax.checkpoint` recomputes its body from its inputs in the backward pass, so
    its floating inputs are residuals: a checkpointed segment that saves none of them
    recomputes the matmul producing them (JAX does), and the matmul result may be saved.
    Its residuals were empty, and the model priced that recompute at 0 FLOPs."""
    from jremat._src.plan.planners.save_sets import SaveSetPricer

    def loss(w, x):
        h = x @ w
        return jnp.sum(jax.checkpoint(lambda a: jnp.sin(a) * 3.0)(h))

    graph = jremat.trace(loss, jnp.ones((16, 16)), jnp.ones((8, 16)))
    (dot,) = [nd for nd in graph.nodes if nd.primitive == "dot_general"]
    (ckpt,) = [nd for nd in graph.nodes if nd.primitive in ("checkpoint", "remat", "remat2")]
    assert ckpt.vjp_residuals == dot.outputs
    pricer = SaveSetPricer(graph)
    n = graph.num_nodes
    assert pricer.price(0, n, ()).flops >= dot.flops
    assert pricer.facts(0, n).candidates == dot.outputs
    assert pricer.price(0, n, dot.outputs).flops == 0.0


def _named_layer(w, x):
    from jax.ad_checkpoint import checkpoint_name

    h = checkpoint_name(jnp.tanh(x @ w), "a")
    return checkpoint_name(h @ w.T, "b")


_P = jax.checkpoint_policies
_NAMED = 2 * 8 * 16 * 4  # the two named f32[8, 16] and f32[8, 16] results
_POLICIES = {
    "none": (None, 0),
    "dots": (_P.dots_saveable, _NAMED),
    "names": (_P.save_only_these_names("a", "b"), _NAMED),
    # JAX's `Saveable` marker, not True: was counted as 0
    "save_and_offload, saved": (
        _P.save_and_offload_only_these_names(
            names_which_can_be_saved=["a", "b"],
            names_which_can_be_offloaded=[],
            offload_src="device",
            offload_dst="pinned_host",
        ),
        _NAMED,
    ),
    "save_and_offload, offloaded": (
        _P.save_and_offload_only_these_names(
            names_which_can_be_saved=[],
            names_which_can_be_offloaded=["a", "b"],
            offload_src="device",
            offload_dst="pinned_host",
        ),
        0,
    ),
}


@pytest.mark.parametrize("name", sorted(_POLICIES))
def test_what_a_users_checkpoint_policy_saves_is_its_internal_bytes(name):
    from jremat._src.base import compat

    policy, expected = _POLICIES[name]
    w, x = jnp.ones((16, 16)), jnp.ones((8, 16))
    jaxpr = jax.make_jaxpr(jax.checkpoint(_named_layer, policy=policy))(w, x)
    (eqn,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name in compat.CHECKPOINT_PRIMITIVES]
    assert cost_model.internal_residual_bytes(eqn) == expected


def test_a_scan_in_a_users_checkpoint_saves_its_dots_stacked():
    from jremat._src.base import compat

    def body(w, x):
        return jax.lax.scan(lambda c, _: (_named_layer(w, c), None), x, None, length=3)[0]

    jaxpr = jax.make_jaxpr(jax.checkpoint(body, policy=_P.dots_saveable))(
        jnp.ones((16, 16)), jnp.ones((8, 16))
    )
    (eqn,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name in compat.CHECKPOINT_PRIMITIVES]
    assert cost_model.internal_residual_bytes(eqn) == 3 * _NAMED
