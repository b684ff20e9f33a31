"""Sharding arguments: meshes and `in_shardings=`, the sharding each argument runs under, and
`shard_map` bodies (their manual axes, compiled over a mesh of the same axes).

Per-device bytes under SPMD; the measured facts this rests on are in
docs/design.md#sharding.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jremat._src.base import compat as _compat
from jremat._src.base.args import abstract_args

Spec = tuple[tuple[str, ...], ...]

IN_SHARDINGS_FORMS = (
    "a NamedSharding, a PartitionSpec (with mesh= or under jax.set_mesh), None (leave the "
    "argument as it is), or a tuple with one such entry (or pytree prefix of them) per "
    "positional argument"
)
MESH_FORMS = (
    "a jax.sharding.Mesh (e.g. jax.make_mesh(...)) or AbstractMesh, or None (the mesh set by "
    "jax.set_mesh)"
)


def check_mesh(mesh: Any) -> None:
    """Check the `mesh=` keyword (it needs no arguments, so callers check it eagerly).

    Raises:
      TypeError: `mesh` is neither None, a `jax.sharding.Mesh` nor an `AbstractMesh`.
    """
    if mesh is None or isinstance(mesh, (jax.sharding.Mesh, jax.sharding.AbstractMesh)):
        return
    raise TypeError(
        f"mesh is {type(mesh).__name__} {mesh!r}; accepted: {MESH_FORMS}. A mesh axis name "
        "such as 'data' belongs in a PartitionSpec: in_shardings=PartitionSpec('data')."
    )


def check_in_shardings(in_shardings: Any) -> None:
    """Check the form of `in_shardings=` without the arguments: None, a `NamedSharding`, a
    `PartitionSpec`, or a tuple/list of pytrees whose leaves are these or None. Whether it
    matches the arguments is checked by `shard_args`.

    Raises:
      TypeError: `in_shardings`, or a leaf of one of its entries, is of another type.
    """
    if in_shardings is None or isinstance(in_shardings, (NamedSharding, PartitionSpec)):
        return
    if not isinstance(in_shardings, (tuple, list)):
        raise TypeError(
            f"in_shardings is {type(in_shardings).__name__} {in_shardings!r}; accepted: "
            f"{IN_SHARDINGS_FORMS}."
        )
    for i, entry in enumerate(in_shardings):
        leaves = jax.tree_util.tree_flatten_with_path(
            entry, is_leaf=lambda s: isinstance(s, (NamedSharding, PartitionSpec))
        )[0]
        for path, leaf in leaves:
            if not isinstance(leaf, (NamedSharding, PartitionSpec)):
                raise TypeError(
                    f"in_shardings[{i}]{jax.tree_util.keystr(path)} is "
                    f"{type(leaf).__name__} {leaf!r}; accepted: {IN_SHARDINGS_FORMS}."
                )


# -- arguments ---------------------------------------------------------------------------------
def leaf_sharding(x: Any, per_example: bool = True) -> Any:
    """The sharding an argument carries: a concrete array's NamedSharding over more than one
    device, a ShapeDtypeStruct's sharding, or an explicit-mode tracer's (abstract) sharding;
    inside `jax.jit` in Auto mode, what `traced_placement` reads. For a `vmap` tracer, the
    sharding of one example (`per_example`) or of the whole batched array."""
    if isinstance(x, jax.ShapeDtypeStruct):
        s = getattr(x, "sharding", None)
        if not isinstance(s, NamedSharding) or _is_manual(s.mesh):
            return None  # a shard_map body's value: per device already
        return s
    if _compat.is_tracer(x):
        s = getattr(jax.typeof(x), "sharding", None)
        if isinstance(s, NamedSharding) and explicit_axes(s.mesh):
            return s
        inner = _compat.concrete_primal(x)  # grad/vmap of a concrete array: its placement
        if inner is not None and not _compat.is_tracer(inner):
            outer = leaf_sharding(inner)
        else:
            outer = traced_placement(x)[1]
        return _per_example(outer, x) if per_example else outer
    s = getattr(x, "sharding", None)
    if isinstance(s, NamedSharding) and (s.mesh.size > 1 or foreign_mesh(s.mesh)):
        return s
    return None


def mesh_device(mesh: Any) -> Any:
    """The first device of a concrete mesh; None for no mesh, an AbstractMesh (explicit-mode
    tracers: its `devices` raises ValueError) or a mesh without devices."""
    try:
        return mesh.devices.flat[0]
    except (AttributeError, IndexError, ValueError):
        return None


def foreign_mesh(mesh: Any) -> bool:
    """Whether `mesh`'s devices are of another platform than JAX's default backend (a
    compile-only TPU topology's, `jremat.target_mesh`): then even a one-device mesh says
    where the program compiles, and arguments on it are kept on it."""
    device = mesh_device(mesh)
    if device is None:
        return False
    platform = str(device.platform)
    return platform != jax.default_backend() and not (
        platform in ("cuda", "rocm") and jax.default_backend() == "gpu"
    )


def _per_example(s: Any, x: Any) -> Any:
    """The sharding `s` of the array a `vmap` tracer `x` batches, for `x` itself: each vmap
    level's batch dimension dropped from the spec, the outermost level first (None when no
    dimension left is split)."""
    levels = _compat.batch_tracers(x) or []
    dims = [d for _, d in levels if d is not None]
    if s is None or not dims:
        return s
    spec = list(s.spec) + [None] * (len(x.shape) + len(dims) - len(s.spec))
    for d in reversed(dims):
        del spec[d]
    if not any(spec_axes(e) for e in spec):
        return None
    return NamedSharding(s.mesh, PartitionSpec(*spec))


def traced_placement(x: Any) -> tuple[str, Any]:
    """How a leaf traced inside `jax.jit` in JAX's default (Auto) sharding mode is placed,
    where its tracer does not say: read from the `jit` traces under way (`compat.jit_traces`).

    An input of a `jit` trace takes `jit`'s own `in_shardings` entry where one was given, else
    the placement of the argument the caller passed: a concrete array's sharding (its
    committed `NamedSharding`; one device: not sharded), a `ShapeDtypeStruct`'s, a NumPy value
    (not sharded), or for a tracer of an enclosing `jit`, its placement there, in turn. Any
    other traced value (computed in the trace, a loop body's) is not sharded when its aval is
    on no mesh (JAX gives a value the mesh of the sharded values it is computed from, and of
    `with_sharding_constraint`, `device_put`, `shard_map`), unless a `jit` on the stack shards
    an input by its `in_shardings` (which avals do not show); otherwise GSPMD decides its
    sharding when the caller's program compiles, and it is unknown here.

    Returns:
      ("sharded", NamedSharding), ("unsharded", None), or ("unknown", None).
    """
    t = _compat.jaxpr_tracer(x)
    if t is None:
        return _value_placement(x)
    if not placement_readable():
        return ("unknown", None)  # never a guess: the read is broken on this JAX
    traces = _compat.jit_traces()
    while True:
        jt = next((j for j in traces if getattr(t, "_trace", None) is j.trace), None)
        idx = None if jt is None else next((i for i, a in enumerate(jt.in_tracers) if a is t), None)
        if idx is None:  # not a jit input: computed in a trace, or a loop body's value
            spread = any(
                _sharding_placement(s)[0] != "unsharded"
                for j in traces
                for s in j.in_shardings
                if isinstance(s, jax.sharding.Sharding)
            )
            if _on_a_mesh(t) or spread:
                return ("unknown", None)
            return ("unsharded", None)
        given = jt.in_shardings[idx]
        if isinstance(given, jax.sharding.Sharding):
            return _sharding_placement(given)
        x = jt.args[idx]
        t = _compat.jaxpr_tracer(x)
        if t is None:
            return _value_placement(x)


_UNREADABLE_WARNED: list[bool] = []


def placement_readable() -> bool:
    """Whether `traced_placement` can read the placement of `jax.jit`'s inputs on this JAX
    (`compat.jit_frames_readable`, probed once per process); True on one device, where nothing
    is sharded. Where it cannot, a `RuntimeWarning` says so, once per process."""
    if jax.device_count() == 1 or _compat.jit_frames_readable():
        return True
    if not _UNREADABLE_WARNED:
        _UNREADABLE_WARNED.append(True)
        import warnings

        warnings.warn(
            f"jremat: {_unreadable_why()} jremat.auto therefore treats the placement of every "
            "value traced inside jax.jit in the Auto sharding mode as unknown and refuses to "
            "plan it; pass in_shardings= to jremat.auto (the shardings its arguments run under, "
            "PartitionSpec() where they are not sharded) or use a mesh with Explicit axes "
            "(jax.make_mesh(..., axis_types=(jax.sharding.AxisType.Explicit, ...)) under "
            "jax.set_mesh), whose tracers carry their shardings.",
            RuntimeWarning,
            stacklevel=_caller_stacklevel(through_jax=True),
        )
    return False


def _unreadable_why() -> str:
    return (
        f"on jax {jax.__version__}, jremat cannot read how jax.jit places its inputs (its read "
        "of JAX-internal frames, compat.jit_traces, failed its self-check; jremat is tested on "
        "jax 0.10 to 0.12, see docs/guides/jax-versions.md)."
    )


def _on_a_mesh(t: Any) -> bool:
    """Whether tracer `t`'s aval is on a mesh of more than one device (True when it cannot
    be told)."""
    mesh = getattr(getattr(jax.typeof(t), "sharding", None), "mesh", None)
    return mesh is None or mesh.size > 1  # the empty mesh has size 1


def _value_placement(x: Any) -> tuple[str, Any]:
    """The placement of a concrete argument (or one a JVP/vmap tracer wraps)."""
    inner = _compat.concrete_primal(x)
    s = getattr(inner, "sharding", None)
    if s is None:
        return ("unsharded", None)  # NumPy values and Python scalars; ShapeDtypeStruct()
    return _sharding_placement(s)


def _sharding_placement(s: Any) -> tuple[str, Any]:
    if isinstance(s, NamedSharding) and not _is_manual(s.mesh):
        if s.mesh.size == 1 and not foreign_mesh(s.mesh):
            return ("unsharded", None)
        if not isinstance(s.mesh, jax.sharding.Mesh):
            return ("sharded", NamedSharding(concrete_mesh(s.mesh), s.spec))
        return ("sharded", s)
    if len(getattr(s, "device_set", ())) == 1:
        return ("unsharded", None)  # SingleDeviceSharding, or any sharding over one device
    return ("unknown", None)


def _is_manual(mesh: Any) -> bool:
    return any("Manual" in str(t) for t in (getattr(mesh, "axis_types", None) or ()))


def concrete_mesh(mesh: Any) -> Any:
    """A concrete `Mesh` for `mesh`: itself, or for an `AbstractMesh` one over `jax.devices()`
    with the same axis names, sizes and types.

    Raises:
      ValueError: the mesh needs more devices than this process has.
    """
    if isinstance(mesh, jax.sharding.Mesh):
        return mesh
    types = getattr(mesh, "axis_types", None) or ("Auto",) * len(mesh.axis_names)
    return make_mesh(
        mesh_axes(mesh),
        explicit=[n for n, t in zip(mesh.axis_names, types, strict=True) if "Explicit" in str(t)],
    )


def make_mesh(axes: Mapping[str, int], explicit: Sequence[str] = ()) -> Any:
    """A `Mesh` over the first devices of `jax.devices()` with these axis names and sizes
    (Auto axis types, except those named in `explicit`).

    Raises:
      ValueError: the mesh needs more devices than this process has.
    """
    sizes = tuple(int(s) for s in axes.values())
    need = math.prod(sizes)
    if need > len(jax.devices()):
        raise ValueError(
            f"the mesh {dict(axes)} needs {need} devices; this process has "
            f"{len(jax.devices())} ({jax.devices()[0].platform}). On CPU, set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={need} before importing jax."
        )
    at = jax.sharding.AxisType
    types = tuple(at.Explicit if n in explicit else at.Auto for n in axes)
    return jax.make_mesh(sizes, tuple(axes), axis_types=types, devices=jax.devices()[:need])


def _ambient_mesh() -> Any:
    am = jax.sharding.get_abstract_mesh()
    return am if am is not None and not getattr(am, "empty", True) else None


def _to_sharding(entry: Any, mesh: Any, where: str) -> Any:
    if entry is None or isinstance(entry, NamedSharding):
        return entry
    if isinstance(entry, PartitionSpec):
        m = mesh if mesh is not None else _ambient_mesh()
        if m is None and not any(spec_axes(e) for e in entry):
            return None  # PartitionSpec() without a mesh: not sharded (one device, replicated)
        if m is None:
            raise ValueError(
                f"in_shardings{where} is the PartitionSpec {entry}, but no mesh is known: "
                "pass mesh=jax.make_mesh(...) or call under `with jax.set_mesh(mesh):`, or "
                "give a NamedSharding."
            )
        missing = [a for e in entry for a in spec_axes(e) if a not in m.axis_names]
        if missing:
            raise ValueError(
                f"in_shardings{where} is the PartitionSpec {entry}, which names mesh axis "
                f"{', '.join(map(repr, missing))} that the mesh lacks: its axes are "
                f"{mesh_axes(m)}. Name axes of the mesh, or pass the mesh they belong to "
                "(mesh= or jax.set_mesh)."
            )
        return NamedSharding(concrete_mesh(m), entry)
    raise TypeError(
        f"in_shardings{where} is {type(entry).__name__} {entry!r}; accepted: {IN_SHARDINGS_FORMS}."
    )


def shard_args(args: Sequence[Any], in_shardings: Any = None, mesh: Any = None) -> tuple:
    """`args` as `jax.ShapeDtypeStruct`s carrying the sharding each leaf runs under.

    Args:
      args: the positional arguments (arrays, ShapeDtypeStructs or tracers).
      in_shardings: None (use what the arguments carry), or as `jax.jit`'s: a NamedSharding or
        PartitionSpec for every argument, or a tuple with one pytree prefix per argument.
      mesh: the mesh PartitionSpecs refer to (default: the one set by `jax.set_mesh`). It
        shards nothing by itself: given while no PartitionSpec refers to it and no argument is
        sharded, it has no effect, and a RuntimeWarning says so.

    Returns:
      A tuple of pytrees of ShapeDtypeStructs (shape, dtype, weak type, sharding or None).

    Raises:
      TypeError: `mesh` is not a Mesh/AbstractMesh/None (`check_mesh`); `in_shardings`, or a
        leaf of an entry, is neither a NamedSharding, a PartitionSpec nor None.
      ValueError: `in_shardings` does not match the arguments' structure, a PartitionSpec has
        no mesh or names an axis the mesh lacks, a spec has more entries than its argument has
        dimensions, or the mesh needs more devices than exist.
    """
    check_mesh(mesh)
    check_in_shardings(in_shardings)
    avals = abstract_args(args)
    given: list[Any]
    if in_shardings is None:
        given = [None] * len(args)
    elif isinstance(in_shardings, (NamedSharding, PartitionSpec)):
        given = [in_shardings] * len(args)
    elif isinstance(in_shardings, (tuple, list)) and len(in_shardings) == len(args):
        given = list(in_shardings)
    else:
        n = len(in_shardings) if isinstance(in_shardings, (tuple, list)) else None
        raise ValueError(
            f"in_shardings must match the {len(args)} positional argument(s)"
            + (f"; got a sequence of {n}" if n is not None else f"; got {in_shardings!r}")
            + f". Accepted: {IN_SHARDINGS_FORMS}."
        )
    out = []
    for i, (a, aval, g) in enumerate(zip(args, avals, given, strict=True)):
        leaves, tree = jax.tree_util.tree_flatten(a)
        aval_leaves = tree.flatten_up_to(aval)
        if g is None or isinstance(g, (NamedSharding, PartitionSpec)):
            per_leaf = [g] * len(leaves)
        else:
            try:
                per_leaf = tree.flatten_up_to(
                    jax.tree_util.tree_map(
                        lambda s, sub: [s] * len(jax.tree_util.tree_leaves(sub)),
                        g,
                        a,
                        is_leaf=lambda s: (
                            s is None or isinstance(s, (NamedSharding, PartitionSpec))
                        ),
                    )
                )
            except (ValueError, TypeError) as e:
                raise ValueError(
                    f"in_shardings[{i}] is not a pytree prefix of argument {i} "
                    f"({jax.tree_util.tree_structure(a)}): {e}. Accepted: {IN_SHARDINGS_FORMS}."
                ) from None
            per_leaf = [x for sub in per_leaf for x in (sub if isinstance(sub, list) else [sub])]
        new_leaves = []
        for k, (x, av, s) in enumerate(zip(leaves, aval_leaves, per_leaf, strict=True)):
            sharding = _to_sharding(s, mesh, f"[{i}]")
            if sharding is None:
                sharding = leaf_sharding(x)
            if sharding is None or not isinstance(av, jax.ShapeDtypeStruct):
                new_leaves.append(av)
                continue
            if not isinstance(sharding.mesh, jax.sharding.Mesh):
                sharding = NamedSharding(concrete_mesh(sharding.mesh), sharding.spec)
            if len(sharding.spec) > len(av.shape):
                raise ValueError(
                    f"in_shardings[{i}]: {sharding.spec} has {len(sharding.spec)} entries but "
                    f"leaf {k} of argument {i} has shape {tuple(av.shape)}"
                )
            new_leaves.append(
                jax.ShapeDtypeStruct(
                    av.shape, av.dtype, weak_type=getattr(av, "weak_type", False), sharding=sharding
                )
            )
        out.append(jax.tree_util.tree_unflatten(tree, new_leaves))
    if mesh is not None and not _has_spec(in_shardings):
        if arg_mesh(jax.tree_util.tree_leaves(out)) is None:
            import warnings

            warnings.warn(
                f"jremat: mesh={mesh_axes(mesh)} was given, but no PartitionSpec in "
                "in_shardings refers to it and no argument is sharded, so it has no effect: "
                "the program is planned/measured unsharded. mesh= only names the mesh that "
                "PartitionSpecs refer to; pass in_shardings= (as to jax.jit, e.g. "
                "PartitionSpec('data')) or sharded arrays to run under it.",
                RuntimeWarning,
                stacklevel=_caller_stacklevel(),
            )
    return tuple(out)


def _has_spec(in_shardings: Any) -> bool:
    """Whether `in_shardings` holds a PartitionSpec (which refers to `mesh=`)."""
    leaves = jax.tree_util.tree_leaves(in_shardings, is_leaf=lambda s: isinstance(s, PartitionSpec))
    return any(isinstance(s, PartitionSpec) for s in leaves)


def _caller_stacklevel(through_jax: bool = False) -> int:
    """`warnings.warn`'s stacklevel of the first frame outside jremat (the user's call), and
    outside JAX too where `through_jax` (a call from inside a caller's `jax.jit` trace)."""
    import os
    import sys

    # jremat/ itself: this file is jremat/_src/base/sharding.py
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    inside = [here + os.sep]
    if through_jax:
        inside.append(os.path.dirname(os.path.abspath(jax.__file__)) + os.sep)
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(tuple(inside)):
        frame, level = frame.f_back, level + 1
    return level


def check_known(args: Sequence[Any], avals: Sequence[Any], in_shardings: Any = None) -> None:
    """Refuse to plan when the arguments' shardings are hidden: traced inside `jax.jit` (or
    another jaxpr trace) in JAX's default Auto mode on more than one device, where a tracer does
    not say how it is sharded, with no `in_shardings=` given. jremat would otherwise plan the
    unpartitioned program while the partitioned one runs (docs/design.md#sharding).

    Raises:
      ValueError: naming `in_shardings=`, `mesh=` and the explicit sharding mode.
    """
    if in_shardings is not None or manual_axes():
        return
    mesh = _ambient_mesh()
    if mesh is not None and explicit_axes(mesh):
        return  # explicit mode: a tracer's type says its sharding (none: replicated)
    flat, flat_avals = jax.tree_util.tree_leaves(args), jax.tree_util.tree_leaves(avals)
    hidden = [
        i
        for i, (x, av) in enumerate(zip(flat, flat_avals, strict=True))
        if _compat.is_jaxpr_traced(x)
        and leaf_sharding(av) is None
        and hasattr(x, "shape")
        and traced_placement(x)[0] == "unknown"
    ]
    devices = jax.device_count()
    if not hidden or (mesh is None and devices == 1) or (mesh is not None and mesh.size == 1):
        return
    if not placement_readable():
        raise ValueError(
            f"jremat.auto is called inside jax.jit, but {_unreadable_why()} The placement of "
            f"its traced arguments is unknown ({len(hidden)} of {len(flat)} array leaves: "
            f"{_leaf_names(args, hidden)}), and jremat does not plan for a guess. Pass "
            "in_shardings= (as to jax.jit: the shardings the arguments run under, with mesh= "
            "or jax.set_mesh for PartitionSpecs; in_shardings=PartitionSpec() if they are not "
            "sharded), or use a mesh with Explicit axes (jax.sharding.AxisType.Explicit, "
            "jax.make_mesh's default, under jax.set_mesh), whose tracers carry their shardings."
        )
    where = (
        f"under the mesh {mesh_axes(mesh)} (Auto axes)"
        if mesh is not None
        else f"with {devices} devices and no mesh set"
    )
    raise ValueError(
        f"jremat.auto is called inside jax.jit {where}, where the traced arguments do not say "
        f"how they are sharded ({len(hidden)} of {len(flat)} array leaves: "
        f"{_leaf_names(args, hidden)}; values the caller computed on a mesh, or a loop body's, "
        "whose sharding GSPMD decides when the caller's program compiles), and a plan "
        "verified for another partitioning does not hold for the program that runs. Pass "
        "in_shardings= (as to jax.jit: the shardings the arguments run under, with mesh= or "
        "jax.set_mesh for PartitionSpecs), in_shardings=PartitionSpec() if they are not "
        "sharded (one device, or replicated), or use explicit sharding "
        "(jax.sharding.AxisType.Explicit), whose tracers carry their shardings."
    )


def _leaf_names(args: Sequence[Any], which: Sequence[int], most: int = 4) -> str:
    """The paths (`args[1]['w']`) of the flattened leaves `which` of `args`, the first `most`."""
    paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(tuple(args))[0]]
    names = [f"args{jax.tree_util.keystr(paths[i])}" for i in which[:most]]
    return ", ".join(names) + (", ..." if len(which) > most else "")


