"""Trace a function into a graph of values (bytes) and equations (FLOPs, residuals).

`trace` flattens `jit`/`closed_call` bodies into one equation list in program order, so cuts can
fall anywhere inside them; `scan`, `cond`, `while`, `custom_jvp`, `custom_vjp` and nested
checkpoints stay single nodes whose cost includes their bodies; each node remembers the calls it
was inlined from (`Node.calls`: the user's blocks without names)
(docs/design.md#tracing-and-the-cost-model).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jremat._src.base import compat as _compat
from jremat._src.base import sharding
from jremat._src.base.args import check_differentiable, normalize_argnums
from jremat._src.trace import cost_model
from jremat._src.trace.sharding import aval_spec, per_device_nbytes, propagate, spec_of

ARG = -1  # producer index of a function argument
CONST = -2  # producer index of a captured constant


@dataclasses.dataclass(frozen=True)
class Value:
    """One array in the program: `nbytes` on each device, produced by node `producer`.

    `shape` is the global shape. `dtype` is the dtype's name (text: fingerprints, reports);
    `jax_dtype` the dtype object itself (a numpy dtype, or JAX's extended dtype of a typed
    PRNG key array, whose name "key<fry>" numpy does not know), from which `struct` builds the
    value's aval. Under sharding (docs/design.md#sharding) `spec` holds the mesh axes of each
    dimension, `nbytes` the bytes of one device's shard and `global_nbytes` those of the whole
    array; unsharded, both byte counts agree and `spec` is None.
    """

    id: int
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    producer: int
    is_float: bool
    global_nbytes: int | None = None
    spec: tuple[tuple[str, ...], ...] | None = None
    jax_dtype: Any = dataclasses.field(default=None, compare=False, repr=False)
    #: inside a `shard_map` body, `(manual-axis type, sharding)` of a value that varies over
    #: some of its manual axes (`_compat.aval_manual`; None otherwise): part of its type
    manual: Any = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def saveable(self) -> bool:
        """Whether a checkpoint policy can save the value: a real floating value. JAX's remat
        cannot save a complex residual by policy (jax 0.10-0.12 raise `reduce_precision does
        not accept dtype complex64`), so a checkpointed segment recomputes complex values."""
        return self.is_float and "complex" not in self.dtype

    @property
    def struct(self) -> jax.ShapeDtypeStruct:
        """The value's global aval, `jax.ShapeDtypeStruct(shape, jax_dtype)` (extended dtypes
        too: built from the dtype object, never its name); inside a `shard_map` body with the
        manual axes it varies over (a jaxpr traced at it re-traces as the body's did)."""
        dtype = self.dtype if self.jax_dtype is None else self.jax_dtype
        if self.manual is None:
            return jax.ShapeDtypeStruct(self.shape, dtype)
        mat, sharding = self.manual
        return jax.ShapeDtypeStruct(self.shape, dtype, sharding=sharding, manual_axis_type=mat)


@dataclasses.dataclass
class Node:
    """One equation: its inputs (value ids, or a Literal), outputs, FLOPs and residuals."""

    index: int
    primitive: str
    eqn: Any
    inputs: tuple[Any, ...]
    outputs: tuple[int, ...]
    flops: float
    #: value ids whose primal XLA keeps for this node's VJP: `vjp_residuals` moved off
    #: fused elementwise intermediates onto the values they are fused from (`_anchor_residuals`)
    residuals: tuple[int, ...]
    internal_bytes: int  # residual bytes kept inside a control-flow node (scan stacks ...)
    source: str
    name_stack: str
    #: the call equations (`jit`, `closed_call`) this node was inlined from, outermost first,
    #: each as `<callee name>@<equation index in the caller>`: the user's own functions, found
    #: without names (trace/layers.py `call_keys`)
    calls: tuple[str, ...] = ()
    #: value ids whose primal the node's VJP rule reads by jremat's residual table
    #: (`cost_model.residual_positions`, floating values only: not a select's predicate nor
    #: gather indices), before anchoring: what a checkpointed segment recomputes unless saved
    vjp_residuals: tuple[int, ...] = ()


@dataclasses.dataclass
class Graph:
    """A traced program. `nodes` are in program (topological) order.

    Attributes:
      values: every value, indexed by id.
      nodes: every equation after inlining `jit`/`closed_call`.
      invars: ids of the flattened arguments of `fn`, in order.
      outvars: ids (or Literals) of the flattened outputs.
      consts: captured constants, id -> array.
      diff_invars: for each argument, whether it is differentiated (in `argnums`, floating).
      in_tree, out_tree: pytree structures of the arguments and outputs.
      out_shape: the outputs as a pytree of `jax.ShapeDtypeStruct`s (None if not traced).
      fingerprint: a hash of the program: every value's shape and dtype and every equation's
        primitive and wiring (stable across processes); plans are tied to it.
      consumers: for each value id, the indices of the nodes that read it, in program order
        (each node once).
      mesh_axes: {mesh axis name: size} the values are sharded over ({} on one device).
      memo: figures derived from the graph once and kept with it (its layer keys); not part
        of its equality.

    Examples:
      `jremat.trace` builds one (a planner reads it; users rarely construct one):

      >>> import jax.numpy as jnp, jremat
      >>> graph = jremat.trace(lambda w, x: jnp.sum(x @ w), jnp.ones((8, 8)), jnp.ones((4, 8)))
      >>> isinstance(graph, jremat.Graph)
      True
      >>> [(graph.values[i].shape, graph.values[i].nbytes) for i in graph.invars]
      [((8, 8), 256), ((4, 8), 128)]
      >>> graph.is_temp(graph.invars[0]), graph.is_temp(graph.nodes[0].outputs[0])
      (False, True)
    """

    values: list[Value]
    nodes: list[Node]
    invars: list[int]
    outvars: list[Any]
    consts: dict[int, Any]
    diff_invars: list[bool]
    in_tree: Any
    out_tree: Any
    fingerprint: str
    consumers: list[list[int]] = dataclasses.field(default_factory=list)
    mesh_axes: dict[str, int] = dataclasses.field(default_factory=dict)
    out_shape: Any = None
    memo: dict[str, Any] = dataclasses.field(default_factory=dict, repr=False, compare=False)

    @property
    def num_nodes(self) -> int:
        """The number of equations (nodes) of the program."""
        return len(self.nodes)

    @property
    def total_flops(self) -> float:
        """FLOPs of the forward program: the sum of its equations' FLOPs."""
        return float(sum(n.flops for n in self.nodes))

    def is_temp(self, vid: int) -> bool:
        """Whether a value lives in XLA's temporaries (not an argument or constant)."""
        return self.values[vid].producer >= 0


def is_literal(x: Any) -> bool:
    return not isinstance(x, int)


class _Builder:
    def __init__(self, axes: dict[str, int] | None = None) -> None:
        self.values: list[Value] = []
        self.nodes: list[Node] = []
        self.consts: dict[int, Any] = {}
        self.axes: dict[str, int] = dict(axes or {})

    def new_value(self, aval: Any, producer: int, spec: Any = None) -> int:
        vid = len(self.values)
        dtype = getattr(aval, "dtype", None)
        shape = tuple(getattr(aval, "shape", ()))
        explicit = aval_spec(aval)
        if explicit is not None:  # explicit sharding mode: the aval says it
            spec, axes = explicit
            self.axes.update(axes)
        nbytes = _compat.aval_nbytes(aval)
        if spec is not None and not any(spec):
            spec = None
        self.values.append(
            Value(
                id=vid,
                shape=shape,
                dtype=str(dtype),
                nbytes=per_device_nbytes(nbytes, shape, spec, self.axes),
                producer=producer,
                is_float=_compat.is_float_dtype(dtype),
                global_nbytes=nbytes,
                spec=spec,
                jax_dtype=dtype,
                manual=_compat.aval_manual(aval),
            )
        )
        return vid

    def out_specs(self, eqn: Any, ins: Sequence[Any]) -> list[Any]:
        """Specs of an equation's outputs propagated from its inputs (None when unsharded)."""
        if not self.axes:
            return [None] * len(eqn.outvars)
        in_specs = [None if not isinstance(x, int) else self.values[x].spec for x in ins]
        if not any(in_specs) and eqn.primitive.name != "sharding_constraint":
            return [None] * len(eqn.outvars)
        in_shapes = [tuple(getattr(v.aval, "shape", ())) for v in eqn.invars]
        out_shapes = [tuple(getattr(v.aval, "shape", ())) for v in eqn.outvars]
        return propagate(eqn, in_specs, in_shapes, out_shapes)

    def add_jaxpr(
        self,
        jaxpr: Any,
        consts: Sequence[Any],
        in_ids: Sequence[Any],
        stack: str,
        calls: tuple[str, ...] = (),
    ):
        env: dict[Any, Any] = {}
        for var, c in zip(jaxpr.constvars, consts, strict=True):
            cid = self.new_value(var.aval, CONST)
            self.consts[cid] = c
            env[var] = cid
        for var, x in zip(jaxpr.invars, in_ids, strict=True):
            env[var] = x

        def read(v: Any) -> Any:
            return v if hasattr(v, "val") else env[v]

        for position, eqn in enumerate(jaxpr.eqns):
            ins = [read(v) for v in eqn.invars]
            inner_stack = _join(stack, _compat.name_stack(eqn))
            call = (
                _compat.inner_call_jaxpr(eqn)
                if eqn.primitive.name in _compat.INLINE_PRIMITIVES
                else None
            )
            if call is not None:
                callee = f"{eqn.params.get('name', eqn.primitive.name)}@{position}"
                outs = self.add_jaxpr(call[0], call[1], ins, inner_stack, (*calls, callee))
                for var, o in zip(eqn.outvars, outs, strict=True):
                    env[var] = o
                continue
            index = len(self.nodes)
            specs = self.out_specs(eqn, ins)
            out_ids = tuple(
                self.new_value(v.aval, index, sp) for v, sp in zip(eqn.outvars, specs, strict=True)
            )
            for var, o in zip(eqn.outvars, out_ids, strict=True):
                env[var] = o
            in_pos, out_pos = cost_model.residual_positions(eqn)
            res = [ins[i] for i in in_pos if isinstance(ins[i], int)]
            res += [out_ids[i] for i in out_pos]
            self.nodes.append(
                Node(
                    index=index,
                    primitive=eqn.primitive.name,
                    eqn=eqn,
                    inputs=tuple(ins),
                    outputs=out_ids,
                    flops=cost_model.eqn_flops(eqn),
                    residuals=tuple(dict.fromkeys(res)),
                    vjp_residuals=tuple(dict.fromkeys(res)),
                    internal_bytes=self.local_internal_bytes(eqn, out_ids),
                    source=_compat.source_summary(eqn),
                    name_stack=inner_stack,
                    calls=calls,
                )
            )
        return [read(v) for v in jaxpr.outvars]

    def local_internal_bytes(self, eqn: Any, out_ids: Sequence[int]) -> int:
        """Per-device residual bytes kept inside a control-flow node: its global figure,
        scaled like its outputs' (a scan's stacked residuals follow its carry's sharding)."""
        total = cost_model.internal_residual_bytes(eqn)
        ratios = [
            self.values[o].nbytes / self.values[o].global_nbytes
            for o in out_ids
            if self.values[o].global_nbytes
        ]
        return int(total * max(ratios)) if ratios and total else total


def _join(a: str, b: str) -> str:
    return f"{a}/{b}" if a and b else a or b


def trace(fn: Callable[..., Any], *args: Any, argnums: int | Sequence[int] = 0) -> Graph:
    """Trace `fn(*args)` into a `Graph` of values and equations.

    Args:
      fn: a JAX-traceable function of positional array (pytree) arguments.
      *args: example arguments (arrays or `jax.ShapeDtypeStruct`); only shapes and dtypes matter.
      argnums: which positional arguments are differentiated (int or tuple of ints).

    Returns:
      A `Graph`: values with their bytes, equations with FLOPs and the residuals their VJP
      keeps ([design.md#tracing-and-the-cost-model](../design.md#tracing-and-the-cost-model)).
      `jit`/`closed_call` bodies are inlined.

    Raises:
      TypeError: `fn` is not callable, or an argument at `argnums` has no floating leaves.
      ValueError: `argnums` is out of range.

    Examples:
      >>> import jax.numpy as jnp, jremat
      >>> def loss(w, x):
      ...     return jnp.sum(jnp.tanh(x @ w) ** 2)
      >>> graph = jremat.trace(loss, jnp.ones((8, 8)), jnp.ones((4, 8)))
      >>> graph.diff_invars  # argnums=0: only w is differentiated
      [True, False]
      >>> first = graph.nodes[0]
      >>> first.primitive, first.flops  # x @ w: 2 * 4 * 8 * 8 FLOPs
      ('dot_general', 512.0)
    """
    if not callable(fn):
        raise TypeError(f"fn must be a callable, got {type(fn).__name__}")
    nums = normalize_argnums(argnums, len(args))
    check_differentiable(args, nums)
    return build_graph(fn, args, nums)


def build_graph(fn: Callable[..., Any], args: Sequence[Any], nums: tuple[int, ...] = ()) -> Graph:
    """`trace` without argument checks (used when re-evaluating a known program)."""
    closed_jaxpr, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    flat_args, in_tree = jax.tree_util.tree_flatten(args)
    mesh = sharding.arg_mesh(flat_args)
    axes = sharding.mesh_axes(mesh) if mesh is not None else {}
    out_tree = jax.tree_util.tree_structure(out_shape)
    diff = []
    for i, a in enumerate(args):
        for x in jax.tree_util.tree_leaves(a):
            diff.append(i in nums and _compat.is_float_dtype(getattr(x, "dtype", None)))
    b = _Builder(axes)
    jaxpr, consts = _compat.closed(closed_jaxpr)
    in_ids = [
        b.new_value(v.aval, ARG, spec_of(sharding.leaf_sharding(x), len(v.aval.shape)))
        for v, x in zip(jaxpr.invars, flat_args, strict=True)
    ]
    outs = b.add_jaxpr(jaxpr, consts, in_ids, "")
    _anchor_residuals(b)
    consumers: list[list[int]] = [[] for _ in b.values]
    for node in b.nodes:
        for x in node.inputs:
            if isinstance(x, int) and (not consumers[x] or consumers[x][-1] != node.index):
                consumers[x].append(node.index)
    return Graph(
        values=b.values,
        nodes=b.nodes,
        invars=in_ids,
        outvars=outs,
        consts=b.consts,
        diff_invars=diff,
        in_tree=in_tree,
        out_tree=out_tree,
        fingerprint=_fingerprint(b, in_ids, outs),
        consumers=consumers,
        mesh_axes=dict(b.axes),
        out_shape=out_shape,
    )


def _anchor_residuals(b: _Builder) -> None:
    """Move residuals off fusible (elementwise) results onto the values they are fused from.

    XLA fuses elementwise chains into their consumers and recomputes them inside backward
    fusions, so what it stores is the chain's inputs (matmul/conv/reduction results, arguments),
    not each intermediate. Residual bytes summed without this overestimate XLA about 2.6x.
    """
    anchors: dict[int, tuple[int, ...]] = {}
    uses: dict[int, list[str]] = {}
    for node in b.nodes:
        for x in node.inputs:
            if isinstance(x, int):
                uses.setdefault(x, []).append(node.primitive)

    def materialized(v: int, node: Node | None) -> bool:
        """XLA writes `v` to memory: not fusible, shared, or an operand of a non-fusible op."""
        if node is None or node.primitive not in cost_model.FUSIBLE:
            return True
        users = uses.get(v, [])
        return len(users) > 1 or any(u not in cost_model.FUSIBLE for u in users)

    def anchor(vid: int) -> tuple[int, ...]:
        if vid in anchors:
            return anchors[vid]
        stack = [vid]
        while stack:  # iterative post-order: chains can be thousands of equations long
            v = stack.pop()
            if v in anchors:
                continue
            p = b.values[v].producer
            node = b.nodes[p] if p >= 0 else None
            if materialized(v, node):
                anchors[v] = (v,)
                continue
            pending = [x for x in node.inputs if isinstance(x, int) and x not in anchors]
            if pending:
                stack.append(v)
                stack.extend(pending)
                continue
            out: dict[int, None] = {}
            assert node is not None
            for x in node.inputs:
                if isinstance(x, int):
                    out.update(dict.fromkeys(anchors[x]))
            anchors[v] = tuple(out)
        return anchors[vid]

    for node in b.nodes:
        res: dict[int, None] = {}
        for r in node.residuals:
            res.update(dict.fromkeys(anchor(r)))
        node.residuals = tuple(res)


def _fingerprint(b: _Builder, invars: Sequence[int], outvars: Sequence[Any]) -> str:
    """A hash of the program a plan is tied to: every value's shape and dtype (in id order),
    every equation's primitive and wiring (which value ids, or a literal, feed it, and which it
    produces), and which values are the arguments and outputs.

    Only deterministic text enters it (primitive names, value ids, shapes, dtype names), so the
    same function at the same signature hashes alike in every process (saved plans, `plan_dir`
    keys). Two programs of the same primitives wired differently hash differently.
    """

    def ref(x: Any) -> str:
        return "L" if is_literal(x) else str(x)

    h = hashlib.sha256()
    for v in b.values:  # global shapes; how values are sharded is the signature's part
        h.update(f"{v.shape}{v.dtype};".encode())
    h.update(f"in{','.join(map(str, invars))};".encode())
    for n in b.nodes:
        h.update(f"{n.primitive}({','.join(map(ref, n.inputs))})->{n.outputs};".encode())
        h.update(_params_text(n.eqn.params).encode())
    h.update(f"out{','.join(map(ref, outvars))};".encode())
    return h.hexdigest()[:16]


def _params_text(params: dict[str, Any]) -> str:
    """An equation's parameters as deterministic text: nested jaxprs (scan and while bodies,
    cond branches, custom_vjp rules) by their equations, avals, parameters and wiring; numbers,
    strings, dtypes and enums by value; callables by qualified name (never an address), so
    that two programs alike at the top but with other loop bodies, exponents, strides or
    axes hash differently, and one program hashes alike in every process."""
    return "[" + ",".join(f"{k}={_param_text(params[k])}" for k in sorted(params)) + "]"


def _param_text(v: Any) -> str:
    if hasattr(v, "jaxpr") and hasattr(v, "consts"):  # a ClosedJaxpr
        return _jaxpr_text(v.jaxpr)
    if hasattr(v, "eqns") and hasattr(v, "invars"):  # an open Jaxpr
        return _jaxpr_text(v)
    if isinstance(v, (tuple, list)):
        return "(" + ",".join(map(_param_text, v)) + ")"
    if isinstance(v, dict):
        return _params_text(v)
    if v is None or isinstance(v, (bool, int, float, str, np.dtype, np.generic)):
        return repr(v)
    if callable(v) and not hasattr(v, "shape"):
        return getattr(v, "__qualname__", type(v).__name__)
    text = str(v)
    return type(v).__name__ if " at 0x" in text else text


def _jaxpr_text(jaxpr: Any) -> str:
    ids: dict[Any, int] = {}

    def ref(x: Any) -> str:
        if is_literal(x):
            return f"L{getattr(x, 'val', '')}"
        return str(ids.setdefault(x, len(ids)))

    parts = [",".join(f"{ref(v)}:{v.aval}" for v in [*jaxpr.constvars, *jaxpr.invars])]
    for e in jaxpr.eqns:
        ins = ",".join(map(ref, e.invars))
        outs = ",".join(f"{ref(v)}:{v.aval}" for v in e.outvars)
        parts.append(f"{e.primitive.name}({ins}){_params_text(e.params)}->{outs}")
    parts.append("out" + ",".join(map(ref, jaxpr.outvars)))
    return "{" + ";".join(parts) + "}"


@dataclasses.dataclass(frozen=True)
class Signature:
    """What a call's arguments trace by: a hashable key, and its readable `description`.

    Equal signatures trace the same function to the same program, so plans (`jremat.auto`,
    `PlanCache`) and traced graphs (`jremat.rematerialize`) are cached per signature.

    Attributes:
      tree: the arguments' pytree structure.
      leaves: per flat leaf `(shape, dtype, weak_type, sharding, varying)`: `sharding` is
        `base.sharding.sharding_key` of the leaf (None when it is not sharded), `varying`
        the sorted `shard_map` axes a traced value varies over inside a body (else `()`).
    """

    tree: Any
    leaves: tuple[tuple[Any, ...], ...]

    @property
    def sharding(self) -> tuple:
        """Per-leaf sharding keys, or `()` when no leaf is sharded."""
        out = tuple(leaf[3] for leaf in self.leaves)
        return out if any(s is not None for s in out) else ()

    @property
    def description(self) -> str:
        """The leaves as text, e.g. `float32[8,16] int32[8] float32[]{weak}`; a sharded
        dimension reads `512@data` (`@(data,model)` over two axes), a `shard_map` body's value
        ends in `{V:axes}`."""
        return " ".join(_describe_leaf(*leaf) for leaf in self.leaves)

    def __str__(self) -> str:
        return self.description


def _describe_leaf(shape: tuple, dtype: str, weak: bool, shard: Any, varying: tuple) -> str:
    spec = shard[1] if shard is not None else ()
    dims = []
    for i, d in enumerate(shape):
        axes = spec[i] if i < len(spec) else ()
        on = "" if not axes else "@" + (axes[0] if len(axes) == 1 else f"({','.join(axes)})")
        dims.append(f"{d}{on}")
    text = f"{dtype}[{','.join(dims)}]"
    if weak:
        text += "{weak}"
    if varying:
        text += "{V:" + ",".join(varying) + "}"
    return text


def signature(args: Sequence[Any]) -> Signature:
    """The `Signature` of a call's arguments: their tree structure and, per leaf, shape,
    dtype, weak type, sharding and (inside `shard_map`) varying axes. The one signature
    function: `jremat.auto`, `PlanCache` keys and `jremat.rematerialize` all use it.

    Weak typing counts: a Python scalar (or a value traced from one) traces to a different
    program than a committed float32 array. So do shardings (`base.sharding.sharding_key`):
    the same shapes sharded differently are planned apart. Arguments may be arrays, tracers,
    `jax.ShapeDtypeStruct`s or Python scalars; only these properties are read."""
    leaves, tree = jax.tree_util.tree_flatten(args)

    def key(x: Any) -> tuple:
        if isinstance(x, (bool, int, float, complex)):
            return ((), type(x).__name__, True, None, ())
        weak = bool(getattr(getattr(x, "aval", x), "weak_type", False))
        varying: tuple[str, ...] = ()
        if _compat.is_tracer(x):  # inside shard_map: the axes a value varies over
            manual = _compat.manual_axis_type(x)
            if manual is not None:
                varying = tuple(sorted(manual.varying))
        dtype = str(getattr(x, "dtype", type(x).__name__))
        return (tuple(np.shape(x)), dtype, weak, sharding.sharding_key(x), varying)

    return Signature(tree, tuple(key(x) for x in leaves))
