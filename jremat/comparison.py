"""`jremat.compare`: what each policy costs in memory and compute, on one program.

Every row is compiled (XLA's `memory_analysis` and `cost_analysis`) and executed once to
compare its gradients with the unrematerialized ones.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .budget import parse_budget
from .errors import InfeasibleBudgetError
from .planning import Compiled, Program, recipe_plan, solve
from .rewrite import rematerialize

#: JAX built-in policies applied per layer (the layers found from the jaxpr's name stack).
BUILTIN_PER_LAYER = ("nothing_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable")


@dataclasses.dataclass
class Row:
    """One policy at one budget. Bytes in bytes, FLOPs as XLA counts them, times in seconds.

    `extra_flops_pct` is 100 x (FLOPs / unrematerialized FLOPs - 1); `max_grad_diff` the largest
    absolute difference from the unrematerialized gradients; `status` "ok" or "infeasible".
    """

    policy: str
    budget: Any
    temp_bytes: int | None
    footprint_bytes: int | None
    extra_flops_pct: float | None
    max_grad_diff: float | None
    compile_seconds: float
    plan_seconds: float | None = None
    status: str = "ok"
    note: str = ""


@dataclasses.dataclass
class Comparison:
    """Rows of a comparison, with exporters (Markdown, CSV, JSON)."""

    rows: list[Row]
    description: str = ""
    baseline_temp_bytes: int = 0

    def to_json(self) -> str:
        """A JSON list of row objects."""
        return json.dumps([dataclasses.asdict(r) for r in self.rows], indent=2)

    def to_csv(self, path: str | None = None) -> str:
        """The rows as CSV text; also written to `path` when given."""
        buf = io.StringIO()
        fields = [f.name for f in dataclasses.fields(Row)]
        w = csv.DictWriter(buf, fieldnames=fields)
        w.writeheader()
        for r in self.rows:
            w.writerow(dataclasses.asdict(r))
        if path:
            with open(path, "w", encoding="utf-8", newline="") as f:
                f.write(buf.getvalue())
        return buf.getvalue()

    def to_markdown(self) -> str:
        """A Markdown table: policy, budget, temp MiB, footprint MiB, extra FLOPs %, ..."""
        mib = 2.0**20
        head = (
            "| policy | budget | temp MiB | footprint MiB | extra FLOPs % | max grad diff "
            "| compile s | plan s |"
        )
        lines = [head, "|---|---|---:|---:|---:|---:|---:|---:|"]
        for r in self.rows:
            if r.status != "ok":
                lines.append(
                    f"| {r.policy} | {r.budget} | {r.note} | | | | | "
                    f"{_fmt(r.plan_seconds, '.1f')} |"
                )
                continue
            lines.append(
                f"| {r.policy} | {r.budget if r.budget is not None else '-'} "
                f"| {r.temp_bytes / mib:.2f} | {r.footprint_bytes / mib:.2f} "
                f"| {r.extra_flops_pct:.1f} | {r.max_grad_diff:.1e} | {r.compile_seconds:.1f} "
                f"| {_fmt(r.plan_seconds, '.1f')} |"
            )
        return "\n".join(lines)

    def _repr_markdown_(self) -> str:
        return self.to_markdown()


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _max_diff(a: Any, b: Any) -> float:
    diffs = [
        jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32)))
        for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True)
    ]
    return float(max(diffs)) if diffs else 0.0


def compare(
    fn: Callable[..., Any],
    *args: Any,
    budgets: Sequence[Any] = (0.25, 0.5, 0.75),
    builtins: Sequence[str] = BUILTIN_PER_LAYER,
    argnums: int | Sequence[int] = 0,
    progress: bool = True,
) -> Comparison:
    """Compare the unrematerialized program, JAX's built-in policies per layer, sqrt(n)
    segments (Chen et al. 2016) and `jremat.plan` at each budget, on `fn(*args)`.

    Args:
      fn: returns a scalar float loss; `args` concrete arrays (rows are executed once).
      budgets: budgets for the planner (any accepted form, see `jremat.budget`).
      builtins: names in `jremat.policies` to apply per layer.
      argnums: differentiated arguments.
      progress: show a tqdm progress bar on stderr.

    Returns:
      A `Comparison`. An unreachable budget gives a row with status "infeasible" whose note
      states the smallest reachable budget.
    """
    specs = [parse_budget(b) for b in budgets]
    prog = Program(fn, args, argnums)
    nums = prog.nums[0] if len(prog.nums) == 1 else prog.nums
    grad = lambda f: jax.jit(jax.grad(f, argnums=nums))(*args)  # noqa: E731
    ref = grad(fn)
    jobs: list[tuple[str, Any, Any]] = [("no remat", None, None)]
    jobs += [(f"{p} per layer", None, recipe_plan(prog.graph, p, "layers")) for p in builtins]
    jobs.append(("sqrt(n) segments", None, recipe_plan(prog.graph, "nothing_saveable", "sqrt_n")))
    jobs += [("jremat auto (chain)", spec, None) for spec in specs]
    rows = []
    bar = _progress(len(jobs), progress)
    base = _timed_compile(prog, None)
    for name, spec, plan in jobs:
        plan_s = None
        try:
            if spec is not None:
                t0 = time.perf_counter()
                plan = solve(prog, spec)
                plan_s = time.perf_counter() - t0
            if plan is not None and plan.measured_temp_bytes is not None:
                # the planner already compiled it while verifying
                c = Compiled(plan.measured_temp_bytes, plan.measured_flops, base[0].fixed_bytes)
                secs = 0.0
            else:
                c, secs = base if plan is None else _timed_compile(prog, plan)
            f = fn if plan is None else rematerialize(fn, plan)
            diff = 0.0 if plan is None else _max_diff(grad(f), ref)
            rows.append(
                Row(
                    name,
                    None if spec is None else spec.raw,
                    c.temp_bytes,
                    c.temp_bytes + c.fixed_bytes,
                    100.0 * (c.flops / base[0].flops - 1.0) if base[0].flops else 0.0,
                    diff,
                    secs,
                    plan_s,
                )
            )
        except InfeasibleBudgetError as e:
            rows.append(
                Row(
                    name,
                    spec.raw if spec else None,
                    None,
                    None,
                    None,
                    None,
                    0.0,
                    None,
                    "infeasible",
                    f"infeasible: smallest reachable {e.smallest_reachable}",
                )
            )
        bar.update(1)
    bar.close()
    return Comparison(rows, baseline_temp_bytes=base[0].temp_bytes)


def _timed_compile(prog: Program, plan: Any) -> tuple[Compiled, float]:
    t0 = time.perf_counter()
    c = prog.baseline if plan is None else prog.compile(plan)
    return c, time.perf_counter() - t0


def _progress(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, disable=not enabled, desc="jremat compare", leave=False)
