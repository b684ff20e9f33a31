"""The planners' acceptance check on models the tests do not know.

    python benchmarks/heldout.py            # writes benchmarks/results/heldout.md
    python benchmarks/heldout.py --per-value   # only the per-value MILP section (no compiles):
                                               # benchmarks/results/heldout_values.md

For an MLP chain, a GPT-2 decoder unrolled (Hugging Face Flax) and scanned (`lax.scan` over
layers) and a U-Net, at budgets 0.25 / 0.4 / 0.55 / 0.7 / 0.85 of the unrematerialized temp:

* `auto`'s compiled temp must meet the budget (or the budget must raise
  `InfeasibleBudgetError` stating the smallest reachable one, which must then hold);
* `auto` never recomputes more than the best built-in recipe that fits (JAX's policies per
  layer, sqrt(n) segments, and for scans the body policies and sqrt(L) nesting);
* where that built-in recomputes more than 1%, the ratio of extra FLOPs (auto / built-in) is
  reported with its geometric mean;
* the chain DP's objective against the exact MILP's on each model's segment model at the same
  budgets: within 5% of it wherever HiGHS proves its optimum (gap 0); the gap where not;
* the chain DP's and greedy's recompute against the per-value MILP's (`milp_values`: each
  checkpointed segment saves any set of values, priced by the same accounting), the issue's
  goal being 5% where HiGHS proves it; misses are listed, not counted as failures (open);
* planning seconds (trace, segment table, one DP solve; no compiles) of a 12-layer decoder.

Figures are XLA's deterministic compiled temp bytes and FLOPs (scan bodies times their trip
count), so the table is the same on every run of the same jax version.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import jax

import jremat
import jremat.models
from jremat._src.base.budget import parse_budget
from jremat._src.compile.program import Program
from jremat._src.plan.plan import KEEP
from jremat._src.plan.planners import PLANNERS
from jremat._src.plan.planners.milp_values import PerValueMILP
from jremat._src.plan.planners.segments import (
    CUT_OPTIONS,
    DEFAULT_OPTIONS,
    MARGINAL_OPTIONS,
    option_pieces,
)
from jremat._src.plan.recipes import ANCHOR_RECIPES, recipe_plan, scan_configs
from jremat._src.search.solve import solve

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from run import scanned_decoder  # noqa: E402

BUDGETS = (0.25, 0.4, 0.55, 0.7, 0.85)
MODELS = ("mlp", "gpt2", "gpt2_scan", "unet")


def _unpredicted(plan) -> str:
    """Why `plan` carries no cost-model prediction (`predicted_temp_bytes` 0)."""
    if plan.scans:
        return "loop settings"
    if plan.solver.endswith("+split"):
        return "sub-layer segments"
    return "chosen on its compiled figures"


def workload(name: str):
    if name == "gpt2_scan":
        return scanned_decoder()
    w = jremat.models.get(name)
    return w.loss, w.params, w.batch


def builtins(prog: Program) -> list[tuple[str, object]]:
    """(label, compiled) of every built-in recipe: per layer, sqrt(n), scan body policies."""
    out = []
    for policy, seg in ANCHOR_RECIPES:
        out.append((f"{policy}/{seg}", prog.compile(recipe_plan(prog.graph, policy, seg))))
    for cfg in scan_configs(prog.graph):
        p = jremat.Plan.identity(prog.graph)
        p.scans = cfg
        c0 = next(iter(cfg.values()))
        out.append((f"scan body {c0.policy} nest {c0.nest}", prog.compile(p)))
    return out


def model_rows(name: str, budgets) -> tuple[list[str], list[float], list[str]]:
    loss, params, batch = workload(name)
    prog = Program(loss, (params, batch), 0)
    base = prog.baseline
    refs = builtins(prog)
    lines, ratios, failures = [], [], []
    print(f"[{name}] {prog.graph.num_nodes} equations, temp {base.temp_bytes / 2**20:.2f} MiB")
    for b in budgets:
        target = b * base.temp_bytes
        fits = [(c.flops, label, c) for label, c in refs if c.temp_bytes <= target]
        ref = min(fits, key=lambda t: t[0]) if fits else None
        ref_pct = 100 * (ref[0] / base.flops - 1) if ref else None
        t0 = time.perf_counter()
        try:
            plan = solve(prog, parse_budget(b), solver="auto")
        except jremat.InfeasibleBudgetError as e:
            again = solve(prog, parse_budget(e.smallest_reachable), solver="auto", max_rounds=1)
            holds = again.measured_temp_bytes <= e.smallest_reachable * base.temp_bytes + 1
            if not holds:
                failures.append(f"{name} {b}: the stated smallest budget does not hold")
            lines.append(
                f"| {name} | {b} | infeasible: smallest reachable {e.smallest_reachable} "
                f"({'holds' if holds else 'DOES NOT HOLD'}) | - | "
                + (f"{ref[1]} {ref_pct:.2f}%" if ref else "none fits")
                + " | - |"
            )
            continue
        seconds = time.perf_counter() - t0
        frac = plan.measured_temp_bytes / base.temp_bytes
        pct = 100 * (plan.measured_flops / base.flops - 1)
        if plan.measured_temp_bytes > target:
            failures.append(f"{name} {b}: compiled temp {frac:.3f} over the budget")
        if ref and plan.measured_flops > ref[0]:
            failures.append(f"{name} {b}: recomputes more than {ref[1]}")
        ratio = ""
        if ref and ref_pct > 1.0:
            r = max(pct, 0.0) / ref_pct
            ratios.append(r)
            ratio = f"{r:.2f}"
        pred = plan.predicted_temp_bytes / plan.measured_temp_bytes
        pred_text = f"{pred:.2f}" if plan.predicted_temp_bytes else f"n/a ({_unpredicted(plan)})"
        lines.append(
            f"| {name} | {b} | {frac:.3f} / {pct:.2f}% ({plan.solver}, {seconds:.0f} s, "
            f"predicted/compiled temp {pred_text}) | {ratio or '-'} | "
            + (f"{ref[1]} {ref_pct:.2f}%" if ref else "none fits")
            + " |"
        )
        print(lines[-1], flush=True)
    lines.append(calibration_row(name, prog))
    return lines, ratios, failures


def calibration_row(name: str, prog: Program) -> str:
    """Leave-one-out error of the fitted cost model (`SegmentModel.calibrate`) on every
    compiled plan it describes: each plan's temp is predicted by the model fitted to all the
    other compiled plans, then compared with XLA's. FLOPs: the model's recompute FLOPs added
    to the unrematerialized program's compiled FLOPs, against the plan's compiled FLOPs."""
    import copy

    import numpy as np

    model = copy.copy(prog.planner("chain", 160).model)  # calibrated here only
    base = prog.baseline
    compiled = [(jremat.Plan.identity(prog.graph), base)] + list(prog.tried)
    compiled = [(p, c) for p, c in compiled if model.segments_of(p) is not None]
    samples = [(p, c.temp_bytes) for p, c in compiled]
    errs, flop_errs = [], []
    t = model.raw_table
    for i, (plan, real) in enumerate(samples):
        if model.calibrate(samples[:i] + samples[i + 1 :]):
            errs.append(abs(model.predict(plan) / real - 1))
        recompute = sum(t.flops[k, a, b] for a, b, k in model.segments_of(plan))
        flop_errs.append(abs((base.flops + recompute) / compiled[i][1].flops - 1))
    if not errs:
        return f"| {name} | calibration | too few compiled plans | - | - |"
    within = sum(e <= 0.15 for e in errs) / len(errs)
    return (
        f"| {name} | calibration | leave-one-out temp error over {len(errs)} compiled plans: "
        f"median {100 * float(np.median(errs)):.1f}%, {100 * within:.0f}% within 15%; "
        f"FLOPs error median {100 * float(np.median(flop_errs)):.2f}%, "
        f"max {100 * float(np.max(flop_errs)):.2f}% | - | - |"
    )


#: The chain DP's recompute may exceed the MILP's proven optimum by this much (relative).
CHAIN_TOLERANCE = 0.05
#: Wall-time cap per MILP solve (the benchmark's only one; the gap it leaves is reported).
MILP_SECONDS = 60.0
#: HiGHS's relative gap at or below which the MILP's objective is called the optimum.
PROVEN_GAP = 1e-6


def exact_milp(graph, max_cuts: int = 32):
    """The MILP run for a proven optimum: no node limit where the planner takes one, and a cap
    of `MILP_SECONDS` per solve so that the benchmark ends. Where the cap stops HiGHS first,
    the row reports the gap it reached and calls nothing optimal."""
    return PLANNERS["milp"](graph, max_cuts=max_cuts, max_nodes=None, time_limit=MILP_SECONDS)


def milp_rows(name: str, budgets) -> tuple[list[str], list[str]]:
    """Chain DP and auto's planner against the MILP on the model's segment model (no
    compiles): where HiGHS proves its optimum (gap <= `PROVEN_GAP`), the chain DP must be
    within `CHAIN_TOLERANCE` of it (a failure otherwise); elsewhere the row gives the gap and
    how far the DP is at most from the optimum (over HiGHS's lower bound). The MILP starts from
    the DP's plan, so a row where HiGHS found nothing better reads +0.00% whatever the gap:
    only rows with gap 0 show the DP optimal."""
    loss, params, batch = workload(name)
    graph = jremat.trace(loss, params, batch)
    from jremat._src.compile.program import AUTO_MILP_MAX_NODES

    milp = exact_milp(graph)
    chain = PLANNERS["chain"](graph, max_cuts=32)
    small = graph.num_nodes <= AUTO_MILP_MAX_NODES  # auto's own planner is then the MILP
    out, failures = [], []
    for b in budgets:
        budget = b * milp.no_remat_peak()
        best, dp = milp.plan(budget), chain.plan(budget)
        if best is None or dp is None:
            out.append(f"| {name} | {b} | infeasible in the model | - | - | - |")
            continue
        ref = max(best.recompute_flops, 1.0)
        over = dp.recompute_flops / ref - 1
        gap = float(milp.last_gap)
        if gap <= PROVEN_GAP:
            status = "optimal (gap 0)"
            dp_text = f"{100 * over:+.2f}%"
            if over > CHAIN_TOLERANCE:
                failures.append(
                    f"{name} {b}: chain DP {100 * over:.2f}% over the MILP's proven optimum"
                )
        else:
            bound = max(ref * (1 - gap), 1.0)  # HiGHS's lower bound on the optimum
            status = f"not proven: gap {gap:.2g}"
            dp_text = f"{100 * over:+.2f}% (at most {100 * (dp.recompute_flops / bound - 1):+.1f}%)"
        out.append(
            f"| {name} | {b} | {best.recompute_flops:.4g} | {status} | {dp_text} "
            f"| {'milp' if small else 'chain'} |"
        )
    return out, failures


#: The per-value MILP's size: segments of at most this many cut intervals (of the 32 cut
#: candidates the segment MILP takes), and HiGHS's node limit per solve (no time limit).
PER_VALUE_SPAN = 4
PER_VALUE_NODES = 300


def per_value_rows(name: str, budgets) -> tuple[list[str], list[str]]:
    """Chain DP and greedy against the per-value MILP on the model's cuts (no compiles).

    The MILP (`PerValueMILP`, segments of at most `PER_VALUE_SPAN` cut intervals plus the
    chain DP's own, at most `PER_VALUE_NODES` nodes, warm-started from the best of the chain
    DPs' plans, so never above them where they fit) prices
    with `recompute_internal=True` (a custom_jvp or scan in a checkpointed segment is
    recomputed whatever is saved, as JAX does); the chain DP's and greedy's plans are priced by
    the same `SaveSetPricer` (their table's own figure is shown where it differs). Returns the
    rows and the misses of the issue's goal (chain over 5% above a proven optimum)."""
    loss, params, batch = workload(name)
    graph = jremat.trace(loss, params, batch)
    chain = PLANNERS["chain"](graph, max_cuts=32)
    # the opt-in rungs (`segments.MARGINAL_OPTIONS`, `segments.CUT_OPTIONS`): the same cuts,
    # more save sets
    laddered = PLANNERS["chain"](graph, max_cuts=32, options=(*DEFAULT_OPTIONS, *MARGINAL_OPTIONS))
    cut = PLANNERS["chain"](graph, max_cuts=32, options=(*DEFAULT_OPTIONS, *CUT_OPTIONS))
    greedy = PLANNERS["greedy"](graph, max_cuts=32)
    polishing = PLANNERS["chain"](graph, max_cuts=32, polish=True)
    pv = PerValueMILP(
        graph,
        max_cuts=32,
        max_span=PER_VALUE_SPAN,
        max_nodes=PER_VALUE_NODES,
        recompute_internal=True,
    )
    cuts = chain.model.cuts
    assert laddered.model.cuts == cuts == cut.model.cuts
    out, misses = [], []
    for b in budgets:
        budget = b * chain.no_remat_peak()
        found = chain.model.cheapest_segments(budget)
        start, start_flops = None, math.inf
        if found is not None:
            chain_peak, chain_flops = pv.pricer.path_cost(option_pieces(graph, cuts, found[1]))
            start, start_flops = found[1], chain_flops
        polished_flops = None
        polished = polishing.plan(budget)  # the DP's plans polished value by value
        if polished is not None:
            polished_peak, polished_flops = pv.pricer.path_cost(
                [(s.start, s.end, None if s.policy == KEEP else tuple(s.saved))
                 for s in polished.segments]
            )  # fmt: skip
            assert polished_peak <= budget, (name, b, polished_peak / budget)
        rung_flops = {}
        for label, planner in (("marginal", laddered), ("cut", cut)):
            got = planner.model.cheapest_segments(budget)
            if got is None:
                continue
            peak, rung_flops[label] = pv.pricer.path_cost(option_pieces(graph, cuts, got[1]))
            if peak <= budget and rung_flops[label] < start_flops:
                start, start_flops = got[1], rung_flops[label]  # warm-start from the best
        t0 = time.perf_counter()
        sol = pv.solve(budget, start=start)
        seconds = time.perf_counter() - t0
        if sol is None or found is None:
            out.append(f"| {name} | {b} | infeasible in the model | - | - | - | - | - | - |")
            continue
        ref = max(sol.objective, 1.0)
        picked = greedy.choose(budget)
        greedy_flops = (
            None if picked is None else pv.pricer.path_cost(option_pieces(graph, cuts, picked))[1]
        )
        bound = max(ref * (1 - min(sol.gap, 1.0)), 1.0)  # HiGHS's lower bound on the optimum

        def over(flops, sol=sol, ref=ref, bound=bound) -> str:
            text = f"{100 * (flops / ref - 1):+.2f}%"
            return text if sol.proven else f"{text} (at most {100 * (flops / bound - 1):+.1f}%)"

        own = "" if chain_flops == found[0] else f"; its table: {found[0]:.4g}"
        if chain_peak > budget:  # a custom_jvp's recompute needs saved inputs kept
            own += f"; peak {chain_peak / budget:.3f} x the budget"
        status = "optimal (gap 0)" if sol.proven else f"not proven: gap {sol.gap:.2g}"
        if sol.proven and chain_flops > (1 + CHAIN_TOLERANCE) * ref:
            misses.append(f"{name} {b}: chain DP {100 * (chain_flops / ref - 1):.1f}% over")

        def rung(label: str, rung_flops=rung_flops) -> str:
            return "none fits" if label not in rung_flops else over(rung_flops[label])

        if sol.proven and rung_flops.get("cut", math.inf) > (1 + CHAIN_TOLERANCE) * ref:
            misses.append(f"{name} {b}: chain DP with the cut rungs {rung('cut')}")

        out.append(
            f"| {name} | {b} | {sol.objective:.4g} | {status}, {pv.last_nodes} nodes, "
            f"{pv.num_binaries} binaries, {seconds:.0f} s | {over(chain_flops)}{own} | "
            f"{rung('marginal')} | {rung('cut')} | "
            + ("-" if polished_flops is None else over(polished_flops))
            + " | "
            + ("none fits" if greedy_flops is None else over(greedy_flops))
            + " |"
        )
        print(out[-1], flush=True)
    return out, misses


def per_value_section(names, budgets) -> tuple[list[str], list[str]]:
    """The markdown section of `per_value_rows` over `names`, and the misses."""
    rows, misses = [], []
    for name in names:
        r, m = per_value_rows(name, budgets)
        rows += r
        misses += m
    md = [
        "## Chain DP and greedy against the per-value MILP (save sets value by value)",
        "",
        "`milp_values.PerValueMILP`: Checkmate's program value by value on the segment "
        f"model's cuts (segments of at most {PER_VALUE_SPAN} cut intervals, and the chain DP's "
        f"own segments), at most {PER_VALUE_NODES} HiGHS nodes per solve, no time limit, "
        "warm-started from the best chain DP plan; 'optimal' is within that space; custom_jvp "
        "and scan nodes in a checkpointed segment are recomputed (`recompute_internal=True`). "
        "The chain DP's (default options; with the opt-in marginal rungs "
        "`segments.MARGINAL_OPTIONS`; with the opt-in min-cut rungs `segments.CUT_OPTIONS`; "
        "and the default DP's plan polished value by value on its "
        "own cuts, `value_polish`) and greedy's plans are priced "
        "by the same accounting. The issue's goal: the chain DP within "
        f"{100 * CHAIN_TOLERANCE:.0f}% of the MILP where HiGHS proves its optimum.",
        "",
        "| model | budget | per-value MILP recompute FLOPs | HiGHS | chain DP over it "
        "| chain DP with the marginal rungs over it | chain DP with the cut rungs over it "
        "| chain DP polished value by value (`ChainPlanner(polish=True)`) over it "
        "| greedy over it |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        "Goal missed (the default options, and the cut rungs): "
        + ("; ".join(misses) if misses else "nowhere")
        + ".",
    ]
    return md, misses


def planning_seconds(n_layer: int = 12) -> tuple[int, float, float, float]:
    from jremat.models import gpt2

    w = gpt2.workload(n_layer=n_layer)
    t0 = time.perf_counter()
    graph = jremat.trace(w.loss, w.params, w.batch)
    t1 = time.perf_counter()
    planner = PLANNERS["chain"](graph)
    t2 = time.perf_counter()
    planner.plan(0.5 * planner.no_remat_peak())
    t3 = time.perf_counter()
    return graph.num_nodes, t1 - t0, t2 - t1, t3 - t2


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--out", default=None, help="default: results/heldout.md (or _values.md)")
    ap.add_argument(
        "--per-value",
        action="store_true",
        help="only the section against the per-value MILP (no compiles)",
    )
    args = ap.parse_args(argv)
    names = args.models.split(",")
    t_start = time.perf_counter()
    if args.per_value:
        out = args.out or os.path.join(HERE, "results", "heldout_values.md")
        section, misses = per_value_section(names, BUDGETS)
        md = [
            f"# Per-value reference ({jax.__version__}, {jax.devices()[0].platform}, "
            f"{time.perf_counter() - t_start:.0f} s)",
            "",
            *section,
        ]
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out, "w") as f:
            f.write("\n".join(md) + "\n")
        print("\n".join(md))
        return 1 if misses else 0
    args.out = args.out or os.path.join(HERE, "results", "heldout.md")
    table = [
        "| model | budget | auto: compiled temp / extra FLOPs | ratio to built-in | "
        "best built-in that fits |",
        "|---|---|---|---|---|",
    ]
    ratios, failures = [], []
    for name in names:
        lines, rs, fs = model_rows(name, BUDGETS)
        table += lines
        ratios += rs
        failures += fs
    geo = math.exp(sum(math.log(max(r, 1e-9)) for r in ratios) / len(ratios)) if ratios else None
    milp = [
        "| model | budget | MILP recompute FLOPs | HiGHS | chain DP over the MILP "
        "| auto's planner |",
        "|---|---|---|---|---|---|",
    ]
    for name in names:
        rows, fs = milp_rows(name, BUDGETS)
        milp += rows
        failures += fs
    per_value, _ = per_value_section(names, BUDGETS)  # misses: open, not failures
    n, tt, tb, ts = planning_seconds()
    md = [
        f"# Held-out acceptance ({jax.__version__}, {jax.devices()[0].platform}, "
        f"{time.perf_counter() - t_start:.0f} s)",
        "",
        "Compiled temp as a fraction of the unrematerialized program / extra FLOPs over it.",
        "Ratio: auto's extra FLOPs over the best fitting built-in's, where that exceeds 1%.",
        "",
        *table,
        "",
        f"Geometric mean of the ratios: **{geo:.2f}** over {len(ratios)} cells."
        if geo
        else "No cell where a built-in recomputes more than 1%.",
        "",
        "## Chain DP against the exact MILP (the cost model's optimum, HiGHS)",
        "",
        f"HiGHS runs without a node limit, at most {MILP_SECONDS:.0f} s per solve, from the "
        "chain DP's plan. Where it proves its optimum (gap 0) the DP must be within "
        f"{100 * CHAIN_TOLERANCE:.0f}% of it; elsewhere the gap it reached is shown and "
        "nothing is called optimal.",
        "",
        *milp,
        "",
        "Failures: " + ("; ".join(failures) if failures else "none") + ".",
        "",
        *per_value,
        "",
        f"## Planning a 12-layer GPT-2 ({n} equations, no compiles)",
        "",
        f"trace {tt:.2f} s, segment table {tb:.2f} s, one DP solve {ts:.2f} s: "
        f"total {tt + tb + ts:.2f} s.",
    ]
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
