"""Per-equation cost model: FLOPs, and which primal values an equation's VJP keeps (residuals).

FLOPs count a multiply-add as 2, as XLA's `cost_analysis` does; unknown primitives cost one
FLOP per output element and keep their float inputs (conservative defaults, never a crash).
The FLOP and residual tables, and fusion: docs/design.md#tracing-and-the-cost-model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from jremat._src.base import compat as _compat

NEEDS_NOTHING = frozenset(
    """add add_any sub neg reshape broadcast_in_dim transpose squeeze expand_dims
    convert_element_type reduce_sum slice dynamic_slice dynamic_update_slice concatenate pad copy
    copy_p real imag complex conj select_n gather scatter-add scatter_add iota stop_gradient
    cumsum rev reduce_precision device_put sharding_constraint squeeze eq ne lt le gt ge and or
    not xor shift_left shift_right_logical shift_right_arithmetic random_bits random_seed
    random_wrap random_unwrap random_fold_in random_split threefry2x32 floor ceil round sign
    is_finite argmax argmin population_count clz iota broadcast_to split mesh_cast
    """.split()
)
NEEDS_OUTPUT = frozenset("tanh exp exp2 logistic sqrt rsqrt cbrt expm1".split())
MOVEMENT = frozenset(
    """reshape broadcast_in_dim transpose squeeze expand_dims convert_element_type slice
    dynamic_slice dynamic_update_slice concatenate pad copy copy_p gather iota rev device_put
    sharding_constraint random_wrap random_unwrap split mesh_cast stop_gradient""".split()
)
#: Counted one FLOP per input element (approximate: XLA's count depends on how a backend
#: lowers them, docs/design.md#tracing-and-the-cost-model).
REDUCTIONS = frozenset(
    "argmax argmin cumsum cumprod cummax cummin cumlogsumexp reduce_precision".split()
)
#: Reductions XLA counts as one operation per input element folded into another: input
#: elements minus output elements (a sum of 4 x 64 over its rows: 192; none over an empty
#: axis). A general `lax.reduce` counts its body's FLOPs per fold.
FOLDS = frozenset("reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or".split())
#: Windowed reductions (pooling): window elements - 1 operations per output element, padding
#: taps included, as XLA counts them; a general `lax.reduce_window` its body's FLOPs each.
WINDOW_FOLDS = frozenset("reduce_window_sum reduce_window_max reduce_window_min".split())
#: Operations per element where XLA expands a primitive into several (on every backend:
#: `logistic` is 1 / (1 + exp(-x)), a transcendental and three operations).
EXPANDED = {"logistic": 4}


#: Elementwise (and broadcast/convert) primitives XLA fuses into the consumer's kernel; their
#: results are not stored for the backward pass but recomputed from the fusion's inputs.
FUSIBLE = frozenset(
    """add add_any sub mul div neg max min exp exp2 log log1p expm1 tanh logistic sqrt rsqrt
    cbrt pow integer_pow select_n convert_element_type erf erfc abs sign square
    broadcast_in_dim reshape squeeze expand_dims eq ne lt le gt ge and or not is_finite
    sin cos tan floor ceil round clamp nextafter rem copy copy_p stop_gradient
    """.split()
)


def _size(aval: Any) -> int:
    shape = getattr(aval, "shape", ())
    return int(np.prod(shape, dtype=np.int64)) if shape else 1


def dot_general_flops(eqn: Any) -> float:
    (lc, _rc), (lb, _rb) = eqn.params["dimension_numbers"]
    lhs = eqn.invars[0].aval.shape
    out = _size(eqn.outvars[0].aval)
    contracted = int(np.prod([lhs[d] for d in lc], dtype=np.int64)) if lc else 1
    del lb
    return 2.0 * out * contracted


def _window_taps(
    out: int, kernel: int, size: int, stride: int, pad_low: int, lhs_dil: int, rhs_dil: int
) -> int:
    """(output position, kernel tap) pairs of one spatial dimension whose input index falls
    on an input element: not in the padding, not between the elements of a dilated input."""
    o = np.arange(out, dtype=np.int64)[:, None]
    k = np.arange(kernel, dtype=np.int64)[None, :]
    dilated = o * stride - pad_low + k * rhs_dil  # index into the padded, dilated input
    on_input = (dilated % lhs_dil == 0) & (dilated >= 0) & (dilated < (size - 1) * lhs_dil + 1)
    return int(on_input.sum())


def conv_flops(eqn: Any) -> float:
    """FLOPs of a `conv_general_dilated`: 2 per multiply-add whose input tap falls on the
    input, as XLA's `HloCostAnalysis` counts them (taps on the padding or between the
    elements of a dilated input are not computed): 2 * batch / batch groups * output
    features * input features / feature groups * the product over spatial dimensions of
    `_window_taps`. (XLA:CPU rewrites a convolution whose batch groups equal its output
    features, a depthwise convolution's weight gradient, into an ungrouped one and counts
    that: 8-12x this figure there.)"""
    lhs, rhs = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
    out = eqn.outvars[0].aval.shape
    dn = eqn.params["dimension_numbers"]
    lhs_spec, rhs_spec, out_spec = dn.lhs_spec, dn.rhs_spec, dn.out_spec
    spatial = len(lhs_spec) - 2
    strides = eqn.params.get("window_strides") or (1,) * spatial
    padding = eqn.params.get("padding") or ((0, 0),) * spatial
    lhs_dil = eqn.params.get("lhs_dilation") or (1,) * spatial
    rhs_dil = eqn.params.get("rhs_dilation") or (1,) * spatial
    taps = 1
    for d in range(spatial):
        taps *= _window_taps(
            out[out_spec[2 + d]],
            rhs[rhs_spec[2 + d]],
            lhs[lhs_spec[2 + d]],
            strides[d],
            padding[d][0],
            lhs_dil[d],
            rhs_dil[d],
        )
    batch = lhs[lhs_spec[0]] // eqn.params.get("batch_group_count", 1)
    in_feat = lhs[lhs_spec[1]] // eqn.params.get("feature_group_count", 1)
    return 2.0 * batch * out[out_spec[1]] * in_feat * taps


def integer_pow_multiplies(y: int) -> int:
    """Operations per element of `x ** y` as JAX lowers it, by squaring and multiplying
    (one more, a reciprocal, for y < 0): 0 for y = 0 or 1, 2 for 3, 6 for 15."""
    n = abs(int(y))
    ops = max(n.bit_length() - 1, 0) + max(bin(n).count("1") - 1, 0)
    return ops + (y < 0)


def eqn_flops(eqn: Any) -> float:
    """FLOPs of one equation, nested bodies included (the table in
    docs/design.md#tracing-and-the-cost-model)."""
    name = eqn.primitive.name
    if name == "dot_general":
        return dot_general_flops(eqn)
    if name == "conv_general_dilated":
        return conv_flops(eqn)
    if name in MOVEMENT:
        return 0.0
    if name in FOLDS or name == "reduce":
        folds = max(_size(eqn.invars[0].aval) - _size(eqn.outvars[0].aval), 0)
        return _flops_per_fold(eqn, name in FOLDS) * folds
    if name in WINDOW_FOLDS or name == "reduce_window":
        window = int(np.prod(eqn.params["window_dimensions"], dtype=np.int64))
        folds = _size(eqn.outvars[0].aval) * max(window - 1, 0)
        return _flops_per_fold(eqn, name in WINDOW_FOLDS) * folds
    if name in REDUCTIONS:
        return float(sum(_size(v.aval) for v in eqn.invars))
    if name == "integer_pow":
        return float(_size(eqn.outvars[0].aval) * integer_pow_multiplies(eqn.params["y"]))
    if name in EXPANDED:
        return float(_size(eqn.outvars[0].aval) * EXPANDED[name])
    subs = _compat.subjaxprs(eqn)
    if subs:
        costs = [jaxpr_flops(j) for j in subs]
        if name == "scan":
            return _compat.scan_length(eqn) * sum(costs)
        if name == "cond":
            return max(costs)
        if name.startswith("custom_"):
            return costs[0]
        return float(sum(costs))
    return float(sum(_size(v.aval) for v in eqn.outvars))


def _flops_per_fold(eqn: Any, builtin: bool) -> float:
    """FLOPs of one fold of a reduction: 1 for a built-in one (`FOLDS`, `WINDOW_FOLDS`); a
    general `lax.reduce` / `lax.reduce_window` applies its body (per operand of a tuple)."""
    return 1.0 if builtin else sum(jaxpr_flops(j) for j in _compat.subjaxprs(eqn))


def jaxpr_flops(jaxpr: Any) -> float:
    jaxpr, _ = _compat.closed(jaxpr)
    return float(sum(eqn_flops(e) for e in jaxpr.eqns))


def residual_positions(eqn: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(input positions, output positions) whose primal values the VJP of `eqn` keeps.

    A nested checkpoint's VJP recomputes its body from its inputs: it keeps its floating
    inputs, as `internal_residual_bytes` leaves them to the caller."""
    name = eqn.primitive.name
    if name in NEEDS_NOTHING:
        return (), ()
    if name in NEEDS_OUTPUT:
        return (), (0,)
    if name == "integer_pow":
        return (0,), ()
    if name == "select_n":
        return (0,), ()
    floats = tuple(
        i
        for i, v in enumerate(eqn.invars)
        if _compat.is_float_dtype(getattr(v.aval, "dtype", None)) and not hasattr(v, "val")
    )
    if name == "mul" and len(floats) == 1:  # scaling by a constant is linear
        return (), ()
    return floats, ()


def internal_residual_bytes(eqn: Any) -> int:
    """Bytes a control-flow equation keeps inside itself for its backward pass.

    A scan keeps every iteration's residuals stacked (length x body residuals); a cond the
    largest branch's; a nested checkpoint its inputs (counted by the caller) and what its
    policy saves (`policy_saved_bytes`).
    """
    name = eqn.primitive.name
    if name in _compat.CHECKPOINT_PRIMITIVES:
        return policy_saved_bytes(eqn)
    subs = _compat.subjaxprs(eqn)
    if not subs:
        return 0
    inner = [jaxpr_residual_bytes(j) for j in subs]
    if name == "scan":
        return _compat.scan_length(eqn) * sum(inner)
    if name == "cond":
        return max(inner)
    return inner[0] if name.startswith("custom_") else sum(inner)


def policy_saved_bytes(eqn: Any) -> int:
    """Bytes a nested checkpoint's policy saves inside it for its backward pass: the floating
    outputs of the body's equations (calls included, scans times their length) its policy
    marks saveable on the device (a user's `jax.checkpoint(f, policy=dots_saveable)` keeps
    its matmul results). 0 without a policy (JAX's default saves nothing). An outer
    checkpoint that saves none of them recomputes them: on jax 0.12, `nothing_saveable`
    around 4 such MLP layers compiled to 0.36 of the unrematerialized temp, where they alone
    hold all of it."""
    policy = eqn.params.get("policy")
    body = eqn.params.get("jaxpr")
    if policy is None or body is None:
        return 0
    return jaxpr_policy_saved_bytes(body, policy)


def jaxpr_policy_saved_bytes(jaxpr: Any, policy: Callable[..., Any]) -> int:
    """Bytes `jax.checkpoint(policy)` around `jaxpr` saves for the backward pass: the floating
    outputs of its equations (calls included, scans times their length) `policy` marks
    saveable (`policy_saved_bytes`' count, for a policy not applied yet)."""

    def saved(jaxpr: Any) -> int:
        total = 0
        for e in _compat.closed(jaxpr)[0].eqns:
            if e.primitive.name in _compat.INLINE_PRIMITIVES:
                total += sum(saved(j) for j in _compat.subjaxprs(e))
                continue
            if e.primitive.name == "scan":  # a scan saves its body's values stacked
                total += _compat.scan_length(e) * sum(saved(j) for j in _compat.subjaxprs(e))
                continue
            try:
                keep = policy(e.primitive, *[v.aval for v in e.invars], **e.params)
            except Exception:  # a policy that cannot judge this equation: counted as not saved
                keep = False
            # True, or JAX's `Saveable` marker (an instance of `SaveableType`, what
            # `save_and_offload_only_these_names` returns); `Offloadable` leaves the device
            if keep is True or type(keep).__name__ == "SaveableType":
                total += sum(
                    _compat.aval_nbytes(v.aval)
                    for v in e.outvars
                    if _compat.is_float_dtype(getattr(v.aval, "dtype", None))
                )
        return total

    return saved(jaxpr)


def jaxpr_residual_bytes(jaxpr: Any) -> int:
    """Bytes of the residuals the VJP of a whole jaxpr keeps (per the residual table)."""
    jaxpr, _ = _compat.closed(jaxpr)
    seen: set[int] = set()
    total = 0
    for eqn in jaxpr.eqns:
        ins, outs = residual_positions(eqn)
        for v in [eqn.invars[i] for i in ins] + [eqn.outvars[i] for i in outs]:
            if hasattr(v, "val") or id(v) in seen:
                continue
            seen.add(id(v))
            total += _compat.aval_nbytes(v.aval)
        total += internal_residual_bytes(eqn)
    return total
