"""Checks of plain keyword arguments shared by `jremat.plan`, `jremat.auto` and `PlanCache`."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jremat._src.base import compat as _compat


def as_int(name: str, value: Any) -> int | None:
    """`value` as an int when it is an integer: a Python or NumPy int, or a 0-d NumPy or JAX
    integer array (`jnp.int32(4)`); None for anything else, bools included.

    Raises:
      TypeError: a traced 0-d integer array (its value is not known while tracing); the
        message names `name`.
    """
    if isinstance(value, (bool, np.bool_)):
        return None
    if isinstance(value, numbers.Integral):
        return int(value)
    dtype = getattr(value, "dtype", None)
    if getattr(value, "shape", None) != () or dtype is None:
        return None
    try:
        if not np.issubdtype(dtype, np.integer):
            return None
    except TypeError:  # an extended dtype (PRNG keys)
        return None
    try:
        return int(value)
    except jax.errors.ConcretizationTypeError as e:
        raise TypeError(
            f"{name} must be a concrete int, known before tracing; got a traced "
            f"{type(value).__name__} (pass it as a Python int or a static argument)"
        ) from e


def as_real(value: Any) -> float | None:
    """`value` as a float when it is a real number (Python/NumPy int or float, or a 0-d
    NumPy/JAX array of an integer or floating dtype, bfloat16 included; not a bool), else
    None."""
    if isinstance(value, (bool, np.bool_)):
        return None
    if isinstance(value, numbers.Real):
        try:
            return float(value)
        except OverflowError:  # an int too large for a float
            return math.inf
    dtype = getattr(value, "dtype", None)
    if getattr(value, "shape", None) == () and dtype is not None and _real_dtype(dtype):
        try:
            return float(value)
        except TypeError:  # a tracer
            return None
    return None


def _real_dtype(dtype: Any) -> bool:
    """Whether `dtype` is an integer or real floating dtype, JAX's (bfloat16, float8_*)
    included, whose NumPy kind is 'V'; bool and complex are not."""
    try:
        return bool(
            jax.numpy.issubdtype(dtype, jax.numpy.integer)
            or jax.numpy.issubdtype(dtype, jax.numpy.floating)
        )
    except TypeError:  # a `dtype` attribute that is not a dtype
        return False


def check_count(name: str, value: Any) -> int:
    """`value` as an int when it is an int >= 1 (Python or NumPy, or a 0-d integer array:
    `as_int`; not a bool).

    Raises:
      TypeError: not an int (a bool, float, string, None ...), or a traced one; the message
        names `name`.
      ValueError: an int below 1; the message names `name`.
    """
    count = as_int(name, value)
    if count is None:
        raise TypeError(f"{name} must be an int >= 1, got {type(value).__name__} {value!r}")
    if count < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return count


def check_compile_budget(value: Any) -> int | str | None:
    """`value` as a compile budget: "auto" (the default of `jremat.plan` and its callers),
    None (no limit), or an int >= 1 (as `check_count`); whether an int covers what
    verification needs depends on the program (`Program.verification_compiles`), checked
    where it is traced.

    Raises:
      TypeError: anything else (a bool, float, another string ...); the message names
        `compile_budget` and the accepted forms.
      ValueError: an int below 1.
    """
    if value is None or (isinstance(value, str) and value == "auto"):
        return value
    forms = (
        '"auto" (the default), None (no limit) or an int: at least the compiles verification '
        "needs (3 for a plain training step; more with has_aux or in a shard_map body)"
    )
    count = as_int("compile_budget", value)
    if count is None:
        raise TypeError(f"compile_budget must be {forms}, got {type(value).__name__} {value!r}")
    if count < 1:
        raise ValueError(f"compile_budget must be {forms}, got {value!r}")
    return count


def check_flag(name: str, value: Any) -> bool:
    """`value` as a bool when it is one (Python or NumPy bool).

    Raises:
      TypeError: anything else (0/1, strings such as "yes", None ...); the message names `name`.
    """
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(
            f"{name} must be a bool (True or False), got {type(value).__name__} {value!r}"
        )
    return bool(value)


def abstract_args(args: Sequence[Any]) -> tuple[Any, ...]:
    """Arguments as `jax.ShapeDtypeStruct`s (planning needs shapes and dtypes, and inside a
    `shard_map` body the axes each varies over). Shardings are attached by
    `base.sharding.shard_args`."""

    def to_aval(x: Any) -> Any:
        if isinstance(x, jax.ShapeDtypeStruct):
            return x
        if isinstance(x, (bool, int, float, complex)):  # a Python scalar traces weakly typed
            return jax.ShapeDtypeStruct((), jax.numpy.asarray(x).dtype, weak_type=True)
        if hasattr(x, "shape") and hasattr(x, "dtype"):
            weak = bool(getattr(getattr(x, "aval", x), "weak_type", False))
            # inside a shard_map body: which mesh axes the value varies over is part of its
            # type, and of the program it traces to
            manual = _compat.manual_axis_type(x) if _compat.is_tracer(x) else None
            if manual is not None:
                sharding = jax.typeof(x).sharding  # over the body's (Manual) abstract mesh
                return _compat.shape_dtype(x, manual=manual, weak_type=weak, sharding=sharding)
            return jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=weak)
        return x

    return tuple(jax.tree_util.tree_map(to_aval, a) for a in args)


def normalize_argnums(argnums: int | Sequence[int], nargs: int) -> tuple[int, ...]:
    """Validate `argnums` (an int or a non-empty sequence of distinct ints, as in `jax.grad`)
    against the number of positional arguments; returns non-negative positions."""
    import operator

    items = argnums if isinstance(argnums, (tuple, list)) else (argnums,)
    try:
        if not items or any(isinstance(a, bool) for a in items):
            raise TypeError
        nums = tuple(operator.index(a) for a in items)
    except TypeError:
        raise TypeError(
            f"argnums must be an int or a non-empty tuple of ints, got {argnums!r}"
        ) from None
    for a in nums:
        if not -nargs <= a < nargs:
            raise ValueError(
                f"argnums={argnums!r} is out of range for a function called with {nargs} "
                "positional argument(s)"
            )
    out = tuple(a % nargs for a in nums)
    if len(set(out)) != len(out):
        raise ValueError(f"argnums={argnums!r} names an argument twice")
    return out


def check_differentiable(args: Sequence[Any], argnums: tuple[int, ...]) -> None:
    for a in argnums:
        leaves = jax.tree_util.tree_leaves(args[a])
        if not any(_compat.is_float_dtype(getattr(x, "dtype", None)) for x in leaves):
            kinds = sorted({str(getattr(x, "dtype", type(x).__name__)) for x in leaves}) or ["none"]
            raise TypeError(
                f"argument {a} (argnums) has no floating-point leaves to differentiate "
                f"(found: {', '.join(kinds)}). Pass the parameters as argument {a}, or set "
                "argnums to the position of a float array or pytree of float arrays."
            )


def check_scalar_output(fn: Callable[..., Any], args: Sequence[Any], has_aux: bool = False) -> None:
    """Check `fn(*args)` returns what `jax.value_and_grad(fn, has_aux=has_aux)` takes (traced
    abstractly, `check_loss_output`)."""
    check_loss_output(jax.eval_shape(fn, *args), has_aux)


def check_loss_output(out: Any, has_aux: bool = False) -> None:
    """Check a function's output (a pytree of arrays or `jax.ShapeDtypeStruct`s) is a scalar
    floating-point loss, or with `has_aux` a pair `(loss, aux)` of such a loss and any pytree.

    Raises:
      TypeError: anything else; the message names `has_aux` where the output is a pair (or
        `has_aux=True` was given) and says what was returned.
    """

    def describe(tree: Any) -> str:
        shapes = [f"{x.dtype}{list(x.shape)}" for x in jax.tree_util.tree_leaves(tree)]
        return ", ".join(shapes) if shapes else "no arrays"

    def is_loss(x: Any) -> bool:
        leaves = jax.tree_util.tree_leaves(x)
        return (
            len(leaves) == 1 and leaves[0].shape == () and _compat.is_float_dtype(leaves[0].dtype)
        )

    pair = isinstance(out, (tuple, list)) and len(out) == 2
    if has_aux:
        if pair and is_loss(out[0]):
            return
        got = (
            f"a pair whose first element is {describe(out[0])}"
            if pair
            else f"{type(out).__name__} of {describe(out)}"
        )
        raise TypeError(
            "with has_aux=True, fn must return a pair (loss, aux): a scalar floating-point loss "
            "and any pytree of arrays (as jax.value_and_grad(fn, has_aux=True)); fn returned "
            f"{got}."
        )
    if is_loss(out):
        return
    hint = (
        " It returned a pair: if that is (loss, aux), with metrics or updated state as aux, "
        "pass has_aux=True."
        if pair
        else " Reduce the output (for example with .mean()) or wrap fn in a loss."
    )
    raise TypeError(
        "jremat needs fn to return a scalar floating-point loss (it compiles "
        f"jax.value_and_grad(fn)), or (loss, aux) with has_aux=True; fn returned "
        f"[{describe(out)}].{hint}"
    )
