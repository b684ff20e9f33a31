"""The best-first searches (`search/predicted.py`): loop settings for scan programs (fewer
compiles than the full search, never a plan that recomputes more than a body policy that
fits), the aimed search under a compile budget, and the full search where the cost model
misreads the program. Small models: each test compiles a dozen small programs."""

from __future__ import annotations

import warnings

import jax
import models as M  # tests/ is on sys.path via conftest
import pytest

import jremat
from jremat._src.base.budget import parse_budget
from jremat._src.compile.program import Program
from jremat._src.search import predicted
from jremat._src.search import solve as solve_module
from jremat._src.search.solve import solve


@pytest.fixture(scope="module")
def decoder():
    # activations large enough that the cost model reads this program within `TRUST`
    return M.decoder(depth=4, d=64, seq=64, batch=8)


def _solve(model, fraction: float, best_first: bool, monkeypatch) -> tuple[jremat.Plan, Program]:
    monkeypatch.setattr(solve_module, "BEST_FIRST_LOOPS", best_first)
    prog = Program(model.loss, model.args, 0)
    return solve(prog, parse_budget(fraction), solver=M.SOLVER), prog


def test_a_target_at_or_below_zero_compiles_nothing_and_warns_nothing(decoder):
    """A byte budget at or below the step's fixed bytes leaves a temp target of 0 or below:
    the aimed search finds nothing and divides nothing by 0 (numpy's RuntimeWarning)."""
    prog = Program(decoder.loss, decoder.args, 0)
    prog.compile_budget = 6
    planner = prog.planner(M.SOLVER, 160, baseline_fit=True)
    for target in (0.0, -1.0):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            search = predicted.run_budgeted(
                prog, planner, target, lambda p, c: c.flops, close_enough=0.03
            )
        assert search.best[1] is None
        assert all(p.solver == planner.name for p, _ in search.compiled)


def test_a_planner_the_model_does_not_describe_hands_over_without_compiling_its_plan(decoder):
    """A planner whose plans the model does not describe (dtr's, its checkpointed segments
    under `everything_saveable`, a policy no save option is): nothing to aim by, so the full
    search plans them, and the aimed search compiles none of them."""
    prog = Program(decoder.loss, decoder.args, 0)
    prog.compile_budget = 6
    planner = prog.planner("dtr", 160, baseline_fit=True)
    own_plan = planner.plan

    def undescribed(model_budget):
        plan = own_plan(model_budget)
        for seg in plan.segments if plan is not None else []:
            if seg.checkpointed:
                seg.policy, seg.saved = "everything_saveable", []
        return plan

    planner.plan = undescribed
    target = 0.45 * prog.baseline.temp_bytes
    assert planner.model.predict(planner.plan(target)) is None  # else this tests nothing
    search = predicted.run_budgeted(prog, planner, target, lambda p, c: c.flops, close_enough=0.03)
    assert not search.trusted and not search.compiled
    assert "does not describe" in search.log[-1]


@pytest.fixture(scope="module")
def scanned():
    return M.scan_layers(depth=6, width=32, batch=128)


@pytest.mark.parametrize("fraction", [0.5])
def test_loop_settings_first_that_fits_then_mixes(scanned, fraction, monkeypatch):
    """A program whose layers live in a scan: body policies in the order of what they save,
    the first that fits, then mixes; fewer compiles than the full search, and no body policy
    that fits recomputes less than the plan."""
    from jremat._src.search import mixing

    plan, prog = _solve(scanned, fraction, True, monkeypatch)
    _, full = _solve(scanned, fraction, False, monkeypatch)
    assert prog.compiles < full.compiles
    target = fraction * plan.baseline_temp_bytes
    assert plan.measured_temp_bytes <= target and plan.scans
    units, build = mixing.loop_family(prog)
    fitting = [
        c.flops
        for c in (prog.compile(build([p] * units)) for p in mixing.UNIT_POLICIES[1:])
        if c.temp_bytes <= target
    ]
    assert fitting and plan.measured_flops <= min(fitting)