def arg_mesh(flat_args: Sequence[Any]) -> Any:
    """The mesh the arguments are sharded over (None when none is sharded).

    Raises:
      ValueError: arguments are sharded over meshes with different axes.
    """
    meshes = {}
    for x in flat_args:
        s = leaf_sharding(x)
        if s is not None:
            meshes[tuple(mesh_axes(s.mesh).items())] = s.mesh
    if len(meshes) > 1:
        raise ValueError(f"arguments are sharded over different meshes: {list(meshes)}")
    return next(iter(meshes.values()), None)


def sharding_key(x: Any) -> tuple | None:
    """How one argument leaf is sharded, hashable: `(mesh axes, spec)`, the mesh's
    `(name, size)` pairs and per dimension the tuple of mesh axes it is split over (`()`: not
    split; `P("data")` and `P("data", None)` agree), or None when the leaf is not sharded (see
    `leaf_sharding`). The sharding part of a call's signature (`trace.graph.signature`)."""
    s = leaf_sharding(x)
    if s is None:
        return None
    ndim = len(getattr(x, "shape", ()))
    spec = [spec_axes(e) for e in s.spec]
    key = (tuple(mesh_axes(s.mesh).items()), tuple(spec + [()] * (ndim - len(spec))))
    if foreign_mesh(s.mesh):  # a compile-only TPU's: a v5e's plan is not a v6e's
        device = mesh_device(s.mesh)
        key += (f"{device.platform}:{getattr(device, 'device_kind', '')}",)
    return key


