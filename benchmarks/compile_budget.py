"""What a compile budget costs in plan quality, over size sweeps of two model families.

    python benchmarks/compile_budget.py          # writes results/compile_budget_jax<ver>.md
    python benchmarks/compile_budget.py --quick  # two cells, one budget (a smoke run)
    python benchmarks/compile_budget.py --rows-from F  # the tables of a run's JSON lines

For each cell (a GPT decoder and a residual MLP, `benchmarks/vs_pytorch.py`'s JAX side, over
depth, width and batch x sequence; seeds fixed) and memory budget (0.4 and 0.6 of the
unrematerialized compiled temp), `jremat.plan` runs with compile budgets of 3, 4 and 6 and
with none (the unlimited search). Per run: the compiles spent (`Plan.compiles`), whether
both the plan's step and the caller's `jit(grad)` step (compiled apart) meet the budget, and
its extra FLOPs (compiled, against the unrematerialized step) minus the unlimited search's,
in points. The summary gives, per compile budget, the median and worst cell and the
geometric mean of (100 + extra) / (100 + unlimited extra) - 1 in points.

Figures are XLA's deterministic compiled temp bytes and FLOPs, so the tables are the same on
every run of the same jax version (no seconds are reported).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys

os.environ.setdefault("JREMAT_PLAN_CACHE", "0")  # every plan searched, none read from disk
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # this checkout's jremat
sys.path.insert(0, HERE)

import jax  # noqa: E402
from vs_pytorch import _jax_inputs, gpt, mlp  # noqa: E402

import jremat  # noqa: E402

COMPILE_BUDGETS = (3, 4, 6, None)
BUDGETS = (0.4, 0.6)
#: (family, builder, keyword sweeps): depth, width, batch x sequence (rows for the MLP)
CELLS = [
    ("gpt", gpt, dict(layers=4, width=64, heads=4, seq=64, batch=4, vocab=256)),
    ("gpt", gpt, dict(layers=6, width=64, heads=4, seq=64, batch=4, vocab=256)),
    ("gpt", gpt, dict(layers=4, width=128, heads=4, seq=64, batch=4, vocab=256)),
    ("gpt", gpt, dict(layers=4, width=64, heads=4, seq=128, batch=8, vocab=256)),
    ("mlp", mlp, dict(layers=6, width=128, hidden=512, rows=512)),
    ("mlp", mlp, dict(layers=10, width=128, hidden=512, rows=512)),
    ("mlp", mlp, dict(layers=6, width=256, hidden=1024, rows=512)),
    ("mlp", mlp, dict(layers=6, width=128, hidden=512, rows=2048)),
]
QUICK = [CELLS[0], CELLS[4]]


def _grad_temp(fn, params, batch) -> int:
    exe = jax.jit(jax.grad(fn)).lower(params, batch).compile()
    return exe.memory_analysis().temp_size_in_bytes


def run_cell(family, builder, kw, budgets) -> list[dict]:
    model = builder(**kw)
    params, batch = _jax_inputs(model)
    label = f"{family} " + " ".join(f"{k}={v}" for k, v in kw.items() if k != "vocab")
    rows = []
    for b in budgets:
        for cb in COMPILE_BUDGETS:
            row = dict(cell=label, budget=b, compile_budget=cb)
            try:
                plan = jremat.plan(model.jax_loss, params, batch, budget=b, compile_budget=cb)
            except jremat.InfeasibleBudgetError as e:
                row.update(infeasible=True, floor=e.smallest_reachable)
                rows.append(row)
                print(json.dumps(row), flush=True)
                continue
            base = plan.baseline_temp_bytes
            fn = jremat.rematerialize(model.jax_loss, plan)
            grad_temp = _grad_temp(fn, params, batch)
            row.update(
                infeasible=False,
                compiles=plan.compiles,
                temp=plan.measured_temp_bytes / base,
                grad_temp=grad_temp / base,
                met=max(plan.measured_temp_bytes, grad_temp) <= b * base,
                extra=100 * (plan.measured_flops / plan.baseline_flops - 1),
            )
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def summary(rows: list[dict]) -> str:
    unlimited = {(r["cell"], r["budget"]): r for r in rows if r["compile_budget"] is None}
    out = [
        "| compile budget | cells | met | infeasible | compiles (max) | extra FLOPs vs unlimited, "
        "median / worst (points) | geometric mean (points) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for cb in COMPILE_BUDGETS:
        mine = [r for r in rows if r["compile_budget"] == cb]
        ok = [r for r in mine if not r["infeasible"]]
        deltas, ratios = [], []
        for r in ok:
            u = unlimited.get((r["cell"], r["budget"]))
            if u is None or u["infeasible"]:
                continue
            deltas.append(r["extra"] - u["extra"])
            ratios.append(math.log((100 + r["extra"]) / (100 + u["extra"])))
        med = f"{statistics.median(deltas):+.2f}" if deltas else "-"
        worst = f"{max(deltas):+.2f}" if deltas else "-"
        gm = f"{100 * (math.exp(statistics.mean(ratios)) - 1):+.2f}" if ratios else "-"
        out.append(
            f"| {cb if cb is not None else 'none'} | {len(mine)} | "
            f"{sum(r['met'] for r in ok)}/{len(ok)} | {len(mine) - len(ok)} | "
            f"{max((r['compiles'] for r in ok), default=0)} | {med} / {worst} | {gm} |"
        )
    return "\n".join(out)


def cells_table(rows: list[dict]) -> str:
    out = [
        "| cell | budget | " + " | ".join(f"{cb or 'none'}" for cb in COMPILE_BUDGETS) + " |",
        "|---|---:|" + "---:|" * len(COMPILE_BUDGETS),
    ]
    keys = sorted({(r["cell"], r["budget"]) for r in rows}, key=lambda k: (k[0], k[1]))
    for cell, b in keys:
        cols = []
        for cb in COMPILE_BUDGETS:
            r = next(
                x for x in rows if (x["cell"], x["budget"], x["compile_budget"]) == (cell, b, cb)
            )
            cols.append(
                f"floor {r['floor']}"
                if r["infeasible"]
                else f"{r['extra']:+.2f}% ({r['compiles']}){'' if r['met'] else ' MISS'}"
            )
        out.append(f"| {cell} | {b} | " + " | ".join(cols) + " |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument(
        "--rows-from", help="JSON lines of an earlier run's rows (its stdout): tables only"
    )
    args = ap.parse_args()
    cells, budgets = (QUICK, (0.5,)) if args.quick else (CELLS, BUDGETS)
    if args.rows_from:
        with open(args.rows_from) as f:
            rows = [json.loads(line) for line in f if line.startswith("{")]
    else:
        rows = [r for fam, builder, kw in cells for r in run_cell(fam, builder, kw, budgets)]
    ver = jax.__version__
    text = (
        f"# Compile budgets: plan quality over size sweeps (jax {ver}, XLA:CPU)\n\n"
        "Made by `benchmarks/compile_budget.py`. Each cell is planned with compile budgets "
        "of 3, 4 and 6 whole-program compiles and with none; extra FLOPs are the compiled "
        "step's over the unrematerialized one; (n) is the compiles spent; MISS would mark a "
        "plan whose step or `jit(grad)` step is over the budget.\n\n"
        f"{summary(rows)}\n\n{cells_table(rows)}\n"
    )
    if not args.quick:
        line = "jax" + "".join(ver.split(".")[:2])
        path = os.path.join(HERE, "results", f"compile_budget_{line}.md")
        with open(path, "w") as f:
            f.write(text)
        print(f"wrote {path}")
    print(text)


if __name__ == "__main__":
    main()