def _count_baseline_flops_for(recipe, flops: float, monkeypatch) -> None:
    """Make "XLA" count `flops` (the baseline's) for `recipe` when it compiles: a recipe that
    recomputes nothing, which the test models do not give on every JAX version."""
    import dataclasses

    real_step = Program._compile_step

    def step(self, plan, *args, **kwargs):  # `figures_only` passes through
        c, exe, seconds = real_step(self, plan, *args, **kwargs)
        if plan is not None and plan.solver == recipe.solver:
            c = dataclasses.replace(c, flops=flops)
        return c, exe, seconds

    monkeypatch.setattr(Program, "_compile_step", step)


def test_a_recipe_that_recomputes_nothing_ends_the_search(decoder, monkeypatch):
    """Where the recipe that saves the most fits (both steps) and XLA counts no more FLOPs for
    it than for the unrematerialized program, no plan can recompute less: it is returned and
    nothing else is compiled. One FLOP more and the search goes on: the rule is exact."""
    import dataclasses

    from jremat._src.search import mixing

    prog = Program(decoder.loss, decoder.args, 0)
    base = prog.baseline
    recipe = mixing.most_saving_plan(prog)
    _count_baseline_flops_for(recipe, base.flops, monkeypatch)
    target = 1.02 * max(prog.compile(recipe).temp_bytes, prog.grad_step_temp(recipe))
    assert target < base.temp_bytes  # else the identity plan, and this tests nothing
    meta = dict(budget=target / base.temp_bytes, budget_temp_bytes=int(target))

    real_compile = prog.compile
    one_more = lambda p: dataclasses.replace(real_compile(p), flops=base.flops + 1)  # noqa: E731
    monkeypatch.setattr(prog, "compile", one_more)
    assert solve_module._no_recompute(prog, target, recipe, meta, M.SOLVER) is None
    monkeypatch.setattr(prog, "compile", real_compile)

    plan = solve(prog, parse_budget(target / base.temp_bytes), solver=M.SOLVER)
    assert plan.solver == recipe.solver
    assert [p.solver for p, _ in prog.tried] == [recipe.solver]  # no reference plan compiled
    assert prog.compiles == 2 and plan.measured_temp_bytes <= target
    assert plan.measured_flops == base.flops


def test_a_byte_budget_of_a_sharded_program_ends_the_search_on_the_same_recipe(
    decoder, monkeypatch
):
    """The recipe that recomputes nothing is tried wherever the target is below the
    unrematerialized program, not only where the cost model guessed so before compiling:
    a byte budget of a program on a mesh (whose footprint is not guessed) ends the search
    after the same two compiles as a fraction does."""
    from jax.sharding import PartitionSpec as P

    from jremat._src.search import mixing

    mesh = jax.make_mesh((1,), ("data",))
    prog = Program(decoder.loss, decoder.args, 0, in_shardings=P(), mesh=mesh)
    assert not prog.threads_ok  # a program on a mesh: `_likely_below` does not guess bytes
    base, recipe = prog.baseline, mixing.most_saving_plan(prog)
    _count_baseline_flops_for(recipe, base.flops, monkeypatch)
    target = 1.02 * max(prog.compile(recipe).temp_bytes, prog.grad_step_temp(recipe))
    assert target < base.temp_bytes
    plan = solve(prog, parse_budget(int(target) + base.fixed_bytes), solver=M.SOLVER)
    assert plan.solver == recipe.solver and plan.measured_temp_bytes <= target
    assert prog.compiles == 2  # was 10: the reference plans, their rounds and mixes


def _reverse_scan_with_outputs():
    """A 7-layer reverse scan with per-iteration outputs: its split loops compile far above
    the interpolation of their pure policies, so every mix the loop search tries at a budget
    of 0.6 misses, and `nothing_saveable` on every iteration (0.34 of the temp) recomputes
    16.2% of the FLOPs more than `dots_with_no_batch_dims_saveable`, the policy before it."""
    import jax.numpy as jnp

    params, x = M.scan_layers(depth=7, width=64, batch=512).args

    def loss(p, xb):
        def layer(c, q):
            h = jnp.tanh(c @ q["w1"])
            c = c + h @ q["w2"]
            return c, jnp.sum(h, axis=-1)

        xb, ys = jax.lax.scan(layer, xb, p, reverse=True)
        return jnp.mean(xb**2) + jnp.mean(ys**2)

    return Program(loss, (params, x), 0)