# -- shard_map bodies --------------------------------------------------------------------------
def manual_axes() -> dict[str, int]:
    """{name: size} of the `shard_map` (Manual) mesh axes the current trace is inside; {}
    outside any `shard_map` body."""
    am = _ambient_mesh()
    if am is None:
        return {}
    names = getattr(am, "manual_axes", None)
    if names is None:
        names = [n for n, t in zip(am.axis_names, am.axis_types, strict=True) if "Manual" in str(t)]
    sizes = mesh_axes(am)
    return {n: sizes[n] for n in names}


def tie_for(tie: Any, x: Any) -> Any:
    """`tie`, a scalar jremat adds to `x` to order work without changing its value (a zero read
    from other values), in a type `x + tie` keeps: inside a `shard_map` body with checked
    varying axes, summed (`psum`) over the manual axes `tie` varies over and `x` does not. An
    invariant value (a replicated parameter) tied to a varying one (read from a split batch)
    would otherwise turn varying, and a jaxpr traced at its type (its `pvary`s) no longer
    re-evaluates on it (docs/design.md#sharding). `tie` itself where no axis is extra."""
    extra = _compat.varying_axes(tie) - _compat.varying_axes(x)
    return jax.lax.psum(tie, tuple(a for a in manual_axes() if a in extra)) if extra else tie


