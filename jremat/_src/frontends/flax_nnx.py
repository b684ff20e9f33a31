"""`jremat.auto` for Flax NNX: module classes and functions that take modules.

A call runs through NNX's functional API (`nnx.split`, one trace, the planned evaluation,
`nnx.update`), not inside `nnx.remat`; why: docs/design.md#flax-blocks. Imported lazily by
`jremat.auto`: `import jremat` does not import Flax.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx
from flax.nnx import graph as nnx_graph

from jremat._src.base import compat as _compat
from jremat._src.base.args import check_loss_output
from jremat._src.base.sharding import shard_args
from jremat._src.frontends.blocks import run_block
from jremat._src.frontends.cache import PlanCache
from jremat._src.frontends.flax_linen import (
    _param_names,
    merge_static,
    method_names,
    resolve_static,
    split_static,
)
from jremat._src.frontends.options import AutoOptions
from jremat._src.plan.rewrite import run_graph
from jremat._src.trace.graph import build_graph


def is_module_class(target: Any) -> bool:
    """An `nnx.Module` subclass."""
    return isinstance(target, type) and issubclass(target, nnx.Module)


def is_module(x: Any) -> bool:
    """An NNX Module instance."""
    return isinstance(x, nnx.Module)


def has_graph_node(tree: Any) -> bool:
    """Whether a pytree holds an NNX graph node (Module, Rngs, Variable, ...)."""
    leaves = jax.tree_util.tree_leaves(tree, is_leaf=nnx_graph.is_graph_node)
    return any(nnx_graph.is_graph_node(x) for x in leaves)


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def planned_call(
    fn: Callable[..., Any],
    cache: PlanCache,
    prevent_cse: bool,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    has_aux: bool = False,
) -> Any:
    """Run `fn(*args, **kwargs)` through its traced jaxpr under the plan for its signature,
    then update the modules among the arguments with their new state (docs/design.md#flax-blocks).

    A call the caller differentiates that returns a scalar float loss (with `has_aux`, a pair
    `(loss, aux)`) is a loss function of modules (Flax's gemma example's `loss_fn(params,
    rngs)`): it is planned as `jremat.auto` plans a plain loss, on the step that runs
    (`_run_loss`). Anything else is a block, planned by what it keeps (`run_block`).

    Array leaves of the arguments are traced; other leaves (the static arguments) are closed
    over as they are, so a Python value that is not declared static is static here too. Only
    the variables the call changed are written back (`changed_paths`).

    Raises:
      TypeError: `has_aux` and the call does not return a pair `(loss, aux)` of a scalar float
        loss and any pytree.
    """
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs), is_leaf=nnx_graph.is_graph_node)
    node_idx = [i for i, x in enumerate(leaves) if nnx_graph.is_graph_node(x)]
    arr_idx = [i for i, x in enumerate(leaves) if i not in set(node_idx) and _is_array(x)]
    nodes = [leaves[i] for i in node_idx]
    graphdef, state = nnx.split(nodes)
    state_leaves, state_tree = jax.tree_util.tree_flatten(state)
    changed: set[tuple[Any, ...]] = set()  # the paths of the variables the call changed

    def pure(state_leaves, arrays):
        given = jax.tree_util.tree_unflatten(state_tree, state_leaves)
        before = flat_leaves(given)  # now: merge shares the variables, which the call mutates
        merged = nnx.merge(graphdef, given)
        vals = list(leaves)
        for i, m in zip(node_idx, merged, strict=True):
            vals[i] = m
        for i, a in zip(arr_idx, arrays, strict=True):
            vals[i] = a
        a, k = jax.tree_util.tree_unflatten(treedef, vals)
        out = fn(*a, **k)
        _, new_state = nnx.split(merged)
        changed.update(changed_paths(before, new_state))
        return out, new_state

    def written(new_state: Any) -> Any:
        """The part of `new_state` the write-back updates."""
        return new_state.filter(lambda path, _: tuple(path) in changed)

    operands = (state_leaves, [leaves[i] for i in arr_idx])
    flat = jax.tree_util.tree_leaves(operands)
    diff = tuple(i for i, x in enumerate(flat) if _compat.is_differentiated(x))
    closed, out_shape = jax.make_jaxpr(pure, return_shape=True)(*operands)
    if has_aux:
        check_loss_output(out_shape[0], has_aux=True)
    if diff and (has_aux or _is_loss(out_shape[0])):
        out, new_state = _run_loss(pure, written, operands, diff, cache, prevent_cse, has_aux)
    else:
        out_leaves, out_tree = jax.tree_util.tree_flatten(out_shape)
        n_out = len(jax.tree_util.tree_leaves(out_shape[0]))
        ct_mask = [True] * n_out + [False] * (len(out_leaves) - n_out)
        outs = run_block(closed, flat, out_leaves, ct_mask, cache, prevent_cse=prevent_cse)
        out, new_state = jax.tree_util.tree_unflatten(out_tree, outs)
    if changed:  # only what the call changed: the rest may belong to an outer trace
        nnx.update(nodes, written(new_state))
    return out


def _is_loss(out: Any) -> bool:
    """A scalar float output (one leaf): what a loss function returns."""
    got = jax.tree_util.tree_leaves(out)
    return len(got) == 1 and got[0].shape == () and _compat.is_float_dtype(got[0].dtype)


def _run_loss(
    pure: Callable[..., Any],
    written: Callable[[Any], Any],
    operands: Any,
    diff: tuple[int, ...],
    cache: PlanCache,
    prevent_cse: bool,
    has_aux: bool,
) -> tuple[Any, Any]:
    """`pure(state_leaves, arrays)` (a loss function of modules made pure: `(out,
    new_state)`) as a plain loss of the leaves of `operands`, the `diff` ones
    differentiated: planned and verified, as `jremat.auto` plans a loss function, on
    `jit(value_and_grad(loss, has_aux=True))`, whose aux is the function's own aux and the
    written part of the new state (`written`: the variables the call changed; the caller's
    step returns no copies of its parameters). Its budget is then a fraction of that step's
    unrematerialized temp bytes, the step the caller's `jax.grad` runs
    (docs/design.md#flax-blocks). Returns the output and the written state."""
    flat, in_tree = jax.tree_util.tree_flatten(operands)

    def loss(*flat_args: Any) -> Any:
        out, new_state = pure(*jax.tree_util.tree_unflatten(in_tree, flat_args))
        value, aux = out if has_aux else (out, ())
        return value, (aux, written(new_state))

    avals = shard_args(tuple(flat), None, None)
    graph = build_graph(loss, avals, diff)
    p = cache.get(graph, loss, avals, argnums=diff, has_aux=True)
    outs = run_graph(graph, p, flat, prevent_cse=prevent_cse)
    value, (aux, new_state) = jax.tree_util.tree_unflatten(graph.out_tree, outs)
    return ((value, aux) if has_aux else value), new_state


def flat_leaves(state: Any) -> dict[tuple[Any, ...], list[Any]]:
    """{path: the array leaves of the variable there} of NNX state `state`, read now."""
    return {tuple(p): jax.tree_util.tree_leaves(v) for p, v in nnx.to_flat_state(state)}


def changed_paths(before: dict[tuple[Any, ...], list[Any]], after: Any) -> set[tuple[Any, ...]]:
    """The paths of the variables of NNX state `after` whose values are not those `before`
    held (`flat_leaves` of the state given, read before the call; compared by identity:
    traced in one `make_jaxpr`, a variable the call left alone holds the very tracer it was
    given), and of the variables `before` lacks.

    The write-back updates only these (RNG counts, batch statistics, other mutable
    collections): updating a variable at all, even to its own value, is a mutation, which NNX
    refuses for a variable created at an outer trace level, e.g. parameters merged under
    `jax.value_and_grad` and closed over by a `lax.scan`, `fori_loop` or `cond` body
    (`TraceContextError`; docs/design.md#robust-where-it-runs-issue-47)."""
    out = set()
    for p, v in nnx.to_flat_state(after):
        path, new = tuple(p), jax.tree_util.tree_leaves(v)
        was = before.get(path)
        if (
            was is None
            or len(was) != len(new)
            or any(a is not b for a, b in zip(was, new, strict=True))
        ):
            out.add(path)
    return out


def make_caller(
    fn: Callable[..., Any], options: AutoOptions, cache: PlanCache, *, self_counted: bool
) -> Callable[..., Any]:
    """The callable running `fn` (a function taking modules, or an unbound module method when
    `self_counted`) under the plan for each signature."""
    owner = getattr(fn, "__qualname__", getattr(fn, "__name__", "function"))
    nums, names = resolve_static(
        fn,
        options.static_argnums,
        options.static_argnames,
        owner=owner,
        self_counted=self_counted,
    )
    param_names = _param_names(fn)
    prevent_cse = options.prevent_cse
    has_aux = options.has_aux

    def call(*args: Any, **kwargs: Any) -> Any:
        static_pos, dyn, static_kw, dyn_kw = split_static(
            args, kwargs, nums, names, param_names, owner
        )
        full = tuple(merge_static(static_pos, dyn))
        return planned_call(fn, cache, prevent_cse, full, {**dyn_kw, **static_kw}, has_aux)

    return call


def auto_nnx_class(target: type, options: AutoOptions, cache: PlanCache) -> type:
    """`jremat.auto` on an `nnx.Module` subclass: a subclass of the same name whose methods
    (`__call__` by default, or `methods`) run under the plan for each signature."""
    names = method_names(options.methods)
    if options.variables is not True or options.rngs is not True:
        raise ValueError(
            "variables= and rngs= are linen lifting filters; NNX modules carry their state and "
            "RNG streams themselves, so leave them at their defaults for an nnx.Module"
        )
    body: dict[str, Any] = {}
    for m in names:
        method = getattr(target, m, None)
        if method is None or not callable(method):
            raise ValueError(f"methods={options.methods!r}: {target.__name__} has no method {m!r}")
        caller = make_caller(method, options, cache, self_counted=True)

        def wrapped(self, *args, _caller=caller, **kwargs):
            return _caller(self, *args, **kwargs)

        wrapped.__name__ = m
        wrapped.__qualname__ = f"{target.__qualname__}.{m}"
        wrapped.__doc__ = method.__doc__
        body[m] = wrapped
    body["__module__"] = target.__module__
    body["__qualname__"] = target.__qualname__
    body["__doc__"] = target.__doc__
    new = type(target.__name__, (target,), body)
    new.plan_cache = cache
    return new