@pytest.mark.parametrize("gap", [predicted.HAND_OVER_GAP, 0.5])
def test_loop_mixes_that_all_miss_hand_over_to_the_full_search_where_it_may_pay(gap, monkeypatch):
    """Every mix missed: at the default `HAND_OVER_GAP` (below the 16.2% gap) the full search
    plans, and its plan recomputes less than the pure policy that fits; with a threshold
    above the gap, the loop search returns that pure policy and compiles nothing more."""
    from jremat._src.search import mixing

    monkeypatch.setattr(predicted, "HAND_OVER_GAP", gap)
    prog = _reverse_scan_with_outputs()
    plan = solve(prog, parse_budget(0.6), solver=M.SOLVER)
    assert plan.measured_temp_bytes <= 0.6 * plan.baseline_temp_bytes
    units, build = mixing.loop_family(prog)
    pure = prog.compile(build(["nothing_saveable"] * units))
    assert pure.temp_bytes <= 0.6 * plan.baseline_temp_bytes  # the fallback that fits
    if gap < 0.162:
        assert plan.measured_flops < pure.flops
    else:
        assert plan.measured_flops == pure.flops
        assert any("the full search is not run" in n for n in plan.notes)


def test_a_model_fitted_to_the_baseline_reads_it_exactly_and_scales_only_kept_stores(decoder):
    """`SegmentModel.fit_unrematerialized`: the unrematerialized program's modelled peak is
    its compiled temp bytes; only the bytes kept segments store are scaled, and the planners
    of the other searches keep their own models."""
    import chex
    import numpy as np

    prog = Program(decoder.loss, decoder.args, 0)
    planner = prog.planner(M.SOLVER, 160, baseline_fit=True)
    model, base = planner.model, prog.baseline
    assert planner.no_remat_peak() == pytest.approx(base.temp_bytes, rel=1e-9)
    raw, keep = model.raw_table, model.raw_table.option_index("keep")
    others = [k for k in range(len(raw.options)) if k != keep]
    chex.assert_trees_all_close(model.table.stored[keep], raw.stored[keep] * model.weights["keep"])
    chex.assert_trees_all_equal(model.table.stored[others], raw.stored[others])
    chex.assert_trees_all_equal(model.table.transient, raw.transient)
    assert model.weights["offset_bytes"] == 0.0
    assert prog.planner(M.SOLVER, 160, uncalibrated=True).model.weights is None
    assert prog.planner(M.SOLVER, 160).model.weights is None  # the full search's, not fitted yet
    assert np.isfinite(model.weights["keep"]) and model.weights["keep"] > 0


@pytest.fixture
def aimed(monkeypatch) -> list[predicted.Search]:
    """Every run of the aimed search (`predicted.run_budgeted`) while the test runs."""
    runs, real = [], predicted.run_budgeted

    def recorded(*args, **kwargs):
        runs.append(real(*args, **kwargs))
        return runs[-1]

    monkeypatch.setattr(predicted, "run_budgeted", recorded)
    return runs


@pytest.mark.parametrize("compile_budget", [3, 5])
def test_the_aimed_search_spends_the_budget_and_meets_the_target(decoder, aimed, compile_budget):
    """Under a compile budget: the planner's plans aimed at the target, while the budget
    leaves a plan's two steps; the cheapest fitting one returned, both its steps within the
    target, and no more compiles than the budget. The plan notes say where each was aimed."""
    prog = Program(decoder.loss, decoder.args, 0)
    plan = solve(prog, parse_budget(0.5), solver=M.SOLVER, compile_budget=compile_budget)
    (search,) = aimed
    assert search.trusted and search.compiled
    assert plan.compiles == prog.compiles_spent <= compile_budget
    target = 0.5 * plan.baseline_temp_bytes
    assert plan.measured_temp_bytes <= target
    assert prog.grad_step_temp(plan) <= target
    fitting = [c.flops for _, c in search.compiled if c.temp_bytes <= target]
    assert plan.measured_flops == min(fitting)
    aims = [n.split(":")[0] for n in plan.notes if n.startswith("aim ") and "model budget" in n]
    assert aims == [f"aim {i + 1}" for i in range(len(search.compiled))]