def bind_axes(
    fn: Callable[..., Any], axes: Mapping[str, int], args: Sequence[Any], has_aux: bool = False
) -> tuple[Callable[..., Any], tuple]:
    """The per-device program of a `shard_map` body, compilable on its own.

    `fn` is the body (its collectives name the mesh axes `axes`, {name: size}) and `args` its
    per-device arguments (ShapeDtypeStructs, with the manual-axis type of each inside the body).
    Returns `(g, global_args)`: `g` runs `fn` under a `shard_map` over a fresh mesh with these
    axes, each argument that varies over axes V given a leading dimension split over V (and
    dropped inside), the others replicated, so that `fn` sees exactly the shapes and types it
    sees in the body; `g` returns the sum of the per-device losses (with `has_aux`, `fn`
    returns `(loss, aux)` and `g` that sum and the aux, each leaf stacked over the devices).
    """
    mesh = make_mesh(dict(axes))
    flat, tree = jax.tree_util.tree_flatten(args)
    specs, glob = [], []
    for x in flat:
        mat = getattr(x, "manual_axis_type", None)
        varying = tuple(a for a in axes if mat is not None and a in getattr(mat, "varying", ()))
        k = math.prod(axes[a] for a in varying)
        specs.append(PartitionSpec(varying) if varying else PartitionSpec())
        shape = (k, *x.shape) if varying else tuple(x.shape)
        glob.append(jax.ShapeDtypeStruct(shape, x.dtype, weak_type=getattr(x, "weak_type", False)))
    lifted = [bool(s) for s in specs]

    def body(*flat_in: Any) -> Any:
        local = [a.reshape(a.shape[1:]) if v else a for a, v in zip(flat_in, lifted, strict=True)]
        out = fn(*jax.tree_util.tree_unflatten(tree, local))
        lead = (1,) * len(axes)
        if not has_aux:
            return out.reshape(lead)
        loss, aux = out
        return loss.reshape(lead), jax.tree_util.tree_map(
            lambda a: jnp.reshape(a, lead + jnp.shape(a)), aux
        )

    every = PartitionSpec(*axes)
    sm = _compat.shard_map(body, mesh, in_specs=tuple(specs), out_specs=every, check=True)

    def g(*a: Any) -> Any:
        out = sm(*jax.tree_util.tree_leaves(a))
        return (out[0].sum(), out[1]) if has_aux else out.sum()

    return g, tuple(jax.tree_util.tree_unflatten(tree, glob))


