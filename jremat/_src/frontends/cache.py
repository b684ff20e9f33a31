"""Plans cached per program signature and budget (in memory and optionally on disk), and the
planned evaluation of a traced block: the engine behind `jremat.auto` on Flax modules.

How a Flax block is planned
---------------------------
A block is not a loss: it maps (variables, inputs, RNG keys) to outputs and updated collections.
jremat plans it as a *function of arrays*:

1. The block is traced once per call into a jaxpr, exactly as `jax.checkpoint` traces it (so
   Flax side effects such as RNG counters, `setup` calls and module state happen once, as with
   `nn.remat`/`nnx.remat`). `block_fn` turns the jaxpr into a pure function `f(diff, rest)`:
   `diff` are its floating-point inputs (parameters, activations, float state), `rest` the
   others (integer inputs, RNG keys) and the captured constants. No user code runs again.
2. What a budget bounds. A block's own training step cannot get much below its unrematerialized
   memory: its backward pass needs its activations, recomputed or not (measured on a
   LayerNorm/Dense/GELU/Dense block: at best 0.96 of the unrematerialized temp bytes). What
   rematerializing a block saves is what it *keeps from its forward to its backward pass*
   while the rest of the model runs: that is what accumulates over a stack of blocks. So for
   a block the budget bounds its **kept bytes**, measured on the compiled program
   (`BlockProgram`) as the temp bytes it adds to a step in which a second, unrematerialized
   copy of the block runs after it (forced to, by a zero-valued data dependency):
   `kept(plan) = temp(block under plan -> block) - temp(block)`. A fraction is of the
   unrematerialized block's kept bytes; an int or a size string caps the kept bytes; "auto"
   (the device's free memory, see `jremat.budget`) is read each time a signature is planned.
3. The planner (`jremat.planning.solve`, all its solvers) needs a scalar loss, so it sees the
   block through a surrogate `sum_i <out_i, t_i>` over the block's outputs (not its updated
   collections), with fixed tangents `t_i` built in the graph from `iota`. The surrogate's
   first equations are exactly the block's, so each plan maps back to the block's graph by
   dropping the tail (`_block_plan`). Besides the planner's own plans and its min-memory
   anchor, the whole block under one checkpoint saving nothing (what `nn.remat` does), saving
   matmul results (`dots_saveable`) or unbatched ones are compiled as anchors; the fitting plan
   with the fewest compiled FLOPs wins.
4. The block's graph is evaluated under the plan (`jremat.rewrite.run_graph`): each
   checkpointed segment is a `jax.checkpoint` with a names policy.

With `verify=False` nothing is compiled: a block whose budget is below 1 gets the
whole-block plan that keeps only its inputs (the least kept bytes; `nn.remat`'s choice).
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import hashlib
import json
import os
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _compat
from .budget import Budget, parse_budget
from .measure import compile_step, scan_flops_correction, xla_flops
from .plan import KEEP, SAVE_NAMES, Plan, Segment
from .planning import Compiled, Program, abstract_args, check_solver, plan, solve
from .rewrite import run_graph
from .sharding import sharding_key
from .trace import Graph, build_graph, is_literal

_DISABLED: contextvars.ContextVar[bool] = contextvars.ContextVar("jremat_disabled", default=False)

#: Whole-block plans compiled as anchors next to the planner's (policy of the one segment).
BLOCK_ANCHORS = (SAVE_NAMES, "dots_saveable", "dots_with_no_batch_dims_saveable")


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Within this context, `jremat.auto`-decorated Flax modules run without rematerialization
    and without planning (their code is traced and evaluated as is). `jremat.explain` uses it
    to analyse a model as written; use it to measure a model with and without the decorator."""
    token = _DISABLED.set(True)
    try:
        yield
    finally:
        _DISABLED.reset(token)


def is_disabled() -> bool:
    """Whether a `disabled()` context is active."""
    return _DISABLED.get()