def _aims(plan: jremat.Plan) -> list[float]:
    """The model budgets the aimed search's plans were aimed at, in order (its plan notes)."""
    return [
        float(n.split("model budget ")[1].split(" ")[0].replace(",", ""))
        for n in plan.notes
        if n.startswith("aim ") and "model budget" in n
    ]


def test_while_nothing_fits_each_aim_moves_far_below_the_last(decoder, aimed, monkeypatch):
    """Under a compile budget, a correction in proportion to a small miss gives a plan XLA
    packs as the one that missed: while no plan fits, each aim is `MISS_MOVE` at least below
    the one before. Here the first aim is over the target (`AIM_FIRST` 1.3) and the
    correction is made to move 0.5% only; the aims still step down by `MISS_MOVE` until one
    fits, which is returned, both steps within the target."""
    monkeypatch.setattr(predicted, "AIM_FIRST", 1.3)
    monkeypatch.setattr(predicted, "_aim", lambda model, compiled, t: compiled_aims[-1] * 0.995)
    compiled_aims: list[float] = []
    real_try = predicted.Search.try_plan

    def try_plan(self, plan, label, with_grad=False):
        compiled_aims.append(float(label.split("model budget ")[1].replace(",", "")))
        return real_try(self, plan, label, with_grad)

    monkeypatch.setattr(predicted.Search, "try_plan", try_plan)
    prog = Program(decoder.loss, decoder.args, 0)
    plan = solve(prog, parse_budget(0.5), solver=M.SOLVER, compile_budget=10)
    (search,) = aimed
    target = 0.5 * plan.baseline_temp_bytes
    assert search.compiled[0][1].temp_bytes > target  # the first aim missed
    first_fit = next(i for i, (_, c) in enumerate(search.compiled) if c.temp_bytes <= target)
    for a, b in zip(compiled_aims[:first_fit], compiled_aims[1 : first_fit + 1], strict=True):
        assert b <= a * (1 - predicted.MISS_MOVE) + 1, compiled_aims  # the label rounds
    assert plan.measured_temp_bytes <= target and prog.grad_step_temp(plan) <= target


@pytest.mark.parametrize("min_gain", [0.0, 1.0])
def test_once_a_plan_fits_the_aimed_search_stops_where_the_model_prices_little_gain(
    decoder, aimed, monkeypatch, min_gain
):
    """Under a compile budget a plan that fits ends the aimed search where the model prices
    the next plan's recompute less than `MIN_GAIN` of the baseline's FLOPs below its own: at
    1.0 (every gain too small) the first plan that fits is the last compiled, where the
    search goes on (0.0) after it. Either way the plan returned fits on both steps."""
    monkeypatch.setattr(predicted, "MIN_GAIN", min_gain)
    monkeypatch.setattr(predicted, "AIM_FIRST", 0.6)  # fits far under the target: room to gain
    prog = Program(decoder.loss, decoder.args, 0)
    plan = solve(prog, parse_budget(0.5), solver=M.SOLVER, compile_budget=10)
    (search,) = aimed
    target = 0.5 * plan.baseline_temp_bytes
    fits = [c.temp_bytes <= target for _, c in search.compiled]
    assert fits[0]
    if min_gain:
        assert len(search.compiled) == 1
        assert "not compiled" in search.log[-1]
    else:
        assert len(search.compiled) > 1
    assert plan.measured_temp_bytes <= target and prog.grad_step_temp(plan) <= target


