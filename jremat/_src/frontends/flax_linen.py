"""`jremat.auto` for Flax linen: a lifted transform like `nn.remat` whose checkpoints are planned.

Built the way `nn.remat` is (`flax/linen/transforms.py` and `flax/core/lift.py`, `checkpoint`):
`lift_transform` over a `lift.pack`ed function, keeping the wrapped class's name. How, and
why: docs/design.md#flax-blocks. Imported lazily by `jremat.auto`: `import jremat` does not
import Flax.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax
from flax import errors as flax_errors
from flax import linen as nn
from flax.core import lift
from flax.linen import transforms as nn_transforms

from jremat._src.frontends.blocks import run_block
from jremat._src.frontends.cache import PlanCache
from jremat._src.frontends.options import AutoOptions


class AutoTargetError(TypeError, flax_errors.TransformTargetError):
    """`jremat.auto` was given a linen Module *instance* (decorate the class or a method).

    A `TypeError`, and also Flax's `TransformTargetError`, which `nn.remat` raises here.
    """

    def __init__(self, target: Any):
        TypeError.__init__(
            self,
            f"jremat.auto decorates a linen Module class, a method of one, or a function; got "
            f"the Module instance {type(target).__name__}(...). Decorate the class instead: "
            f"jremat.auto({type(target).__name__}, budget=...)(...)(x), as with nn.remat.",
        )


# -- static arguments --------------------------------------------------------------------------
def resolve_static(
    fn: Callable[..., Any],
    static_argnums: int | Sequence[int],
    static_argnames: str | Sequence[str],
    *,
    owner: str,
    self_counted: bool = True,
) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Check static arguments against `fn`'s signature and complete each set from the other.

    `jax.checkpoint` silently ignores `static_argnames`; jremat turns names into positions and
    positions into names, so a static argument is static however it is passed.

    Args:
      fn: the method or function (for a method, its first parameter is `self`).
      static_argnums: positions as `nn.remat`/`nnx.remat` count them: `self` is position 0.
      static_argnames: parameter names.
      owner: how to name `fn` in messages (for example `"Block.__call__"`).
      self_counted: whether position 0 is `self` (linen methods, NNX module methods).

    Returns:
      (positions, names), both complete; positions still count `self` as 0.

    Raises:
      ValueError: a position out of range, position 0 (`self`), a negative position, or an
        unknown name; the message lists the parameters with their positions.
    """
    nums = (static_argnums,) if isinstance(static_argnums, int) else tuple(static_argnums)
    names = (static_argnames,) if isinstance(static_argnames, str) else tuple(static_argnames)
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # builtins without a signature: accept as given
        return nums, names
    P = inspect.Parameter
    positional = [p for p in params if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    var_pos = any(p.kind == P.VAR_POSITIONAL for p in params)
    var_kw = any(p.kind == P.VAR_KEYWORD for p in params)
    listing = ", ".join(f"{p.name}={i}" for i, p in enumerate(positional))
    how = (
        "positions count `self` as 0, as nn.remat does"
        if self_counted
        else "positions count the function's arguments from 0"
    )
    out_nums: list[int] = []
    out_names: list[str] = list(names)
    for n in nums:
        if not isinstance(n, int) or isinstance(n, bool):
            raise ValueError(f"static_argnums must be ints, got {static_argnums!r}")
        if n < 0:
            raise ValueError(
                f"static_argnums={static_argnums!r}: negative positions are not supported; "
                f"{how} ({owner}: {listing})"
            )
        if self_counted and n == 0:
            raise ValueError(
                f"static_argnums={static_argnums!r} names `self` (position 0) of {owner}; "
                f"{how}: {listing}. Mark the argument after self as static with 1."
            )
        if n >= len(positional) and not var_pos:
            raise ValueError(
                f"static_argnums={static_argnums!r} is out of range for {owner}, which has "
                f"{len(positional)} positional parameters; {how}: {listing}"
            )
        out_nums.append(n)
        if n < len(positional) and positional[n].name not in out_names:
            out_names.append(positional[n].name)
    by_name = {p.name: p for p in params}
    for name in names:
        p = by_name.get(name)
        if p is None or p.kind in (P.VAR_POSITIONAL, P.VAR_KEYWORD):
            if var_kw and p is None:
                continue
            raise ValueError(
                f"static_argnames={static_argnames!r}: {owner} has no parameter {name!r} "
                f"(parameters: {', '.join(by_name)})"
            )
        if p in positional:
            i = positional.index(p)
            if i not in out_nums:
                out_nums.append(i)
    return tuple(sorted(out_nums)), tuple(out_names)


def check_hashable(
    value: Any, name: str, position: int | None, owner: str, next_name: str | None = None
) -> None:
    """Raise a ValueError naming the argument when a static argument is not hashable."""
    try:
        hash(value)
    except TypeError:
        if hasattr(value, "shape") and hasattr(value, "dtype"):
            what = f"an array {value.dtype}{list(value.shape)}"
        else:
            what = f"a {type(value).__name__}"
        where = f"position {position} " if position is not None else ""
        hint = (
            f" (the next parameter, {next_name!r}, is position {position + 1})"
            if next_name is not None and position is not None
            else ""
        )
        raise ValueError(
            f"static argument {name!r} ({where}of {owner}) received {what}, which is not "
            "hashable; static arguments must be hashable Python values (bools, ints, strings, "
            "tuples). jremat.auto counts static_argnums as nn.remat/nnx.remat do, with `self` "
            "as position 0 for a module or method: if you counted from the first argument after "
            f"self, add one to each position{hint}, or pass static_argnames."
        ) from None


def split_static(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    nums: tuple[int, ...],
    names: tuple[str, ...],
    param_names: Sequence[str],
    owner: str,
    label_offset: int = 0,
) -> tuple[dict[int, Any], list[Any], dict[str, Any], dict[str, Any]]:
    """Split a call's arguments into (static positional, dynamic positional, static keyword,
    dynamic keyword). `nums` and `param_names` index `args`; `label_offset` is added to
    positions in messages (1 where `self` was already taken off `args`)."""
    static_pos = {}
    dyn = []
    for i, a in enumerate(args):
        if i in nums or _is_flag(a):
            label = param_names[i] if i < len(param_names) else f"args[{i}]"
            nxt = param_names[i + 1] if i + 1 < len(param_names) else None
            check_hashable(a, label, i + label_offset, owner, nxt)
            static_pos[i] = a
        else:
            dyn.append(a)
    static_kw = {}
    dyn_kw = {}
    for k, v in kwargs.items():
        if k in names or _is_flag(v):
            check_hashable(v, k, None, owner)
            static_kw[k] = v
        else:
            dyn_kw[k] = v
    return static_pos, dyn, static_kw, dyn_kw


def _is_flag(a: Any) -> bool:
    """A bool or string argument (a `train` flag, a mode): static even when not declared, as
    it can only steer Python control flow (traced, `if train:` would fail)."""
    return isinstance(a, (bool, str)) or type(a).__name__ == "bool_"


def merge_static(static_pos: dict[int, Any], dyn: Sequence[Any]) -> list[Any]:
    out: list[Any] = []
    it = iter(dyn)
    for i in range(len(static_pos) + len(dyn)):
        out.append(static_pos[i] if i in static_pos else next(it))
    return out


def _param_names(fn: Callable[..., Any]) -> list[str]:
    try:
        P = inspect.Parameter
        return [
            p.name
            for p in inspect.signature(fn).parameters.values()
            if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):
        return []


# -- the lifted transform -------------------------------------------------------------------------
def lift_auto(
    fn: Callable[..., Any],
    *,
    cache: PlanCache,
    variables: Any = True,
    rngs: Any = True,
    prevent_cse: bool = True,
    static_argnums: tuple[int, ...] = (),
    static_argnames: tuple[str, ...] = (),
    owner: str = "",
    param_names: Sequence[str] = (),
) -> Callable[..., Any]:
    """`flax.core.lift.checkpoint` with a planned rematerialization instead of one region.

    `static_argnums` are positions of `fn`'s arguments after the scope (0 = first argument
    after `self`): the linen wrapper has already subtracted one for `self`.
    """

    def inner(scope_fn, repack_fn, variable_groups, rng_groups, *args, **kwargs):
        static_pos, dyn, static_kw, dyn_kw = split_static(
            args, kwargs, static_argnums, static_argnames, param_names, owner, label_offset=1
        )
        initializing = []

        def rematted(variable_groups, rng_groups, dyn, dyn_kw):
            scope = scope_fn(variable_groups, rng_groups)
            initializing.append(
                any(
                    s.get_flag("initializing", False)
                    for s in jax.tree_util.tree_leaves(scope)
                    if hasattr(s, "get_flag")
                )
            )
            y = fn(scope, *merge_static(static_pos, dyn), **dyn_kw, **static_kw)
            return y, repack_fn(scope)

        operands = (variable_groups, rng_groups, tuple(dyn), dyn_kw)
        closed, out_shape = jax.make_jaxpr(rematted, return_shape=True)(*operands)
        flat_args = jax.tree_util.tree_leaves(operands)
        out_leaves, out_tree = jax.tree_util.tree_flatten(out_shape)
        n_y = len(jax.tree_util.tree_leaves(out_shape[0]))
        ct_mask = [True] * n_y + [False] * (len(out_leaves) - n_y)
        outs = run_block(
            closed,
            flat_args,
            out_leaves,
            ct_mask,
            cache,
            prevent_cse=prevent_cse,
            plan_it=not any(initializing),
        )
        return jax.tree_util.tree_unflatten(out_tree, outs)

    return lift.pack(
        inner, (variables,), (variables,), (rngs,), name="jremat.auto", enable_kwargs=True
    )


def _transform_kwargs(
    method: Callable[..., Any], owner: str, options: AutoOptions, cache: PlanCache
) -> dict[str, Any]:
    """The keywords of `lift_auto` for one method (Flax's lifting passes them per method)."""
    nums, names = resolve_static(
        method, options.static_argnums, options.static_argnames, owner=owner
    )
    return dict(
        cache=cache,
        variables=options.variables,
        rngs=options.rngs,
        prevent_cse=options.prevent_cse,
        static_argnums=tuple(n - 1 for n in nums),  # `self` is not passed to the lifted fn
        static_argnames=names,
        owner=owner,
        param_names=_param_names(method)[1:],
    )


def _transform(fn: Callable[..., Any], **kw: Any) -> Callable[..., Any]:
    return lift_auto(fn, **kw)


def method_names(methods: Any) -> list[str]:
    """The `methods=` keyword of `nn.remat`/`nnx.remat` as a list of method names.

    Raises TypeError unless it is None (`__call__`), a name, or a list/tuple of names.
    """
    if methods is None:
        return ["__call__"]
    if isinstance(methods, str):
        return [methods]
    items = methods if isinstance(methods, (list, tuple)) else [methods]
    out = []
    for m in items:
        if isinstance(m, str):
            out.append(m)
        elif callable(m) and isinstance(getattr(m, "__name__", None), str):
            out.append(m.__name__)  # Module.method: the function, named as nn.remat names it
        else:
            raise TypeError(
                f"methods must be None, a method name or a list of names (or the methods "
                f"themselves, e.g. [Module.encode]), got {type(m).__name__} {m!r:.60}"
            )
    return out


def auto_linen_class(target: Any, options: AutoOptions, cache: PlanCache) -> Any:
    """`jremat.auto` on a linen Module class (or a `functools.partial` of one)."""
    cls = target.func if isinstance(target, functools.partial) else target
    names = method_names(options.methods)
    per_method = {}
    for m in names:
        method = getattr(cls, m, None)
        if method is None or not callable(method):
            raise ValueError(f"methods={options.methods!r}: {cls.__name__} has no method {m!r}")
        per_method[m] = _transform_kwargs(method, f"{cls.__name__}.{m}", options, cache)
    new = nn_transforms.lift_transform(_transform, target, methods=per_method)
    new_cls = new.func if isinstance(new, functools.partial) else new
    new_cls.__name__ = cls.__name__  # auto-names (`Block_0`), hence parameter paths, unchanged
    new_cls.__qualname__ = cls.__qualname__
    new_cls.__module__ = cls.__module__
    new_cls.__doc__ = cls.__doc__
    new_cls.plan_cache = cache
    return new


def linen_method_call(
    fn: Callable[..., Any], options: AutoOptions, cache: PlanCache, state: dict
) -> Any:
    """The callable that runs a `jremat.auto`-decorated linen method (built once, on the first
    call whose first argument is a linen Module)."""
    if "lifted" not in state:
        owner = getattr(fn, "__qualname__", getattr(fn, "__name__", "method"))
        kw = _transform_kwargs(fn, owner, options, cache)
        state["lifted"] = nn_transforms.decorator_lift_transform(_transform, fn, **kw)
    return state["lifted"]


def is_module_class(target: Any) -> bool:
    """A linen Module class or a `functools.partial` of one."""
    return nn_transforms._is_module_class(target)


def is_module(x: Any) -> bool:
    """A linen Module instance."""
    return isinstance(x, nn.Module)
