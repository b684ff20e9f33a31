"""`jremat.plan`: trace, solve under a budget, verify on the compiled program, tighten.

The planners work on a cost model (bytes of JAX values), which differs from what XLA packs
(it fuses and frees more). So a plan is judged by compiling it: the model is calibrated between
two compiled anchors (the unrematerialized program and the smallest-memory plan), and the
model budget is then moved by secant/bisection steps until the compiled temp bytes are within
the budget with the fewest compiled FLOPs found.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from . import _compat, mixing, refine
from .budget import Budget, parse_budget
from .errors import InfeasibleBudgetError
from .measure import compile_figures
from .offload import OffloadCost, host_offload_effective, parse_offload
from .plan import Plan
from .planners import PLANNERS
from .planners.candidates import candidate_cuts, layer_spans
from .planners.chain import ChainPlanner
from .rewrite import rematerialize
from .sharding import manual_axes, shard_args
from .trace import Graph, _check_differentiable, build_graph, normalize_argnums

SOLVERS = ("auto", "chain", "greedy", "dtr", "milp")
#: `solver="auto"` uses the exact MILP (1 s per solve, warm-started with the chain DP's plan)
#: up to this many equations; above, the chain DP, which is exact on the same model up to its
#: 1/384 memory discretization and runs in well under a second.
AUTO_MILP_MAX_NODES = 120
AUTO_MILP_SECONDS = 1.0
#: Fixed recipes compiled next to every plan search: JAX's built-in policies per layer and
#: sqrt(n) segments. `plan` returns the cheapest compiled plan that fits, so it never recomputes
#: more than any of these when one fits the budget.
ANCHOR_RECIPES = (
    ("nothing_saveable", "layers"),
    ("nothing_saveable", "sqrt_n"),
    ("dots_with_no_batch_dims_saveable", "layers"),
    ("dots_saveable", "layers"),
)


def check_solver(solver: Any, *, none_ok: bool = False) -> None:
    """Check a `solver=` keyword: one of `SOLVERS`, or with `none_ok` also None (the default
    of `jremat.plan`, as `jremat.auto` and `PlanCache` take it).

    Raises:
      ValueError: anything else; the message names `solver` and lists the accepted solvers.
    """
    if (none_ok and solver is None) or (isinstance(solver, str) and solver in SOLVERS):
        return
    accepted = ", ".join(repr(s) for s in SOLVERS)
    default = " or None (jremat.plan's default, 'auto')" if none_ok else " (default 'auto')"
    raise ValueError(
        f"solver must be one of {accepted}{default}; got {type(solver).__name__} {solver!r}"
    )


def abstract_args(args: Sequence[Any]) -> tuple[Any, ...]:
    """Arguments as `jax.ShapeDtypeStruct`s (planning needs shapes and dtypes, and inside a
    `shard_map` body the axes each varies over). Shardings are attached by
    `jremat.sharding.shard_args`."""

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


@dataclasses.dataclass
class Compiled:
    temp_bytes: int
    flops: float
    fixed_bytes: int  # argument + output - alias
    #: for a plan that offloads on a backend where offloading has no memory effect (CPU): the
    #: offload plan's own compiled temp bytes; `temp_bytes` is then that of the proxy plan
    #: (offloaded values recomputed instead), see `jremat.offload`. None otherwise.
    offload_temp_bytes: int | None = None


class Program:
    """One function at one signature: its graph, and compiled figures of plans on it."""

    def __init__(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any],
        argnums: int | Sequence[int],
        in_shardings: Any = None,
        mesh: Any = None,
    ):
        if not callable(fn):
            raise TypeError(f"fn must be a callable, got {type(fn).__name__}")
        self.fn = fn
        self.nums = normalize_argnums(argnums, len(args))
        # shapes, dtypes and the sharding each argument runs under (jremat.sharding)
        self.args = shard_args(args, in_shardings, mesh)
        _check_differentiable(self.args, self.nums)
        from .measure import _check_scalar_output

        _check_scalar_output(fn, self.args)
        self.graph: Graph = build_graph(fn, self.args, self.nums)
        #: inside a shard_map body: its mesh axes, bound when compiling (see compile_step)
        self.manual_axes = manual_axes()
        self._baseline: Compiled | None = None
        self.has_scan = _has_scan(self.graph)
        self._planners: dict = {}
        self._steps: dict[str, tuple[Compiled, Any, float]] = {}
        self.tried: list[tuple[Plan, Compiled]] = []  # every plan compiled on this program
        self._anchors: dict = {}

    def compile(self, plan: Plan | None) -> Compiled:
        """Compiled temp bytes and FLOPs of one training step under `plan` (None: no remat).
        Memoized per plan structure: the same segments and saves compile once."""
        return self.step(plan)[0]

    def step(self, plan: Plan | None) -> tuple[Compiled, Any, float]:
        """(figures, executable, compile seconds) of `jit(value_and_grad)` under `plan`,
        compiled once per plan structure; every compiled plan is also listed in `tried`."""
        key = _key(plan)
        if key not in self._steps:
            f = self.fn if plan is None else rematerialize(self.fn, plan)
            t0 = time.perf_counter()
            exe, flops = compile_figures(
                f, self.args, self.nums, manual_axes=self.manual_axes, scan_flops=self.has_scan
            )
            seconds = time.perf_counter() - t0
            mem = exe.memory_analysis()
            fixed = mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
            compiled = Compiled(int(mem.temp_size_in_bytes), flops, int(fixed))
            if _offloads(plan) and not host_offload_effective():
                # the offload is a no-op here: device memory from the proxy (module docstring
                # of jremat.offload); FLOPs and executable stay the offload plan's own
                proxy = self.compile(offload_proxy(plan))
                compiled = dataclasses.replace(
                    compiled, temp_bytes=proxy.temp_bytes, offload_temp_bytes=compiled.temp_bytes
                )
            self._steps[key] = (compiled, exe, seconds)
            if plan is not None and not plan.is_identity:
                self.tried.append((copy.deepcopy(plan), compiled))
        return self._steps[key]

    @property
    def baseline(self) -> Compiled:
        if self._baseline is None:
            self._baseline = self.compile(None)
        return self._baseline

    def planner(self, solver: str, max_cuts: int, offload: OffloadCost | None = None):
        """The planner for this graph (built once per solver, cut count and offload cost)."""
        kw: dict[str, Any] = {}
        if solver == "auto":
            solver = "milp" if self.graph.num_nodes <= AUTO_MILP_MAX_NODES else "chain"
            kw = {"time_limit": AUTO_MILP_SECONDS} if solver == "milp" else {}
        if solver == "milp":
            max_cuts = min(max_cuts, 32)  # the MILP has O(max_cuts x span x options) binaries
        key = (solver, max_cuts, offload)
        if offload is not None:
            kw["offload"] = offload
        if key not in self._planners:
            self._planners[key] = PLANNERS[solver](self.graph, max_cuts=max_cuts, **kw)
        return self._planners[key]

    def anchors(self, planner) -> list[tuple[Plan, Compiled]]:
        """Compiled reference plans, first the planner's min-memory plan, then `ANCHOR_RECIPES`
        (built-in policies per layer, sqrt(n) segments of Chen et al. 2016). Compiled once per
        program."""
        akey = (planner.name, getattr(planner, "offload", None))
        if akey not in self._anchors:
            plans = [planner.min_memory_plan()]
            if len(layer_segments(self.graph)) > 1:
                plans += [recipe_plan(self.graph, policy, seg) for policy, seg in ANCHOR_RECIPES]
            for scans in scan_configs(self.graph):
                for base_plan in (Plan.identity(self.graph), planner.min_memory_plan()):
                    p = copy.deepcopy(base_plan)
                    p.scans, p.solver = scans, f"{base_plan.solver}+scan"
                    plans.append(p)
            unique = {_key(p): p for p in reversed(plans)}  # first occurrence wins
            plans = [p for p in plans if unique.get(_key(p)) is p]
            self._anchors[akey] = [(p, self.compile(p)) for p in plans]
        return [(copy.deepcopy(p), c) for p, c in self._anchors[akey]]

    def record(self, plan: Plan, c: Compiled) -> Plan:
        plan.measured_temp_bytes = c.temp_bytes
        plan.measured_flops = c.flops
        plan.baseline_temp_bytes = self.baseline.temp_bytes
        if c.offload_temp_bytes is not None:
            plan.notes.append(
                f"host offload has no memory effect on backend {jax.default_backend()!r}: "
                f"this plan compiles to {c.offload_temp_bytes:,} temp bytes here; "
                f"measured_temp_bytes ({c.temp_bytes:,}) is the compiled temp of the same plan "
                "with its offloaded values recomputed instead, the device memory expected "
                "where pinned host memory exists. Not confirmed by this compile."
            )
        return plan


def _has_scan(graph: Graph) -> bool:
    from ._compat import subjaxprs

    def walk(eqns) -> bool:
        return any(
            e.primitive.name == "scan" or any(walk(j.eqns) for j in subjaxprs(e)) for e in eqns
        )

    return walk([n.eqn for n in graph.nodes])


def plan(
    fn: Callable[..., Any],
    *args: Any,
    budget: Any,
    solver: str = "auto",
    argnums: int | Sequence[int] = 0,
    verify: bool = True,
    max_rounds: int = 4,
    max_cuts: int = 160,
    offload: bool | OffloadCost | None = None,
    in_shardings: Any = None,
    mesh: Any = None,
) -> Plan:
    """Plan the rematerialization of `fn` under a memory budget.

    Under SPMD every figure is per device: arguments sharded over a mesh (sharded `jax.Array`s,
    `jax.ShapeDtypeStruct(..., sharding=...)`, or `in_shardings=`) make the values' bytes the
    bytes of one shard, and plans are compiled as `jit(value_and_grad(fn))` under those
    shardings, whose `memory_analysis()` is per device. Called inside a `shard_map` body (as
    `jremat.auto` is), the program is the per-device body, compiled over the same mesh axes.

    Args:
      fn: returns a scalar floating-point loss; positional array/pytree arguments.
      *args: example arguments (arrays or `jax.ShapeDtypeStruct`s).
      budget: a float in (0, 1] (fraction of the unrematerialized compiled temp bytes), an int
        (footprint bytes), a string such as "512MiB"/"8GB", or "auto" (see `jremat.budget`).
      solver: the planner (see `jremat.planners`): "chain" (dynamic programming over cuts and
        save sets; Chen et al. 2016, Rotor, Rockmate), "greedy" (cost-per-byte knapsack),
        "dtr" (simulated Dynamic Tensor Rematerialization, Kirisame et al. 2021), "milp"
        (exact, HiGHS; Checkmate, Jain et al. 2020), or "auto": "milp" up to
        `AUTO_MILP_MAX_NODES` equations, "chain" above. Every solver's plans are compiled
        and verified the same way.
      argnums: differentiated arguments, as in `jax.grad`.
      verify: compile plans and keep only one whose compiled temp bytes meet the budget
        (recommended). With False the cost model (scaled to the baseline) decides and only
        the baseline is compiled; the plan may then miss the budget.
      max_rounds: how many plans verification may compile before settling (an int >= 1).
      max_cuts: cut candidates the DP considers (an int >= 1).
      offload: host offload (`jremat.offload`). None/False (default): segments save or
        recompute. True or a `jremat.OffloadCost(host_bandwidth=bytes/s, device_flops=FLOP/s)`:
        a segment may also offload the values `dots_saveable` would save to pinned host
        memory, charged 2 x bytes / host_bandwidth seconds x device_flops FLOPs; the
        planner takes it where that is cheaper than the recompute it spares. On a backend
        where offloading has no memory effect (CPU), the plan still compiles and runs, and
        its device memory is verified on the plan with those values recomputed (`Plan.notes`
        says so). The "dtr" solver never offloads.
      in_shardings: the shardings the arguments run under, as `jax.jit`'s `in_shardings`: a
        `NamedSharding` or `PartitionSpec` for all arguments, or a tuple with a pytree prefix
        of them (None: as the argument carries) per positional argument. Default: what the
        arguments carry. Needed inside `jax.jit` in Auto sharding mode, whose tracers do not
        reveal their shardings.
      mesh: the mesh `PartitionSpec`s in `in_shardings` refer to: a `jax.sharding.Mesh` (or
        `AbstractMesh`), or None (default: the one set by `jax.set_mesh`). It shards nothing
        by itself; given while no `PartitionSpec` refers to it and no argument is sharded, the
        program is planned unsharded and a `RuntimeWarning` says so.

    Returns:
      A `Plan`; `Plan.identity` when the budget is at or above the unrematerialized program.

    Raises:
      ValueError: an invalid budget (names the accepted forms) or unknown solver;
        `max_rounds` or `max_cuts` below 1.
      InfeasibleBudgetError: no plan reaches the budget; states the smallest reachable budget
        in the caller's unit.
      TypeError: `fn` does not return a scalar float, or `argnums` selects no float input;
        `in_shardings` (or an entry's leaf) or `mesh` of another type; `offload` is not one of
        the accepted forms; `verify` not a bool; `max_rounds` or `max_cuts` not an int (a
        bool included).
      ValueError (sharding): `in_shardings` does not match the arguments, a `PartitionSpec`
        without a mesh, or a mesh needing more devices than exist (see `jremat.sharding`).
    """
    from ._args import check_count, check_flag

    spec = parse_budget(budget)
    offload_cost = parse_offload(offload)
    check_solver(solver)
    verify = check_flag("verify", verify)
    max_rounds = check_count("max_rounds", max_rounds)
    max_cuts = check_count("max_cuts", max_cuts)
    prog = Program(fn, args, argnums, in_shardings=in_shardings, mesh=mesh)
    return solve(
        prog,
        spec,
        solver=solver,
        verify=verify,
        max_rounds=max_rounds,
        max_cuts=max_cuts,
        offload=offload_cost,
    )


def solve(
    prog: Program,
    spec: Budget,
    *,
    solver: str = "auto",
    verify: bool = True,
    max_rounds: int = 4,
    max_cuts: int = 160,
    offload: OffloadCost | None = None,
) -> Plan:
    """`plan` on an already traced `Program` (lets callers reuse the baseline compile).

    Plans are ranked by compiled FLOPs plus, for those that offload, the transfer time of
    their predicted offloaded bytes under `offload` as FLOP-equivalents."""

    def score(p: Plan, c: Compiled) -> float:
        if not p.offloaded_bytes:
            return c.flops
        return math.inf if offload is None else c.flops + offload.transfer_flops(p.offloaded_bytes)

    base = prog.baseline
    target = spec.temp_bytes(base.temp_bytes, base.fixed_bytes)
    meta = dict(budget=spec.raw, budget_temp_bytes=int(target) if target > 0 else 0)
    if target >= base.temp_bytes:
        p = Plan.identity(prog.graph, **meta)
        p.predicted_temp_bytes = base.temp_bytes
        return prog.record(p.annotate(prog.graph), base)
    planner = prog.planner(solver, max_cuts, offload)
    min_plan = planner.min_memory_plan()
    model_min, model_none = min_plan.predicted_temp_bytes, planner.no_remat_peak()
    if not verify:
        # the model's bytes scaled so that the unrematerialized program maps onto its compiled
        # temp bytes (the only compiled figure verify=False has)
        model_target = target * model_none / max(base.temp_bytes, 1)
        chosen = planner.plan(model_target) or _raise_model_infeasible(
            spec, prog, planner, model_none
        )
        chosen.notes.append("verify=False: chosen by the cost model, scaled to the baseline")
        return _finish(chosen, meta, solver, prog.graph)
    anchors = prog.anchors(planner)  # compiled: DP min-memory plan, per-layer and sqrt(n) remat
    fitting = [(score(p, c), p, c) for p, c in anchors if c.temp_bytes <= target]
    min_c = anchors[0][1]
    # fit the cost model's per-option scales to every program compiled so far
    samples = [(p, c.temp_bytes) for p, c in [*anchors, *prog.tried]]
    log: list[str] = []
    calibrated = planner.calibrate([*samples, (Plan.identity(prog.graph), base.temp_bytes)])
    if calibrated:
        model_none = planner.no_remat_peak()
        model_min = planner.min_memory_plan().predicted_temp_bytes
        scales = ", ".join(
            f"{k} {v:,.0f}" if k.endswith("_bytes") else f"{k} {v:.2f}"
            for k, v in (planner.weights or {}).items()
        )
        log.append(f"cost model fitted to {len(samples) + 1} compiled programs: scales {scales}")
    # then map compiled bytes to model bytes through every compiled anchor (what is left)
    points = sorted(
        {(c.temp_bytes, planner.predict(p)) for p, c in anchors if planner.predict(p) is not None}
        | {(base.temp_bytes, model_none)}
    )
    xs = np.array([x for x, _ in points], dtype=float)
    ys = np.maximum.accumulate(np.array([y for _, y in points], dtype=float))
    slope = (model_none - model_min) / max(base.temp_bytes - min_c.temp_bytes, 1)
    model_budget = (
        float(np.interp(target, xs, ys))
        if len(xs) > 1
        else (model_min + (target - min_c.temp_bytes) * max(slope, 1e-3))
    )
    # no reference plan fits: the solver's own plans and mixes may still (a couple of rounds)
    best: tuple[float, Plan | None, Compiled | None] = (
        min(fitting, key=lambda t: t[0]) if fitting else (math.inf, None, None)
    )
    lo, hi = model_min, math.inf  # model budgets known feasible / infeasible when compiled
    seen: set[str] = {_key(p) for p, _ in anchors}
    # No reference plan fits: the model's plans just above its minimum, at fixed model
    # budgets. They do not depend on the target, so the smallest budget an
    # InfeasibleBudgetError states (anchors and these) is found again when asked for.
    floor: list[tuple[Plan, Compiled]] = []

    def add_floor(candidate: Plan | None, label: str) -> None:
        nonlocal best
        if candidate is None or _key(candidate) in seen:
            return
        seen.add(_key(candidate))
        c = prog.compile(candidate)
        floor.append((candidate, c))
        log.append(f"{label} -> compiled temp {c.temp_bytes:,}")
        if c.temp_bytes <= target and score(candidate, c) < best[0]:
            best = (score(candidate, c), candidate, c)

    for factor in () if fitting else FLOOR_LADDER:
        # the DP: no time limit, so the same plans come back in a new call
        add_floor(
            ChainPlanner.plan(planner, model_min * factor),
            f"floor: model budget {model_min * factor:,.0f}",
        )
    for round_ in range(max_rounds if fitting else min(max_rounds, 2)):
        candidate = planner.plan(model_budget)
        if candidate is not None and _key(candidate) not in seen:
            seen.add(_key(candidate))
            c = prog.compile(candidate)
            ok = c.temp_bytes <= target
            log.append(
                f"round {round_}: model budget {model_budget:,.0f} -> compiled temp "
                f"{c.temp_bytes:,} ({'fits' if ok else 'over'})"
            )
            if ok:
                lo = max(lo, model_budget)
                if score(candidate, c) < best[0]:
                    best = (score(candidate, c), candidate, c)
            else:
                hi = min(hi, model_budget)
            ratio = target / max(c.temp_bytes, 1)
        else:
            ratio = 1.05  # same plan as before: probe further out
            if candidate is None:
                lo = max(lo, model_budget)
        nxt = model_budget * ratio
        if math.isfinite(hi):
            nxt = min(max(nxt, lo), hi)
            if not lo < nxt < hi or (hi - lo) / hi < 0.01:
                nxt = (lo + hi) / 2
            if (hi - lo) / hi < 0.005:
                break
        model_budget = max(nxt, model_min)
    # mixes of the compiled recipes (some layers or scan iterations under each of two)
    mixing.search(prog, target, best[0])
    # a plan compiled for another budget on this program may fit this one more cheaply
    for p, c in prog.tried:
        if c.temp_bytes <= target and score(p, c) < best[0]:
            best = (score(p, c), copy.deepcopy(p), c)
    if best[1] is None:
        # still nothing fits: cut the segment at the peak of the lowest compiled plan finer
        # (jremat.refine); like the floor plans, this does not depend on the target
        lowest = min(
            ((p, c) for p, c in [*anchors, *floor] if not p.scans),
            key=lambda pc: pc[1].temp_bytes,
            default=None,
        )
        for candidate in refine.candidates(prog.graph, planner, lowest[0]) if lowest else []:
            add_floor(candidate, "peak segment split")
    _, chosen, c = best
    if chosen is None:
        # what a new plan() call at the stated budget compiles again (not the target-driven
        # rounds and mixes, which a larger target steers elsewhere)
        _raise_infeasible(spec, prog, [*anchors, *floor])
    chosen = prog.record(chosen, c)
    chosen.notes.extend(log)
    model = planner.predict(chosen)  # None for loop pieces: a mix keeps its interpolation
    if model is None and chosen.solver.endswith("+split"):
        chosen.predicted_temp_bytes = 0
        chosen.notes.append(
            "no cost-model prediction: its sub-layer cuts are not the model's cut candidates"
        )
    if model is not None and calibrated:
        # the fitted model is in compiled bytes already
        chosen.predicted_temp_bytes = int(model)
        chosen.notes.append(f"cost model fitted to XLA predicts {int(model):,} temp bytes")
    elif model is not None:
        # the cost model's bytes mapped back to compiled bytes through the anchors
        chosen.predicted_temp_bytes = int(np.interp(model, ys, xs))
        chosen.notes.append(
            f"calibrated through {len(xs)} compiled anchors: model {model:,.0f} -> "
            f"{chosen.predicted_temp_bytes:,} bytes"
        )
    return _finish(chosen, meta, solver, prog.graph)


#: Model budgets (multiples of the model's minimum peak) compiled when no reference plan fits.
FLOOR_LADDER = (1.03, 1.08, 1.15)


def _key(p: Plan | None) -> str:
    """What decides the rewritten program: segments with their saves, and scan settings."""
    if p is None or p.is_identity:
        return "unchanged"
    segs = ";".join(
        f"{s.start}:{s.end}:{s.policy}:{','.join(map(str, s.saved))}"
        + (f">{','.join(map(str, s.offloaded))}" if s.offloaded else "")
        for s in p.segments
    )
    return f"{segs}|{json.dumps(p.scans, sort_keys=True)}"


def _offloads(p: Plan | None) -> bool:
    return p is not None and any(s.offloaded for s in p.segments)


def offload_proxy(p: Plan) -> Plan:
    """`p` with every offloaded value recomputed instead (no longer named): on a backend
    with pinned host memory, the device holds offloaded values as it holds recomputed ones,
    so this plan's compiled temp bytes estimate `p`'s device memory where the offload
    itself compiles to a no-op (CPU; see `jremat.offload`)."""
    q = copy.deepcopy(p)
    for s in q.segments:
        s.offloaded = []
    q.offloaded_bytes = 0
    return q


def _finish(p: Plan, meta: dict, solver: str, graph: Graph) -> Plan:
    p.annotate(graph)
    if p.offloaded_bytes and p.measured_temp_bytes is None and not host_offload_effective():
        p.notes.append(
            f"host offload has no memory effect on backend {jax.default_backend()!r}: this "
            "plan's offloads free device memory only where pinned host memory exists"
        )
    p.budget, p.budget_temp_bytes = meta["budget"], meta["budget_temp_bytes"]
    p.notes.append(f"solver={solver!r}")
    return p


def _raise_infeasible(spec: Budget, prog: Program, compiled: list[tuple[Plan, Compiled]]):
    """Raise `InfeasibleBudgetError` naming the smallest compiled temp among `compiled`."""
    base = prog.baseline
    least = min([c.temp_bytes for _, c in compiled] + [base.temp_bytes])
    smallest = spec.in_caller_unit(least, base.temp_bytes, base.fixed_bytes)
    raise InfeasibleBudgetError(
        f"budget={spec.raw!r} is below what rematerialization can reach for this program: "
        f"the smallest reachable budget is {spec.describe(smallest)}; compiled temp "
        f"{least:,} bytes vs {base.temp_bytes:,} unrematerialized. Raise the budget, or cut "
        "activations another way (smaller microbatches: jremat.microbatch).",
        budget=spec.raw,
        smallest_reachable=smallest,
        smallest_reachable_bytes=least,
    )


def _raise_model_infeasible(spec: Budget, prog: Program, planner: Any, model_none: float):
    base = prog.baseline
    # the smallest model budget the planner returns a plan at (its DP rounds stores up, so
    # the model's minimum peak itself may not be one), scaled to compiled bytes through the
    # unrematerialized program as verify=False scales budgets; 1.0 is always reachable
    model_min = planner.min_memory_plan().predicted_temp_bytes
    budgets = [model_min * f for f in (1.0, *FLOOR_LADDER)]
    reachable = next((b for b in budgets if ChainPlanner.plan(planner, b) is not None), model_none)
    estimate = math.ceil(min(reachable / max(model_none, 1.0), 1.0) * base.temp_bytes)
    smallest = spec.in_caller_unit(estimate, base.temp_bytes, base.fixed_bytes)
    raise InfeasibleBudgetError(
        f"budget={spec.raw!r} is below the smallest the cost model reaches "
        f"({spec.describe(smallest)}; verify=False, so this is the model's estimate)",
        budget=spec.raw,
        smallest_reachable=smallest,
        smallest_reachable_bytes=estimate,
    )


# -- fixed recipes: built-in policies per layer, sqrt(n), scans over layers --------------------
def scan_configs(graph: Graph) -> list[dict[str, dict]]:
    """Loop rematerializations to try for the graph's top-level scans (one decision for every
    iteration): the body under nothing / dots-without-batch / dots saveable, and sqrt(L)
    nesting (outer scan over checkpointed inner scans) keeping or recomputing the inner body.
    Flax's `nn.remat_scan` never checkpoints its innermost body; these configurations do."""
    scans = [n for n in graph.nodes if n.primitive == "scan"]
    if not scans:
        return []
    configs = []
    options = [
        ("nothing_saveable", 1),
        ("dots_with_no_batch_dims_saveable", 1),
        ("dots_saveable", 1),
        ("everything_saveable", 0),
        ("nothing_saveable", 0),
    ]
    for policy, nest in options:
        cfg = {}
        for node in scans:
            length = int(node.eqn.params["length"])
            k = nest or _sqrt_divisor(length)
            if nest == 0 and k <= 1:
                continue
            cfg[str(node.index)] = {"policy": policy, "nest": k}
        if cfg:
            configs.append(cfg)
    return configs


