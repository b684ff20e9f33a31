"""A traced Flax block as a function of arrays (`block_fn`), the surrogate loss it is planned
through (`pairing`), and `BlockProgram`, which compiles a plan's *kept bytes*.

The reasoning (what a block's budget bounds, the anchors): docs/design.md#flax-blocks."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jremat._src.base import compat as _compat
from jremat._src.base import sharding
from jremat._src.compile.program import Compiled, Objective, Program
from jremat._src.compile.xla import MemoryFigures
from jremat._src.plan.plan import KEEP, SAVE_NAMES, Plan, Segment
from jremat._src.plan.recipes import dots_policies_differ
from jremat._src.plan.rewrite import run_graph
from jremat._src.trace.graph import Graph

#: Whole-block plans compiled as anchors next to the planner's (policy of the one segment).
BLOCK_ANCHORS = (SAVE_NAMES, "dots_saveable", "dots_with_no_batch_dims_saveable")


# -- a traced block as a function of arrays --------------------------------------------------
#: An open jaxpr evaluated equation by equation (re-exported for the Flax frontends).
eval_jaxpr = _compat.eval_jaxpr


def _is_diff(x: Any) -> bool:
    return _compat.is_float_dtype(getattr(x, "dtype", None))


def _size(x: Any) -> int:
    return int(np.prod(np.shape(x), dtype=np.int64))


def block_fn(
    closed_jaxpr: Any, flat_args: Sequence[Any]
) -> tuple[Callable[..., Any], tuple[tuple[Any, ...], tuple[Any, ...]]]:
    """A traced block as the pure function `f(diff, rest) -> flat outputs`, and its arguments.

    `diff` holds the floating-point arguments (differentiated when planning), `rest` the
    others followed by the jaxpr's captured constants. At run time gradients flow to every
    argument and constant alike; the split only tells the planner what a training step
    differentiates.
    """
    jaxpr, consts = _compat.closed(closed_jaxpr)
    all_in = list(flat_args) + list(consts)
    diff_idx = [i for i, x in enumerate(flat_args) if _is_diff(x)]
    diff_set = set(diff_idx)
    rest_idx = [i for i in range(len(all_in)) if i not in diff_set]
    n_args = len(flat_args)

    def f(diff: tuple[Any, ...], rest: tuple[Any, ...]) -> list[Any]:
        vals: list[Any] = [None] * len(all_in)
        for i, x in zip(diff_idx, diff, strict=True):
            vals[i] = x
        for i, x in zip(rest_idx, rest, strict=True):
            vals[i] = x
        return eval_jaxpr(jaxpr, vals[n_args:], vals[:n_args])

    diff = tuple(all_in[i] for i in diff_idx)
    rest = tuple(all_in[i] for i in rest_idx)
    return f, (diff, rest)


def pairing(outs: Sequence[Any], ct_mask: Sequence[bool], salt: int = 0) -> Any:
    """`sum_i <outs[i], t_i>` over the float outputs `ct_mask` selects, with fixed tangents
    `t_i = sin(0.7548777 * iota + i + salt)` (built in the graph, not a foldable constant)."""
    total = None
    for i, (o, use) in enumerate(zip(outs, ct_mask, strict=True)):
        if not use or not _is_diff(o) or _size(o) == 0:
            continue
        t = jnp.sin(jax.lax.iota(jnp.float32, o.size) * 0.7548777 + float(i + salt))
        term = jnp.sum(o.astype(jnp.float32) * t.reshape(o.shape))
        total = term if total is None else total + term
    return total


def surrogate_loss(fn: Callable[..., Any], ct_mask: Sequence[bool]) -> Callable[..., Any]:
    """The scalar loss a block is planned through: `fn`'s equations, then `pairing`."""

    def loss(*args: Any) -> Any:
        return pairing(fn(*args), ct_mask)

    return loss


