"""In-step microbatching: value and gradient of a loss over k microbatches in one call.

`microbatch` runs `jax.value_and_grad` on k microbatches inside a `lax.fori_loop`
(`optax.microbatching.microbatch`), exact for mean, sum and count-weighted losses; why:
docs/design.md#accumulation-and-microbatching.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
from optax import microbatching as omb

from jremat._src.base.args import as_int
from jremat._src.base.sharding import split_rows, stacked_zeros
from jremat._src.training.accumulation import check_float_dtype, warn_batch_stats_once

__all__ = ["microbatch"]

_REDUCTIONS = ("mean", "sum", "weighted")
_AUX_REDUCTIONS = ("mean", "sum", "last", "stack")


def _acc_dtype(dtype: Any, requested: Any) -> Any:
    if not jnp.issubdtype(dtype, jnp.inexact):
        return dtype
    if requested is not None:
        return requested
    return jnp.promote_types(dtype, jnp.float32)


def _leafwise(init, update, finalize) -> omb.Accumulator:
    """An optax microbatching Accumulator applying per-leaf functions to a subtree."""
    return omb.Accumulator(
        init=lambda v: jax.tree.map(init, v),
        update=lambda c, v, i: jax.tree.map(lambda cc, vv: update(cc, vv, i), c, v),
        finalize=lambda c: jax.tree.map(finalize, c),
        aggregate=lambda v: v,  # unused: only micro_vmap calls it
    )


def _aux_accumulator(kind: str, k: int) -> omb.Accumulator:
    # zeros_like and stacked_zeros keep each value's sharding: a loop carry must keep its type
    if kind == "sum":
        return _leafwise(jnp.zeros_like, lambda c, v, i: c + v, lambda c: c)
    if kind == "mean":

        def init(v):
            if not jnp.issubdtype(v.dtype, jnp.inexact):
                raise TypeError(
                    "aux_reduction='mean' needs floating-point aux leaves; got a "
                    f"{v.dtype}{list(v.shape)} leaf. Use 'sum', 'last' or 'stack' for it "
                    "(aux_reduction may be a pytree prefix of aux, e.g. "
                    "{'metrics': 'mean', 'n_correct': 'sum'})."
                )
            return jnp.zeros_like(v, dtype=_acc_dtype(v.dtype, None))

        return _leafwise(
            init,
            lambda c, v, i: c + v.astype(c.dtype),
            lambda c: c / k,
        )
    if kind == "last":
        return _leafwise(jnp.zeros_like, lambda c, v, i: v, lambda c: c)
    if kind == "stack":
        return _leafwise(
            lambda v: stacked_zeros(v, k),
            lambda c, v, i: c.at[i].set(v),
            lambda c: c,
        )
    raise AssertionError(kind)


def check_aux_reduction(aux_reduction: Any) -> None:
    leaves = jax.tree.leaves(aux_reduction)
    bad = [x for x in leaves if x not in _AUX_REDUCTIONS]
    if not leaves or bad:
        raise ValueError(
            f"aux_reduction must be one of {_AUX_REDUCTIONS} or a pytree prefix of aux with "
            f"those strings as leaves (e.g. {{'batch_stats': 'mean', 'n': 'sum'}}); got "
            f"{aux_reduction!r}."
        )


def _describe(x: Any) -> str:
    if isinstance(x, tuple | list):
        return f"a {type(x).__name__} of length {len(x)}"
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"an array {x.dtype}{list(x.shape)}"
    return f"a {type(x).__name__}"


def leading_batch_size(batch: Any, k: int) -> int:
    paths = jax.tree_util.tree_flatten_with_path(batch)[0]
    if not paths:
        raise ValueError(
            "batch must be a pytree with at least one array leaf (each split along axis 0); "
            f"got {batch!r}."
        )
    sizes: dict[int, list[str]] = {}
    for path, leaf in paths:
        name = "batch" + jax.tree_util.keystr(path)
        shape = getattr(leaf, "shape", None)
        if shape is None:
            raise ValueError(
                f"every leaf of batch must be an array with a leading batch axis; {name} is a "
                f"{type(leaf).__name__}. Pass non-batched values as extra arguments instead."
            )
        if len(shape) == 0:
            raise ValueError(
                f"every leaf of batch must have a leading batch axis to split; {name} is a "
                "scalar. Pass non-batched values as extra arguments instead."
            )
        sizes.setdefault(int(shape[0]), []).append(name)
    if len(sizes) > 1:
        detail = "; ".join(f"{n}: {', '.join(v)}" for n, v in sorted(sizes.items()))
        raise ValueError(
            f"every leaf of batch must have the same leading (batch) size; found sizes {detail}."
        )
    (size,) = sizes
    if size % k != 0:
        divisors = [d for d in range(1, size + 1) if size % d == 0]
        shown = ", ".join(map(str, divisors[:24])) + (", ..." if len(divisors) > 24 else "")
        raise ValueError(
            f"num_microbatches={k} must divide the batch size {size} (leading axis of every "
            f"leaf of batch); accepted values: {shown}."
        )
    return size


def microbatch(
    loss_fn: Callable[..., Any],
    num_microbatches: int,
    *,
    reduction: Literal["mean", "sum", "weighted"] = "mean",
    has_aux: bool = False,
    aux_reduction: Any = "mean",
    accumulator_dtype: Any = None,
) -> Callable[..., tuple[Any, Any]]:
    """Value and gradient of `loss_fn` accumulated over microbatches in one step.

    The returned function `f(params, batch, *args, **kwargs)` splits every leaf of
    `batch` along axis 0 into `num_microbatches` equal pieces, calls
    `jax.value_and_grad(loss_fn)(params, piece, *args, **kwargs)` on each inside a
    `lax.fori_loop` (via `optax.microbatching.microbatch`), and combines the
    results. `args`/`kwargs` are passed unchanged to every microbatch (so an RNG
    key passed there is the same for all; put per-example keys in `batch`). It
    only calls `loss_fn`, so any JAX function works, including ones rewritten by
    `jax.checkpoint`/jremat. Wrap the result in `jax.jit`.

    Microbatch `j` holds rows `j, j + k, j + 2k, ...` of the batch (optax's
    strided split, which keeps a batch-axis sharding local to each device); the
    order only matters for per-microbatch aux (`"last"`, `"stack"`) and for
    batch-dependent layers such as BatchNorm.

    Gradients and loss are accumulated in `accumulator_dtype` and cast back to
    the dtype `loss_fn` produced (that of params for the gradients), so bf16
    models accumulate in float32 by default.

    BatchNorm: if `params` or `aux` contain a `batch_stats` collection, a
    warning is shown once: each microbatch normalizes with its own statistics (over
    `batch / k` examples), so the result is the exact full-batch value only for
    batch-independent models. Every microbatch starts from the same incoming
    `batch_stats`; `aux_reduction="mean"` then returns the mean of the k
    updated running averages, i.e. one running-average update with the mean of the
    microbatch statistics (mean of means is the full-batch mean; the variance is the
    average within-microbatch variance). `"last"` keeps the last microbatch's,
    `"stack"` returns all k to combine yourself.

    Args:
      loss_fn: `loss_fn(params, batch, *args, **kwargs)` returning, for
        `reduction="mean"`, the mean loss over the examples of `batch` (scalar);
        for `"sum"`, the summed loss (scalar); for `"weighted"`, a pair
        `(sum_of_losses, count)` of scalars where `count` (int or float, the
        number of tokens / unmasked positions) does not depend on `params`. With
        `has_aux=True` it returns `(value, aux)` where `value` is as above.
      num_microbatches: `k`, a positive int dividing the batch size.
      reduction: `"mean"` (default), `"sum"` or `"weighted"` as above.
      has_aux: whether `loss_fn` returns `(value, aux)`.
      aux_reduction: how the k per-microbatch `aux` pytrees are combined:
        `"mean"` (default; float leaves only), `"sum"`, `"last"` (the last
        microbatch's), `"stack"` (new leading axis of size k); or a pytree prefix of
        `aux` with these strings as leaves, e.g. `{"batch_stats": "mean",
        "n_correct": "sum"}`.
      accumulator_dtype: floating dtype of the gradient/loss accumulators; `None`
        (default) uses the wider of each value's dtype and float32.

    Returns:
      `f(params, batch, *args, **kwargs) -> (loss, grads)`, or
      `((loss, aux), grads)` with `has_aux`, like `jax.value_and_grad`:
      `loss` is the full-batch mean (`"mean"`), sum (`"sum"`) or
      `sum / count` (`"weighted"`; NaN if the total count is 0, as unsplit);
      `grads` has the structure and dtypes of `params`.

    Raises:
      TypeError: `loss_fn` not callable; `num_microbatches` not an int;
        `has_aux` not a bool; `"weighted"` `loss_fn` not returning a pair of
        scalars; `aux_reduction="mean"` on a non-float aux leaf.
      ValueError: `num_microbatches <= 0`; unknown `reduction` or
        `aux_reduction`; at call time, a `batch` leaf that is not an array with a
        leading axis, leaves with different leading sizes, or a batch size that
        `num_microbatches` does not divide (the message lists accepted values).

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from jremat import microbatch
      >>> def loss_fn(w, batch):
      ...     return jnp.mean((batch["x"] @ w - batch["y"]) ** 2)
      >>> w = jnp.ones(3)
      >>> batch = {"x": jnp.arange(24.0).reshape(8, 3), "y": jnp.ones(8)}
      >>> loss, g = jax.jit(microbatch(loss_fn, 4))(w, batch)
      >>> ref_loss, ref_g = jax.value_and_grad(loss_fn)(w, batch)
      >>> bool(jnp.allclose(loss, ref_loss)), bool(jnp.allclose(g, ref_g))
      (True, True)
    """
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable; got {type(loss_fn).__name__}.")
    if (k := as_int("num_microbatches", num_microbatches)) is None:
        raise TypeError(
            f"num_microbatches must be a positive int; got {type(num_microbatches).__name__} "
            f"{num_microbatches!r}."
        )
    if k <= 0:
        raise ValueError(
            f"num_microbatches must be a positive int dividing the batch size; got {k}."
        )
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}; got {reduction!r}.")
    if not isinstance(has_aux, bool):
        raise TypeError(f"has_aux must be a bool; got {has_aux!r}.")
    check_aux_reduction(aux_reduction)
    acc_dt = None
    if accumulator_dtype is not None:
        acc_dt = check_float_dtype("accumulator_dtype (or None)", accumulator_dtype)

    weighted = reduction == "weighted"

    def value_fn(params, mb, *args, **kwargs):
        out = loss_fn(params, mb, *args, **kwargs)
        if has_aux and not (isinstance(out, tuple | list) and len(out) == 2):
            raise TypeError(
                f"With has_aux=True, loss_fn must return a pair (value, aux); got {_describe(out)}."
            )
        value, aux = out if has_aux else (out, None)
        if has_aux:
            warn_batch_stats_once("jremat.microbatch", aux)
        if weighted:
            if not (isinstance(value, tuple | list) and len(value) == 2):
                raise TypeError(
                    "With reduction='weighted', loss_fn must return (sum_of_losses, count)"
                    + (" as the first element of (value, aux)" if has_aux else "")
                    + f"; got {_describe(value)}."
                )
            total, count = value
            if jnp.shape(total) != () or jnp.shape(count) != ():
                raise TypeError(
                    "With reduction='weighted', loss_fn must return scalars "
                    f"(sum_of_losses, count); got shapes {jnp.shape(total)} and "
                    f"{jnp.shape(count)}."
                )
            return total, (jax.lax.stop_gradient(count), aux)
        if isinstance(value, tuple | list):
            raise TypeError(
                f"loss_fn returned {_describe(value)}; with reduction={reduction!r} it "
                "must return a scalar loss, or (loss, aux) with has_aux=True"
                + (", or (sum_of_losses, count) with reduction='weighted'." if not has_aux else ".")
            )
        if jnp.shape(value) != ():
            raise TypeError(
                f"loss_fn must return a scalar loss ({'mean' if reduction == 'mean' else 'sum'} "
                f"over the examples of its batch); got shape {jnp.shape(value)}."
            )
        return value, (None, aux)

    grad_fn = jax.value_and_grad(value_fn, has_aux=True)
    traced: dict[str, Any] = {}  # dtype of the loss, recorded while tracing `one`

    def one(params, mb, *args, **kwargs):
        (value, (count, aux)), grads = grad_fn(params, mb, *args, **kwargs)
        if has_aux:
            try:
                jax.tree.map(lambda r, sub: None, aux_reduction, aux)
            except ValueError as e:
                raise ValueError(
                    "aux_reduction must be one of "
                    f"{_AUX_REDUCTIONS} or a pytree prefix of the aux returned by loss_fn; "
                    f"got {aux_reduction!r} for aux of structure {jax.tree.structure(aux)}."
                ) from e
        traced["value_dtype"] = jnp.result_type(value)
        cast = lambda x: x.astype(_acc_dtype(x.dtype, acc_dt))  # noqa: E731
        count = None if count is None else cast(jnp.asarray(count))
        return (cast(value), jax.tree.map(cast, grads), count, aux)

    def microbatched(params: Any, batch: Any, *args: Any, **kwargs: Any):
        leading_batch_size(batch, k)  # checks the batch (k divides its rows)
        warn_batch_stats_once("jremat.microbatch", params)
        main = omb.AccumulationType.MEAN if reduction == "mean" else omb.AccumulationType.SUM
        aux_acc = jax.tree.map(lambda r: _aux_accumulator(r, k), aux_reduction) if has_aux else None
        # jremat splits the batch itself, stating the split's sharding under explicit
        # sharding (optax 0.2.8 reshapes without it on jax >= 0.10: its version check
        # compares strings); optax loops over the microbatch indices and accumulates
        split = jax.tree.map(lambda x: split_rows(x, k), batch)

        def indexed(params, index, split, *args, **kwargs):
            mb = jax.tree.map(lambda x: x[index[0]], split)
            return one(params, mb, *args, **kwargs)

        run = omb.microbatch(
            indexed,
            argnums=1,
            microbatch_size=1,
            accumulator=(main, main, omb.AccumulationType.SUM, aux_acc),
        )
        value, grads, count, aux = run(params, jnp.arange(k), split, *args, **kwargs)
        if weighted:
            value = value / count
            grads = jax.tree.map(lambda g: g / count, grads)
        value = value.astype(traced["value_dtype"])
        grads = jax.tree.map(lambda g, p: g.astype(jnp.result_type(p)), grads, params)
        return ((value, aux), grads) if has_aux else (value, grads)

    microbatched.__doc__ = (
        f"{getattr(loss_fn, '__name__', 'loss_fn')} value and grad over {k} microbatches "
        f"(reduction={reduction!r})."
    )
    return microbatched