class PlanCache:
    """Plans of one decorated function or module, keyed by program signature and budget.

    The in-memory key and the file name of a saved plan are a SHA-256 of: the shapes and dtypes
    of the planned program's arguments, the program's `Graph.fingerprint` and wiring (which
    value feeds which equation), the budget as given (`"auto"` stays `"auto"`, so a saved plan is
    reused whatever memory is free), the solver and `verify`. A new batch size or sequence
    length is a new signature, so it is planned anew.

    Args:
      budget: as `jremat.plan` (validated here; `"auto"` is read again at each solve).
      solver: the planner name, or None for `jremat.plan`'s default.
      verify: compile and check each plan against the budget.
      max_rounds: verification compiles per signature.
      plan_dir: a folder; when set, each plan is saved there as `jremat-<key>.json`
        (`Plan.save`) and a later run with the same key loads it instead of solving.
      offload: host offload, as `jremat.plan`'s `offload` (None: never offload).

    Attributes:
      plans: key -> `Plan`, in the order first seen.
      signatures: key -> a readable description of the signature (shapes and dtypes).
      solves, loads: how many plans were solved, and loaded from `plan_dir`.

    Raises:
      ValueError: an invalid budget or solver; `max_rounds` below 1.
      TypeError: `offload` is not None, a bool or a `jremat.OffloadCost`; `verify` is not a
        bool; `max_rounds` is not an int (a bool included).
    """

    def __init__(
        self,
        budget: Any,
        *,
        solver: str | None = None,
        verify: bool = True,
        max_rounds: int = 4,
        plan_dir: str | os.PathLike | None = None,
        offload: Any = None,
    ):
        from ._args import check_count, check_flag
        from .offload import parse_offload

        parse_budget(budget)
        self.offload = parse_offload(offload)
        check_solver(solver, none_ok=True)
        self.budget = budget
        self.solver = solver
        self.verify = check_flag("verify", verify)
        self.max_rounds = check_count("max_rounds", max_rounds)
        self.plan_dir = Path(plan_dir) if plan_dir is not None else None
        self.plans: dict[str, Plan] = {}
        self.signatures: dict[str, str] = {}
        self.solves = 0
        self.loads = 0
        self._lock = threading.RLock()

    def __repr__(self) -> str:
        return (
            f"PlanCache(budget={self.budget!r}, solver={self.solver!r}, plans={len(self.plans)}, "
            f"solves={self.solves}, loads={self.loads}, plan_dir={self.plan_dir})"
        )

    # -- keys -----------------------------------------------------------------------------
    def key(self, graph: Graph, args: Sequence[Any], kind: str = "function") -> tuple[str, str]:
        """(key, readable signature) of a program; stable across processes."""
        sig = describe_signature(args)
        shard_key = sharding_key(args)
        payload = json.dumps(
            {
                "kind": kind,
                "signature": sig,
                "fingerprint": graph.fingerprint,
                "wiring": wiring_hash(graph),
                "budget": repr(self.budget),
                "solver": self.solver,
                "verify": bool(self.verify),
                **({"offload": repr(self.offload)} if self.offload is not None else {}),
                **({"sharding": repr(shard_key)} if shard_key else {}),
            },
            sort_keys=True,
        )
        return hashlib.sha256(payload.encode()).hexdigest()[:24], sig

    def path(self, key: str) -> Path | None:
        """Where the plan of `key` is saved (None without `plan_dir`)."""
        return None if self.plan_dir is None else self.plan_dir / f"jremat-{key}.json"

    # -- lookup / solve ------------------------------------------------------------------
    def get(
        self,
        graph: Graph,
        fn: Callable[..., Any],
        args: Sequence[Any],
        argnums: int | Sequence[int] = 0,
        ct_mask: Sequence[bool] | None = None,
    ) -> Plan:
        """The plan for `graph` (the traced `fn(*args)`): cached, loaded or solved.

        Args:
          graph: `build_graph(fn, args)`.
          fn: the function the plan is for: a scalar loss, or (with `ct_mask`) a block
            `f(diff, rest)` from `block_fn`.
          args: its arguments (arrays, tracers or avals; only shapes and dtypes are used).
          argnums: differentiated arguments of a loss.
          ct_mask: for a block, which flat outputs a training step differentiates (the
            module's outputs, not its updated collections); see the module docstring.

        Raises:
          InfeasibleBudgetError, and the other errors of `jremat.plan`, unchanged.
        """
        avals = abstract_args(args)
        key, sig = self.key(graph, avals, "function" if ct_mask is None else "block")
        with self._lock:
            if key in self.plans:
                return self.plans[key]
            p = self._load(key, graph)
            if p is None:
                spec = parse_budget(self.budget)  # "auto": free memory now
                opts: dict[str, Any] = {} if self.solver is None else {"solver": self.solver}
                if self.offload is not None:
                    opts["offload"] = self.offload
                if ct_mask is None:
                    p = plan(
                        fn,
                        *avals,
                        budget=spec,
                        argnums=argnums,
                        verify=self.verify,
                        max_rounds=self.max_rounds,
                        **opts,
                    )
                else:
                    p = plan_block(
                        fn,
                        graph,
                        avals,
                        ct_mask,
                        spec,
                        verify=self.verify,
                        max_rounds=self.max_rounds,
                        **opts,
                    )
                p.budget = _jsonable(self.budget)
                p.notes.append(f"signature: {sig}")
                self.solves += 1
                self._save(key, p)
            self.plans[key] = p
            self.signatures[key] = sig
            return p

    def _load(self, key: str, graph: Graph) -> Plan | None:
        path = self.path(key)
        if path is None or not path.exists():
            return None
        p = Plan.load(path)
        if p.fingerprint != graph.fingerprint or p.num_nodes != graph.num_nodes:
            warnings.warn(
                f"jremat: saved plan {path} was made for program {p.fingerprint} "
                f"({p.num_nodes} equations), not {graph.fingerprint} ({graph.num_nodes}); "
                "solving again and overwriting it",
                RuntimeWarning,
                stacklevel=3,
            )
            return None
        self.loads += 1
        return p

    def _save(self, key: str, p: Plan) -> None:
        path = self.path(key)
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".jremat-", suffix=".json", dir=path.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(p.to_json())
        os.replace(tmp, path)  # atomic: concurrent runs never read a half-written plan


