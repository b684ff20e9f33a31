"""Gradient accumulation across optimizer steps, built on `optax.MultiSteps`.

`accumulate` wraps an optax optimizer to apply it once per `every_k` calls; its state is
`optax.MultiStepsState`, which `has_updated`, `state_bytes` and `state_breakdown` inspect. For
accumulation inside one jitted step see `jremat.microbatch`. Design, learning-rate scaling
sources and BatchNorm: docs/design.md#accumulation-and-microbatching.
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax import MultiStepsState

from jremat._src.base import compat as _compat
from jremat._src.base.args import as_int

__all__ = [
    "MultiStepsState",
    "accumulate",
    "has_updated",
    "lr_scale_factor",
    "state_breakdown",
    "state_bytes",
]

EveryK = int | Callable[[jax.Array], Any]
ShouldSkipFn = Callable[[Any, jax.Array, Any], tuple[jax.Array, Any]]

_REDUCTIONS = ("mean", "sum")
_LR_RULES = ("linear", "sqrt")


# ----------------------------------------------------------------------------
# BatchNorm warning, shared with microbatching.py.
# ----------------------------------------------------------------------------

_WARNED: set[str] = set()

BATCH_STATS_NOTE = (
    "BatchNorm running statistics ('batch_stats') were found. Under microbatching or "
    "gradient accumulation every forward pass normalizes with the statistics of its own "
    "microbatch (microbatch size = batch / k), not of the full effective batch, so the "
    "activations, the gradients and the running averages differ from a single large-batch "
    "step. Options: keep it (usual practice; the running averages then see k updates of "
    "microbatch statistics per optimizer update under accumulate(), or one update with the "
    "average of the k microbatch statistics under microbatch(aux_reduction='mean')); use "
    "aux_reduction='stack' to receive every microbatch's batch_stats and combine them "
    "yourself; or replace BatchNorm by GroupNorm/LayerNorm, whose output does not depend "
    "on the batch split. Never pass 'batch_stats' to an optimizer as parameters: they have "
    "zero gradient and would be changed by weight decay. This warning is shown once."
)


def _path_has_batch_stats(path: tuple[Any, ...]) -> bool:
    for entry in path:
        name = getattr(entry, "key", None)
        if name is None:
            name = getattr(entry, "name", None)
        if name == "batch_stats":
            return True
    return False


def tree_has_batch_stats(tree: Any) -> bool:
    """Whether any leaf of `tree` sits under a key or attribute named `batch_stats`."""
    paths = jax.tree_util.tree_flatten_with_path(tree)[0]
    return any(_path_has_batch_stats(path) for path, _ in paths)


def warn_batch_stats_once(where: str, tree: Any) -> None:
    """Warns (once per process and `where`) if `tree` holds a `batch_stats` leaf.

    Runs at trace time (Python side effect), so it costs nothing in the compiled step.
    """
    if where in _WARNED or not tree_has_batch_stats(tree):
        return
    _WARNED.add(where)
    warnings.warn(f"{where}: {BATCH_STATS_NOTE}", UserWarning, stacklevel=3)


# ----------------------------------------------------------------------------
# Argument checking.
# ----------------------------------------------------------------------------


def _check_every_k(every_k: Any) -> EveryK:
    if isinstance(every_k, bool):
        raise TypeError(
            "every_k must be a positive int or a callable gradient_step -> int; "
            f"got bool {every_k}."
        )
    if (k := as_int("every_k", every_k)) is not None:
        if k <= 0:
            raise ValueError(
                f"every_k must be a positive int (number of micro-steps per optimizer update) "
                f"or a callable gradient_step -> int; got {every_k}."
            )
        return k
    if callable(every_k):
        try:
            out = jax.eval_shape(every_k, jax.ShapeDtypeStruct((), jnp.int32))
        except Exception as e:  # noqa: BLE001 - re-raised with context
            raise TypeError(
                "every_k, when callable, must map an int32 scalar gradient_step (the number of "
                "optimizer updates so far) to an int scalar and be traceable by jax.jit (use "
                f"jnp.where, not a Python if, on the step); calling it failed with: {e!r}"
            ) from e
        if not (
            hasattr(out, "shape") and out.shape == () and jnp.issubdtype(out.dtype, jnp.integer)
        ):
            raise TypeError(
                "every_k, when callable, must return an integer scalar (e.g. "
                "`lambda step: jnp.where(step < 100, 1, 4)`); got "
                f"{getattr(out, 'dtype', type(out))}{getattr(out, 'shape', '')}."
            )
        return every_k
    raise TypeError(
        "every_k must be a positive int or a callable gradient_step -> int scalar; "
        f"got {type(every_k).__name__} {every_k!r}."
    )


def check_float_dtype(name: str, dtype: Any) -> jnp.dtype:
    try:
        dt = jnp.dtype(dtype)
    except TypeError as e:
        raise TypeError(
            f"{name} must be a floating dtype such as jnp.float32, jnp.bfloat16, jnp.float16 "
            f"or 'float32'; got {dtype!r}."
        ) from e
    if not jnp.issubdtype(dt, jnp.floating):
        raise TypeError(
            f"{name} must be a floating dtype such as jnp.float32, jnp.bfloat16, jnp.float16 "
            f"or 'float32'; got {dt}."
        )
    return dt


def lr_scale_factor(k: Any, rule: str | None, reference_k: int = 1) -> Any:
    """Learning-rate multiplier for an effective batch `k / reference_k` times larger.

    Args:
      k: micro-steps (or microbatches) per optimizer update; int or int array.
      rule: `None` (factor 1), `"linear"` (`k / reference_k`; Goyal et al. 2017,
        "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour") or `"sqrt"`
        (`sqrt(k / reference_k)`; Krizhevsky 2014, "One weird trick for parallelizing
        convolutional neural networks"; Hoffer et al. 2017, "Train longer, generalize
        better").
      reference_k: the `k` the base learning rate was tuned for.

    Returns:
      A Python float when `k` is a Python int, else a float32 scalar array.

    Raises:
      ValueError: unknown `rule`.

    Examples:
      >>> lr_scale_factor(4, "linear"), lr_scale_factor(4, "sqrt")
      (4.0, 2.0)
    """
    if rule is None:
        return 1.0
    if rule not in _LR_RULES:
        raise ValueError(f"lr_scaling must be None, 'linear' or 'sqrt'; got {rule!r}.")
    if isinstance(k, numbers.Integral):
        ratio = int(k) / reference_k
        return ratio if rule == "linear" else math.sqrt(ratio)
    ratio = jnp.asarray(k, jnp.float32) / reference_k
    return ratio if rule == "linear" else jnp.sqrt(ratio)


# ----------------------------------------------------------------------------
# The transformation.
# ----------------------------------------------------------------------------


def accumulate(
    optimizer: optax.GradientTransformation,
    every_k: EveryK,
    *,
    reduction: Literal["mean", "sum"] = "mean",
    accumulator_dtype: Any = jnp.float32,
    skip_non_finite: bool = False,
    should_skip_update_fn: ShouldSkipFn | None = None,
    lr_scaling: Literal["linear", "sqrt"] | None = None,
    reference_k: int = 1,
) -> optax.GradientTransformationExtraArgs:
    """Accumulates gradients over `every_k` calls and applies `optimizer` once.

    A thin, checked wrapper around `optax.MultiSteps` (the idea and the state come
    from there). Each `update` call is one *micro-step*: its gradients are folded
    into an accumulator of dtype `accumulator_dtype` (mean by Welford's update, or
    sum). On micro-steps `1 .. k-1` of a cycle the returned updates are zeros of
    the inner optimizer's update dtype (so `optax.apply_updates` leaves params
    unchanged); on the `k`-th the accumulated gradient is cast to the incoming
    gradient dtype, passed to `optimizer` and its updates are returned. With
    `reduction="mean"` and equal microbatch sizes, `k` micro-steps on microbatches
    of a batch equal one step of `optimizer` on the whole batch (for a loss that is a
    mean over examples) up to float rounding.

    Schedules count optimizer updates: the wrapped optimizer's state (including the
    `count` read by learning-rate schedules) only advances on the `k`-th
    micro-step, so a schedule `lr(n)` sees `n` = number of *optimizer updates*
    done, not micro-steps. `every_k` as a callable also receives that count
    (`state.gradient_step`).

    Args:
      optimizer: an `optax.GradientTransformation` (`init`/`update`); extra
        keyword arguments of `update` (e.g. `value=` for line searches) pass through.
      every_k: micro-steps per optimizer update: a positive `int`, or a callable
        `gradient_step (int32 scalar) -> int scalar` to vary the effective batch
        over training.
      reduction: `"mean"` (default) averages the micro-step gradients, `"sum"`
        adds them (`optax.MultiSteps(use_grad_mean=...)`).
      accumulator_dtype: dtype of the accumulator, a floating dtype; `jnp.float32`
        (default) keeps bf16/f16 gradients exact-ish, `jnp.bfloat16` halves its
        memory at a precision cost. Returned updates keep the gradient dtype.
      skip_non_finite: if `True`, a micro-step whose gradients contain NaN or Inf is
        dropped entirely (`optax.skip_not_finite`): accumulator and counters are left
        as they were and zero updates are returned, so the mean is over accepted
        micro-steps and an update happens after `k` *accepted* micro-steps.
      should_skip_update_fn: a custom `optax.ShouldSkipUpdateFunction` (e.g.
        `functools.partial(optax.skip_large_updates, max_squared_norm=...)`);
        mutually exclusive with `skip_non_finite`.
      lr_scaling: `None` (default, off), `"linear"` or `"sqrt"`: multiply the
        emitted updates by `k / reference_k` (linear rule, Goyal et al. 2017) or its
        square root (Krizhevsky 2014; Hoffer et al. 2017), `k` being the current
        `every_k`. Multiplying the updates equals multiplying the learning rate for
        optimizers whose learning rate is a final scale (sgd, momentum, adam, adamw
        including its decoupled weight decay, lion, ...), not for ones using the
        learning rate inside their state (e.g. schedule-free).
      reference_k: the `every_k` the base learning rate was tuned for (positive int,
        default 1: the learning rate was tuned for one microbatch).

    Returns:
      An `optax.GradientTransformationExtraArgs` whose state is an
      `optax.MultiStepsState` (`mini_step`, `gradient_step` int32 scalars;
      `inner_opt_state`; `acc_grads` like params in `accumulator_dtype`;
      `skip_state`).

    Raises:
      TypeError: `optimizer` is not a GradientTransformation; `every_k` is not a
        positive int or an int-valued callable; `accumulator_dtype` is not floating;
        `should_skip_update_fn` is not callable.
      ValueError: `every_k <= 0`; unknown `reduction` or `lr_scaling`;
        `reference_k <= 0`; both `skip_non_finite` and `should_skip_update_fn`.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> from jremat import accumulate, has_updated
      >>> opt = accumulate(optax.sgd(0.5), every_k=2)
      >>> params = {"w": jnp.zeros(3)}
      >>> state = opt.init(params)
      >>> u, state = opt.update({"w": jnp.ones(3)}, state, params)  # micro-step 1
      >>> bool(has_updated(state)), bool(jnp.all(u["w"] == 0))  # zero updates (maybe -0.0)
      (False, True)
      >>> u, state = opt.update({"w": 3 * jnp.ones(3)}, state, params)  # update
      >>> bool(has_updated(state)), u["w"].tolist()  # -0.5 * mean(1, 3)
      (True, [-1.0, -1.0, -1.0])
    """
    init, update = getattr(optimizer, "init", None), getattr(optimizer, "update", None)
    if not (callable(init) and callable(update)):
        raise TypeError(
            "optimizer must be an optax.GradientTransformation (an object with init and update, "
            f"e.g. optax.adamw(1e-3)); got {type(optimizer).__name__}."
        )
    every_k = _check_every_k(every_k)
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}; got {reduction!r}.")
    acc_dtype = check_float_dtype("accumulator_dtype", accumulator_dtype)
    if lr_scaling is not None and lr_scaling not in _LR_RULES:
        raise ValueError(f"lr_scaling must be None, 'linear' or 'sqrt'; got {lr_scaling!r}.")
    if (ref := as_int("reference_k", reference_k)) is None or ref <= 0:
        raise ValueError(f"reference_k must be a positive int; got {reference_k!r}.")
    reference_k = ref
    if skip_non_finite and should_skip_update_fn is not None:
        raise ValueError(
            "Pass either skip_non_finite=True or should_skip_update_fn, not both "
            "(skip_non_finite=True is should_skip_update_fn=optax.skip_not_finite)."
        )
    if should_skip_update_fn is not None and not callable(should_skip_update_fn):
        raise TypeError(
            "should_skip_update_fn must be a callable (updates, gradient_step, params) -> "
            f"(bool scalar, state), e.g. optax.skip_not_finite; got {should_skip_update_fn!r}."
        )
    if skip_non_finite:
        should_skip_update_fn = optax.skip_not_finite

    ms = optax.MultiSteps(
        optimizer,
        every_k_schedule=every_k,
        use_grad_mean=reduction == "mean",
        should_skip_update_fn=should_skip_update_fn,
        accumulator_dtype=acc_dtype,
    )
    k_of = (lambda step: every_k) if isinstance(every_k, int) else every_k

    def init_fn(params):
        warn_batch_stats_once("jremat.accumulate", params)
        return ms.init(params)

    def update_fn(updates, state, params=None, **extra_args):
        if not isinstance(state, MultiStepsState):
            raise TypeError(
                "state must be the optax.MultiStepsState returned by this transformation's "
                f"init; got {type(state).__name__}."
            )
        new_updates, new_state = ms.update(updates, state, params, **extra_args)
        # optax.MultiSteps resets the accumulator (and masks the updates of mid steps) by
        # multiplying by 0/1, which keeps a NaN or Inf forever; select instead
        emitted = new_state.gradient_step != state.gradient_step
        new_state = new_state._replace(
            acc_grads=jax.tree.map(
                lambda a: jnp.where(emitted, jnp.zeros_like(a), a), new_state.acc_grads
            )
        )
        new_updates = jax.tree.map(lambda u: jnp.where(emitted, u, jnp.zeros_like(u)), new_updates)
        if lr_scaling is not None:
            factor = lr_scale_factor(k_of(state.gradient_step), lr_scaling, reference_k)
            new_updates = jax.tree.map(lambda u: (u * factor).astype(u.dtype), new_updates)
        return new_updates, new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


# ----------------------------------------------------------------------------
# State helpers.
# ----------------------------------------------------------------------------


def _find_multisteps(state: Any, fn: str) -> MultiStepsState:
    if isinstance(state, MultiStepsState):
        return state
    found = [
        leaf
        for leaf in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, MultiStepsState))
        if isinstance(leaf, MultiStepsState)
    ]
    if len(found) != 1:
        raise TypeError(
            f"{fn} needs the state of jremat.accumulate / optax.MultiSteps (an "
            "optax.MultiStepsState), or a pytree holding exactly one; found "
            f"{len(found)} in a {type(state).__name__}."
        )
    return found[0]


def has_updated(state: Any) -> jax.Array:
    """Whether the last `update` call applied the optimizer (bool scalar array).

    Same rule as `optax.MultiSteps.has_updated`: `mini_step == 0` and at least
    one optimizer update done. After a skipped micro-step (`skip_non_finite`) it
    keeps the value it had. Works under `jit` (returns a traced bool).

    Args:
      state: an `optax.MultiStepsState`, or a pytree (e.g. a chain's tuple state)
        holding exactly one.

    Returns:
      A bool scalar array.

    Raises:
      TypeError: no or several `MultiStepsState` in `state`.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> from jremat import accumulate, has_updated
      >>> opt = accumulate(optax.sgd(1.0), 1)
      >>> s = opt.init(jnp.zeros(2))
      >>> bool(has_updated(s)), bool(has_updated(opt.update(jnp.ones(2), s)[1]))
      (False, True)
    """
    s = _find_multisteps(state, "has_updated")
    return jnp.logical_and(s.mini_step == 0, s.gradient_step > 0)


def _leaf_bytes(x: Any) -> int:
    shape = getattr(x, "shape", None)
    dtype = getattr(x, "dtype", None)
    if shape is None or dtype is None:
        return int(np.asarray(x).nbytes)
    # dtype_itemsize: a typed PRNG key's dtype (`key<fry>`) is no numpy dtype
    return int(math.prod(shape)) * _compat.dtype_itemsize(dtype)


def state_bytes(state: Any) -> int:
    """Total bytes of the array leaves of `state` (an optimizer state or any pytree).

    `size * itemsize` summed over leaves; works on concrete arrays and on
    `jax.ShapeDtypeStruct` trees, e.g. `state_bytes(jax.eval_shape(opt.init, params))`
    sizes a state without allocating it. Python scalars count as their NumPy size.

    Args:
      state: an optimizer state or any pytree of arrays, `ShapeDtypeStruct`s or scalars.

    Returns:
      The bytes, an int.

    Examples:
      >>> import jax, jax.numpy as jnp, optax
      >>> from jremat import accumulate, state_bytes
      >>> p = {"w": jnp.zeros((1000,), jnp.float32)}
      >>> state_bytes(optax.adam(1e-3).init(p))  # count (4) + mu, nu (2 * 4000)
      8004
      >>> state_bytes(jax.eval_shape(accumulate(optax.adam(1e-3), 4).init, p))
      12012
    """
    return sum(_leaf_bytes(x) for x in jax.tree.leaves(state))


def state_breakdown(state: Any) -> dict[str, int]:
    """Bytes of an accumulation state by part.

    Args:
      state: an `optax.MultiStepsState`, or a pytree holding exactly one.

    Returns:
      `{"inner": inner optimizer state, "accumulator": acc_grads,
      "counters": mini_step + gradient_step, "skip": skip_state, "total": sum}`.

    Raises:
      TypeError: `state` holds no or several `MultiStepsState`.
    """
    s = _find_multisteps(state, "state_breakdown")
    parts = {
        "inner": state_bytes(s.inner_opt_state),
        "accumulator": state_bytes(s.acc_grads),
        "counters": state_bytes((s.mini_step, s.gradient_step)),
        "skip": state_bytes(s.skip_state),
    }
    parts["total"] = sum(parts.values())
    return parts