def bind_axes_step(
    fn: Callable[..., Any],
    axes: Mapping[str, int],
    args: Sequence[Any],
    argnums: tuple[int, ...],
    has_aux: bool = False,
) -> tuple[Callable[..., Any], tuple]:
    """The training step a data-parallel caller runs around a `shard_map` body `fn`:
    `value_and_grad(fn, argnums)` inside the body, then the loss and each gradient averaged
    over the axes they vary over and their argument does not (the gradient all-reduce of a
    replicated parameter over the batch axes), as `jax.lax.pmean(value_and_grad(f)(p, x),
    "data")` does. Where no argument is seen to vary (a body traced with `check_vma=False`
    carries no varying axes), over every axis. `(h, global_args)` as `bind_axes`; `h` is the
    whole step (compile `jit(h)`, not its gradient). With `has_aux` the aux values are
    dropped (not returned)."""
    mesh = make_mesh(dict(axes))
    flat, tree = jax.tree_util.tree_flatten(args)
    varying_of, specs, glob = [], [], []
    for x in flat:
        mat = getattr(x, "manual_axis_type", None)
        varying = tuple(a for a in axes if mat is not None and a in getattr(mat, "varying", ()))
        varying_of.append(varying)
        k = math.prod(axes[a] for a in varying)
        specs.append(PartitionSpec(varying) if varying else PartitionSpec())
        shape = (k, *x.shape) if varying else tuple(x.shape)
        glob.append(jax.ShapeDtypeStruct(shape, x.dtype, weak_type=getattr(x, "weak_type", False)))
    lifted = [bool(v) for v in varying_of]
    seen = any(lifted)
    leaves_of = [len(jax.tree_util.tree_leaves(a)) for a in args]
    offsets = [sum(leaves_of[:i]) for i in range(len(args))]
    diff_leaves = [j for i in argnums for j in range(offsets[i], offsets[i] + leaves_of[i])]
    grad_step = jax.value_and_grad(fn, argnums=argnums, has_aux=has_aux)

    def reduced(v: Any, own: tuple[str, ...]) -> Any:
        vary = getattr(_compat.manual_axis_type(v), "varying", ()) or ()
        over = tuple(a for a in axes if (a in vary or not seen) and a not in own)
        return jax.lax.pmean(v, over) if over else v

    def body(*flat_in: Any) -> Any:
        local = [a.reshape(a.shape[1:]) if v else a for a, v in zip(flat_in, lifted, strict=True)]
        value, grads = grad_step(*jax.tree_util.tree_unflatten(tree, local))
        loss = reduced(value[0] if has_aux else value, ())
        out = [loss.reshape((1,) * len(axes))]
        for j, gr in zip(diff_leaves, jax.tree_util.tree_leaves(grads), strict=True):
            gr = reduced(gr, varying_of[j])
            out.append(gr.reshape((1, *gr.shape)) if lifted[j] else gr)
        return tuple(out)

    out_specs = (PartitionSpec(*axes), *[specs[j] for j in diff_leaves])
    sm = _compat.shard_map(body, mesh, in_specs=tuple(specs), out_specs=out_specs, check=True)

    def h(*a: Any) -> Any:
        return sm(*jax.tree_util.tree_leaves(a))

    return h, tuple(jax.tree_util.tree_unflatten(tree, glob))


