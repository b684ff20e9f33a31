"""`jremat.plan`: trace, solve under a budget, verify on the compiled program, tighten.

The planners' cost model is fitted to compiled programs and every plan returned has been
compiled; the steps (anchors, calibration, rounds, mixes, floor plans, refinement) and why:
docs/design.md#verification.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jremat._src.base import compat as _compat
from jremat._src.base.args import check_compile_budget, check_count, check_flag
from jremat._src.base.batching import Batching
from jremat._src.base.budget import Budget, BudgetLike, parse_budget
from jremat._src.base.errors import InfeasibleBudgetError
from jremat._src.compile.program import CompileBudgetSpent, Compiled, Program
from jremat._src.compile.xla import step_grad
from jremat._src.plan.offload import OffloadCost, host_offload_effective, parse_offload
from jremat._src.plan.plan import Plan, plan_key
from jremat._src.plan.rewrite import drop_unkept_names
from jremat._src.search import mixing, predicted, refine
from jremat._src.trace.graph import Graph

logger = logging.getLogger(__name__)

SOLVERS = ("auto", "chain", "greedy", "dtr", "milp")

#: Whether `solve` tries the best-first search (search/predicted.py) before the full one on
#: programs whose layers live in top-level scans (their loop settings: the same plans, a
#: third of the compiles; docs/design.md#best-first-search). `benchmarks/plan_cost.py
#: --full-search` sets it False, and `NO_RECOMPUTE_FIRST` too.
BEST_FIRST_LOOPS = True

#: Whether `solve` compiles the recipe that saves the most (`mixing.most_saving_plan`) with
#: the baseline before the reference plans, and returns it where it fits and XLA counts no
#: more FLOPs for it than for the unrematerialized program: no plan recomputes less, so the
#: reference plans, rounds and mixes are not compiled (docs/design.md#best-first-search).
NO_RECOMPUTE_FIRST = True

#: Under a compile budget, the recipe of `NO_RECOMPUTE_FIRST` compiles with the baseline,
#: before the aimed search, where the budget leaves that search this many plans besides it
#: (a plain loss: 6 compiles and up); below, after the aimed search hands over. Where it fits
#: it ends the search at 3 compiles (plan_cost's residual MLP at 0.3-0.7, aimed first: all 6
#: compiles spent for the recipe's FLOPs); where it does not, it is an aimed plan fewer: the
#: tests' 4-layer MLP chain at 0.6, met by the third aimed plan at 5 compiles, was refused
#: with the recipe first at 5.
RECIPE_FIRST_AIMS = 3

#: The solvers the best-first search runs for: the exact ones ("auto" picks one of them).
BEST_FIRST_SOLVERS = ("auto", "chain", "milp")
#: The full search also compiles the plan of the model fitted to the baseline alone, aimed at
#: the target (`_second_model`), among its candidates.
BASELINE_FIT_SHOT = True
#: Rounds of the baseline-fitted model (`_second_model`) where it read its plan closer than the
#: calibrated model read its rounds, by this margin (log distance of compiled over predicted
#: temp bytes).
SECOND_ROUNDS = 2
#: The second model is asked only where the calibrated model's rounds read their compiled temp
#: off by more than this, at their median (log distance, about 10%): elsewhere it costs no
#: compile (at 0.05 it cost one more compile in most of heldout GPT-2's cells for no gain).
SECOND_GATE = 0.1
SECOND_READ_MARGIN = 0.02
#: ... aimed this far into the target (half the 3% band a fitting round ends in): they start
#: where the model's read is known, so a miss is small and on either side.
SECOND_AIM = 0.985

#: The default compile budget ("auto") leaves this many steps' compiles beyond what verifying
#: one plan needs: 6 compiles for a plain loss (8 with `has_aux`, 15 in a `shard_map` body).
#: On plan_cost's held-out models (a residual MLP, GPT-2 of 6 layers, a scanned decoder, at
#: 0.3-0.7; jax 0.12) 6 compiles met every budget the unlimited search meets, within 0.05
#: points of its FLOPs as a geometric mean (0.38 at worst), where the unlimited search spent
#: up to 14 (benchmarks/results/plan_cost_compile_budget_jax012.md); 3 compiles refused 4 of
#: those 9 cells and 4 cost the residual MLP a compile (its no-recompute recipe goes first
#: only from 6 up: `RECIPE_FIRST_AIMS`).
AUTO_COMPILE_STEPS = 3

#: A round's plan that fits and whose compiled temp bytes are within this fraction of the
#: target ends the rounds: closer plans save little recompute for another compile each.
CLOSE_ENOUGH = 0.03


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


def plan(
    fn: Callable[..., Any],
    *args: Any,
    budget: BudgetLike,
    solver: str = "auto",
    argnums: int | Sequence[int] = 0,
    verify: bool = True,
    max_rounds: int = 4,
    max_cuts: int = 160,
    offload: bool | OffloadCost | None = None,
    in_shardings: Any = None,
    mesh: Any = None,
    graph: Graph | None = None,
    has_aux: bool = False,
    batching: Batching | None = None,
    compile_budget: int | str | None = "auto",
) -> Plan:
    """Plan the rematerialization of `fn` under a memory budget.

    Under SPMD every figure is per device: arguments sharded over a mesh (sharded `jax.Array`s,
    `jax.ShapeDtypeStruct(..., sharding=...)`, or `in_shardings=`) make the values' bytes the
    bytes of one shard, and plans are compiled as `jit(value_and_grad(fn))` under those
    shardings, whose `memory_analysis()` is per device. Called inside a `shard_map` body (as
    `jremat.auto` is), the program is the per-device body, compiled over the same mesh axes.

    Args:
      fn: returns a scalar floating-point loss (or `(loss, aux)` with `has_aux`); positional
        array/pytree arguments.
      *args: example arguments (arrays or `jax.ShapeDtypeStruct`s).
      budget: a float in (0, 1] (fraction of the unrematerialized compiled temp bytes), an int
        (footprint bytes), a string such as "512MiB"/"8GB", or "auto" (see `jremat.parse_budget`);
        or a `Budget` already parsed from one (`jremat.parse_budget`), used as it is.
      solver: the planner ([design.md#planners](../design.md#planners)): "chain" (dynamic
        programming over cuts and save sets; Chen et al. 2016, Rotor, Rockmate), "greedy"
        (cost-per-byte knapsack), "dtr" (simulated Dynamic Tensor Rematerialization, Kirisame et al.
        2021), "milp" (exact, HiGHS; Checkmate, Jain et al. 2020), or "auto": "milp" up to
        `AUTO_MILP_MAX_NODES` equations, "chain" above. Every solver's plans are compiled and
        verified the same way.
      argnums: differentiated arguments, as in `jax.grad`.
      verify: compile plans and keep only one whose compiled temp bytes meet the budget
        (recommended). With False the cost model (scaled to the baseline) decides and only
        the baseline is compiled; the plan may then miss the budget. Programs whose layers
        live in a `lax.scan` try their loop body policies first
        ([design.md#verification](../design.md#verification)).
      max_rounds: how many plans verification may compile before settling (an int >= 1).
      max_cuts: cut candidates the DP considers (an int >= 1).
      offload: host offload ([design.md#host-offload](../design.md#host-offload)). None/False
        (default): segments save or recompute. True or a `jremat.OffloadCost(host_bandwidth=bytes/s,
        device_flops=FLOP/s)`: a segment may also offload the values `dots_saveable` would save to
        pinned host memory, charged 2 x bytes / host_bandwidth seconds x device_flops FLOPs; the
        planner takes it where that is cheaper than the recompute it spares. On a backend where
        offloading has no memory effect (CPU), the plan still compiles and runs, and its device
        memory is verified on the plan with those values recomputed (`Plan.notes` says so). The
        "dtr" solver never offloads.
      in_shardings: the shardings the arguments run under, as `jax.jit`'s `in_shardings`: a
        `NamedSharding` or `PartitionSpec` for all arguments, or a tuple with a pytree prefix
        of them (None: as the argument carries) per positional argument. Default: what the
        arguments carry. Needed inside `jax.jit` in Auto sharding mode, whose tracers do not
        reveal their shardings.
      mesh: the mesh `PartitionSpec`s in `in_shardings` refer to: a `jax.sharding.Mesh` (or
        `AbstractMesh`), or None (default: the one set by `jax.set_mesh`). It shards nothing
        by itself; given while no `PartitionSpec` refers to it and no argument is sharded, the
        program is planned unsharded and a `RuntimeWarning` says so.
      graph: `fn` already traced at these arguments, `jremat.trace(fn, *args, argnums=...)`
        (of the arguments as `in_shardings`/`mesh` shard them), so that it is not traced again
        (as `jremat.auto` passes it); None (default): traced here. A graph of another program
        raises `jremat.PlanMismatchError` when the plan runs.
      has_aux: `fn` returns a pair `(loss, aux)`, aux any pytree of arrays (metrics, updated
        batch statistics), as in `jax.value_and_grad(fn, has_aux=True)`: the step planned and
        verified is `jit(value_and_grad(fn, has_aux=True))`, which computes both. Default
        False.
      batching: the `jax.vmap`s the plan runs under (`jremat.auto` passes those around its
        call; `base.batching.Batching`): `args` are per example and the plan is made on
        `fn`'s per-example program, but the step compiled, verified and budgeted is the
        vmapped one at the batched arguments (a fraction is of its unrematerialized temp).
        None (default): no vmap.
      compile_budget: the XLA compiles of the whole program the search may spend, the
        unrematerialized step and the verification included: an int (at least what verifying
        one plan needs: 3, 5 with `has_aux`; where it runs out, the cheapest plan compiled so
        far that holds on both steps is returned, or `InfeasibleBudgetError`), None for no
        limit (the full search: calibrated rounds, mixes, refinement), or "auto" (default):
        what verification needs plus `AUTO_COMPILE_STEPS` steps (6 for a plain loss) for the
        "auto", "chain" and "milp" solvers, lifted where the search does not end within it
        (no plan fits, or the compiles run out mid-search: the default never refuses a
        budget the unlimited search meets, nor returns a search's plan cut short); no
        limit for "greedy", "dtr",
        offloading plans and Flax blocks. Each `value_and_grad` and `jit(grad)` step counts
        one (with `has_aux` a `jit(grad)` check is two: with and without the aux; in a
        `shard_map` body a step is three); see docs/guides/planning-cost.md.
        `Plan.compiles` records what was spent (except under an int budget, `jit(grad)`
        checks compiled ahead in the background count where the search reads them).

    Returns:
      A `Plan`; `Plan.identity` when the budget is at or above the unrematerialized program,
      or when it is a fraction >= 1 and JAX cannot build `fn`'s reverse derivative (a
      `while_loop` with dynamic bounds, used only forward: nothing to plan).

    Raises:
      ValueError: an invalid budget (names the accepted forms) or unknown solver;
        `max_rounds` or `max_cuts` below 1; `compile_budget` below what verification needs.
      InfeasibleBudgetError: no plan reaches the budget; states the smallest reachable budget
        in the caller's unit. Also where `compile_budget` ran out before a plan that fits
        was verified (the message says so and states a floor that holds under the same
        compile budget: a plan verified that a call at it compiles first, else 1.0).
      TypeError: `compile_budget` not an int, "auto" or None (a bool included).
      TypeError: `fn` does not return a scalar float (with `has_aux`, a pair whose first
        element is one; a pair returned without `has_aux` names it), or `argnums` selects no
        float input; `has_aux` not a bool;
        `in_shardings` (or an entry's leaf) or `mesh` of another type; `offload` is not one of
        the accepted forms; `verify` not a bool; `max_rounds` or `max_cuts` not an int (a
        bool included).
      InfeasibleBudgetError: also for a fraction below 1 where nothing can be
        rematerialized: `fn` traces to no equations, or JAX cannot build its reverse
        derivative (the message quotes JAX's reason and names budget=1.0).
      ValueError: JAX cannot build `fn`'s reverse derivative and the budget is in bytes
        (the message quotes JAX's reason and names budget=1.0).
      ValueError (sharding): `in_shardings` does not match the arguments, a `PartitionSpec`
        without a mesh, or a mesh needing more devices than exist
        ([design.md#sharding](../design.md#sharding)).

    Examples:
      >>> import jax, jax.numpy as jnp, jremat
      >>> def loss(ws, x):  # a 4-layer MLP
      ...     for w in ws:
      ...         x = jnp.tanh(x @ w)
      ...     return jnp.mean(x**2)
      >>> ws, x = [jnp.full((64, 64), 0.01)] * 4, jnp.ones((128, 64))
      >>> p = jremat.plan(loss, ws, x, budget=0.9)  # 90% of the temp bytes without remat
      >>> p.measured_temp_bytes <= p.budget_temp_bytes < p.baseline_temp_bytes
      True
    """
    spec = parse_budget(budget)
    offload_cost = parse_offload(offload)
    check_solver(solver)
    verify = check_flag("verify", verify)
    max_rounds = check_count("max_rounds", max_rounds)
    max_cuts = check_count("max_cuts", max_cuts)
    compile_budget = check_compile_budget(compile_budget)
    t0 = time.perf_counter()
    prog = Program(
        fn,
        args,
        argnums,
        in_shardings=in_shardings,
        mesh=mesh,
        graph=graph,
        has_aux=has_aux,
        batching=batching,
    )
    logger.info(
        "%s %s: %d equations in %.1f s",
        "traced" if graph is None else "checked the traced",
        getattr(fn, "__name__", "fn"),
        prog.graph.num_nodes,
        time.perf_counter() - t0,
    )
    return solve(
        prog,
        spec,
        solver=solver,
        verify=verify,
        max_rounds=max_rounds,
        max_cuts=max_cuts,
        offload=offload_cost,
        compile_budget=compile_budget,
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
    compile_budget: int | str | None = None,
) -> Plan:
    """`plan` on an already traced `Program` (lets callers reuse the baseline compile).

    Plans are ranked by compiled FLOPs plus, for those that offload, the transfer time of
    their predicted offloaded bytes under `offload` as FLOP-equivalents. The stages, each a
    function below that says what it compiles (docs/design.md#verification):

    1. `_compile_baseline`: the unrematerialized step (the target of a fraction), in one
       parallel batch with what the next stage needs first;
    2. `_no_recompute`: the recipe that saves the most, returned where it recomputes nothing
       (under a compile budget where stage 3 is the aimed search: first where the budget
       leaves that search `RECIPE_FIRST_AIMS` plans besides it, else after it);
    3. `_best_first`: the best-first search (search/predicted.py): loop settings for scan
       programs; under a compile budget, plans aimed at the target for the others;
    4. the full search: (a) `_calibrate` (reference plans, the cost model fitted to them),
       (b) `_choose` (floor plans, rounds, mixes, refinement), (c) verify:
       `_holds_under_grad` (the chosen plan's `jit(grad)` step), then `_finish_full`.

    Under a compile budget every stage stops where the next compile would leave none for a
    plan's `jit(grad)` check; `_budget_spent` then returns the cheapest compiled plan that
    holds on both steps (under "auto" the search goes on without a limit instead).
    `compile_budget` as `plan`'s, but None (no limit) by default.
    """
    spec = spec.for_device(prog.device)  # a "device" budget: of the device compiled for
    needed = prog.verification_compiles()
    # "auto": a cap where the best-first searches run (the heuristic planners' and offloading
    # plans' full search needs more; a Flax block's is small), which a refusal lifts
    soft = compile_budget == "auto"
    if soft:
        capped = (
            verify
            and solver in BEST_FIRST_SOLVERS
            and offload is None
            and prog.objective.capped_by_default
        )
        compile_budget = needed + AUTO_COMPILE_STEPS * prog.step_compiles if capped else None
    if compile_budget is not None and compile_budget < needed:
        raise ValueError(
            f"compile_budget={compile_budget!r} is below the {needed} compiles verification "
            "needs on this program (the unrematerialized step, a plan's value_and_grad step "
            "and its jit(grad) check; with has_aux also each without its aux; 3 compiles a "
            f"step in a shard_map body): pass compile_budget>={needed}, or None for no limit"
        )
    lift = soft and compile_budget is not None
    prog.start_counting(compile_budget, lift)
    search = functools.partial(_search, prog, spec, solver, verify, max_rounds, max_cuts, offload)
    # the default's cap never refuses a budget the unlimited search meets, nor states another
    # floor, nor returns a plan of a search cut short (the cheapest compiled so far: on the
    # zoo's residual MLP at 0.3, jax 0.10, a reference plan at +18.2% FLOPs, where the search
    # goes on to +2.1%): there the search goes on without it (nothing compiled twice)
    try:
        spent_out = False
        try:
            p = search()
        except CompileBudgetSpent:
            p, spent_out = None, True
        except InfeasibleBudgetError:
            if not lift:
                raise
            p = None
        if spent_out and not lift:
            # outside the handler: a refusal's traceback shows no internal exception
            p = _budget_spent(prog, spec, offload, solver, max_cuts)
        if p is None:
            logger.info("the default compile budget ended the search: the unlimited one follows")
            prog.settle()
            prog.compile_budget, prog.budget_lifts = None, False
            p = search()
    finally:
        prog.settle()  # no `jit(grad)` compile started ahead outlives the search
        spent = prog.compiles_spent + prog.compiles_ahead_unread
        prog.compile_budget, prog.budget_lifts = None, False
    p.compiles = spent
    return p


def _search(
    prog: Program,
    spec: Budget,
    solver: str,
    verify: bool,
    max_rounds: int,
    max_cuts: int,
    offload: OffloadCost | None,
) -> Plan:
    """`solve`'s stages, under the program's compile budget (`CompileBudgetSpent` ends them)."""
    if not prog.graph.num_nodes:  # `lambda x: x`, a jit returning an input: nothing to remat
        if (error := spec.nothing_to_rematerialize("fn traces to no equations")) is not None:
            raise error
    score = functools.partial(_score, offload)
    t0 = time.perf_counter()
    # best-first first (search/predicted.py): loop settings for scan programs, and under a
    # compile budget the aimed search for the others; the full search below where it finds
    # no plan. Straight to the full search: the heuristic planners (greedy, DTR), whose plan
    # at a model budget is not the model's cheapest, which the best-first search stops on,
    # and offloading programs
    budgeted = prog.compile_budget is not None
    searchable = _best_first_searchable(solver, verify, offload)
    best_first = searchable and (BEST_FIRST_LOOPS if prog.has_scan else budgeted)
    # the recipe that may need no recompute: tried whenever the target is below the baseline
    # (not only where `_likely_below` guessed so), so that where the search ends does not
    # depend on the guess (byte budgets of sharded programs, a model an earlier search fitted);
    # early (compiled with the baseline), except under a compile budget that would leave the
    # aimed search fewer than `RECIPE_FIRST_AIMS` plans besides it: there after that search
    # hands over (compiled up front, it would be an aimed plan fewer)
    aimed = best_first and not prog.has_scan
    eligible = searchable and (aimed or not best_first)
    first = mixing.most_saving_plan(prog) if NO_RECOMPUTE_FIRST and eligible else None
    recipe_early = first is not None and (not aimed or _room_for_recipe(prog, prog.compiles_left))
    try:
        if verify and (not best_first or recipe_early):
            planner = functools.partial(prog.planner, solver, max_cuts, offload)
            _compile_baseline(prog, spec, first, planner, background=aimed)
        base = prog.baseline
        target = spec.temp_bytes(base.temp_bytes, base.fixed_bytes)
        # the aimed search's first plan, planned while the recipe compiles on
        # (`_compile_baseline`; not once it is compiled: where it is the answer, that
        # planning would delay it)
        ahead = aimed and recipe_early and target < base.temp_bytes
        aim = _first_aim(prog, target, solver, max_cuts, first) if ahead else None
        prog.await_ahead()  # the recipe: its error raised here, as where compiled in order
    except CompileBudgetSpent:
        raise
    except Exception as e:  # noqa: BLE001 - re-raised unless fn has no reverse derivative
        return _no_reverse_derivative(prog, spec, e)
    meta = dict(budget=spec.raw, budget_temp_bytes=int(target) if target > 0 else 0)
    if target >= base.temp_bytes:
        p = Plan.identity(prog.graph, **meta)
        p.predicted_temp_bytes = base.temp_bytes
        return prog.record(p.annotate(prog.graph), base)
    if recipe_early and (found := _no_recompute(prog, target, first, meta, solver)):
        return found
    carried: list[tuple[Plan, Compiled]] = []  # what the best-first search compiled
    if best_first:
        found, carried = _best_first(prog, target, meta, score, solver, max_cuts, aim)
        if found is not None:
            return found
    if (
        first is not None
        and not recipe_early
        and (found := _no_recompute(prog, target, first, meta, solver))
    ):
        return found
    # (with an offload cost too: its plans offload nothing, and are candidates of any search)
    if verify and not best_first and not prog.has_scan and solver in BEST_FIRST_SOLVERS:
        carried = _aimed_candidates(prog, target, score, solver, max_cuts)
    planner = prog.planner(solver, max_cuts, offload)
    if not verify:
        return _model_only(prog, spec, planner, target, meta, solver)
    cal = _calibrate(prog, planner)
    logger.info(
        "baseline and %d reference plans compiled in %.1f s",
        len(cal.anchors),
        time.perf_counter() - t0,
    )
    second = (
        functools.partial(prog.planner, solver, max_cuts, baseline_fit=True)
        if BASELINE_FIT_SHOT and solver in BEST_FIRST_SOLVERS and offload is None
        else None
    )
    cands = _choose(prog, planner, cal, target, score, max_rounds, carried, offload, second)
    logger.info(
        "%d rounds compiled, %.1f s since planning began",
        len(cands.stage["rounds"]),
        time.perf_counter() - t0,
    )
    # the plans that do not depend on the target: an InfeasibleBudgetError states their floor
    target_free = [*cal.anchors, *cands.stage["floor"]]
    if cands.best[1] is None and solver in BEST_FIRST_SOLVERS and offload is None:
        _last_resort(prog, cands, max_cuts, target_free)
    best = cands.best
    if best[1] is not None:
        best = _holds_under_grad(prog, target, best, cands.ranked())
    logger.info(
        "planned in %.1f s, %d programs compiled on this program so far",
        time.perf_counter() - t0,
        prog.compiles,
    )
    if best[1] is None:
        best = _floor_fallback(prog, planner, cal, cands)
    _, chosen, c = best
    if chosen is None:
        # what a new plan() call at the stated budget compiles again (not the target-driven
        # rounds and mixes, which a larger target steers elsewhere)
        _raise_infeasible(spec, prog, [*cal.anchors, *cands.stage["floor"]])
    return _finish_full(prog, planner, cal, chosen, c, [*cal.log, *cands.log], meta, solver)


def _room_for_recipe(prog: Program, left: float) -> bool:
    """Whether `left` compiles (a search's, before it starts) leave the aimed search
    `RECIPE_FIRST_AIMS` plans besides the layer recipe compiled with the baseline."""
    return left >= prog.verification_compiles() + RECIPE_FIRST_AIMS * prog.step_compiles


def _best_first_searchable(solver: str, verify: bool, offload: OffloadCost | None) -> bool:
    """Whether a best-first search may run first (`_search`): plans are verified, the
    planner's plan at a model budget is its cheapest (not the heuristic planners'), and
    nothing is offloaded."""
    return verify and solver in BEST_FIRST_SOLVERS and offload is None


def _first_compiled(
    prog: Program, solver: str, max_cuts: int, offload: OffloadCost | None
) -> Callable[[float], set[str] | None] | None:
    """A function of a target (temp bytes): the program keys of the plans a call at it
    under this compile budget compiles first after the baseline, one of which it returns (or
    a plan that fits) where it fits on both steps: the layer recipe where it compiles with
    the baseline, and the aimed search's first plan (`predicted.first_aim`; None where there
    is none). None where the search that runs first is another (a program with top-level
    scans, the heuristic planners, offloading, a model that misreads the baseline)."""
    if prog.has_scan or not _best_first_searchable(solver, True, offload):
        return None
    planner = prog.planner(solver, max_cuts, baseline_fit=True)
    if not predicted.fit_trusted(planner.model):
        return None
    recipe = mixing.most_saving_plan(prog) if NO_RECOMPUTE_FIRST else None
    with_recipe = recipe is not None and _room_for_recipe(prog, prog.compile_budget)
    also = {prog.program_key(recipe)} if with_recipe else set()

    def keys(target: float) -> set[str] | None:
        _, plan = predicted.first_aim(planner, target)
        if plan is None or planner.model.predict(plan) is None:
            return None
        return {prog.program_key(plan), *also}

    return keys


def _budget_spent(
    prog: Program,
    spec: Budget,
    offload: OffloadCost | None,
    solver: str,
    max_cuts: int,
) -> Plan:
    """The compile budget ran out mid-search: the cheapest plan compiled on this program that
    fits the target on its `value_and_grad` step and on its `jit(grad)` step (checked with the
    compile the budget kept for it, where it is not known yet).

    Raises:
      InfeasibleBudgetError: no plan compiled holds; states the lowest plan verified on both
        steps that a call at its temp under this compile budget compiles first
        (`_first_compiled`; the lowest verified where that search is not known from the
        target), else 1.0 (the unrematerialized program).
    """
    base = prog.baseline
    target = spec.temp_bytes(base.temp_bytes, base.fixed_bytes)
    meta = dict(budget=spec.raw, budget_temp_bytes=int(target) if target > 0 else 0)
    score = functools.partial(_score, offload)
    ranked = sorted(
        ((score(p, c), i, p, c) for i, (p, c) in enumerate(prog.tried) if c.temp_bytes <= target),
        key=lambda t: t[:2],
    )

    def grad_temp(p: Plan) -> int | None:
        """`p`'s `jit(grad)` temp where known or the budget leaves its check, else None."""
        if not prog.grad_known(p) and prog.compiles_left < prog.grad_check_compiles(p):
            return None
        try:
            return prog.grad_step_temp(p)
        except CompileBudgetSpent:  # a check the accounting did not foresee: not verified
            return None

    for _, _, p, c in ranked:
        if (grad := grad_temp(p)) is not None and grad <= target:
            held = dataclasses.replace(c, temp_bytes=max(c.temp_bytes, grad))
            chosen = prog.record(copy.deepcopy(p), held)
            chosen.predicted_temp_bytes = 0
            chosen.notes.append(
                f"compile budget of {prog.compile_budget} spent: the cheapest compiled plan "
                "that holds on both steps"
            )
            return _finish(chosen, meta, solver, prog.graph)
    # none fits: what is left of the budget verifies the lowest plans compiled, so that the
    # floor stated is one a plan reached (not the unrematerialized program's 1.0)
    for p, _ in sorted(prog.tried, key=lambda pc: pc[1].temp_bytes):
        if grad_temp(p) is None:
            break
    verified = sorted(
        (max(c.temp_bytes, prog.grad_step_temp(p)), prog.program_key(p))
        for p, c in prog.tried
        if prog.grad_known(p)
    )
    lowest = min([t for t, _ in verified[:1]] + [base.temp_bytes])
    # the floor stated holds under this compile budget: a call at it compiles a plan verified
    # within it. The aimed plan moves with the target, so the lowest plan verified is stated
    # only where a call at its temp compiles it first (tests/models.py's residual MLP at 0.3
    # under 3 compiles: the one plan reached 0.3303; a call there aimed at another, which
    # reached 0.3395, and so on); else the next, else the unrematerialized program (1.0)
    least = base.temp_bytes
    first_compiled = _first_compiled(prog, solver, max_cuts, offload)
    for temp, _ in verified:
        if temp >= base.temp_bytes:  # no lower than the unrematerialized program's own
            break
        at = spec.in_caller_unit(temp, base.temp_bytes, base.fixed_bytes)
        again = parse_budget(at).temp_bytes(base.temp_bytes, base.fixed_bytes)
        firsts = None if first_compiled is None else first_compiled(again)
        if firsts is None or any(k in firsts and t <= again for t, k in verified):
            least = temp
            break
    smallest = spec.in_caller_unit(least, base.temp_bytes, base.fixed_bytes)
    found = f"the lowest plan verified reaches {spec.describe(smallest)}"
    if least > lowest:
        reached = spec.in_caller_unit(lowest, base.temp_bytes, base.fixed_bytes)
        found = (
            f"the lowest plan verified reaches {spec.describe(reached)}, but a call there "
            f"under compile_budget={prog.compile_budget} would compile another plan first, "
            f"which may miss; the budget known to hold under it is {spec.describe(smallest)}"
        )
    raise InfeasibleBudgetError(
        f"budget={spec.raw!r}: the compile budget of {prog.compile_budget} compiles ran out "
        f"before a plan within it was verified; {found}. Raise compile_budget (None: no "
        "limit), or the budget.",
        budget=spec.raw,
        smallest_reachable=smallest,
        smallest_reachable_bytes=least,
    )


def _score(offload: OffloadCost | None, p: Plan, c: Compiled) -> float:
    """A compiled plan's score: its compiled FLOPs, plus for one that offloads the transfer
    time of its predicted offloaded bytes as FLOP-equivalents (inf with no `offload` cost)."""
    if not p.offloaded_bytes:
        return c.flops
    return math.inf if offload is None else c.flops + offload.transfer_flops(p.offloaded_bytes)


def _compile_baseline(
    prog: Program,
    spec: Budget,
    first: Plan | None,
    planner: Callable[[], Any],
    background: bool = False,
) -> None:
    """Stage 1, the baseline: where the target is likely below the unrematerialized
    program (`_likely_below`), compile that program in one parallel batch with `first` (the
    recipe that saves the most, `_no_recompute`'s) or, with no `first`, with the reference
    plans and the mixes' pure recipes (`_calibrate`'s). Elsewhere the baseline compiles
    alone when `prog.baseline` is read. With `background` (the aimed search's), it returns
    once the baseline is compiled and `first` compiles on while the caller plans the first
    aim (`_first_aim`; GPT-2, 6 layers: the recipe's compile took 1.2 s longer than the
    baseline's, the aim's planning 1.1 s)."""
    if not _likely_below(prog, spec, planner):
        return
    if first is not None:
        prog.compile_many([None, first], rest_in_background=background)
    else:
        prog.anchors(planner(), also=[None, *mixing.pure_plans(prog)])


def _model_only(
    prog: Program, spec: Budget, planner: Any, target: float, meta: dict, solver: str
) -> Plan:
    """`verify=False`: the planner's plan at the target in model bytes, scaled so that the
    unrematerialized program maps onto its compiled temp bytes (the only compiled figure it
    has). Raises `InfeasibleBudgetError` where the model reaches no plan."""
    model_none = planner.no_remat_peak()
    model_target = target * model_none / max(prog.baseline.temp_bytes, 1)
    chosen = planner.plan(model_target) or _raise_model_infeasible(spec, prog, planner, model_none)
    chosen.notes.append("verify=False: chosen by the cost model, scaled to the baseline")
    return _finish(chosen, meta, solver, prog.graph)


@dataclasses.dataclass
class Calibration:
    """What `_calibrate` decided: the cost model's map from compiled temp bytes to model bytes.

    Attributes:
      anchors: the compiled reference plans, (plan, figures), the min-memory plan first.
      fitted: whether the model was fitted to them (then its bytes are compiled bytes).
      model_min, model_none: modelled peak (bytes) of the min-memory plan and of the
        unrematerialized program, after the fit.
      xs, ys: compiled temp bytes (ascending) and the model bytes of the same plans (made
        non-decreasing): what is left of the model's error after the fit, interpolated.
      base_temp: the unrematerialized program's compiled temp bytes.
      log: a line for the plan's notes.
    """

    anchors: list[tuple[Plan, Compiled]]
    fitted: bool
    model_min: float
    model_none: float
    xs: np.ndarray
    ys: np.ndarray
    base_temp: float
    log: list[str]

    def model_budget(self, target: float) -> float:
        """The model budget expected to compile to `target` temp bytes."""
        if len(self.xs) > 1:
            return float(np.interp(target, self.xs, self.ys))
        min_temp = self.anchors[0][1].temp_bytes
        slope = (self.model_none - self.model_min) / max(self.base_temp - min_temp, 1)
        return self.model_min + (target - min_temp) * max(slope, 1e-3)


def _calibrate(prog: Program, planner: Any) -> Calibration:
    """Stage 4a, calibrate (the full search): compile the reference plans (`Program.anchors`,
    with the mixes' pure recipes in the same parallel batch; once per program) and fit the
    planner's cost model to them and the baseline (`SegmentModel.calibrate`): the same programs
    whatever budget this program was planned for before, so that the plan is a function of
    (program, budget, solver) only. Mutates the planner's model (its table, in compiled
    bytes after the fit)."""
    anchors = prog.anchors(planner, also=mixing.pure_plans(prog))
    base = prog.baseline
    samples = [(p, c.temp_bytes) for p, c in anchors]
    log: list[str] = []
    fitted = planner.model.calibrate([*samples, (Plan.identity(prog.graph), base.temp_bytes)])
    if fitted:
        scales = ", ".join(
            f"{k} {v:,.0f}" if k.endswith("_bytes") else f"{k} {v:.2f}"
            for k, v in (planner.model.weights or {}).items()
        )
        log.append(f"cost model fitted to {len(samples) + 1} compiled programs: scales {scales}")
    model_none = planner.no_remat_peak()
    model_min = planner.min_memory_plan().predicted_temp_bytes
    # then map compiled bytes to model bytes through every compiled anchor (what is left)
    predict = planner.model.predict
    points = sorted(
        {(c.temp_bytes, predict(p)) for p, c in anchors if predict(p) is not None}
        | {(base.temp_bytes, model_none)}
    )
    xs, ys = _bytes_map(points)
    return Calibration(anchors, fitted, model_min, model_none, xs, ys, base.temp_bytes, log)


def _bytes_map(points) -> tuple[np.ndarray, np.ndarray]:
    """(compiled, model) byte pairs as `Calibration.xs` / `ys`: pairs without a model figure
    dropped, sorted by compiled bytes, the model's side made non-decreasing."""
    points = sorted((x, y) for x, y in points if y is not None)
    xs = np.array([x for x, _ in points], dtype=float)
    ys = np.maximum.accumulate(np.array([y for _, y in points], dtype=float))
    return xs, ys


@dataclasses.dataclass
class Candidates:
    """The plans one `solve` call compiled, by stage, and the cheapest that fits the target.

    Attributes:
      target: the budget in compiled temp bytes.
      score: a compiled plan's score (`_score`).
      stage: (plan, figures) compiled by each stage: "anchors" (`_calibrate`'s), "floor"
        (fixed model budgets and refinement), "rounds", "second" (`_second_model`'s plans
        that joined the candidates), "mixes", "carried" (the best-first search's, handed
        over).
      best: (score, plan, figures) of the cheapest fitting plan offered so far, or
        `(inf, None, None)`.
      seen: plan keys compiled (or skipped) by this call's floor plans and rounds.
      log: lines for the plan's notes.
    """

    target: float
    score: Callable[[Plan, Compiled], float]
    stage: dict[str, list[tuple[Plan, Compiled]]]
    best: tuple[float, Plan | None, Compiled | None] = (math.inf, None, None)
    seen: set[str] = dataclasses.field(default_factory=set)
    log: list[str] = dataclasses.field(default_factory=list)

    def offer(self, plan: Plan, c: Compiled, copied: bool = False) -> bool:
        """Make (plan, c) the best where it fits and scores lower; returns whether it fits."""
        fits = c.temp_bytes <= self.target
        if fits and self.score(plan, c) < self.best[0]:
            self.best = (self.score(plan, c), copy.deepcopy(plan) if copied else plan, c)
        return fits

    def ranked(self) -> list[tuple[float, Plan, Compiled]]:
        """Every plan of this call as (score, plan, figures), for `_holds_under_grad`."""
        order = ("anchors", "rounds", "second", "mixes", "floor", "carried")
        return [(self.score(p, c), p, c) for k in order for p, c in self.stage[k]]


def _choose(
    prog: Program,
    planner: Any,
    cal: Calibration,
    target: float,
    score: Callable[[Plan, Compiled], float],
    max_rounds: int,
    carried: list[tuple[Plan, Compiled]],
    offload: OffloadCost | None,
    second: Callable[[], Any] | None = None,
) -> Candidates:
    """Stage 4b, choose (the full search): the candidates compiled against `target` by the
    calibrated model, and the cheapest that fits (its value_and_grad step only;
    `_holds_under_grad` checks `jit(grad)`): the fitting reference plans; where none fits,
    floor plans at fixed model budgets (`_floor_plan`); rounds towards the target (`_rounds`,
    up to `max_rounds` compiles); where the calibrated model misread its rounds, the plans of
    the planner fitted to the baseline alone (`second()`, built only then:
    `_second_model`); mixes of the compiled recipes (`mixing.search`); below every
    reference and floor plan, refinement (`refine.floor_candidates`). `carried` (the
    best-first search's compiles) are candidates too."""
    found = Candidates(
        target,
        score,
        stage=dict(anchors=cal.anchors, floor=[], rounds=[], second=[], mixes=[], carried=carried),
        seen={plan_key(p) for p, _ in cal.anchors},
        log=[],
    )
    fitting = [(p, c) for p, c in cal.anchors if c.temp_bytes <= target]
    for p, c in fitting:
        found.offer(p, c)
    if not fitting:
        # No reference plan fits: the model's plans just above its minimum, at fixed model
        # budgets. They do not depend on the target, so the smallest budget an
        # InfeasibleBudgetError states (anchors and these) is found again when asked for.
        _ladder(prog, planner, cal, found)
    _rounds(prog, planner, cal, found, max_rounds if fitting else min(max_rounds, 2), offload)
    bar = found.best[0]  # the mixes' bar: as without the second model's plans
    if second is not None:
        _second_model(prog, second, planner, cal, found, offload)
    # mixes of the compiled recipes (some layers or scan iterations under each of two)
    found.stage["mixes"] = mixing.search(prog, target, bar, close_enough=CLOSE_ENOUGH)
    # only plans of this call count (not those another budget compiled on this program)
    for k in ("rounds", "second", "mixes", "floor", "carried"):
        for p, c in found.stage[k]:
            found.offer(p, c, copied=True)
    if target < min(c.temp_bytes for _, c in [*cal.anchors, *found.stage["floor"]]):
        _refined(prog, planner, cal, found)
    if fitting and prog.objective.floor_plans_always:
        # after the rounds and mixes (their bar and compiles as without them): a floor plan
        # is returned only where it recomputes less than what they found
        _ladder(prog, planner, cal, found)
    return found


def _ladder(prog: Program, planner: Any, cal: Calibration, found: Candidates) -> None:
    """The floor plans at fixed model budgets (`FLOOR_LADDER` multiples of the model's
    minimum), compiled where not yet: plans that do not depend on the target."""
    for factor in FLOOR_LADDER:
        # the model's DP: no time limit, so the same plans come back in a new call
        _floor_plan(
            prog,
            found,
            planner.model.cheapest_plan(cal.model_min * factor, planner.name),
            f"floor: model budget {cal.model_min * factor:,.0f}",
        )


def _refined(prog: Program, planner: Any, cal: Calibration, found: Candidates) -> None:
    """The segments at the peaks of the lowest compiled reference and floor plans cut finer
    (search/refine.py); like the floor plans, they do not depend on the target, so a stated
    floor is found again at that budget."""
    lowest = [*cal.anchors, *found.stage["floor"]]
    for candidate in refine.floor_candidates(prog.graph, planner, lowest):
        _floor_plan(prog, found, candidate, "peak segment split")


def _floor_fallback(
    prog: Program, planner: Any, cal: Calibration, found: Candidates
) -> tuple[float, Plan | None, Compiled | None]:
    """Where no candidate held on both steps: every target-independent plan (reference,
    floor ladder, refined; those a call below this target compiled too, whatever this
    call's target skipped), and the cheapest that holds on both steps, so that a budget at
    or above the floor an `InfeasibleBudgetError` states is never refused. (inf, None, None)
    where none holds."""
    _ladder(prog, planner, cal, found)
    _refined(prog, planner, cal, found)
    held = []
    for p, c in sorted([*cal.anchors, *found.stage["floor"]], key=lambda pc: pc[1].temp_bytes):
        if c.temp_bytes > found.target:
            break  # sorted: no later plan fits
        grad_temp = prog.grad_step_temp(p)
        if grad_temp <= found.target:
            held.append((found.score(p, c), p, c, grad_temp))
    if not held:
        return math.inf, None, None
    score_, p, c, grad_temp = min(held, key=lambda t: t[0])
    found.log.append("no candidate held on both steps: the cheapest floor plan that does")
    return score_, copy.deepcopy(p), dataclasses.replace(c, temp_bytes=max(c.temp_bytes, grad_temp))


def _last_resort(
    prog: Program, found: Candidates, max_cuts: int, floor: list[tuple[Plan, Compiled]]
) -> None:
    """Where no plan of an exact solver fits and the target is within `LAST_RESORT_REACH` of
    the lowest of its budget-independent plans (`floor`): greedy's rounds
    (`LAST_RESORT_ROUNDS` compiles at most) before `InfeasibleBudgetError`. Near the floor
    XLA's temp is not monotone in what a plan saves, and greedy orders what to recompute
    otherwise: on a 3-layer block of matmul, `jnp.sort` and `top_k` (jax 0.12) its plan at
    0.7273 of the unrematerialized temp compiled to 0.7197, where the chain DP's plans stated
    0.7347 as the floor. Target-driven, so not part of the stated floor (a new call at that
    floor finds it again without them)."""
    lowest = min((c.temp_bytes for _, c in floor), default=math.inf)
    if found.target < LAST_RESORT_REACH * lowest:
        return  # far below what any plan reached: a plan of another order will not get there
    found.log.append("no plan of the exact solver fits: greedy's rounds follow")
    greedy = prog.planner("greedy", max_cuts, None)
    _rounds(prog, greedy, _calibrate(prog, greedy), found, LAST_RESORT_ROUNDS, None)


#: Greedy's rounds `_last_resort` compiles at most.
LAST_RESORT_ROUNDS = 2

#: `_last_resort` runs where the target is at least this fraction of the lowest compiled
#: budget-independent plan (greedy reached 2% below it on the `top_k` blocks).
LAST_RESORT_REACH = 0.9


def _floor_plan(prog: Program, found: Candidates, candidate: Plan | None, label: str) -> None:
    """Compile `candidate` (None or one compiled by this call already: nothing) as a floor
    plan of `found`."""
    if candidate is None or plan_key(candidate) in found.seen:
        return
    found.seen.add(plan_key(candidate))
    c = prog.compile(candidate)
    found.stage["floor"].append((candidate, c))
    found.log.append(f"{label} -> compiled temp {c.temp_bytes:,}")
    found.offer(candidate, c)


def _second_model(
    prog: Program,
    second: Callable[[], Any],
    planner: Any,
    cal: Calibration,
    found: Candidates,
    offload: OffloadCost | None,
) -> None:
    """Stage 4b continued, after the calibrated rounds: the plans of a second model, the
    planner fitted to the compiled baseline alone (`second()`,
    `SegmentModel.fit_unrematerialized`), where the calibrated model misread its rounds.

    The calibrated model's scale per save option is fitted on per-layer plans and can
    misrank the mixed plans the DP makes: on `benchmarks/vs_pytorch.py`'s GPT (jax 0.10) at
    29.8% of the unrematerialized temp its rounds settled on +10.7% extra FLOPs where the
    baseline-fitted DP's plan at the same compiled temp recomputes +7.6%
    (docs/design.md#the-full-search). Where the rounds' compiled temp was off their
    prediction by more than `SECOND_GATE` (median), its plan at the model budget its reading
    of the compiled reference plans maps the target to is compiled; where it read that plan
    closer than the calibrated model read its rounds (`SECOND_READ_MARGIN`), up to
    `SECOND_ROUNDS` rounds of its own follow, aimed at `SECOND_AIM` of the target. A plan of
    these joins the candidates only where it fits, scores below the best so far and its
    `jit(grad)` step fits too, so the plan returned is never one that recomputes more than
    without them (the mixes keep the rounds' bar)."""
    rounds = found.stage["rounds"]
    miss = float(np.median([_miss(planner, cal, p, c) for p, c in rounds])) if rounds else 0.0
    if miss <= SECOND_GATE:
        return
    fitted = second()
    if not predicted.fit_trusted(fitted.model):
        return  # it misreads the unrematerialized program itself (the aimed search's rule)
    points = {(c.temp_bytes, fitted.model.predict(p)) for p, c in cal.anchors} | {
        (prog.baseline.temp_bytes, fitted.no_remat_peak())
    }
    model_budget = float(np.interp(found.target, *_bytes_map(points)))
    candidate = fitted.plan(model_budget)
    if candidate is None or plan_key(candidate) in found.seen:
        return
    found.seen.add(plan_key(candidate))
    c = prog.compile_with_grad(candidate)
    ok = _offer_checked(prog, found, candidate, c)
    found.log.append(
        f"baseline-fitted model: budget {model_budget:,.0f} -> compiled temp "
        f"{c.temp_bytes:,} ({'fits' if ok else 'over'})"
    )
    if _miss(fitted, None, candidate, c) + SECOND_READ_MARGIN >= miss:
        return
    # it read its plan closer than the calibrated model read its rounds: its own rounds, from
    # where its plan compiled (the bracket seeded with it)
    xs, ys = _bytes_map(points | {(c.temp_bytes, candidate.predicted_temp_bytes)})
    own = dataclasses.replace(
        cal,
        fitted=True,
        model_min=fitted.min_memory_plan().predicted_temp_bytes,
        model_none=fitted.no_remat_peak(),
        xs=xs,
        ys=ys,
        log=[],
    )
    bracket = {"lo": model_budget} if ok else {"hi": model_budget}
    _rounds(
        prog,
        fitted,
        own,
        found,
        SECOND_ROUNDS,
        offload,
        aim=SECOND_AIM,
        offer=lambda p, c: _offer_checked(prog, found, p, c),
        **bracket,
    )


def _offer_checked(prog: Program, found: Candidates, plan: Plan, c: Compiled) -> bool:
    """Offer a second-model plan: it joins the candidates (stage "second") only where it
    fits, scores below the best so far and its `jit(grad)` step fits too (checked here, so
    that it takes none of `_holds_under_grad`'s tries from the plans it checked before).
    Returns whether its `value_and_grad` step fits (for the rounds' bracket)."""
    fits = c.temp_bytes <= found.target
    if fits and found.score(plan, c) < found.best[0]:
        if prog.grad_step_temp(plan) <= found.target:
            found.stage["second"].append((plan, c))
            found.offer(plan, c)
        else:
            found.log.append(f"a baseline-fitted plan's jit(grad) step misses {found.target:,.0f}")
    return fits


def _miss(model: Any, cal: Calibration | None, p: Plan, c: Compiled) -> float:
    """How far `model` read plan `p` compiled as `c`: |log(compiled / predicted)| temp bytes,
    the prediction mapped to compiled bytes through `cal` where the model was not fitted
    (its rounds are aimed through that map); inf where it cannot say."""
    predicted = model.model.predict(p)
    if predicted and cal is not None and not cal.fitted:
        predicted = float(np.interp(predicted, cal.ys, cal.xs))
    if not predicted or predicted <= 0 or c.temp_bytes <= 0:
        return math.inf
    return abs(math.log(c.temp_bytes / predicted))


def _rounds(
    prog: Program,
    planner: Any,
    cal: Calibration,
    found: Candidates,
    max_rounds: int,
    offload: OffloadCost | None,
    aim: float = 1.0,
    offer: Callable[[Plan, Compiled], bool] | None = None,
    lo: float | None = None,
    hi: float = math.inf,
) -> None:
    """The planner's plans at model budgets moved towards `aim` times `found.target` by
    secant and bisection steps on their compiled temp bytes (`max_rounds` at most). They end
    on a plan that fits within `CLOSE_ENOUGH` of the target, on one the model predicts
    recomputes no less than the best fitting plan compiled (the model undercounts XLA's
    recompute, docs/design.md#verification: a closer plan would only recompute more), or
    when the bracket of model budgets is narrower than 0.5%. A plan that misses at the
    compiled temp of an earlier miss moves the next at least `predicted.MISS_MOVE`
    lower (a step in proportion to the miss gave the same packing). `offer` (default: the plan
    joins stage "rounds" and is offered), `lo` and `hi` (the model budgets known to fit /
    miss) serve the second model's rounds (`_second_model`)."""
    target, base = found.target, prog.baseline
    model_budget = cal.model_budget(aim * target)
    # model budgets known feasible / infeasible when compiled
    lo = cal.model_min if lo is None else lo
    if offer is None:

        def offer(p: Plan, c: Compiled) -> bool:
            found.stage["rounds"].append((p, c))
            return found.offer(p, c)

    missed: set[int] = set()  # compiled temp bytes of the rounds that missed
    for round_ in range(max_rounds):
        candidate = planner.plan(model_budget)
        if candidate is not None and _predicted_score(base, candidate, offload) >= found.best[0]:
            found.log.append(
                f"round {round_}: the model's plan recomputes {candidate.recompute_flops:,.0f} "
                "FLOPs, no fewer than the best fitting plan compiled: rounds end"
            )
            break
        if candidate is not None and plan_key(candidate) not in found.seen:
            found.seen.add(plan_key(candidate))
            c = prog.compile_with_grad(candidate)  # a round's plan is often the one returned
            ok = offer(candidate, c)
            if ok and found.best[1] is candidate:  # the plan to return, unless a later beats it
                prog.grad_step_ahead(candidate)
            found.log.append(
                f"round {round_}: model budget {model_budget:,.0f} -> compiled temp "
                f"{c.temp_bytes:,} ({'fits' if ok else 'over'})"
            )
            if ok:
                lo = max(lo, model_budget)
            else:
                hi = min(hi, model_budget)
            ratio = aim * target / max(c.temp_bytes, 1)
            if not ok:
                if c.temp_bytes in missed:  # XLA packed this plan as one that missed
                    ratio = min(ratio, 1 - predicted.MISS_MOVE)
                missed.add(c.temp_bytes)
            if ok and c.temp_bytes >= (1 - CLOSE_ENOUGH) * target:
                break
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
        model_budget = max(nxt, cal.model_min)


def _predicted_score(base: Compiled, p: Plan, offload: OffloadCost | None) -> float:
    """`_score` as the cost model predicts it: the baseline's compiled FLOPs plus the plan's
    modelled recompute (a lower bound in practice: the model counts fewer FLOPs than XLA
    does for the same recompute)."""
    extra = 0.0 if offload is None else offload.transfer_flops(p.offloaded_bytes)
    return base.flops + (p.recompute_flops or 0.0) + extra


def _finish_full(
    prog: Program,
    planner: Any,
    cal: Calibration,
    chosen: Plan,
    c: Compiled,
    log: list[str],
    meta: dict,
    solver: str,
) -> Plan:
    """The full search's plan as returned: its compiled figures, notes and the cost model's
    prediction in compiled bytes (through the fit, or the anchors where there was none)."""
    chosen = prog.record(chosen, c)
    chosen.notes.extend(log)
    model = planner.model.predict(chosen)  # None for loop pieces: a mix keeps its interpolation
    if model is None and chosen.solver.endswith("+split"):
        chosen.predicted_temp_bytes = 0
        chosen.notes.append(
            "no cost-model prediction: its sub-layer cuts are not the model's cut candidates"
        )
    if model is not None and cal.fitted:
        # the fitted model is in compiled bytes already
        chosen.predicted_temp_bytes = int(model)
        chosen.notes.append(f"cost model fitted to XLA predicts {int(model):,} temp bytes")
    elif model is not None:
        # the cost model's bytes mapped back to compiled bytes through the anchors
        chosen.predicted_temp_bytes = int(np.interp(model, cal.ys, cal.xs))
        chosen.notes.append(
            f"calibrated through {len(cal.xs)} compiled anchors: model {model:,.0f} -> "
            f"{chosen.predicted_temp_bytes:,} bytes"
        )
    return _finish(chosen, meta, solver, prog.graph)


def _best_first(
    prog: Program,
    target: float,
    meta: dict,
    score: Callable[[Plan, Compiled], float],
    solver: str,
    max_cuts: int,
    aim: tuple[float, Plan | None] | None = None,
) -> tuple[Plan | None, list[tuple[Plan, Compiled]]]:
    """The plan of the best-first search (`predicted.run_loops` for scan programs; else,
    under a compile budget, `predicted.run_budgeted`, whose first aim is `aim` where given:
    `_first_aim`'s) whose `jit(grad)` step fits too, or None where none fits or the model
    misreads the program; and every plan it compiled (candidates of the full search then)."""
    t0 = time.perf_counter()
    if prog.has_scan:  # layers inside loops: their loop settings (search/predicted.py)
        planner = None
        found = predicted.run_loops(prog, target, score, close_enough=CLOSE_ENOUGH)
    else:  # a compile budget: plans aimed at the target while it lasts
        planner = prog.planner(solver, max_cuts, baseline_fit=True)
        found = predicted.run_budgeted(
            prog, planner, target, score, close_enough=CLOSE_ENOUGH, first=aim
        )
    best, pool = found.best, list(found.compiled)
    if not found.trusted:
        logger.info("best-first search hands over to the full search: %s", found.log[-1])
        return None, pool
    if best[1] is None:
        logger.info(
            "best-first search: no plan fits (%s); the full search follows", "; ".join(found.log)
        )
        return None, pool
    best = _holds_under_grad(prog, target, best, [(score(p, c), p, c) for p, c in pool])
    if best[1] is None:
        return None, pool
    _, chosen, c = best
    logger.info(
        "best-first search: %d plans compiled in %.1f s, %d programs on this program so far",
        len(pool),
        time.perf_counter() - t0,
        prog.compiles,
    )
    chosen = prog.record(chosen, c)
    chosen.notes.extend(found.log)
    model = None if planner is None else planner.model.predict(chosen)
    if model is not None:
        scale = prog.baseline.temp_bytes / max(planner.no_remat_peak(), 1.0)
        chosen.predicted_temp_bytes = int(model * scale)
        chosen.notes.append(
            f"cost model scaled to the baseline predicts {chosen.predicted_temp_bytes:,} temp bytes"
        )
    else:
        chosen.predicted_temp_bytes = 0
        chosen.notes.append(
            "no cost-model prediction: "
            + ("loop settings" if planner is None else "a mix of compiled recipes")
        )
    return _finish(chosen, meta, solver, prog.graph), pool


def _first_aim(
    prog: Program, target: float, solver: str, max_cuts: int, recipe: Plan
) -> tuple[float, Plan | None] | None:
    """`predicted.first_aim` of the aimed search's planner at `target` where `recipe` still
    compiles in the background (`Program.compiling_ahead`), else None (the search plans it
    itself); None also where that search aims nothing (`predicted.fit_trusted`), and where
    planning it fails: the error is the search's to raise in order, after the recipe that may
    be returned first (as where nothing compiles in the background)."""
    if not prog.compiling_ahead(recipe):
        return None
    try:
        planner = prog.planner(solver, max_cuts, baseline_fit=True)
        trusted = predicted.fit_trusted(planner.model)
        return predicted.first_aim(planner, target) if trusted else None
    except Exception as e:  # noqa: BLE001 - planned again, and raised, by the search in order
        logger.debug("the first aim, planned while the recipe compiles, failed: %r", e)
        return None


#: Plans of the aimed search (`predicted.run_budgeted`, the planner's model fitted to the
#: baseline alone) the full search compiles first as candidates of its own: where the
#: calibrated model's rounds stall above the target, they are what fits (vs_pytorch's GPT, 4
#: layers, d 64, batch 8 x 128, at 0.4, jax 0.12: the rounds all compiled 1.7-2.1% over the
#: target and a mix of recipes at +16.8% FLOPs was returned; the aimed plans fit at +2.3%).
AIMED_SHOTS = 2


def _aimed_candidates(
    prog: Program,
    target: float,
    score: Callable[[Plan, Compiled], float],
    solver: str,
    max_cuts: int,
) -> list[tuple[Plan, Compiled]]:
    """The full search's first candidates: `AIMED_SHOTS` plans of the aimed search (none
    where its model misreads the baseline), compiled, for `_choose` to offer."""
    planner = prog.planner(solver, max_cuts, baseline_fit=True)
    found = predicted.run_budgeted(
        prog, planner, target, score, close_enough=CLOSE_ENOUGH, max_plans=AIMED_SHOTS
    )
    return list(found.compiled)


def _no_recompute(prog: Program, target: float, plan: Plan, meta: dict, solver: str):
    """`plan` (compiled already) finished as the plan returned, when it fits `target` in both
    steps and XLA counts no more FLOPs for it than for the unrematerialized program (no plan
    recomputes less); None otherwise."""
    c, base = prog.compile(plan), prog.baseline
    if c.temp_bytes > target or c.flops > base.flops:
        return None
    _, chosen, c = _holds_under_grad(prog, target, (c.flops, plan, c), [])
    if chosen is None:
        return None
    logger.info("%s fits and recomputes nothing: no other plan compiled", plan.solver)
    chosen = prog.record(chosen, c)
    chosen.predicted_temp_bytes = 0
    chosen.notes.append(
        f"{plan.solver} compiles to {c.flops:,.0f} FLOPs, the unrematerialized program to "
        f"{base.flops:,.0f}: no plan recomputes less, so no other plan was compiled; no "
        "cost-model prediction"
    )
    return _finish(chosen, meta, solver, prog.graph)


def _likely_below(prog: Program, spec: Budget, planner: Callable[[], Any]) -> bool:
    """Whether `spec` asks for less than the unrematerialized program: a fraction below 1, or
    a byte budget below its footprint as the cost model estimates it (arguments, gradients
    and the modelled peak; unsharded programs only, whose arguments' bytes are a device's).
    Only decides what is compiled first: the compiled baseline decides the plan."""
    if spec.fraction is not None:
        return spec.fraction < 1
    if not prog.threads_ok:
        return False
    leaves = jax.tree_util.tree_leaves(prog.step_args)
    diff = jax.tree_util.tree_leaves([prog.step_args[i] for i in prog.nums])
    fixed = sum(_compat.aval_nbytes(x) for x in [*leaves, *diff])  # PRNG keys too
    return spec.footprint_bytes < fixed + planner().no_remat_peak()


#: How many of the cheapest fitting plans are compiled as `jit(grad)` steps before giving up.
GRAD_STEP_TRIES = 4


def _holds_under_grad(prog: Program, target: float, best: tuple, pool: list[tuple]) -> tuple:
    """The cheapest fitting plan whose `jit(grad)` step fits `target` too (the caller may run
    either step; XLA schedules them differently), with the larger of its two temp figures
    as its compiled temp; `best` first, then the other fitting plans of this call by score,
    `GRAD_STEP_TRIES` in all. (inf, None, None) when none of them holds under both."""
    seen: set[str] = set()
    ranked = [best, *sorted((t for t in pool if t[2].temp_bytes <= target), key=lambda t: t[0])]
    for score_, p, c in ranked:
        if plan_key(p) in seen:
            continue
        seen.add(plan_key(p))
        grad_temp = prog.grad_step_temp(p)
        if grad_temp <= target:
            return (
                score_,
                copy.deepcopy(p),
                dataclasses.replace(c, temp_bytes=max(c.temp_bytes, grad_temp)),
            )
        logger.info(
            "plan %r fits as value_and_grad (%s bytes) but not as grad (%s bytes)",
            p.solver,
            f"{c.temp_bytes:,}",
            f"{grad_temp:,}",
        )
        if len(seen) >= GRAD_STEP_TRIES:
            break
    return math.inf, None, None


#: Model budgets (multiples of the model's minimum peak) compiled when no reference plan fits.
FLOOR_LADDER = (1.03, 1.08, 1.15)


def _finish(p: Plan, meta: dict, solver: str, graph: Graph) -> Plan:
    drop_unkept_names(graph, p)  # reports list only what the compiled program keeps
    p.annotate(graph)
    if p.offloaded_bytes and p.measured_temp_bytes is None and not host_offload_effective():
        p.notes.append(
            f"host offload has no memory effect on backend {jax.default_backend()!r}: this "
            "plan's offloads free device memory only where pinned host memory exists"
        )
    p.budget, p.budget_temp_bytes = meta["budget"], meta["budget_temp_bytes"]
    p.notes.append(f"solver={solver!r}")
    return p


def _no_reverse_derivative(prog: Program, spec: Budget, error: Exception) -> Plan:
    """The plan of a program whose reverse derivative JAX cannot trace (a `while_loop` with
    dynamic bounds, a callback without a VJP), used only forward (`jax.linearize`, `jvp`):
    there is no backward pass to plan, so a budget that asks for nothing to change (a fraction
    >= 1) gets the identity plan (the function runs unchanged), and any other raises.

    Raises:
      the compile's own error, when the reverse derivative traces (another fault);
      InfeasibleBudgetError: a fraction below 1, which nothing can reach (as for a program of
        no equations: `Budget.nothing_to_rematerialize`), naming JAX's reason;
      ValueError: a byte budget, which cannot be checked (there is no backward step to
        compile), naming JAX's reason and budget=1.0.
    """
    try:
        jax.eval_shape(
            step_grad(prog.fn, prog.nums, prog.has_aux, batching=prog.batching), *prog.step_args
        )
    except Exception as reason:  # noqa: BLE001 - JAX's reason, quoted below
        why = str(reason).splitlines()[0]
        if spec.fraction is not None and spec.fraction >= 1:
            p = Plan.identity(prog.graph, budget=spec.raw, budget_temp_bytes=None)
            p.notes.append(
                f"no reverse derivative (jax.value_and_grad fails: {why}): nothing to plan, "
                "fn runs unchanged"
            )
            return p.annotate(prog.graph)
        infeasible = spec.nothing_to_rematerialize(
            "jremat plans the backward pass of jax.value_and_grad(fn), which JAX cannot build "
            f"for this fn ({why}); used only forward (jax.linearize, jax.jvp) it has no "
            "backward pass"
        )
        if infeasible is not None:
            raise infeasible from None
        raise ValueError(
            f"budget={spec.raw!r}: jremat plans the backward pass of jax.value_and_grad(fn), "
            f"which JAX cannot build for this fn ({why}), so a byte budget cannot be checked. "
            "Used only forward (jax.linearize, jax.jvp) there is nothing to rematerialize: "
            "pass budget=1.0 to run fn unchanged."
        ) from None
    raise error


def _raise_infeasible(spec: Budget, prog: Program, compiled: list[tuple[Plan, Compiled]]):
    """Raise `InfeasibleBudgetError` naming the smallest compiled temp among `compiled`, each
    plan's the larger of its `value_and_grad` and `grad` steps' (what a new call verifies)."""
    base = prog.baseline
    least = max(base.temp_bytes, prog.grad_step_temp(None))
    for p, c in sorted(compiled, key=lambda pc: pc[1].temp_bytes):
        if c.temp_bytes >= least:
            break  # sorted: no later plan can be lower
        least = min(least, max(c.temp_bytes, prog.grad_step_temp(p)))
    smallest = spec.in_caller_unit(least, base.temp_bytes, base.fixed_bytes)
    raise InfeasibleBudgetError(
        f"budget={spec.raw!r} is below what jremat's plans reach for this program: "
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
    cheapest = planner.model.cheapest_segments  # the model's DP, as the floor plans use
    reachable = next((b for b in budgets if cheapest(b) is not None), model_none)
    estimate = math.ceil(min(reachable / max(model_none, 1.0), 1.0) * base.temp_bytes)
    smallest = spec.in_caller_unit(estimate, base.temp_bytes, base.fixed_bytes)
    raise InfeasibleBudgetError(
        f"budget={spec.raw!r} is below the smallest the cost model reaches "
        f"({spec.describe(smallest)}; verify=False, so this is the model's estimate)",
        budget=spec.raw,
        smallest_reachable=smallest,
        smallest_reachable_bytes=estimate,
    )