def _sqrt_divisor(n: int) -> int:
    """The divisor of n closest to sqrt(n) (1 when n is prime)."""
    divisors = [d for d in range(2, n) if n % d == 0]
    return min(divisors, key=lambda d: abs(d - math.sqrt(n))) if divisors else 1


def layer_segments(graph: Graph, max_pseudo_layers: int = 16) -> list[tuple[int, int]]:
    """The model's layers as node ranges (from name stacks), or equal-FLOP chunks between
    low-crossing cuts when the program carries no layer names."""
    spans = layer_spans(graph)
    if len(spans) >= 2:
        return spans
    cuts = candidate_cuts(graph, max_cuts=4 * max_pseudo_layers)
    flops = [0.0]
    for node in graph.nodes:
        flops.append(flops[-1] + node.flops)
    total = flops[-1] or 1.0
    chosen = [0]
    for k in range(1, max_pseudo_layers):
        want = total * k / max_pseudo_layers
        c = min(cuts, key=lambda p: abs(flops[p] - want))
        if c > chosen[-1]:
            chosen.append(c)
    if graph.num_nodes > chosen[-1]:
        chosen.append(graph.num_nodes)
    return list(zip(chosen[:-1], chosen[1:], strict=True))


def recipe_plan(graph: Graph, policy: str, segmentation: str = "layers") -> Plan:
    """A fixed plan: `policy` (a `jremat.policies` name) applied per layer ("layers"), or to
    about sqrt(L) groups of layers ("sqrt_n", Chen et al. 2016); glue between layers is kept."""
    spans = layer_segments(graph)
    if segmentation == "sqrt_n":
        k = max(1, round(math.sqrt(len(spans))))
        size = math.ceil(len(spans) / k)
        groups = [spans[i : i + size] for i in range(0, len(spans), size)]
        spans = [(g[0][0], g[-1][1]) for g in groups]
    elif segmentation != "layers":
        raise ValueError(f"segmentation must be 'layers' or 'sqrt_n', got {segmentation!r}")
    name = f"{policy}/{segmentation}"
    return Plan.from_spans(graph, spans, [policy] * len(spans), name).annotate(graph)