def has_cotangent(outs: Sequence[Any], ct_mask: Sequence[bool]) -> bool:
    """Whether any output selected by `ct_mask` is a non-empty float array."""
    return any(use and _is_diff(o) and _size(o) > 0 for o, use in zip(outs, ct_mask, strict=True))


# -- planning a block ------------------------------------------------------------------------
class KeptBytes(Objective):
    """The objective of a block: its compiled *kept bytes* (docs/design.md#flax-blocks), one
    `Program.step` per plan like any program's.

    For a plan of the surrogate loss it compiles a step in which the block under the plan
    (mapped onto the block's graph by `block_plan`) runs, then an unrematerialized copy of it;
    `figures` reports, as `temp_bytes`, the temp bytes the block under the plan adds to that
    step: `temp(block under plan -> copy) - temp(block alone)` (the second compiled once per
    program, through the same path); `flops` are that step's compiled FLOPs (the copy's are
    the same for every plan); `fixed_bytes` is 0, so a byte budget caps the kept bytes. Plans
    are compiled with `prevent_cse=True` whatever the block runs with: this program is
    unrolled, and without the barrier XLA would merge the recompute into the forward pass
    (docs/design.md#facts-about-jax-remat, fact 4), while inside a scan body the loop
    boundary does that.
    """

    #: A block compiles in a fraction of a step's time, and its cost model misreads it most
    #: (XLA packs a small block's buffers): the tests' two-block linen decoder at 0.5 returned
    #: a plan at +10.9% FLOPs keeping 14,016 bytes, where a floor plan keeps 11,712 at +4.8%;
    #: with the floor plans among its candidates, the user's step no longer compiled higher
    #: at 0.3 than at 0.5 (docs/design.md#flax-blocks).
    floor_plans_always = True

    #: A block's search runs in full under the default compile budget: its programs are a
    #: block's, and the floor plans above are the full search's (aimed under a cap, the tests'
    #: two-block decoder at 0.5 returned the plan at +10.9% FLOPs again).
    capped_by_default = False

    def __init__(self, f: Callable[..., Any], block: Graph, ct_mask: Sequence[bool]):
        self.block_fn, self.block, self.ct_mask = f, block, list(ct_mask)
        #: compiled temp bytes of the surrogate loss's step alone (read at the first figures)
        self.alone_temp_bytes: int | None = None

    def step_fn(self, prog: Program, plan: Plan | None) -> Callable[..., Any]:
        """The block under `plan`, then an unrematerialized copy of it, each paired with
        fixed tangents (`pairing`); the copy's inputs depend on the first's outputs through a
        zero-valued tie, so it runs after it."""
        f, block, mask = self.block_fn, self.block, self.ct_mask
        bp = None if plan is None else block_plan(copy.deepcopy(plan), block, prog.graph)

        def step(diff, rest):
            if bp is None or bp.is_identity:
                first = f(diff, rest)
            else:
                first = run_graph(block, bp, [*diff, *rest], prevent_cse=True)
            floats = [o.reshape(-1)[0].astype(jnp.float32) for o in first if _is_diff(o)]
            floats = [o for o in floats if o.size]
            tie = sum(floats) * 0.0 if floats else jnp.float32(0.0)
            second = f(tuple(d + sharding.tie_for(tie, d).astype(d.dtype) for d in diff), rest)
            return pairing(first, mask) + pairing(second, mask, salt=len(mask))

        return step

    def figures(self, prog: Program, mem: MemoryFigures, flops: float) -> Compiled:
        """Kept bytes as `temp_bytes`, the two-copy step's FLOPs, `fixed_bytes` 0."""
        if self.alone_temp_bytes is None:
            exe, _ = prog.compile_fn(prog.fn, scan_flops=False)
            self.alone_temp_bytes = MemoryFigures.of(exe).temp_bytes
        kept = mem.temp_bytes - self.alone_temp_bytes
        return Compiled(temp_bytes=max(kept, 0), flops=flops, fixed_bytes=0)


