"""How well the segment model reads the chain DP's plans before they are compiled.

    python benchmarks/model_read.py                          # heldout's GPT-2, raw model
    python benchmarks/model_read.py --fit baseline           # fitted to the baseline alone
    python benchmarks/model_read.py --fit full --cache F     # fitted as the full search fits it

The figure issue 29 turns on: a search that compiles its answer, its `jit(grad)` step and at
most one correction needs the model to read an unseen plan's compiled temp within a few
percent before compiling it (docs/design.md#best-first-search). Per model budget (a fraction
of the model's own unrematerialized peak, after the fit) the chain DP's plan is compiled for
its figures and compared with what the model predicted for it:

* `temp ratio`: compiled temp bytes over the plan's modelled peak (`predicted_temp_bytes`);
* `FLOPs ratio`: compiled FLOPs above the unrematerialized program over the modelled
  recompute FLOPs (`recompute_flops`).

The summary gives each ratio's mean and spread (standard deviation over the mean), and the
largest ratio change between plans whose model budgets are neighbours: what one correction
round must absorb. `--fit` chooses the model: `raw` (as traced), `baseline`
(`SegmentModel.fit_unrematerialized`, one compile) or `full` (`SegmentModel.calibrate` on the
full search's reference plans, as `jremat.plan` fits it). Compiled figures are deterministic,
so `--cache` keeps them by plan structure (as `plan_compiles.py`); no seconds are reported.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2", help="a jremat.models name")
    ap.add_argument("--fit", choices=("raw", "baseline", "full"), default="raw")
    ap.add_argument("--budgets", default="", help="comma-separated fractions (default 0.2..0.95)")
    ap.add_argument("--cache", default=None, help="pickle of compiled figures")
    ap.add_argument("--max-cuts", type=int, default=160, help="as jremat.plan's max_cuts")
    a = ap.parse_args()
    sys.path.insert(0, HERE)
    from plan_compiles import _cached

    import jremat.models
    from jremat._src.compile.program import Program
    from jremat._src.search import solve as solve_module

    _cached(a.cache)
    w = jremat.models.get(a.model)
    prog = Program(w.loss, (w.params, w.batch), 0)
    base = prog.baseline
    planner = prog.planner("chain", a.max_cuts, baseline_fit=a.fit == "baseline")
    if a.fit == "full":
        print("; ".join(solve_module._calibrate(prog, planner).log) or "not fitted")
    none = planner.no_remat_peak()
    fractions = (
        [float(x) for x in a.budgets.split(",")] if a.budgets else np.linspace(0.2, 0.95, 16)
    )
    print(f"{a.model}, fit {a.fit}: baseline {base.temp_bytes:,} temp bytes")
    print("| model budget | modelled peak | compiled temp | temp ratio | recompute FLOPs "
          "modelled | compiled extra | FLOPs ratio |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    temps, flops = [], []
    for f in fractions:
        plan = planner.plan(f * none)
        if plan is None:
            print(f"| {f:.3f} | infeasible in the model | | | | | |")
            continue
        c = prog.compile(plan)
        extra = c.flops - base.flops
        rt = c.temp_bytes / max(plan.predicted_temp_bytes, 1)
        rf = extra / plan.recompute_flops if plan.recompute_flops else float("nan")
        temps.append(rt)
        flops.append(rf)
        print(
            f"| {f:.3f} | {plan.predicted_temp_bytes:,} | {c.temp_bytes:,} | {rt:.3f} | "
            f"{plan.recompute_flops:.3e} | {extra:.3e} | {rf:.2f} |",
            flush=True,
        )
    for name, xs in (("temp", temps), ("FLOPs", flops)):
        v = np.array([x for x in xs if np.isfinite(x)])
        if len(v):
            step = np.max(np.abs(np.diff(v))) if len(v) > 1 else 0.0
            print(
                f"{name} ratio: mean {v.mean():.3f}, spread {100 * v.std() / v.mean():.1f}%, "
                f"range {v.min():.3f}-{v.max():.3f}, largest change between neighbours {step:.3f}"
            )


if __name__ == "__main__":
    main()
