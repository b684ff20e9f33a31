"""Whole-program compiles and extra FLOPs of one `solve` per budget, on one model.

    python benchmarks/plan_compiles.py                     # GPT-2 (heldout.py's), jax's line
    python benchmarks/plan_compiles.py --full-search       # best-first search off: the "before"
    python benchmarks/plan_compiles.py --cache /tmp/figs.pkl   # reuse compiled figures

Per cell (a budget) a fresh `Program` on the same traced graph: `compiles` counts its
`jit(value_and_grad)` programs (`Program.compiles`) plus its `jit(grad)` steps, the figure
issue 29 bounds (at most four on unrolled programs); `extra FLOPs` is the plan's compiled
FLOPs over the unrematerialized program's, minus 1; `fits` checks both steps' compiled temp
(`Plan.measured_temp_bytes`, the larger of the two) against the budget.

Compiled figures (temp bytes, FLOPs) are deterministic for a program on one jax version, so
`--cache` stores them by plan structure (`Program.program_key`) and a later run reads them
instead of compiling again: the counts and plans are the same, only faster. Wall seconds are
not reported (the machine may be loaded).
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys

import jax

import jremat
import jremat.models
from jremat._src.base.budget import parse_budget
from jremat._src.compile import program as program_module
from jremat._src.compile.program import Program
from jremat._src.search import predicted
from jremat._src.search import solve as solve_module

BUDGETS = (0.25, 0.4, 0.55, 0.7, 0.85)


def _cached(path: str | None):
    """Make `Program` read compiled figures from (and write them to) the pickle at `path`."""
    store: dict = {}
    if path and os.path.exists(path):
        with open(path, "rb") as f:
            store = pickle.load(f)
    tag = jax.__version__
    step, grad = Program._compile_step, Program._grad_temp

    def save():
        if path:
            with open(path + ".tmp", "wb") as f:
                pickle.dump(store, f)
            os.replace(path + ".tmp", path)

    def compile_step(self, plan, figures_only=True):
        key = ("step", tag, self.program_key(plan))
        if key not in store:
            compiled, _, seconds = step(self, plan, figures_only)
            store[key] = (compiled, seconds)
            save()
        compiled, seconds = store[key]
        return compiled, None, seconds

    def grad_temp(self, plan):
        key = self.program_key(plan)
        if key in self._grad_temps:
            return self._grad_temps[key]
        skey = ("grad", tag, key)
        if skey not in store:
            store[skey] = grad(self, plan)
            save()
        self._grad_temps[key] = store[skey]
        return store[skey]

    Program._compile_step, Program._grad_temp = compile_step, grad_temp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2")
    ap.add_argument("--budgets", default=",".join(map(str, BUDGETS)))
    ap.add_argument("--solver", default="auto")
    ap.add_argument("--full-search", action="store_true", help="best-first searches off")
    ap.add_argument("--cache", default=None, help="pickle of compiled figures")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        help="NAME=x: a flag (0|1) or constant of search/solve.py; predicted.NAME=x: a "
        "constant of search/predicted.py",
    )
    a = ap.parse_args()
    for item in a.set:
        name, _, value = item.partition("=")
        module, name = (
            (predicted, name[len("predicted.") :])
            if name.startswith("predicted.")
            else (solve_module, name)
        )
        current = getattr(module, name)  # an unknown name raises here
        cast = (lambda v: bool(int(v))) if isinstance(current, bool) else type(current)
        setattr(module, name, cast(value))
    if a.full_search:
        solve_module.BEST_FIRST_LOOPS = False
        for name in ("NO_RECOMPUTE_FIRST", "FEW_COMPILES_UNROLLED"):
            if hasattr(solve_module, name):
                setattr(solve_module, name, False)
    # as on a machine of 2 CPUs: no round compiles its jit(grad) step ahead
    program_module.COMPILE_THREADS = min(program_module.COMPILE_THREADS, 2)
    _cached(a.cache)
    w = jremat.models.get(a.model)
    graph = jremat.trace(w.loss, w.params, w.batch)
    print("| budget | compiles | extra FLOPs | temp / baseline | fits | solver |")
    print("|---|---|---|---|---|---|")
    for b in map(float, a.budgets.split(",")):
        prog = Program(w.loss, (w.params, w.batch), 0, graph=graph)
        try:
            p = solve_module.solve(prog, parse_budget(b), solver=a.solver)
        except jremat.InfeasibleBudgetError as e:
            print(f"| {b} | {prog.compiles + len(prog._grad_temps)} | infeasible: {e} |")
            continue
        n = prog.compiles + len(prog._grad_temps)
        extra = 100 * (p.measured_flops / p.baseline_flops - 1)
        frac = p.measured_temp_bytes / p.baseline_temp_bytes
        fits = p.measured_temp_bytes <= b * p.baseline_temp_bytes
        print(f"| {b} | {n} | {extra:.2f}% | {frac:.3f} | {fits} | {p.solver} |", flush=True)
        if os.environ.get("PLAN_NOTES"):
            for line in p.notes:
                print("    ", line, file=sys.stderr)


if __name__ == "__main__":
    main()
