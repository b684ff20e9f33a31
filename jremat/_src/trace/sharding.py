"""Per-value sharding specs and per-device bytes: a spec per dimension from a sharding or an
explicit-mode aval, propagated equation by equation (docs/design.md#sharding)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from jax.sharding import NamedSharding

from jremat._src.base.sharding import Spec, explicit_axes, spec_axes


def spec_of(sharding: Any, ndim: int, axes: Mapping[str, int] | None = None) -> Spec | None:
    """Per-dimension mesh axes of a `NamedSharding` (None for other shardings). With `axes`,
    only axes named there are kept."""
    if not isinstance(sharding, NamedSharding):
        return None
    entries = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
    out = tuple(spec_axes(e) for e in entries[:ndim])
    if axes is not None:
        out = tuple(tuple(a for a in d if a in axes) for d in out)
    return out


def aval_spec(aval: Any) -> tuple[Spec, dict[str, int]] | None:
    """(spec, explicit axes) of an aval carrying an explicit-mode sharding, else None."""
    sharding = getattr(aval, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or not hasattr(aval, "shape"):
        return None
    axes = explicit_axes(mesh)
    if not axes:
        return None
    return spec_of(sharding, len(aval.shape), axes), axes


def replicated(ndim: int) -> Spec:
    return ((),) * ndim


def per_device_nbytes(global_nbytes: int, shape: Sequence[int], spec: Spec | None, axes) -> int:
    """Bytes of one device's shard of a value of `global_nbytes` and `shape` under `spec`."""
    if not spec or not shape:
        return global_nbytes
    size = int(np.prod(shape, dtype=np.int64))
    if size == 0:
        return 0
    local = 1
    for n, d in zip(shape, spec, strict=False):
        k = math.prod(axes.get(a, 1) for a in d)
        local *= -(-int(n) // k)
    return global_nbytes // size * local


def _dedupe(spec: Sequence[tuple[str, ...]]) -> Spec:
    """Drop a mesh axis that shards a second dimension (a spec names each axis once)."""
    seen: set[str] = set()
    out = []
    for d in spec:
        keep = tuple(a for a in d if a not in seen)
        seen.update(keep)
        out.append(keep)
    return tuple(out)


def propagate(eqn: Any, in_specs: Sequence[Spec | None], in_shapes, out_shapes) -> list[Spec]:
    """Output specs of one equation from its inputs' specs (None: a literal or unknown).

    Rules: `sharding_constraint` sets the spec; `broadcast_in_dim`, `transpose`, `reshape`
    (where a dimension maps clearly), reductions and `squeeze` move dimensions; `dot_general`
    keeps its batch and free dimensions' specs (a sharded contracting dimension is summed
    across devices, so the output is not sharded along it); any other equation gives each
    output the spec of an input of the same rank on the dimensions whose sizes agree (so
    elementwise ops, slices, pads and concatenations keep it), else replicated.
    """
    name = eqn.primitive.name
    p = eqn.params
    ins = [
        s if s is not None else replicated(len(sh))
        for s, sh in zip(in_specs, in_shapes, strict=True)
    ]
    outs: list[Spec] | None = None
    if name == "sharding_constraint":
        s = spec_of(p.get("sharding"), len(out_shapes[0]))
        outs = [s if s is not None else ins[0]]
    elif name == "broadcast_in_dim" and ins:
        spec = [()] * len(out_shapes[0])
        for i, od in enumerate(p["broadcast_dimensions"]):
            if in_shapes[0][i] == out_shapes[0][od]:
                spec[od] = ins[0][i]
        outs = [tuple(spec)]
    elif name == "transpose":
        outs = [tuple(ins[0][i] for i in p["permutation"])]
    elif name == "reshape":
        outs = [_reshape_spec(ins[0], in_shapes[0], out_shapes[0])]
    elif name == "squeeze":
        drop = {d % max(len(in_shapes[0]), 1) for d in p["dimensions"]}
        outs = [tuple(s for i, s in enumerate(ins[0]) if i not in drop)]
    elif name.startswith("reduce_") or name in ("argmax", "argmin"):
        axes = set(p.get("axes", ()))
        kept = tuple(s for i, s in enumerate(ins[0]) if i not in axes)
        outs = [kept if len(kept) == len(o) else replicated(len(o)) for o in out_shapes]
    elif name == "dot_general":
        (lc, rc), (lb, rb) = p["dimension_numbers"]
        ls, rs = ins[0], ins[1]
        lf = [i for i in range(len(ls)) if i not in lc and i not in lb]
        rf = [i for i in range(len(rs)) if i not in rc and i not in rb]
        batch = [ls[a] or rs[b] for a, b in zip(lb, rb, strict=True)]
        outs = [_dedupe(batch + [ls[i] for i in lf] + [rs[i] for i in rf])]
    if outs is None:
        outs = []
        for o in out_shapes:
            best: Spec = replicated(len(o))
            score = 0
            for s, sh in zip(ins, in_shapes, strict=True):
                if len(sh) != len(o):
                    continue
                cand = tuple(d if a == b else () for d, a, b in zip(s, sh, o, strict=True))
                n = sum(len(d) for d in cand)
                if n > score:
                    best, score = cand, n
            outs.append(best)
    return [
        _dedupe(s) if len(s) == len(o) else replicated(len(o))
        for s, o in zip(outs, out_shapes, strict=True)
    ]


def _reshape_spec(spec: Spec, old: Sequence[int], new: Sequence[int]) -> Spec:
    """Map a spec through a reshape: dimensions are grouped where their sizes' products
    agree; the major (first non-1) dimension of each input group passes its axes to the major
    dimension of the output group (a dimension that survives, or the outer dimension of a
    merge or split). Others end unsharded (XLA would reshard them)."""
    out: list[tuple[str, ...]] = [()] * len(new)
    i = j = 0
    while i < len(old) and j < len(new):
        gi, gj = [i], [j]
        a, b = old[i], new[j]
        while a != b:
            if a < b:
                i += 1
                if i >= len(old):
                    break
                gi.append(i)
                a *= old[i]
            else:
                j += 1
                if j >= len(new):
                    break
                gj.append(j)
                b *= new[j]
        major_in = next((k for k in gi if old[k] != 1), gi[0])
        major_out = next((k for k in gj if new[k] != 1), gj[0])
        if spec[major_in]:  # a sharded minor dimension of a merge is left unsharded
            out[major_out] = spec[major_in]
        i, j = gi[-1] + 1, gj[-1] + 1
    return tuple(out)