class BlockProgram(Program):
    """A block at one signature, planned by its compiled kept bytes: a `Program` of the
    block's surrogate loss (`surrogate_loss`) whose objective is `KeptBytes`, so `compile`,
    `step`, `tried` and `baseline` report kept bytes (`fixed_bytes` 0)."""

    def __init__(
        self,
        f: Callable[..., Any],
        block: Graph,
        args: Sequence[Any],
        ct_mask: Sequence[bool],
    ):
        super().__init__(
            surrogate_loss(f, ct_mask), args, 0, objective=KeptBytes(f, block, ct_mask)
        )
        self.block_fn, self.block, self.ct_mask = f, block, list(ct_mask)
        block_plan(copy.deepcopy(Plan.identity(self.graph)), block, self.graph)  # invariant

    def anchors(self, planner, also: Sequence[Plan | None] = ()) -> list[tuple[Plan, Compiled]]:
        """The planner's min-memory plan, then the whole block under one checkpoint with each
        policy of `BLOCK_ANCHORS` (`dots_with_no_batch_dims_saveable` only where it saves other
        values than `dots_saveable`: a batched matmul, a convolution; per-layer recipes inside a
        block keep more than the whole block and recompute as much, so they are not compiled).
        Compiled in parallel with the plans of `also` (not returned)."""
        if planner.name not in self._anchors:
            policies = list(BLOCK_ANCHORS)
            if not dots_policies_differ(self.block):  # then it saves what dots_saveable saves
                policies.remove("dots_with_no_batch_dims_saveable")
            plans = [planner.min_memory_plan()] + [
                whole_block_plan(self.graph, self.block.num_nodes, pol) for pol in policies
            ]
            compiled = self.compile_many([*plans, *also])[: len(plans)]
            self._anchors[planner.name] = list(zip(plans, compiled, strict=True))
        return [(copy.deepcopy(p), c) for p, c in self._anchors[planner.name]]


def whole_block_plan(graph: Graph, n: int, policy: str = SAVE_NAMES) -> Plan:
    """Nodes `[0, n)` under one checkpoint with `policy` (`"names"` with nothing named saves
    only the inputs, as `nn.remat` does); the rest of `graph` kept."""
    segs = [Segment(0, n, policy)]
    if n < graph.num_nodes:
        segs.append(Segment(n, graph.num_nodes, KEEP))
    return Plan(segs, graph.fingerprint, graph.num_nodes, solver=f"whole-block/{policy}").annotate(
        graph
    )


def block_plan(p: Plan, block: Graph, planned: Graph) -> Plan:
    """Map a plan of the surrogate loss (`planned`) onto the block's own graph (`block`).

    The surrogate's first `block.num_nodes` equations are the block's with the same value ids;
    segments beyond them (the tangent and the reduction) are dropped and the one crossing the
    boundary is cut there.
    """
    n = block.num_nodes
    same = planned.num_nodes >= n and all(
        a.primitive == b.primitive and a.outputs == b.outputs
        for a, b in zip(block.nodes, planned.nodes[:n], strict=False)
    )
    if not same:  # pragma: no cover - guarded invariant of `surrogate_loss`
        raise AssertionError(
            "jremat internal error: the surrogate loss does not start with the block's "
            "equations; please report this with the block's code"
        )
    if p.fingerprint == block.fingerprint and p.num_nodes == n:
        return p
    segments = []
    for s in p.segments:
        if s.start >= n:
            break
        s.end = min(s.end, n)
        s.saved = [v for v in s.saved if v < len(block.values) and block.values[v].producer < n]
        s.offloaded = [
            v for v in s.offloaded if v < len(block.values) and block.values[v].producer < n
        ]
        segments.append(s)
    p.segments = segments
    p.fingerprint, p.num_nodes = block.fingerprint, n
    p.validate()
    return p.annotate(block)