def test_the_default_budgets_search_plans_alike_on_one_two_and_four_compile_threads(
    decoder, aimed, monkeypatch
):
    """On 2 compile threads the default's search compiles the layer recipe on in the
    background while it plans its first aim, and an aimed plan's `jit(grad)` check starts in
    the background once the plan is the best so far; from 4, the check compiles alongside
    each aimed plan. None of it changes what the search decides: the plans compiled, the
    plan returned and the search's own compiles are those of one thread. A check compiled
    ahead is charged when read; one never read (here the default's budget is lifted and
    the full search returns another plan) is counted apart and in `Plan.compiles`."""
    from jremat._src.compile import program

    got = {}
    for threads in (1, 2, 4):
        monkeypatch.setattr(program, "COMPILE_THREADS", threads)
        prog = Program(decoder.loss, decoder.args, 0)
        plan = solve(prog, parse_budget(0.5), solver=M.SOLVER, compile_budget="auto")
        got[threads] = (plan, prog, aimed[-1])
    one, one_prog, one_search = got[1]
    assert one_prog.compiles_ahead_unread == 0
    for threads in (2, 4):
        plan, prog, search = got[threads]
        assert (plan.segments, plan.measured_temp_bytes, plan.measured_flops) == (
            one.segments,
            one.measured_temp_bytes,
            one.measured_flops,
        )
        assert [c for _, c in search.compiled] == [c for _, c in one_search.compiled]
        assert [p.segments for p, _ in prog.tried] == [p.segments for p, _ in one_prog.tried]
        assert 1 <= prog.compiles_ahead_unread <= len(prog.tried)
        assert plan.compiles == one.compiles + prog.compiles_ahead_unread
        target = 0.5 * plan.baseline_temp_bytes
        assert plan.measured_temp_bytes <= target and prog.grad_step_temp(plan) <= target


def test_a_first_aim_that_fails_while_the_recipe_compiles_on_returns_what_one_thread_does(
    decoder, monkeypatch
):
    """On 2 compile threads the default plans its first aim while the recipe compiles on in
    the background; where that planning raises, the search returns what it returns on one
    thread, which never plans it there: the recipe, where it fits and recomputes nothing
    (the error is the aimed search's to raise, in order, after the recipe)."""
    from jremat._src.compile import program
    from jremat._src.search import mixing

    probe = Program(decoder.loss, decoder.args, 0)
    base = probe.baseline
    recipe = mixing.most_saving_plan(probe)
    _count_baseline_flops_for(recipe, base.flops, monkeypatch)
    target = 1.02 * max(probe.compile(recipe).temp_bytes, probe.grad_step_temp(recipe))

    def fails(planner, target):
        raise RuntimeError("the planner failed")

    monkeypatch.setattr(program, "COMPILE_THREADS", 2)
    # the recipe still compiling when the first aim is planned (else it is never planned)
    monkeypatch.setattr(Program, "compiling_ahead", lambda self, plan: True)
    monkeypatch.setattr(predicted, "first_aim", fails)
    prog = Program(decoder.loss, decoder.args, 0)
    budget = parse_budget(target / base.temp_bytes)
    plan = solve(prog, budget, solver=M.SOLVER, compile_budget="auto")
    assert plan.solver == recipe.solver and plan.measured_flops == base.flops


def test_an_aimed_search_the_default_budget_cuts_short_goes_on_without_it(
    decoder, aimed, monkeypatch
):
    """Where the compile budget leaves no room for a plan the aimed search would compile
    next (every gain worth a compile here, `MIN_GAIN` 0, its first plan far under the
    target), an int budget returns the best plan so far within it; the default's budget
    (here 4 compiles) is lifted instead and the search goes on. Both fit on both steps."""
    monkeypatch.setattr(predicted, "MIN_GAIN", 0.0)
    monkeypatch.setattr(predicted, "AIM_FIRST", 0.6)
    monkeypatch.setattr(solve_module, "AUTO_COMPILE_STEPS", 1)
    plans = {}
    for compile_budget in (4, "auto"):
        prog = Program(decoder.loss, decoder.args, 0)
        plans[compile_budget] = (solve(prog, parse_budget(0.5), solver=M.SOLVER,
                                       compile_budget=compile_budget), prog)  # fmt: skip
        assert "no compiles left for it" in aimed[-1].log[-1] or compile_budget == "auto"
    assert plans[4][0].compiles <= 4 < plans["auto"][0].compiles
    for plan, prog in plans.values():
        target = 0.5 * plan.baseline_temp_bytes
        assert plan.measured_temp_bytes <= target and prog.grad_step_temp(plan) <= target


def test_the_aimed_search_hands_over_where_its_model_misreads_the_program(
    decoder, aimed, monkeypatch
):
    """A baseline fit outside `FIT_SCALE_LIMIT` ends the aimed search before any compile; the
    full search then plans until the compile budget runs out, and the cheapest plan that
    holds on both steps is returned."""
    monkeypatch.setattr(predicted, "FIT_SCALE_LIMIT", 1.0)
    prog = Program(decoder.loss, decoder.args, 0)
    plan = solve(prog, parse_budget(0.5), solver=M.SOLVER, compile_budget=6)
    assert not aimed[0].trusted and not aimed[0].compiled
    assert "not aimed" in aimed[0].log[-1]
    assert plan.compiles <= 6
    assert (
        max(plan.measured_temp_bytes, prog.grad_step_temp(plan)) <= 0.5 * plan.baseline_temp_bytes
    )