# -- arrays jremat makes: their sharding stated where JAX's explicit mode asks for one ---------
def explicit_sharding(x: Any) -> Any:
    """The `NamedSharding` in the type of traced or concrete array `x` where its mesh has
    Explicit axes (`jax.make_mesh`'s default; JAX then asks every reshape, broadcast and
    gather that cannot infer its output's sharding to state it); None otherwise."""
    try:
        s = getattr(jax.typeof(x), "sharding", None)
    except TypeError:
        return None
    if isinstance(s, NamedSharding) and explicit_axes(s.mesh):
        return s
    return None


def split_rows(x: Any, k: int) -> Any:
    """`x` (batch axis 0, `B` rows) as `(k, B // k, ...)`, microbatch `j` (index `j` of the
    new axis) holding rows `j, j + k, j + 2k, ...` (the column-major split of
    `optax.microbatching.reshape_batch_axis`): a device's rows of a batch sharded along axis
    0 stay on it, so the split moves no data. Under explicit sharding the output sharding is
    stated: the new axis unsharded, the rows' axes on the second.

    Raises:
      ValueError: under explicit sharding, `B // k` rows do not split evenly over the
        devices that share the batch axis (naming the `num_microbatches` that do).
    """
    rows = int(x.shape[0])
    shape = (k, rows // k, *x.shape[1:])
    s = explicit_sharding(x)
    if s is None:
        return x.reshape(shape, order="F")
    spec = list(s.spec) + [None] * (len(x.shape) - len(s.spec))
    shards = math.prod(mesh_axes(s.mesh)[a] for a in spec_axes(spec[0]))
    if (rows // k) % shards:
        fits = [d for d in range(1, rows + 1) if rows % d == 0 and (rows // d) % shards == 0]
        raise ValueError(
            f"num_microbatches={k} leaves {rows // k} rows per microbatch, which the {shards} "
            f"devices sharing the batch axis ({PartitionSpec(*spec)} on mesh "
            f"{mesh_axes(s.mesh)}) do not split evenly; accepted num_microbatches: "
            f"{', '.join(map(str, fits[:24]))}{', ...' if len(fits) > 24 else ''}."
        )
    with _on_mesh(s.mesh):
        return x.reshape(shape, order="F", out_sharding=PartitionSpec(None, *spec))


def stacked_zeros(x: Any, k: int, dtype: Any = None) -> Any:
    """Zeros of shape `(k, *x.shape)` (dtype `x`'s unless given), sharded as `x` on the
    trailing axes under explicit sharding (the new axis unsharded)."""
    dtype = x.dtype if dtype is None else dtype
    s = explicit_sharding(x)
    if s is None:
        return jax.numpy.zeros((k, *x.shape), dtype)
    with _on_mesh(s.mesh):
        return jax.numpy.zeros((k, *x.shape), dtype, out_sharding=PartitionSpec(None, *s.spec))


def _on_mesh(mesh: Any) -> Any:
    """A context in which `mesh`'s (abstract) mesh is the current one, for `out_sharding=`
    given as a PartitionSpec: outside `jax.set_mesh`, jax 0.12 drops an `out_sharding`
    NamedSharding over an abstract mesh from `jnp.zeros` and `broadcast_in_dim` (measured:
    `float32[3,64]` where `float32[3,64@data]` was asked; jax 0.10 keeps it)."""
    return jax.sharding.use_abstract_mesh(getattr(mesh, "abstract_mesh", mesh))


# -- specs -------------------------------------------------------------------------------------
def spec_axes(entry: Any) -> tuple[str, ...]:
    if entry is None or entry is PartitionSpec.UNCONSTRAINED:
        return ()
    if isinstance(entry, str):
        return (entry,)
    return tuple(a for a in entry if isinstance(a, str))


def mesh_axes(mesh: Any) -> dict[str, int]:
    """{axis name: size} of a `Mesh` or `AbstractMesh`."""
    return dict(zip(mesh.axis_names, (int(s) for s in mesh.axis_sizes), strict=True))


def explicit_axes(mesh: Any) -> dict[str, int]:
    """The axes of `mesh` of type `Explicit` (whose shardings are part of the avals)."""
    types = getattr(mesh, "axis_types", None) or ()
    names = [n for n, t in zip(mesh.axis_names, types, strict=False) if "Explicit" in str(t)]
    sizes = mesh_axes(mesh)
    return {n: sizes[n] for n in names}
