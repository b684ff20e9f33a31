"""`jremat.explain`: what a plan saves and recomputes, per layer and segment, before you decide.

Every row is one layer (or the glue between layers) intersected with one plan segment:
activation, saved and recomputed bytes, recompute FLOPs and source lines
(docs/design.md#reports). A Flax model is analysed as written, under `jremat.disabled()`.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jremat import policies
from jremat._src.base import compat as _compat
from jremat._src.base.args import abstract_args
from jremat._src.base.budget import BudgetLike
from jremat._src.compile.blocks import pairing
from jremat._src.frontends.auto import is_static_arg
from jremat._src.frontends.blocks import disabled
from jremat._src.plan.plan import KEEP, SAVE_NAMES, Plan
from jremat._src.plan.rewrite import segment_io
from jremat._src.search.solve import plan
from jremat._src.trace.graph import Graph, build_graph, trace
from jremat._src.trace.layers import layer_keys, layer_segments, layer_spans
from jremat._src.trace.sources import source_span

MIB = 2.0**20


@dataclasses.dataclass
class ExplainRow:
    """One layer x segment of an explained plan.

    Attributes:
      layer: the layer's name (`Block_3`, `h/2`), `(between layers)` for glue, or `eqns a-b`
        when the program carries no layer names.
      segment: index of the plan segment; `policy` its policy (`keep`, `names`, a built-in).
      start, end: equations `[start, end)` of the traced graph.
      activation_bytes: bytes of residuals these equations leave for backward without remat.
      saved_bytes, recomputed_bytes: how the plan splits them (saved + recomputed =
        activation, plus any segment-input values these equations produce).
      flops: FLOPs of these equations; recompute_flops: those the backward pass redoes.
      saved, recomputed: the largest saved/recomputed values, as `dtype[shape]` strings.
      source: the user's source lines of these equations (`model.py:12:16-32 (fn)`, the
        innermost frame outside jax, flax and jremat, relative to the working folder).
    """

    layer: str
    segment: int
    policy: str
    start: int
    end: int
    activation_bytes: int
    saved_bytes: int
    recomputed_bytes: int
    flops: float
    recompute_flops: float
    saved: list[str]
    recomputed: list[str]
    source: str


@dataclasses.dataclass
class Explanation:
    """Rows (largest activations first) and totals of `jremat.explain`.

    Attributes:
      rows: `ExplainRow`s sorted by `activation_bytes`, largest first.
      plan: the `Plan` explained.
      graph: the traced `Graph` it refers to.
      baseline_temp_bytes: compiled temp bytes without remat (None with verify=False).
      planned_temp_bytes: compiled temp bytes under the plan (None when not compiled).
      budget: the budget asked for.

    Examples:
      `jremat.explain` returns one; at budget 1.0 the plan keeps every activation:

      >>> import jax.numpy as jnp, jremat
      >>> def loss(ws, x):
      ...     for w in ws:
      ...         x = jnp.tanh(x @ w)
      ...     return jnp.mean(x**2)
      >>> e = jremat.explain(loss, [jnp.ones((8, 8))] * 3, jnp.ones((4, 8)), budget=1.0)
      >>> e.total_recompute_flops, e.total_flops == e.graph.total_flops
      (0.0, True)
      >>> row = e.rows[0]  # an ExplainRow: a layer's activations, largest first
      >>> row.policy, row.activation_bytes, row.saved  # tanh(x @ w) of 4 x 8 floats
      ('keep', 128, ['float32[4, 8]'])
      >>> e.to_dicts()[0]["saved_bytes"]
      128
    """

    rows: list[ExplainRow]
    plan: Plan
    graph: Graph
    budget: BudgetLike
    baseline_temp_bytes: int | None
    planned_temp_bytes: int | None

    @property
    def total_recompute_flops(self) -> float:
        """FLOPs the backward pass recomputes under the plan: the sum over the rows."""
        return float(sum(r.recompute_flops for r in self.rows))

    @property
    def total_flops(self) -> float:
        """Forward FLOPs of the program: the sum over the rows."""
        return float(sum(r.flops for r in self.rows))

    def to_dicts(self) -> list[dict[str, Any]]:
        """The rows as plain dicts (JSON-able)."""
        return [dataclasses.asdict(r) for r in self.rows]

    def __str__(self) -> str:
        return self.table()

    def _repr_html_(self) -> str:
        """The table as HTML (Jupyter shows it when a cell returns the explanation)."""
        import html

        return f"<pre>{html.escape(self.table())}</pre>"

    def table(self, max_rows: int | None = 40) -> str:
        """A text report: the plan's compiled figures (budget asked, without remat, under the
        plan), what the columns mean, then the rows (at most `max_rows`, largest activations
        first), each followed by its source lines."""
        n_ckpt = sum(s.checkpointed for s in self.plan.segments)
        head = [
            f"jremat.explain: {self.graph.num_nodes} equations, {len(self.plan.segments)} "
            f"segments ({n_ckpt} checkpointed), budget={self.budget!r}"
        ]
        head += self.plan.figures()
        tot = self.total_flops or 1.0
        head.append(
            f"  per the rows:    recompute {self.total_recompute_flops / 1e6:.4g} MFLOP "
            f"({100 * self.total_recompute_flops / tot:.1f}% of the forward pass)"
        )
        head += [
            "Rows: one layer within one plan segment, largest activations first. activ = bytes "
            "its residuals would keep for the",
            "  backward pass without remat; saved = of those, kept under the plan; recomp = "
            "recomputed in the backward pass instead;",
            "  recomp MFLOP = forward work redone; policy as in Plan.summary (keep, names, or a "
            "jax.checkpoint_policies name).",
        ]
        cols = (
            f"{'layer':<22} {'seg':>3} {'policy':>9} {'eqns':>9} {'activ MiB':>9} "
            f"{'saved MiB':>9} {'recomp MiB':>10} {'recomp MFLOP':>12}  saves / recomputes"
        )
        lines = head + [cols]
        shown = self.rows if max_rows is None else self.rows[:max_rows]
        for r in shown:
            detail = []
            if r.saved:
                detail.append("saves " + ", ".join(r.saved))
            if r.recomputed:
                detail.append("recomputes " + ", ".join(r.recomputed))
            lines.append(
                f"{r.layer[:22]:<22} {r.segment:>3} {r.policy[:9]:>9} "
                f"{f'{r.start}-{r.end - 1}':>9} {r.activation_bytes / MIB:>9.3f} "
                f"{r.saved_bytes / MIB:>9.3f} {r.recomputed_bytes / MIB:>10.3f} "
                f"{r.recompute_flops / 1e6:>12.4g}  {'; '.join(detail)}"
            )
            if r.source:
                lines.append(f"{'':>22}   at {r.source}")
        if len(shown) < len(self.rows):
            lines.append(f"... {len(self.rows) - len(shown)} more rows (table(max_rows=None))")
        return "\n".join(lines)


def explain(
    target: Any,
    *args: Any,
    budget: BudgetLike = 0.5,
    solver: str | None = None,
    verify: bool = True,
    max_rounds: int = 4,
    argnums: int | Sequence[int] | None = None,
    method: Any = None,
    rngs: Any = None,
    mutable: Any = False,
    **kwargs: Any,
) -> Explanation:
    """Plan `target` under `budget` and explain, per layer and segment, what is saved and what
    is recomputed: bytes, FLOPs and source lines, largest activations first.

    Targets and their arguments:
      * a function: `explain(loss, params, batch)`; differentiates `argnums` (default 0). A
        non-scalar output is reduced with fixed random tangents (`<out, t>`), as for blocks.
      * a linen Module instance: `explain(model, variables, x, rngs=..., mutable=...)`;
        differentiates `variables["params"]` (`model.apply` keywords pass through).
      * an NNX Module instance: `explain(model, x)`; differentiates its `nnx.Param`s.
      * a function taking NNX modules: `explain(f, model, x)`; differentiates the `nnx.Param`s
        of the modules among its arguments.
    The plan is a whole training step's (`jremat.plan`: the budget is a fraction of that
    step's compiled temp bytes, or bytes); `jremat.auto` decorators inside are switched off.

    Args:
      target: as above.
      *args: example arguments (arrays or `jax.ShapeDtypeStruct`s for functions; real
        variables/modules for Flax).
      budget: as `jremat.plan`.
      solver: as `jremat.plan`.
      verify: as `jremat.plan`.
      max_rounds: as `jremat.plan`.
      argnums: functions only: the differentiated arguments (default 0).
      method: linen only, passed to `model.apply`.
      rngs: linen only, passed to `model.apply`.
      mutable: linen only, passed to `model.apply`.
      **kwargs: linen: passed to `model.apply`; NNX modules and functions: passed to the call.

    Returns:
      An `Explanation`: `.rows`, `.plan`, `.graph`, compiled totals; `str()` is the table.

    Raises:
      TypeError: a Module class (pass an instance with its variables), or arguments the
        target cannot be differentiated on; the errors of `jremat.plan`
        (`InfeasibleBudgetError`, ...) unchanged.

    Examples:
      >>> import jax, jax.numpy as jnp, jremat
      >>> def loss(ws, x):  # a 4-layer MLP
      ...     for w in ws:
      ...         x = jnp.tanh(x @ w)
      ...     return jnp.mean(x**2)
      >>> ws, x = [jnp.full((64, 64), 0.01)] * 4, jnp.ones((128, 64))
      >>> e = jremat.explain(loss, ws, x, budget=0.9)
      >>> e.planned_temp_bytes < e.baseline_temp_bytes
      True
      >>> sizes = [r.activation_bytes for r in e.rows]
      >>> sizes == sorted(sizes, reverse=True)  # largest activations first
      True
    """
    with disabled():
        fn, fargs, nums, model_nodes = _as_loss(
            target, args, argnums, method, rngs, mutable, kwargs
        )
        graph = trace(fn, *fargs, argnums=nums)
        opts = {} if solver is None else {"solver": solver}
        p = plan(
            fn, *fargs, budget=budget, argnums=nums, verify=verify, max_rounds=max_rounds, **opts
        )
    rows = explain_plan(graph, p, model_nodes)
    return Explanation(
        rows=rows,
        plan=p,
        graph=graph,
        budget=budget,
        baseline_temp_bytes=p.baseline_temp_bytes,
        planned_temp_bytes=p.measured_temp_bytes,
    )


# -- targets -> (loss function, arguments, argnums) ------------------------------------------
def _scalar_or_pairing(
    fn: Callable[..., Any], args: Sequence[Any], argnums: Any = 0
) -> tuple[Callable[..., Any], tuple[Any, ...], Any, int | None]:
    """(loss, args, argnums, equations of `fn` itself or None when `fn` is already a loss)."""
    out = jax.eval_shape(fn, *args)
    leaves = jax.tree_util.tree_leaves(out)
    if len(leaves) == 1 and leaves[0].shape == () and _compat.is_float_dtype(leaves[0].dtype):
        return fn, tuple(args), argnums, None

    def loss(*a: Any) -> Any:
        outs = jax.tree_util.tree_leaves(fn(*a))
        total = pairing(outs, [True] * len(outs))
        if total is None:
            raise TypeError(
                "jremat.explain: the target returns no floating-point array to differentiate "
                f"(got {[f'{x.dtype}{list(x.shape)}' for x in leaves]})"
            )
        return total

    return loss, tuple(args), argnums, build_graph(fn, abstract_args(args)).num_nodes


def _as_loss(target, args, argnums, method, rngs, mutable, kwargs):
    linen = sys.modules.get("flax.linen")
    nnx = sys.modules.get("flax.nnx")
    if isinstance(target, type):
        raise TypeError(
            f"jremat.explain needs a function or a Module instance, got the class "
            f"{target.__qualname__}; pass an instance (linen: with its variables, "
            "explain(Model(), variables, x); NNX: explain(Model(rngs=...), x))."
        )
    if linen is not None and isinstance(target, linen.Module):
        if not args:
            raise TypeError("jremat.explain(linen_model, variables, *inputs): variables missing")
        variables, inputs = args[0], tuple(args[1:])
        other = {k: v for k, v in variables.items() if k != "params"}
        # a bool, int or string input (`train`) is closed over, as `jremat.auto` reads it
        static = {i: x for i, x in enumerate(inputs) if is_static_arg(x)}

        def apply(params, other, *dyn):
            it = iter(dyn)
            out = target.apply(
                {**other, "params": params},
                *[static[i] if i in static else next(it) for i in range(len(inputs))],
                rngs=rngs,
                mutable=mutable,
                method=method,
                **kwargs,
            )
            return out[0] if mutable is not False else out

        dyn = [x for i, x in enumerate(inputs) if i not in static]
        fargs = (variables.get("params", {}), other, *dyn)
        return _scalar_or_pairing(apply, fargs)
    if nnx is not None:
        from jremat._src.frontends.flax_nnx import has_graph_node

        if isinstance(target, nnx.Module):
            return _nnx_loss(lambda m, *a, **k: m(*a, **k), (target, *args), kwargs, nnx)
        if has_graph_node((args, kwargs)):
            return _nnx_loss(target, args, kwargs, nnx)
    if not callable(target):
        raise TypeError(f"jremat.explain needs a function or a Module, got {type(target).__name__}")
    fn = target if not kwargs else (lambda *a: target(*a, **kwargs))
    return _scalar_or_pairing(fn, tuple(args), 0 if argnums is None else argnums)


def _nnx_loss(fn, args, kwargs, nnx):
    from flax.nnx import graph as nnx_graph

    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs), is_leaf=nnx_graph.is_graph_node)
    node_idx = [i for i, x in enumerate(leaves) if nnx_graph.is_graph_node(x)]
    nodes = [leaves[i] for i in node_idx]
    graphdef, params, rest = nnx.split(nodes, nnx.Param, ...)
    # the states as array leaves, their Variables made inside the traced call: a State passed
    # whole and not differentiated is closed over by jax.grad, its Variables then belong to
    # the outer trace and a BatchNorm in training mode may not update them (flax
    # TraceContextError; helper-4), as `flax_nnx` runs modules
    p_leaves, p_tree = jax.tree_util.tree_flatten(params)
    r_leaves, r_tree = jax.tree_util.tree_flatten(rest)

    def call(p_leaves, r_leaves, arrays):
        merged = nnx.merge(
            graphdef,
            jax.tree_util.tree_unflatten(p_tree, p_leaves),
            jax.tree_util.tree_unflatten(r_tree, r_leaves),
        )
        vals = list(arrays)
        for i, m in zip(node_idx, merged, strict=True):
            vals[i] = m
        a, k = jax.tree_util.tree_unflatten(treedef, vals)
        return fn(*a, **k)

    arrays = [None if i in node_idx else x for i, x in enumerate(leaves)]
    return _scalar_or_pairing(call, (p_leaves, r_leaves, arrays))


# -- rows ------------------------------------------------------------------------------------
def _policy_saves(policy: str, graph: Graph, vid: int) -> bool:
    """Whether the policy named `policy` (`jremat.policies.names()`: JAX's built-ins and
    jremat's own) saves value `vid`: the very policy the rewrite applies, asked on the
    equation producing it."""
    p = graph.values[vid].producer
    if p < 0 or policy not in policies.names():
        return False
    eqn = graph.nodes[p].eqn
    return bool(policies.get(policy)(eqn.primitive, *[v.aval for v in eqn.invars], **eqn.params))


def _describe(graph: Graph, ids: list[int], limit: int = 3) -> list[str]:
    ids = sorted(ids, key=lambda v: -graph.values[v].nbytes)
    out = [f"{graph.values[v].dtype}{list(graph.values[v].shape)}" for v in ids[:limit]]
    if len(ids) > limit:
        out.append(f"+{len(ids) - limit}")
    return out


def _layers(graph: Graph) -> list[tuple[int, int, str]]:
    """(start, end, label) of the layers; glue between them is labelled too."""
    named = len(layer_spans(graph)) >= 2
    keys = layer_keys(graph) if named else []
    spans = layer_segments(graph)
    out: list[tuple[int, int, str]] = []
    pos = 0
    for s, e in spans:
        if s > pos:
            out.append((pos, s, "(between layers)"))
        label = (keys[s] or "(between layers)") if named else f"eqns {s}-{e - 1}"
        out.append((s, e, label))
        pos = e
    if pos < graph.num_nodes:
        out.append((pos, graph.num_nodes, "(between layers)" if named or out else "all"))
    return out


def _recomputed_nodes(
    graph: Graph, p: Plan, seg_of: list[int], kept: Callable[[int], bool]
) -> set[int]:
    """Indices of the equations the backward pass of the checkpointed segments runs again.

    A checkpointed segment's backward needs the residuals of its own equations; those it
    does not keep are recomputed, with (transitively) the equations of the segment that
    compute them from what it keeps; a control-flow equation keeping residuals inside itself
    runs again whole. This is what JAX's partial evaluation leaves of the recompute after
    dead-code elimination: other equations (a layer's last matmul, whose output only a later
    segment's backward uses) are not rerun. Counting every equation of the segment overstated
    the recompute ~2x against the compiled FLOPs (issue 14)."""
    needed: set[int] = set()  # values the recompute must produce
    rerun: set[int] = set()

    def own_temp(v: Any, k: int) -> bool:
        """`v` is a value segment `k` computes and does not keep: recomputed if needed."""
        return (
            isinstance(v, int)
            and graph.is_temp(v)
            and seg_of[graph.values[v].producer] == k
            and not kept(v)
        )

    for node in graph.nodes:
        k = seg_of[node.index]
        if p.segments[k].checkpointed:
            needed.update(v for v in node.residuals if own_temp(v, k))
    for node in reversed(graph.nodes):
        k = seg_of[node.index]
        if not p.segments[k].checkpointed:
            continue
        if node.internal_bytes or any(o in needed for o in node.outputs):
            rerun.add(node.index)
            needed.update(v for v in node.inputs if own_temp(v, k))
    return rerun


def explain_plan(graph: Graph, p: Plan, model_nodes: int | None = None) -> list[ExplainRow]:
    """The rows of `explain` for a plan on its graph (largest activations first).

    `model_nodes`: when the graph ends with the output reduction `explain` added to a
    non-scalar target, the number of equations before it (the rest is labelled so).
    Raises ValueError when the plan was made for another program.
    """
    if p.fingerprint != graph.fingerprint or p.num_nodes != graph.num_nodes:
        raise ValueError(
            f"the plan is for program {p.fingerprint} ({p.num_nodes} equations), the graph is "
            f"{graph.fingerprint} ({graph.num_nodes})"
        )
    seg_of = [0] * graph.num_nodes
    for k, s in enumerate(p.segments):
        for i in range(s.start, s.end):
            seg_of[i] = k
    boundary: set[int] = set()
    for s in p.segments:
        if s.checkpointed:
            boundary.update(segment_io(graph, s)[0])
    residuals: set[int] = set()
    for node in graph.nodes:
        residuals.update(v for v in node.residuals if graph.is_temp(v))

    def kept(v: int) -> bool:
        s = p.segments[seg_of[graph.values[v].producer]]
        if v in boundary or s.policy == KEEP:
            return True
        if s.policy == SAVE_NAMES:
            return v in s.saved
        return _policy_saves(s.policy, graph, v)

    rerun = _recomputed_nodes(graph, p, seg_of, kept)
    layers = _layers(graph)
    cuts = {0, graph.num_nodes} | {s.start for s in p.segments} | {a for a, _, _ in layers}
    label_of = {}
    for a, b, lab in layers:
        for i in range(a, b):
            label_of[i] = lab
    if model_nodes is not None and model_nodes < graph.num_nodes:
        cuts.add(model_nodes)
        for i in range(model_nodes, graph.num_nodes):
            label_of[i] = "(output reduction)"
    cuts = sorted(cuts)
    rows = []
    for a, b in zip(cuts[:-1], cuts[1:], strict=True):
        k = seg_of[a]
        s = p.segments[k]
        saved_ids, recomputed_ids = [], []
        act = internal_kept = internal_recomputed = 0
        flops = recompute_flops = 0.0
        for node in graph.nodes[a:b]:
            flops += node.flops
            act += node.internal_bytes
            if s.checkpointed:
                internal_recomputed += node.internal_bytes
            else:
                internal_kept += node.internal_bytes
            outs = [o for o in node.outputs if o in residuals or o in boundary]
            for o in outs:
                if o in residuals:
                    act += graph.values[o].nbytes
                if kept(o):
                    saved_ids.append(o)
                elif o in residuals:
                    recomputed_ids.append(o)
            if node.index in rerun:
                recompute_flops += node.flops
        source = source_span(n.eqn for n in graph.nodes[a:b])
        rows.append(
            ExplainRow(
                layer=label_of.get(a, ""),
                segment=k,
                policy=s.policy,
                start=a,
                end=b,
                activation_bytes=int(act),
                saved_bytes=int(sum(graph.values[v].nbytes for v in saved_ids) + internal_kept),
                recomputed_bytes=int(
                    sum(graph.values[v].nbytes for v in recomputed_ids) + internal_recomputed
                ),
                flops=flops,
                recompute_flops=recompute_flops if s.checkpointed else 0.0,
                saved=_describe(graph, saved_ids),
                recomputed=_describe(graph, recomputed_ids),
                source=source,
            )
        )
    rows.sort(key=lambda r: (-r.activation_bytes, r.start))
    return rows
