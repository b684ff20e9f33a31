"""What planning costs: compiles, seconds, and `auto`'s first call against the plain step's.

    python benchmarks/plan_cost.py              # short default run (a few minutes)
    python benchmarks/plan_cost.py --full       # every zoo model and decoder depth
    python benchmarks/plan_cost.py --json F     # also write the rows as JSON lines to F
    python benchmarks/plan_cost.py --depth      # trace + solve without compiles, by depth
    python benchmarks/plan_cost.py --full-search  # without the best-first search: the "before"
    python benchmarks/plan_cost.py --compile-budgets auto,3,4,none   # a row per compile budget
    python benchmarks/plan_cost.py --tables-from A.jsonl,B.jsonl   # the table of earlier runs

Per cell (a model at a budget) in a fresh process per model:

* `compiles`: calls of `xla.compile_jitted` during `auto`'s first call (the running program's
  own compile is JAX's, outside it, and not counted);
* `compile s` / `other s`: wall seconds while at least one of those compiles ran (parallel
  compiles counted once) / the rest of auto's first call;
* `ratio`: `auto`'s first call (`jit(value_and_grad(jremat.auto(loss)))`: trace, plan, verify,
  and the compile and first run of what runs) over the plain `jit(value_and_grad(loss))`
  first call (compile and first run), measured first in the same process;
* `warm`: the same ratio in a new process whose plan cache (`plan_dir=`) holds the plan;
* `floor`: the warm first call plus the compiles that verify the plan once it is known (the
  unrematerialized step, the plan's step and its `jit(grad)` step, for their figures, in
  parallel threads), over the plain first call: what a search that compiled nothing but its
  answer would cost; `floor, no grad check` and `floor, plan only` the same with fewer of
  those compiles (the plan's `value_and_grad` step and the baseline; the plan's step
  alone), which bound what dropping a check could win;
* `first call / floor`: `ratio` over `floor`, what the search adds to its answer's own
  verification (issue 29's yardstick: at most 1.25 as a geometric mean, 1.5 in a cell);
* `extra FLOPs`: the plan's compiled FLOPs (`Plan.measured_flops`) over the unrematerialized
  program's (`jremat.measure`), minus 1; `fits`: its compiled temp bytes
  (`Plan.measured_temp_bytes`) meet the budget;
* `compile budget`: `jremat.auto(..., compile_budget=N)` (`auto`: the default; `none`: the
  unlimited search), one row per compile budget of `--compile-budgets`; `vs unlimited` is
  the row's extra FLOPs minus the unlimited search's at the same model and budget (points),
  where both ran.

Ratios are reported because the machine may be loaded by other work: both calls of a ratio
run in one process, minutes apart at most. Runs against another checkout with
`PYTHONPATH=/path/to/checkout python benchmarks/plan_cost.py`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

HERE = os.path.dirname(os.path.abspath(__file__))

BUDGETS = (0.3, 0.5, 0.7)
DEFAULT_MODELS = ("mlp", "gpt2:6", "scan:6")
FULL_MODELS = (
    "mlp",
    "gpt2:6",
    "gpt2:12",
    "gpt2:24",
    "gpt2:48",
    "scan:6",
    "scan:12",
    "scan:24",
    "scan:48",
    "unet",
    "vit",
    "resnet",
)


def workload(name: str):
    """(loss, params, batch) of a benchmark model name: a zoo model ("mlp", "vit", ...), an
    unrolled GPT-2 decoder "gpt2:<layers>" or a scanned one "scan:<layers>"."""
    import jremat.models

    kind, _, depth = name.partition(":")
    if kind == "scan":
        sys.path.insert(0, HERE)
        from run import scanned_decoder

        return scanned_decoder(depth=int(depth))
    kw = {"n_layer": int(depth)} if depth else {}
    w = jremat.models.get(kind, **kw)
    return w.loss, w.params, w.batch


def _search_mode() -> None:
    """`--full-search` (passed to the child processes in the environment): `jremat.plan` runs
    its full search only, as before the best-first search existed."""
    if os.environ.get(FULL_SEARCH_ENV):
        from jremat._src.search import solve

        solve.BEST_FIRST_LOOPS = solve.NO_RECOMPUTE_FIRST = False


FULL_SEARCH_ENV = "JREMAT_BENCH_FULL_SEARCH"


def _auto(loss, budget: float, compile_budget: int | str | None, plan_dir: str):
    """`jremat.auto` of `loss` at one cell, its plans in a folder of that cell's own (so the
    warm process reads the plan of the same budget and compile budget)."""
    import jremat

    return jremat.auto(
        loss,
        budget=budget,
        compile_budget=compile_budget,
        plan_dir=os.path.join(plan_dir, f"{budget}-{compile_budget}"),
    )


def _cell(
    name: str, budgets: list[float], plan_dir: str, compile_budget: int | str | None
) -> Iterator[dict]:
    """Measure one model in this process: the plain step, then auto at each budget under
    `compile_budget` (a row per budget as soon as it is measured)."""
    import jax

    _search_mode()

    import jremat
    from jremat._src.compile import xla

    loss, params, batch = workload(name)
    spans: list[tuple[float, float]] = []  # (start, end) of each compile, from any thread
    real = xla.compile_jitted

    def counted(jitted, args, **kw):
        t0 = time.perf_counter()
        try:
            return real(jitted, args, **kw)
        finally:
            spans.append((t0, time.perf_counter()))

    def wall(intervals) -> float:
        """Seconds during which at least one compile ran (parallel compiles counted once)."""
        total, end = 0.0, -math.inf
        for a, b in sorted(intervals):
            total += max(0.0, b - max(a, end))
            end = max(end, b)
        return total

    xla.compile_jitted = counted

    def first_call(f) -> float:
        t0 = time.perf_counter()
        jax.block_until_ready(jax.jit(jax.value_and_grad(f))(params, batch))
        return time.perf_counter() - t0

    plain = first_call(loss)
    base = jremat.measure(loss, params, batch)
    cb = compile_budget
    for b in budgets:
        spans.clear()
        wrapped = _auto(loss, b, cb, plan_dir)
        try:
            seconds = first_call(wrapped)
        except jremat.InfeasibleBudgetError as e:
            yield {"model": name, "budget": b, "compile_budget": cb, "infeasible": str(e)[:80]}
            continue
        (p,) = wrapped.plans.values()
        yield (
            {
                "model": name,
                "budget": b,
                "compile_budget": cb,
                "compiles": len(spans),
                "compile_s": wall(spans),
                "other_s": seconds - wall(spans),
                "auto_s": seconds,
                "plain_s": plain,
                "ratio": seconds / plain,
                "extra_flops": (p.measured_flops or base.flops) / base.flops - 1,
                "fits": (p.measured_temp_bytes or 0) <= b * base.temp_bytes,
                "solver": p.solver,
            }
        )


def _warm(
    name: str, budgets: list[float], plan_dir: str, compile_budget: int | str | None
) -> Iterator[dict]:
    """A new process with the plans on disk: auto's first call over the plain step's (a row
    per budget as soon as it is measured)."""
    import jax

    _search_mode()

    import jremat

    loss, params, batch = workload(name)

    def first_call(f) -> float:
        t0 = time.perf_counter()
        jax.block_until_ready(jax.jit(jax.value_and_grad(f))(params, batch))
        return time.perf_counter() - t0

    plain = first_call(loss)
    for b in budgets:
        wrapped = _auto(loss, b, compile_budget, plan_dir)
        try:
            seconds = first_call(wrapped)
        except jremat.InfeasibleBudgetError:
            continue
        (p,) = wrapped.plans.values()
        yield (
            {
                "model": name,
                "budget": b,
                "compile_budget": compile_budget,
                "warm_ratio": seconds / plain,
                **{
                    key: (seconds + _verify_seconds(loss, params, batch, p, parts)) / plain
                    for key, parts in FLOORS.items()
                },
                "loads": wrapped.plan_cache.loads,
            }
        )


#: The floor columns (row key -> `_verify_seconds`'s `parts`), measured in this order.
FLOORS = {"floor_ratio": "all", "floor_no_grad_ratio": "no_grad", "floor_plan_ratio": "plan"}


def _verify_seconds(loss, params, batch, plan, parts: str = "all") -> float:
    """Wall seconds of the compiles that verify a known plan at a fractional budget: the
    unrematerialized step (the budget's reference), the plan's step and its `jit(grad)` step,
    as the search compiles them (for their figures only, scan bodies' FLOPs included), on a
    fresh `Program`, all at once in `COMPILE_THREADS` threads. A first call that knew its plan
    would cost the warm first call plus these: the floor of a verified plan, whatever the
    search (`floor_ratio`).

    `parts` drops compiles, to show what each is worth: "all" (the three), "no_grad" (the
    unrematerialized step and the plan's step: a plan verified on `value_and_grad` only) and
    "plan" (the plan's step alone: a byte budget, verified on one step only). Neither of the
    last two is what `jremat.plan` may do; they bound what dropping a check could win."""
    import concurrent.futures

    from jremat._src.compile.program import COMPILE_THREADS, Program

    prog = Program(loss, (params, batch), 0)
    tasks = [] if parts == "plan" else [lambda: prog.compile(None)]
    if not plan.is_identity:
        tasks += [lambda: prog.compile(plan)]
        if parts == "all":
            tasks += [lambda: prog.grad_step_temp(plan)]
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max(1, min(len(tasks), COMPILE_THREADS))) as pool:
        for f in [pool.submit(t) for t in tasks]:
            f.result()
    return time.perf_counter() - t0


DEPTH_MODELS = tuple(f"{kind}:{n}" for kind in ("gpt2", "scan") for n in (6, 12, 24, 48))


def _depth(name: str, budgets: list[float], plan_dir: str, compile_budget=None) -> list[dict]:
    """Seconds to trace the program, build the cost model, and plan at each budget (of the
    model's own unrematerialized peak) without compiling anything: what planning costs
    besides XLA, by depth."""
    from jremat._src.compile.program import Program

    loss, params, batch = workload(name)
    t0 = time.perf_counter()
    prog = Program(loss, (params, batch), 0)
    t1 = time.perf_counter()
    planner = prog.planner("auto", 160)
    t2 = time.perf_counter()
    none = planner.no_remat_peak()
    for b in budgets:
        planner.plan(b * none)
    t3 = time.perf_counter()
    return [
        {
            "model": name,
            "equations": prog.graph.num_nodes,
            "solver": planner.name,
            "trace_s": t1 - t0,
            "model_s": t2 - t1,
            "plan_s": (t3 - t2) / len(budgets),
        }
    ]


def depth_table(rows: list[dict]) -> str:
    lines = [
        "| model | equations | solver | trace s | cost model s | plan s (per budget) | total s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        total = r["trace_s"] + r["model_s"] + r["plan_s"]
        lines.append(
            f"| {r['model']} | {r['equations']} | {r['solver']} | {r['trace_s']:.2f} | "
            f"{r['model_s']:.2f} | {r['plan_s']:.2f} | {total:.2f} |"
        )
    return "\n".join(lines)


def _child(
    mode: str,
    name: str,
    budgets: list[float],
    plan_dir: str,
    compile_budget: int | str | None = None,
) -> list[dict]:
    """Run `mode` for `name` in a new process; its rows, each also echoed to stderr as it
    arrives (a run stopped by a time limit keeps the rows measured so far in its log)."""
    args = [sys.executable, __file__, "--child", mode, name, ",".join(map(str, budgets)), plan_dir]
    args.append(str(compile_budget).lower())  # "none": the unlimited search
    rows = []
    # stderr to a file: a pipe read only at the end could fill and stall the child
    with tempfile.TemporaryFile("w+") as err:
        with subprocess.Popen(args, stdout=subprocess.PIPE, stderr=err, text=True) as proc:
            for line in proc.stdout:
                if line.startswith("{"):
                    rows.append(json.loads(line))
                    print(f"# {mode}: {line.strip()}", file=sys.stderr, flush=True)
        if proc.returncode:
            err.seek(0)
            print(err.read()[-3000:], file=sys.stderr)
    return rows


def table(rows: list[dict]) -> str:
    unlimited = {
        (r["model"], r["budget"]): r["extra_flops"]
        for r in rows
        if r.get("compile_budget") is None and "extra_flops" in r
    }
    for r in rows:
        if "extra_flops" in r and (r["model"], r["budget"]) in unlimited:
            r["vs_unlimited"] = 100 * (r["extra_flops"] - unlimited[(r["model"], r["budget"])])
    lines = [
        "| model | budget | compile budget | compiles | compile s | other s | ratio | warm ratio "
        "| floor ratio | first call / floor | floor, no grad check | floor, plan only "
        "| extra FLOPs | vs unlimited (points) | fits |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def cell(r: dict, key: str, fmt: str = "{:.2f}") -> str:
        return fmt.format(r[key]) if key in r else "-"

    def cb(r: dict) -> str:
        return "none" if r.get("compile_budget") is None else str(r["compile_budget"])

    for r in rows:
        if "infeasible" in r:
            lines.append(f"| {r['model']} | {r['budget']} | {cb(r)} | infeasible |" + " |" * 11)
            continue
        lines.append(
            f"| {r['model']} | {r['budget']} | {cb(r)} | {r['compiles']} | "
            f"{r['compile_s']:.1f} | {r['other_s']:.1f} | {r['ratio']:.1f} | "
            f"{cell(r, 'warm_ratio')} | {cell(r, 'floor_ratio')} | {cell(r, 'over_floor')} | "
            f"{cell(r, 'floor_no_grad_ratio')} | {cell(r, 'floor_plan_ratio')} | "
            f"{100 * r['extra_flops']:.2f}% | {cell(r, 'vs_unlimited', '{:+.2f}')} "
            f"| {'yes' if r['fits'] else 'NO'} |"
        )
    for group in sorted({cb(r) for r in rows}, key=lambda g: (g == "none", g.zfill(4))):
        sub = [r for r in rows if cb(r) == group]
        lines.append(f"\ncompile budget {group}:\n")
        for key, what in (
            ("ratio", "auto's first call / plain first call"),
            ("warm_ratio", "warm plan cache (new process)"),
            ("floor_ratio", "floor (the plan known, only verified)"),
            ("over_floor", "auto's first call / floor (goal 1.25, each cell 1.5)"),
            ("floor_no_grad_ratio", "floor without the jit(grad) check"),
            ("floor_plan_ratio", "floor with the plan's step alone compiled"),
        ):
            values = [r[key] for r in sub if key in r]
            if values:
                gm = math.exp(sum(map(math.log, values)) / len(values))
                lines.append(f"- geometric mean, {what}: {gm:.2f}")
        pairs = [
            (1 + r["extra_flops"], 1 + unlimited[(r["model"], r["budget"])])
            for r in sub
            if "extra_flops" in r and (r["model"], r["budget"]) in unlimited
        ]
        if pairs and group != "none":
            gm = math.exp(sum(math.log(a / b) for a, b in pairs) / len(pairs))
            diffs = sorted(100 * (a - b) for a, b in pairs)
            lines.append(
                f"- extra FLOPs vs the unlimited search: geometric mean {100 * (gm - 1):+.2f}, "
                f"median {diffs[len(diffs) // 2]:+.2f}, worst {diffs[-1]:+.2f} points"
            )
        spent = [r["compiles"] for r in sub if "compiles" in r]
        if spent:
            lines.append(
                f"- compiles spent: at most {max(spent)}; every plan fits: "
                f"{all(r['fits'] for r in sub if 'fits' in r)}"
            )
    return "\n".join(lines)


def _cbs(text: str) -> list[int | str | None]:
    """`--compile-budgets`' list: ints, `auto` (jremat's default), `none` (the unlimited
    search)."""
    named = {"none": None, "auto": "auto"}
    return [named[t] if t in named else int(t) for t in text.strip().lower().split(",")]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        mode, name, budgets, plan_dir, cb = sys.argv[2:7]
        fn = {"cold": _cell, "warm": _warm, "depth": _depth}[mode]
        for row in fn(name, [float(b) for b in budgets.split(",")], plan_dir, *_cbs(cb)):
            print(json.dumps(row), flush=True)
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="every zoo model and decoder depth")
    ap.add_argument("--models", help="comma-separated model names (overrides the preset)")
    ap.add_argument("--budgets", default=",".join(map(str, BUDGETS)))
    ap.add_argument("--json", help="also write the rows as JSON lines to this file")
    ap.add_argument("--no-warm", action="store_true", help="skip the warm plan cache runs")
    ap.add_argument("--depth", action="store_true", help="trace + solve without compiles, by depth")
    ap.add_argument(
        "--full-search", action="store_true", help="jremat.plan's full search only (the before)"
    )
    ap.add_argument(
        "--compile-budgets",
        default="auto",
        help="comma-separated compile budgets of auto: ints, 'auto' (the default's), 'none' "
        "(the unlimited search); a row each",
    )
    ap.add_argument(
        "--tables-from",
        help="comma-separated JSON-lines files of earlier runs (--json): print their table "
        "only, rows of every file together (compile budgets of several runs side by side)",
    )
    a = ap.parse_args()
    if a.tables_from:
        rows = []
        for path in a.tables_from.split(","):
            with open(path) as f:
                rows.extend(json.loads(line) for line in f if line.strip())
        print(table(rows))
        return
    if a.full_search:
        os.environ[FULL_SEARCH_ENV] = "1"
    if a.depth:
        budgets = [float(b) for b in a.budgets.split(",")]
        rows = [
            r
            for name in (a.models.split(",") if a.models else DEPTH_MODELS)
            for r in _child("depth", name, budgets, "")
        ]
        print(depth_table(rows))
        return
    models = a.models.split(",") if a.models else (FULL_MODELS if a.full else DEFAULT_MODELS)
    budgets = [float(b) for b in a.budgets.split(",")]
    cbs = _cbs(a.compile_budgets)
    rows: list[dict] = []
    # a process per model and compile budget: the first `auto` of a process pays jremat's
    # own warm-up (imports, first traces), which one compile budget must not pay for another
    for name, cb in [(name, cb) for name in models for cb in cbs]:
        with tempfile.TemporaryDirectory(prefix="jremat-plan-cost-") as plan_dir:
            cold = _child("cold", name, budgets, plan_dir, cb)
            warm = (
                {}
                if a.no_warm
                else {
                    (r["budget"], r.get("compile_budget")): r
                    for r in _child("warm", name, budgets, plan_dir, cb)
                }
            )
        for r in cold:
            key = (r["budget"], r.get("compile_budget"))
            if key in warm:
                r["warm_ratio"] = warm[key]["warm_ratio"]
                for k in FLOORS:
                    r[k] = warm[key][k]
                # what the search adds to its answer's own verification (issue 29)
                r["over_floor"] = r["ratio"] / r["floor_ratio"]
            rows.append(r)
            print(json.dumps(r), flush=True)
    print(table(rows))
    if a.json:
        with open(a.json, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
