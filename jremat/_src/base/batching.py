"""`jax.vmap` around a planned function: the batch levels its arguments arrive with, and the
batched training step that then runs (docs/design.md#vmap).

Called under `jax.vmap` (per-example gradients, `jax.vmap(jax.grad(loss))`), `jremat.auto`
sees per-example arguments, but the program that runs is the vmapped step, whose temp bytes
scale with the batch and which XLA schedules on its own. The plan stays one of the
per-example program (its cuts and save sets), and every figure it is judged by is measured on
`Batching.step`: the caller's vmaps, with their sizes and batch axes, around
`value_and_grad`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jremat._src.base import compat as _compat


@dataclasses.dataclass(frozen=True)
class VmapLevel:
    """One `jax.vmap` around the call.

    Attributes:
      size: the batch size (the vmap's axis size).
      in_dims: per flat argument leaf, its batch dimension at this level (counted in the
        value this vmap maps over, as `in_axes`), or None: not mapped (`in_axes=None`).
      outside_grad: the vmap is around the caller's differentiation (`vmap(grad(f))`: one
        gradient per example); False for a vmap inside it (`grad(lambda ...:
        vmap(f)(...).mean())`) or where nothing around the call is seen differentiating.
      axis_name: the vmap's `axis_name` (None: unnamed), for collectives inside `fn`.
      spmd_axis_name: the vmap's `spmd_axis_name` (None: none).
    """

    size: int
    in_dims: tuple[int | None, ...]
    outside_grad: bool
    axis_name: Any = None
    spmd_axis_name: Any = None


@dataclasses.dataclass(frozen=True)
class Batching:
    """The vmaps around a call, outermost first, over arguments of tree structure `tree`.

    Hashable: part of `jremat.auto`'s plan key (a new batch size or batch axis is a new plan).
    """

    levels: tuple[VmapLevel, ...]
    tree: Any  # the positional arguments' treedef (a tuple)

    def describe(self) -> str:
        """The levels, outermost first: e.g. "vmap(size=8, batch axis 0 of 1/9 argument
        leaves, around the gradient)"."""
        parts = []
        for lv in self.levels:
            mapped = sorted({d for d in lv.in_dims if d is not None})
            parts.append(
                f"vmap(size={lv.size}, batch axis {'/'.join(map(str, mapped))} of "
                f"{sum(d is not None for d in lv.in_dims)}/{len(lv.in_dims)} argument leaves, "
                f"{'around' if lv.outside_grad else 'inside'} the gradient"
                + (f", axis_name={lv.axis_name!r}" if lv.axis_name is not None else "")
                + ")"
            )
        return " > ".join(parts)

    @property
    def batch_size(self) -> int:
        """The product of the levels' sizes (examples per call)."""
        return math.prod(lv.size for lv in self.levels)

    def global_args(self, args: Sequence[Any]) -> tuple:
        """The batched arguments (ShapeDtypeStructs) of per-example `args`: each leaf with its
        batch dimensions put back, innermost vmap first. Shardings are not kept."""
        flat = self.tree.flatten_up_to(tuple(args))
        out = []
        for k, x in enumerate(flat):
            shape = list(x.shape)
            for lv in reversed(self.levels):
                d = lv.in_dims[k]
                if d is not None:
                    shape.insert(d, lv.size)
            out.append(
                jax.ShapeDtypeStruct(
                    tuple(shape), x.dtype, weak_type=getattr(x, "weak_type", False)
                )
            )
        return tuple(jax.tree_util.tree_unflatten(self.tree, out))

    def step(
        self,
        fn: Callable[..., Any],
        differentiate: Callable[[Callable[..., Any]], Any],
        has_aux: bool = False,
    ) -> Callable[..., Any]:
        """The step that runs, a function of `global_args`: the vmaps inside the gradient
        around `fn` (their batched losses summed, as a caller's mean is), `differentiate`
        (e.g. `jax.value_and_grad(..., argnums)`) of that, and the vmaps around the gradient
        around it all. With `has_aux`, `fn` returns `(loss, aux)`."""
        inner = [lv for lv in self.levels if not lv.outside_grad]
        outer = [lv for lv in self.levels if lv.outside_grad]
        loss = fn
        if inner:
            mapped = self._vmapped(fn, inner)

            def summed(*args: Any) -> Any:
                out = mapped(*args)
                return (out[0].sum(), out[1]) if has_aux else out.sum()

            loss = summed
        return self._vmapped(differentiate(loss), outer)

    def _vmapped(self, f: Callable[..., Any], levels: Sequence[VmapLevel]) -> Callable[..., Any]:
        for lv in reversed(levels):  # the innermost vmap first, nearest `f`
            in_axes = tuple(jax.tree_util.tree_unflatten(self.tree, list(lv.in_dims)))
            kw: dict[str, Any] = {}
            if lv.axis_name is not None:
                kw["axis_name"] = lv.axis_name
            if lv.spmd_axis_name is not None:
                kw["spmd_axis_name"] = lv.spmd_axis_name
            f = jax.vmap(f, in_axes=in_axes, axis_size=lv.size, **kw)
        return f


class UnsupportedBatching(Exception):
    """The call is under a vmap jremat cannot rebuild; `str(e)` says which and why."""


def batching_of(args: Sequence[Any], diff: Sequence[int]) -> Batching | None:
    """The vmaps `args` (a call's positional arguments) arrive under; None when none.

    Args:
      args: the arguments as the call received them (tracers).
      diff: the positions of the differentiated arguments: a vmap that an autodiff trace of
        theirs is nested in is around the gradient (`VmapLevel.outside_grad`).

    Raises:
      UnsupportedBatching: a batch dimension jremat cannot rebuild (a ragged axis).
    """
    flat, tree = jax.tree_util.tree_flatten(tuple(args))
    per_leaf: list[dict[int, int | None]] = []
    traces: dict[int, Any] = {}
    for x in flat:
        found = _compat.batch_tracers(x)
        if found is None:
            raise UnsupportedBatching(
                "an argument is batched along a ragged axis, which jremat cannot rebuild"
            )
        per_leaf.append({id(t): d for t, d in found})
        traces.update((id(t), t) for t, _ in found)
    if not traces:
        return None
    # outermost first: the fewer traces a trace is nested in, the further out it is
    order = sorted(traces.values(), key=lambda t: len(_compat.trace_parents(t)))
    diff_leaves = jax.tree_util.tree_leaves([args[i] for i in diff if i < len(args)])
    around = {
        id(p)
        for x in diff_leaves
        for a in _compat.autodiff_traces(x)
        for p in _compat.trace_parents(a)
    }
    levels = []
    for t in order:
        size, name, spmd = _compat.batch_axis(t)
        levels.append(
            VmapLevel(
                size=size,
                in_dims=tuple(d.get(id(t)) for d in per_leaf),
                outside_grad=id(t) in around,
                axis_name=name,
                spmd_axis_name=spmd,
            )
        )
    return Batching(tuple(levels), tree)