def test_a_recipe_that_recomputes_nothing_ends_the_search_after_the_aimed_search_hands_over(
    decoder, aimed, monkeypatch
):
    """Under a compile budget that leaves the aimed search fewer than `RECIPE_FIRST_AIMS`
    plans besides it (4), the recipe that saves the most is compiled only once the aimed
    search hands over; where it recomputes nothing it is returned then, before the full
    search compiles anything. (From 6 compiles up it compiles with the baseline: the test
    below.)"""
    from jremat._src.search import mixing

    monkeypatch.setattr(predicted, "FIT_SCALE_LIMIT", 1.0)  # hand over without compiling
    prog = Program(decoder.loss, decoder.args, 0)
    base = prog.baseline
    recipe = mixing.most_saving_plan(prog)
    _count_baseline_flops_for(recipe, base.flops, monkeypatch)
    target = 1.02 * max(prog.compile(recipe).temp_bytes, prog.grad_step_temp(recipe))
    plan = solve(prog, parse_budget(target / base.temp_bytes), solver=M.SOLVER, compile_budget=4)
    assert not aimed[0].trusted
    assert plan.solver == recipe.solver and prog.compiles == 2
    assert plan.measured_flops == base.flops


def test_from_six_compiles_the_recipe_compiles_with_the_baseline_and_ends_the_search(
    decoder, aimed, monkeypatch
):
    """Where a compile budget leaves the aimed search three plans besides it, the recipe that
    saves the most compiles with the baseline, as without a budget; where it fits and
    recomputes nothing, the search ends there at 3 compiles, no aimed plan compiled (plan_cost's
    residual MLP at 0.3-0.7, aimed first: all 6 compiles spent for the recipe's FLOPs)."""
    from jremat._src.search import mixing

    probe = Program(decoder.loss, decoder.args, 0)
    base = probe.baseline
    recipe = mixing.most_saving_plan(probe)
    _count_baseline_flops_for(recipe, base.flops, monkeypatch)
    target = 1.02 * max(probe.compile(recipe).temp_bytes, probe.grad_step_temp(recipe))
    prog = Program(decoder.loss, decoder.args, 0)
    plan = solve(prog, parse_budget(target / base.temp_bytes), solver=M.SOLVER, compile_budget=6)
    assert plan.solver == recipe.solver and plan.compiles == 3
    assert not aimed  # the aimed search never ran
    assert plan.measured_flops == base.flops


def test_a_compile_budget_too_tight_to_walk_the_loop_policies_compiles_the_floor_first(
    scanned, monkeypatch
):
    """4 compiles leave the loop search two plans: walking the body policies in order spent
    them on two that compile over 0.45 (`dots_and_transcendentals_saveable` at 0.56,
    `dots_saveable` at 0.56 of the unrematerialized temp) and refused the budget. The floor
    (`nothing_saveable`, 0.32) compiles first instead, then the mix the line through the
    baseline and the floor predicts fits: a plan within the target on both steps, no more
    FLOPs than the floor's, within the compile budget."""
    from jremat._src.search import mixing

    monkeypatch.setattr(solve_module, "BEST_FIRST_LOOPS", True)
    prog = Program(scanned.loss, scanned.args, 0)
    plan = solve(prog, parse_budget(0.45), solver=M.SOLVER, compile_budget=4)
    assert plan.compiles == prog.compiles_spent <= 4
    target = 0.45 * plan.baseline_temp_bytes
    assert plan.measured_temp_bytes <= target and prog.grad_step_temp(plan) <= target
    units, build = mixing.loop_family(prog)
    floor = build([mixing.UNIT_POLICIES[-1]] * units)
    first = prog.tried[0][0]
    assert prog.program_key(first) == prog.program_key(floor)
    assert plan.measured_flops <= prog.compile(floor).flops
    assert any("predicted temps" in n for n in plan.notes) or plan.solver == floor.solver