def _jsonable(x: Any) -> Any:
    try:
        json.dumps(x)
        return x
    except TypeError:
        return repr(x)


def describe_signature(args: Sequence[Any]) -> str:
    """Shapes and dtypes of the array leaves of `args`, e.g. `float32[8,16] int32[8]`."""
    parts = []
    for x in jax.tree_util.tree_leaves(args):
        shape = ",".join(str(d) for d in np.shape(x))
        parts.append(f"{getattr(x, 'dtype', type(x).__name__)}[{shape}]")
    return " ".join(parts)


def wiring_hash(graph: Graph) -> str:
    """A hash of which value feeds which equation, and of every value's shape and dtype (what
    `Graph.fingerprint` leaves out); stable across processes."""
    h = hashlib.sha256()
    for node in graph.nodes:
        ins = ",".join("L" if is_literal(x) else str(x) for x in node.inputs)
        h.update(f"{node.primitive}({ins})->{node.outputs};".encode())
    for v in graph.values:
        h.update(f"{v.shape}{v.dtype};".encode())
    return h.hexdigest()[:16]


# -- a traced block as a function of arrays --------------------------------------------------
def eval_jaxpr(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
    """Evaluate an open jaxpr equation by equation (`_compat.bind`); returns the flat outputs."""
    env: dict[Any, Any] = {}

    def read(v: Any) -> Any:
        return v.val if hasattr(v, "val") else env[v]

    for var, x in zip(jaxpr.constvars, consts, strict=True):
        env[var] = x
    for var, x in zip(jaxpr.invars, args, strict=True):
        env[var] = x
    for eqn in jaxpr.eqns:
        with _source_of(eqn):
            outs = _compat.bind(eqn, [read(v) for v in eqn.invars])
        for var, val in zip(eqn.outvars, outs, strict=True):
            env[var] = val
    return [read(v) for v in jaxpr.outvars]


def _source_of(eqn: Any) -> contextlib.AbstractContextManager:
    """Re-emit `eqn` with its own traceback and name stack (appended to the current one), so
    the re-evaluated program keeps the user's source lines and layer names (for plan
    summaries, `jremat.explain`, and the planner's layer detection)."""
    try:
        from jax._src import source_info_util as siu

        info = eqn.source_info
        stack = siu.current_name_stack() + info.name_stack
        return siu.user_context(info.traceback, name_stack=stack)
    except Exception:  # noqa: BLE001 - source info is best effort across jax versions
        return contextlib.nullcontext()


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


def _pairing(outs: Sequence[Any], ct_mask: Sequence[bool], salt: int = 0) -> Any:
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
    """The scalar loss a block is planned through: `fn`'s equations, then `_pairing`."""

    def loss(*args: Any) -> Any:
        return _pairing(fn(*args), ct_mask)

    return loss


def has_cotangent(outs: Sequence[Any], ct_mask: Sequence[bool]) -> bool:
    """Whether any output selected by `ct_mask` is a non-empty float array."""
    return any(use and _is_diff(o) and _size(o) > 0 for o, use in zip(outs, ct_mask, strict=True))


# -- planning a block ------------------------------------------------------------------------
class BlockProgram(Program):
    """A block at one signature, planned by its compiled *kept bytes* (module docstring, 2).

    `compile(plan)` reports, as `temp_bytes`, the temp bytes the block under `plan` adds to a
    step in which an unrematerialized copy of it runs after it; `flops` are that step's
    compiled FLOPs (the copy's are the same for every plan); `fixed_bytes` is 0, so a byte
    budget caps the kept bytes. Plans are compiled with `prevent_cse=True` whatever the block
    runs with: this program is unrolled, and without the barrier XLA would merge the recompute
    into the forward pass (DESIGN 1.4), while inside a scan body the loop boundary does that.
    """

    def __init__(
        self,
        f: Callable[..., Any],
        block: Graph,
        args: Sequence[Any],
        ct_mask: Sequence[bool],
    ):
        super().__init__(surrogate_loss(f, ct_mask), args, 0)
        self.block_fn, self.block, self.ct_mask = f, block, list(ct_mask)
        self._alone: int | None = None
        _block_plan(copy.deepcopy(Plan.identity(self.graph)), block, self.graph)  # invariant

    def _two_copies(self, p: Plan | None) -> Callable[..., Any]:
        f, block, mask = self.block_fn, self.block, self.ct_mask
        bp = None if p is None else _block_plan(copy.deepcopy(p), block, self.graph)

        def step(diff, rest):
            if bp is None or bp.is_identity:
                first = f(diff, rest)
            else:
                first = run_graph(block, bp, [*diff, *rest], prevent_cse=True)
            floats = [o.reshape(-1)[0].astype(jnp.float32) for o in first if _is_diff(o)]
            floats = [o for o in floats if o.size]
            tie = sum(floats) * 0.0 if floats else jnp.float32(0.0)
            second = f(tuple(d + tie.astype(d.dtype) for d in diff), rest)
            return _pairing(first, mask) + _pairing(second, mask, salt=len(mask))

        return step

    def compile(self, plan: Plan | None) -> Compiled:
        if self._alone is None:
            exe = compile_step(self.fn, self.args, self.nums)
            self._alone = int(exe.memory_analysis().temp_size_in_bytes)
        step = self._two_copies(plan)
        exe = compile_step(step, self.args, self.nums)
        flops = xla_flops(exe)
        if self.has_scan:
            flops += scan_flops_correction(step, self.args, self.nums)
        kept = int(exe.memory_analysis().temp_size_in_bytes) - self._alone
        return Compiled(temp_bytes=max(kept, 0), flops=flops, fixed_bytes=0)

    def anchors(self, planner) -> list[tuple[Plan, Compiled]]:
        """The planner's min-memory plan, then the whole block under one checkpoint with each
        policy of `BLOCK_ANCHORS` (`dots_with_no_batch_dims_saveable` only when some matmul
        has batch dimensions, otherwise it equals `dots_saveable`; per-layer recipes inside a
        block keep more than the whole block and recompute as much, so they are not compiled)."""
        if planner.name not in self._anchors:
            policies = list(BLOCK_ANCHORS)
            if not _has_batched_dot(self.block):  # then it saves what dots_saveable saves
                policies.remove("dots_with_no_batch_dims_saveable")
            plans = [planner.min_memory_plan()] + [
                whole_block_plan(self.graph, self.block.num_nodes, pol) for pol in policies
            ]
            self._anchors[planner.name] = [(p, self.compile(p)) for p in plans]
        return [(copy.deepcopy(p), c) for p, c in self._anchors[planner.name]]


def _has_batched_dot(graph: Graph) -> bool:
    """Whether a top-level `dot_general` of `graph` has batch dimensions (attention does)."""
    return any(
        n.primitive == "dot_general" and n.eqn.params["dimension_numbers"][1][0]
        for n in graph.nodes
    )


def whole_block_plan(graph: Graph, n: int, policy: str = SAVE_NAMES) -> Plan:
    """Nodes `[0, n)` under one checkpoint with `policy` (`"names"` with nothing named saves
    only the inputs, as `nn.remat` does); the rest of `graph` kept."""
    segs = [Segment(0, n, policy)]
    if n < graph.num_nodes:
        segs.append(Segment(n, graph.num_nodes, KEEP))
    return Plan(segs, graph.fingerprint, graph.num_nodes, solver=f"whole-block/{policy}").annotate(
        graph
    )


def plan_block(
    f: Callable[..., Any],
    block: Graph,
    args: Sequence[Any],
    ct_mask: Sequence[bool],
    spec: Budget,
    *,
    verify: bool = True,
    max_rounds: int = 4,
    **solve_kw: Any,
) -> Plan:
    """Plan a block `f(diff, rest)` (from `block_fn`) under a kept-bytes budget.

    Returns a plan for `block` (the graph of `f`). Raises `InfeasibleBudgetError` as
    `jremat.plan` does, its figures being kept bytes.
    """
    if not verify:
        if spec.fraction is not None and spec.fraction >= 1:
            p = Plan.identity(block, budget=spec.raw)
        else:
            p = whole_block_plan(block, block.num_nodes)
            p.budget = spec.raw
        p.notes.append("verify=False: a block below budget 1 keeps only its inputs")
        return p
    prog = BlockProgram(f, block, args, ct_mask)
    p = solve(prog, spec, verify=True, max_rounds=max_rounds, **solve_kw)
    p = _block_plan(p, block, prog.graph)
    if p.measured_temp_bytes is not None:  # the calibrated model figure is not kept bytes
        p.predicted_temp_bytes = p.measured_temp_bytes
    p.notes.append(
        "block plan: measured_temp_bytes and baseline_temp_bytes are the block's kept bytes "
        "(temp it adds ahead of an unrematerialized copy of itself), see jremat.plan_cache"
    )
    return p


def _block_plan(p: Plan, block: Graph, planned: Graph) -> Plan:
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


# -- evaluation ------------------------------------------------------------------------------
def run_block(
    closed_jaxpr: Any,
    flat_args: Sequence[Any],
    out_avals: Sequence[Any],
    ct_mask: Sequence[bool],
    cache: PlanCache,
    *,
    prevent_cse: bool = True,
    plan_it: bool = True,
) -> list[Any]:
    """Evaluate a traced block on `flat_args` under the plan for its signature.

    Evaluates it unchanged (no planning) when `plan_it` is False (Flax's `init`), inside
    `disabled()`, or when the block has no float argument or no float output to differentiate.
    """
    jaxpr, consts = _compat.closed(closed_jaxpr)
    f, (diff, rest) = block_fn(closed_jaxpr, flat_args)
    if not plan_it or is_disabled() or not diff or not has_cotangent(out_avals, ct_mask):
        return eval_jaxpr(jaxpr, consts, flat_args)
    graph = build_graph(f, (diff, rest))
    p = cache.get(graph, f, (diff, rest), ct_mask=ct_mask)
    return run_graph(graph, p, [*diff, *rest], prevent_cse=prevent_cse)
