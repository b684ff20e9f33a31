"""`jremat.compare`: what each remat policy costs in memory and compute, on one program.

Every row is one compiled training step `jit(value_and_grad(fn))`; `Comparison` exports to
Markdown, CSV and JSON (and loads back), renders as HTML and plots its Pareto frontier. What
the rows are: docs/design.md#reports.
"""

from __future__ import annotations

import csv
import dataclasses
import html
import importlib.util
import io
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jremat import policies as _policies
from jremat._src.base.args import check_compile_budget
from jremat._src.base.budget import Budget, BudgetLike, parse_budget
from jremat._src.base.errors import InfeasibleBudgetError
from jremat._src.compile.program import Program
from jremat._src.plan.plan import Plan
from jremat._src.plan.recipes import ANCHOR_RECIPES, recipe_plan
from jremat._src.plan.rewrite import check_plan_program
from jremat._src.reports.measure import median_step_seconds
from jremat._src.reports.pareto import pareto_front
from jremat._src.reports.plot import plot_comparison
from jremat._src.reports.units import memory_unit
from jremat._src.search.solve import SOLVERS, solve
from jremat._src.trace.layers import layer_segments

#: JAX built-in policies applied per layer (the layers found from the jaxpr's name stack).
BUILTIN_PER_LAYER = ("nothing_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable")
#: Label of the reference row.
NO_REMAT = "no remat"
#: Label of the sqrt(n) row of the default set (Chen et al. 2016).
SQRT_N = "sqrt(n) segments"
#: Label of the planner rows ("jremat auto (<solver>)" for a solver other than "auto").
AUTO = "jremat auto"
#: The planner budgets `compare` runs when none are given (fractions of no remat's temp),
#: unless the program cannot reach the smallest (see `default_budgets`).
DEFAULT_BUDGETS = (0.25, 0.5, 0.75)
#: One line per column of the tables `Comparison` prints (`to_markdown`, the HTML view).
LEGEND = (
    "temp: the peak bytes of the compiled training step's temporaries (activations and what "
    "the backward pass holds; XLA's temp_size_in_bytes on CPU and GPU, peak_memory_in_bytes - "
    "arguments - outputs + aliased on TPU: jremat.MEMORY_FIGURES); footprint: arguments + "
    "outputs - aliased + temp; extra FLOPs: compiled FLOPs over no remat's; max grad diff: "
    "largest difference from no remat's gradients; budget: the planner's budget (a fraction "
    "of no remat's temp, or footprint bytes); compile s / plan s: wall seconds to compile the "
    "row's step / to plan it; Pareto: yes when no other row has both less temp and fewer "
    "extra FLOPs."
)

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Row:
    """One policy (at one budget, for a planner). Bytes in bytes, times in seconds.

    Attributes:
      policy: the row's label ("no remat", "dots_saveable per layer", "jremat auto", ...).
      budget: the budget the planner was given, as the caller wrote it; None for fixed policies.
      temp_bytes: XLA's temp bytes of the compiled step (activations, residuals in flight).
      footprint_bytes: argument + output - alias + temp bytes.
      flops: XLA's FLOPs of the step (scan bodies counted once per trip).
      extra_flops_pct: 100 x (flops / unrematerialized flops - 1).
      max_grad_diff: largest absolute difference from the unrematerialized gradients.
      compile_seconds: wall seconds to lower and compile the step. Where the search's own
        compile of the plan runs (no figures-only options: GPU, TPU;
        `Program.figures_compile_runs`), that compile's seconds, also inside `plan_seconds`.
      step_seconds: median wall seconds of one step over `runs` runs; None when runs == 0.
      plan_seconds: wall seconds the planner took (planner rows only).
      budget_temp_bytes: the budget translated to temp bytes (planner rows only).
      status: "ok" or "infeasible" (the budget is below what any plan reaches).
      note: why a row is not "ok" (the smallest reachable budget).
    """

    policy: str
    budget: BudgetLike | None = None
    temp_bytes: int | None = None
    footprint_bytes: int | None = None
    flops: float | None = None
    extra_flops_pct: float | None = None
    max_grad_diff: float | None = None
    compile_seconds: float | None = None
    step_seconds: float | None = None
    plan_seconds: float | None = None
    budget_temp_bytes: int | None = None
    status: str = "ok"
    note: str = ""

    @property
    def ok(self) -> bool:
        """The row was compiled (its figures are set)."""
        return self.status == "ok" and self.temp_bytes is not None

    @property
    def label(self) -> str:
        """`policy`, with the budget for planner rows ("jremat auto @ 0.25")."""
        return self.policy if self.budget is None else f"{self.policy} @ {self.budget}"


_FIELDS = [f.name for f in dataclasses.fields(Row)]
_INT_FIELDS = {"temp_bytes", "footprint_bytes", "budget_temp_bytes"}
_FLOAT_FIELDS = {
    "flops",
    "extra_flops_pct",
    "max_grad_diff",
    "compile_seconds",
    "step_seconds",
    "plan_seconds",
}


@dataclasses.dataclass
class Comparison:
    """Rows of a policy comparison, with exporters, an HTML view and a Pareto plot.

    Attributes:
      rows: one `Row` per policy (and per budget for planners), the "no remat" row first.
      description: what was compared (the model), used as the plot's and table's caption.
      baseline_temp_bytes: temp bytes of the unrematerialized step.

    Examples:
      `jremat.compare` returns one; `from_json` and `from_csv` read one back:

      >>> import json, jremat
      >>> rows = [
      ...     {"policy": "no remat", "temp_bytes": 4096, "extra_flops_pct": 0.0},
      ...     {"policy": "dots_saveable", "temp_bytes": 2048, "extra_flops_pct": 12.5},
      ...     {"policy": "nothing_saveable", "temp_bytes": 3072, "extra_flops_pct": 30.0},
      ... ]
      >>> c = jremat.Comparison.from_json(json.dumps(rows), "a 2-layer MLP")
      >>> c.baseline_temp_bytes  # the "no remat" row's
      4096
      >>> [r.policy for r in c.pareto()]  # nothing_saveable: more bytes and FLOPs than dots
      ['no remat', 'dots_saveable']
      >>> jremat.Comparison.from_csv(c.to_csv()).rows == c.rows  # a CSV round trip
      True
    """

    rows: list[Row]
    description: str = ""
    baseline_temp_bytes: int = 0

    # -- queries --------------------------------------------------------------------------
    def pareto(self) -> list[Row]:
        """The compiled rows no other row beats in both temp bytes and extra FLOPs, sorted by
        extra FLOPs ([design.md#reports](../design.md#reports))."""
        ok = [r for r in self.rows if r.ok]
        return [ok[i] for i in pareto_front([(r.extra_flops_pct, r.temp_bytes) for r in ok])]

    def _frontier_ids(self) -> set[int]:
        return {id(r) for r in self.pareto()}

    # -- exports --------------------------------------------------------------------------
    def to_json(self, path: str | os.PathLike | None = None) -> str:
        """The rows as a JSON list of objects (keys: `Row`'s fields); also written to `path`.

        Units: bytes, FLOPs, percent, seconds. `Comparison.from_json` reads it back.
        """
        text = json.dumps([dataclasses.asdict(r) for r in self.rows], indent=2)
        if path is not None:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text + "\n")
        return text

    def to_csv(self, path: str | os.PathLike | None = None) -> str:
        """The rows as CSV text (header: `Row`'s fields; empty cell for None); also written to
        `path` when given. `Comparison.from_csv` reads it back with the same numbers."""
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=_FIELDS, lineterminator="\n")
        w.writeheader()
        for r in self.rows:
            w.writerow({k: ("" if v is None else v) for k, v in dataclasses.asdict(r).items()})
        if path is not None:
            with open(path, "w", encoding="utf-8", newline="") as f:
                f.write(buf.getvalue())
        return buf.getvalue()

    @classmethod
    def from_json(cls, source: str | os.PathLike, description: str = "") -> Comparison:
        """Load rows written by `to_json`: JSON text, or the path of a file holding it.

        Also accepts an object `{"rows": [...], "description": ...}`. Keys that are not `Row`
        fields are ignored. Raises ValueError when the JSON is not a list of row objects.
        """
        data = json.loads(_read_source(source, "[{"))
        if isinstance(data, dict):
            description = description or data.get("description", "")
            data = data.get("rows")
        if not isinstance(data, list) or not all(isinstance(d, dict) for d in data):
            raise ValueError("from_json expects a JSON list of row objects (as to_json writes)")
        rows = []
        for i, d in enumerate(data):
            if "policy" not in d:
                raise ValueError(f"row {i} has no 'policy' key: {d!r}")
            rows.append(Row(**{k: v for k, v in d.items() if k in _FIELDS}))
        return cls._with_rows(rows, description)

    @classmethod
    def from_csv(cls, source: str | os.PathLike, description: str = "") -> Comparison:
        """Load rows written by `to_csv`: CSV text, or the path of a file holding it.

        Raises ValueError when the header lacks the `policy` column or a number is malformed.
        """
        reader = csv.DictReader(io.StringIO(_read_source(source, None)))
        if not reader.fieldnames or "policy" not in reader.fieldnames:
            raise ValueError(
                f"from_csv expects a header with a 'policy' column, got {reader.fieldnames}"
            )
        rows = []
        for line, rec in enumerate(reader, start=2):
            kw: dict[str, Any] = {}
            for k, v in rec.items():
                if k not in _FIELDS:
                    continue
                try:
                    kw[k] = _from_cell(k, v or "")
                except ValueError as e:
                    raise ValueError(f"CSV line {line}, column {k!r}: {e}") from e
            rows.append(Row(**kw))
        return cls._with_rows(rows, description)

    @classmethod
    def _with_rows(cls, rows: list[Row], description: str) -> Comparison:
        base = next((r.temp_bytes for r in rows if r.policy == NO_REMAT and r.ok), None)
        if base is None:
            base = max((r.temp_bytes for r in rows if r.ok), default=0)
        return cls(rows, description, int(base))

    def to_markdown(self, legend: bool = True) -> str:
        """A Markdown table: policy, budget, temp and footprint (MiB, or KiB/GiB by size),
        extra FLOPs %, max gradient difference, seconds, and whether the row is on the Pareto
        frontier; notes for infeasible rows follow the table, then (with `legend`) a paragraph
        saying what each column means (`LEGEND`)."""
        head, body, notes = self._table()
        lines = ["| " + " | ".join(head) + " |"]
        lines.append("|" + "|".join("---" if i < 2 else "---:" for i in range(len(head))) + "|")
        lines += ["| " + " | ".join(cells) + " |" for cells, _ in body]
        lines += [""] + [f"- {n}" for n in notes] if notes else []
        if legend:
            lines += ["", LEGEND]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        head, body, notes = self._table()
        caption = html.escape(self.description or "jremat compare")
        if self.baseline_temp_bytes:
            caption += f" (no remat temp: {self.baseline_temp_bytes / 2**20:.2f} MiB)"
        out = [f"<table><caption>{caption}</caption><thead><tr>"]
        out += [f"<th>{html.escape(h)}</th>" for h in head]
        out.append("</tr></thead><tbody>")
        for cells, kind in body:
            style = {"front": "font-weight:bold", "bad": "color:#888;font-style:italic"}.get(kind)
            attr = f' style="{style}"' if style else ""
            tds = "".join(
                f'<td style="text-align:{"left" if i < 2 else "right"}">{html.escape(c)}</td>'
                for i, c in enumerate(cells)
            )
            out.append(f"<tr{attr}>{tds}</tr>")
        out.append("</tbody></table>")
        if notes:
            out.append("<ul>" + "".join(f"<li>{html.escape(n)}</li>" for n in notes) + "</ul>")
        out.append(
            "<p><small>Bold: on the Pareto frontier. " + html.escape(LEGEND) + "</small></p>"
        )
        return "".join(out)

    def _table(self) -> tuple[list[str], list[tuple[list[str], str]], list[str]]:
        unit, scale = memory_unit(max((r.temp_bytes for r in self.rows if r.ok), default=0))
        plan_col = any(r.plan_seconds is not None for r in self.rows)
        step_col = any(r.step_seconds is not None for r in self.rows)
        head = ["policy", "budget", f"temp {unit}", f"footprint {unit}", "extra FLOPs %"]
        head += ["max grad diff", "compile s"]
        head += ["plan s"] * plan_col + ["step ms"] * step_col + ["Pareto"]
        front = self._frontier_ids()
        body, notes = [], []
        for r in self.rows:
            budget = "-" if r.budget is None else str(r.budget)
            if not r.ok:
                cells = [r.policy, budget, r.status] + [""] * (len(head) - 3)
                body.append((cells, "bad"))
                notes.append(f"{r.label}: {r.note or r.status}")
                continue
            cells = [
                r.policy,
                budget,
                f"{r.temp_bytes / scale:.2f}",
                f"{r.footprint_bytes / scale:.2f}",
                f"{r.extra_flops_pct:.1f}",
                _fmt(r.max_grad_diff, ".1e"),
                _fmt(r.compile_seconds, ".1f"),
            ]
            cells += [_fmt(r.plan_seconds, ".1f")] * plan_col
            cells += [_fmt(None if r.step_seconds is None else 1e3 * r.step_seconds, ".3g")] * (
                step_col
            )
            on_front = id(r) in front
            cells.append("yes" if on_front else "")
            body.append((cells, "front" if on_front else ""))
        return head, body, notes

    # -- plot -----------------------------------------------------------------------------
    def plot(
        self, path: str | os.PathLike | None = None, *, title: str | None = None, dpi: int = 150
    ):
        """A matplotlib figure of temp memory against extra FLOPs, Pareto frontier marked.

        Each compiled row is a labelled point; the frontier (rows no other row beats on both
        axes) is a staircase line; the planner's budgets are dashed lines. Drawn with the Agg
        canvas (no display needed, pyplot's state untouched).

        Args:
          path: when given, the figure is saved there (format from the suffix, e.g. ".png").
          title: the figure's title; default "Remat policies: <description>".
          dpi: resolution of the saved file.

        Returns:
          A `matplotlib.figure.Figure` (in Jupyter, display it or let the cell return it).

        Raises:
          ImportError: matplotlib is not installed (`pip install "jremat[plot]"`).
          ValueError: no row was compiled, so there is nothing to plot.
        """
        return plot_comparison(self, path=path, title=title, dpi=dpi)


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _read_source(source: str | os.PathLike, starts: str | None) -> str:
    """Text given directly, or read from a path (a PathLike, or a one-line str naming a file)."""
    if isinstance(source, os.PathLike):
        with open(source, encoding="utf-8") as f:
            return f.read()
    if not isinstance(source, str):
        raise TypeError(f"expected text or a path, got {type(source).__name__}")
    text = source.lstrip()
    looks_like_text = "\n" in text or (starts is not None and text[:1] in starts)
    if not looks_like_text and os.path.isfile(source):
        with open(source, encoding="utf-8") as f:
            return f.read()
    return source


def _from_cell(field: str, text: str) -> Any:
    if field in _INT_FIELDS:
        return None if text == "" else int(text)
    if field in _FLOAT_FIELDS:
        return None if text == "" else float(text)
    if field == "budget":
        return None if text == "" else parse_budget_text(text)
    return text


def parse_budget_text(text: str) -> Any:
    """A budget written as text ("0.25", "1000000", "512MiB") as the value `compare` takes:
    an int, else a float, else the string itself."""
    text = text.strip()
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


def _abstract(args: Any) -> bool:
    """Whether any argument leaf is a `jax.ShapeDtypeStruct` (compiled for, not run)."""
    return any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree_util.tree_leaves(args))


def _max_diff(a: Any, b: Any) -> float | None:
    if a is None or b is None:  # compiled for a target that cannot run here
        return None
    diffs = [
        jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32)))
        for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True)
        if getattr(x, "size", 0)
    ]
    return float(max(diffs)) if diffs else 0.0


# -- what to compare -----------------------------------------------------------------------
@dataclasses.dataclass
class _Job:
    label: str
    recipe: tuple[str, str] | None = None  # (policy or preset name, segmentation)
    plan: Plan | None = None
    solver: str | None = None
    spec: Budget | None = None


def fixed_jobs(policies: str | Sequence[Any] | None, builtins: Sequence[str] | None) -> list[_Job]:
    """Validate the policy names and return the fixed-recipe jobs (no tracing needed)."""
    jobs: list[_Job] = []
    if builtins is not None or policies is None:
        names = BUILTIN_PER_LAYER if builtins is None else builtins
        if isinstance(names, str):
            names = [names]
        for i, name in enumerate(names):
            if name not in _policies.names():
                raise ValueError(
                    f"builtins[{i}]={name!r} is not a jremat.policies name; accepted: "
                    f"{', '.join(_policies.names())}"
                )
            jobs.append(_Job(f"{name} per layer", recipe=(name, "layers")))
    if policies is None:
        jobs.append(_Job(SQRT_N, recipe=("nothing_saveable", "sqrt_n")))
        return jobs
    if isinstance(policies, str) or _is_plan_pair(policies):
        policies = [policies]
    presets, names = _policies.preset_names(), _policies.names()
    for i, p in enumerate(list(policies)):
        if _is_plan_pair(p):
            jobs.append(_Job(str(p[0]), plan=p[1]))
        elif isinstance(p, str) and p in names:
            jobs.append(_Job(f"{p} per layer", recipe=(p, "layers")))
        elif isinstance(p, str) and p in presets:
            pre = _policies.preset(p)
            # a parameter-free preset runs as its policy's name, so that its program is the
            # same (and compiled once) as the planner's reference plans
            policy = pre.policy_name if not pre.params and pre.policy_name in names else p
            recipe = None if pre.segmentation == "none" else (policy, pre.segmentation)
            jobs.append(_Job(p, recipe=recipe))
        else:
            raise ValueError(
                f"policies[{i}]={p!r} is neither a jremat.policies name (applied per layer: "
                f"{', '.join(_policies.names())}), a preset ({', '.join(presets)}), nor a "
                "(label, jremat.Plan) pair"
            )
    return jobs


def _is_plan_pair(p: Any) -> bool:
    return isinstance(p, tuple) and len(p) == 2 and isinstance(p[1], Plan)


# -- running it ----------------------------------------------------------------------------
@dataclasses.dataclass
class _Run:
    temp_bytes: int
    fixed_bytes: int
    flops: float
    grads: Any
    compile_seconds: float
    step_seconds: float | None

    @property
    def footprint_bytes(self) -> int:
        return self.fixed_bytes + self.temp_bytes


def _run(prog: Program, args: tuple, plan: Plan | None, runs: int) -> _Run:
    """Figures of the step under `plan`; execute it once for gradients (and `runs` timed).
    Arguments given as `jax.ShapeDtypeStruct`s (a compile-only target) are compiled for,
    never run: no gradients."""
    c, exe, compile_s = prog.step(plan)
    if _abstract(args):
        return _Run(c.temp_bytes, c.fixed_bytes, c.flops, None, compile_s, None)
    _, grads = jax.block_until_ready(exe(*args))
    step = median_step_seconds(exe, args, runs) if runs else None  # the run above warmed up
    return _Run(c.temp_bytes, c.fixed_bytes, c.flops, grads, compile_s, step)


def compare(
    fn: Callable[..., Any],
    *args: Any,
    policies: str | Sequence[Any] | None = None,
    budgets: Sequence[BudgetLike] | None = None,
    argnums: int | Sequence[int] = 0,
    runs: int = 0,
    solvers: Sequence[str] = ("auto",),
    builtins: Sequence[str] | None = None,
    description: str = "",
    progress: bool | None = None,
    has_aux: bool = False,
    compile_budget: int | None = None,
) -> Comparison:
    """Compile `fn`'s training step under each remat policy and compare memory and FLOPs.

    Rows: "no remat" (the reference), then each policy, then each planner at each budget
    (`jremat.plan`, which compiles and verifies its plan). Every row is compiled and executed
    once; its gradients are compared with the unrematerialized ones.

    Args:
      fn: returns a scalar float loss (with `has_aux`, a pair `(loss, aux)`); `args` are
        concrete arrays or pytrees (rows execute), or `jax.ShapeDtypeStruct`s placed on a
        `jremat.target_mesh` (rows are compiled for that target, never run: no gradient
        differences).
      policies: what to compare besides "no remat" and the planners. None: the default set,
        JAX's built-in policies per layer (`builtins`) and sqrt(n) segments (Chen et al.
        2016, "Training Deep Nets with Sublinear Memory Cost"). Otherwise a sequence whose
        items are names in `jremat.policies.names()` (applied per layer), preset names from
        `jremat.policies.preset_names()` (each with its own segmentation), or
        `(label, jremat.Plan)` pairs.
      budgets: budgets for each planner, in any form `jremat.plan` accepts (fractions of the
        unrematerialized temp bytes, footprint bytes, "512MiB", "auto"); () for none. None
        (the default): 0.25, 0.5 and 0.75, or, when the lowest compiled reference plan
        (a built-in per layer, sqrt(n) segments) holds more than 0.25, three budgets from
        it to 1 (`default_budgets`), so that every default row is feasible.
      argnums: differentiated arguments, as in `jax.grad`.
      runs: when > 0, time this many executions of each row's step (median, seconds).
      solvers: planners run at every budget (the `solver=` names of `jremat.plan`); default
        "auto", `jremat.plan`'s choice (the MILP on small graphs, the chain DP otherwise).
      builtins: `jremat.policies` names applied per layer; default
        `BUILTIN_PER_LAYER` when `policies` is None. Given with `policies`, both are compared.
      description: a caption for tables and plots (for example the model's name).
      progress: show a tqdm progress bar (row, budget, count) while compiling; None (the
        default): on a terminal, or as a widget in Jupyter with ipywidgets. Each row's
        start and result are also logged at INFO level to the "jremat" logger (quiet unless
        configured, e.g. `jremat.log_to_stderr()`).
      has_aux: `fn` returns `(loss, aux)`, aux any pytree of arrays: every row compiles
        `jit(value_and_grad(fn, has_aux=True))`, which computes both (as `jremat.plan`).
      compile_budget: whole-program compiles each planner row's search may spend, as
        `jremat.plan`'s `compile_budget` (None, the default: no limit); a row's plan records
        what it spent (`Plan.compiles`).

    Returns:
      A `Comparison`. A budget below what any plan reaches gives a row with status
      "infeasible" whose note states the reachable range (smallest reachable budget .. no
      remat's).

    Raises:
      ValueError: an unknown policy, preset or solver name (the message lists the accepted
        ones), a malformed budget, `runs` < 0, or `compile_budget` below 1 (below what
        verification needs: at the first planner row).
      TypeError: `fn` does not return a scalar float (with `has_aux`, a pair whose first
        element is one), `argnums` selects no float input, or `has_aux` is not a bool.

    Examples:
      >>> import jax.numpy as jnp, jremat
      >>> loss = lambda w, x: jnp.mean(jnp.tanh(x @ w) ** 2)
      >>> c = jremat.compare(loss, jnp.ones((8, 8)), jnp.ones((4, 8)), budgets=())
      >>> [r.policy for r in c.rows][:2]
      ['no remat', 'nothing_saveable per layer']
    """
    if not isinstance(runs, int) or isinstance(runs, bool) or runs < 0:
        raise ValueError(f"runs must be an int >= 0, got {runs!r}")
    if runs and _abstract(args):
        raise ValueError(
            "runs > 0 times the steps, which needs arrays: args hold jax.ShapeDtypeStructs "
            "(a compile-only target, jremat.target_mesh); pass runs=0"
        )
    check_compile_budget(compile_budget)
    if isinstance(solvers, str):
        solvers = [solvers]
    for s in solvers:
        if s not in SOLVERS:
            raise ValueError(f"solvers: {s!r} is not a planner; accepted: {', '.join(SOLVERS)}")
    if isinstance(budgets, (str, int, float)):
        budgets = [budgets]
    specs = None if budgets is None else [parse_budget(b) for b in budgets]
    jobs = fixed_jobs(policies, builtins)
    t_start = time.perf_counter()
    what = description or getattr(fn, "__name__", "the function")
    logger.info("compare %s: tracing", what)
    prog = Program(fn, args, argnums, has_aux=has_aux)
    for job in jobs:
        if job.recipe is not None:
            job.plan = recipe_plan(prog.graph, *job.recipe)
        elif job.plan is not None:  # a (label, Plan) pair: made for this program?
            check_plan_program(prog.graph, job.plan, f"fn (the row {job.label!r})")
    n_budgets = len(DEFAULT_BUDGETS) if specs is None else len(specs)
    total = 1 + len(jobs) + len(solvers) * n_budgets
    bar = _progress(total, progress, what)
    done = 0

    def start(label: str) -> float:
        bar.set_postfix_str(label)
        logger.info(
            "compare %s: %s (%d of %d, %.0f s so far)",
            what,
            label,
            done + 1,
            total,
            time.perf_counter() - t_start,
        )
        return time.perf_counter()

    def finish(row: Row, t0: float) -> None:
        nonlocal done
        done += 1
        bar.update(1)
        figures = (
            f"temp {row.temp_bytes / 2**20:.2f} MiB, {row.extra_flops_pct:+.1f}% FLOPs"
            if row.ok
            else row.note or row.status
        )
        logger.info(
            "compare %s: %s: %s (%.1f s)", what, row.label, figures, time.perf_counter() - t0
        )

    t0 = start(NO_REMAT)
    base = _run(prog, args, None, runs)
    rows = [
        Row(
            NO_REMAT,
            None,
            base.temp_bytes,
            base.footprint_bytes,
            base.flops,
            0.0,
            _max_diff(base.grads, base.grads),  # None where nothing ran (a compile-only target)
            base.compile_seconds,
            base.step_seconds,
        )
    ]
    finish(rows[0], t0)

    def extra(flops: float) -> float:
        return 100.0 * (flops / base.flops - 1.0) if base.flops else 0.0

    def run_job(job: _Job) -> None:
        label = job.label if job.spec is None else f"{job.label} @ {job.spec.raw}"
        t0 = start(label)
        plan, plan_s, target = job.plan, None, None
        if job.spec is not None:
            job.spec = job.spec.for_device(prog.device)  # a "device" budget: of that device
            target = job.spec.temp_bytes(base.temp_bytes, base.fixed_bytes)
            target = max(int(target), 0)
            t_plan = time.perf_counter()
            try:
                plan = solve(prog, job.spec, solver=job.solver, compile_budget=compile_budget)
            except InfeasibleBudgetError as e:
                top = job.spec.in_caller_unit(base.temp_bytes, base.temp_bytes, base.fixed_bytes)
                rows.append(
                    Row(
                        job.label,
                        job.spec.raw,
                        plan_seconds=time.perf_counter() - t_plan,
                        budget_temp_bytes=target,
                        status="infeasible",
                        note=(
                            f"infeasible: {e}"  # the compile budget ran out: its own words
                            if "compile budget" in str(e)
                            else f"infeasible: budget {job.spec.raw} is below the reachable "
                            f"range {e.smallest_reachable} .. {top} (smallest reachable budget "
                            f"{e.smallest_reachable}; {top} is no remat)"
                        ),
                    )
                )
                finish(rows[-1], t0)
                return
            plan_s = time.perf_counter() - t_plan
            if plan.is_identity:
                plan = None  # the budget holds without remat: fn itself
        r = base if plan is None and job.plan is None else _run(prog, args, plan, runs)
        rows.append(
            Row(
                job.label,
                None if job.spec is None else job.spec.raw,
                r.temp_bytes,
                r.footprint_bytes,
                r.flops,
                extra(r.flops),
                _max_diff(r.grads, base.grads),
                r.compile_seconds,
                r.step_seconds,
                plan_s,
                target,
            )
        )
        finish(rows[-1], t0)

    for job in jobs:
        run_job(job)
    if specs is None:
        lowest = _lowest_reference_fraction(prog, jobs, rows[1:], base.temp_bytes)
        specs = [parse_budget(b) for b in default_budgets(lowest)]
        if len(specs) != n_budgets:
            bar.total = total = 1 + len(jobs) + len(solvers) * len(specs)
        if lowest is not None and lowest > DEFAULT_BUDGETS[0]:
            logger.info(
                "compare %s: the lowest reference plan holds %.3f of no remat's temp; budgets "
                "%s (the defaults %s start below it)",
                what,
                lowest,
                ", ".join(str(sp.raw) for sp in specs),
                ", ".join(map(str, DEFAULT_BUDGETS)),
            )
    for solver in solvers:
        for spec in specs:
            run_job(_Job(_solver_label(solver), solver=solver, spec=spec))
    bar.close()
    logger.info("compare %s: done in %.0f s", what, time.perf_counter() - t_start)
    return Comparison(rows, description, base.temp_bytes)


def default_budgets(lowest: float | None) -> tuple[float, ...]:
    """The planner budgets `compare` runs when given none: `DEFAULT_BUDGETS` (0.25, 0.5, 0.75)
    when the lowest compiled reference plan (`lowest`, a fraction of no remat's temp bytes;
    None when unknown) holds at most the smallest of them, else three budgets spread over the
    reachable range: `lowest` rounded up to 0.01, then a third and two thirds of the way
    from it to 1. Every reference plan is a candidate of `jremat.plan`, so a budget at or
    above `lowest` is reachable."""
    if lowest is None or lowest <= DEFAULT_BUDGETS[0]:
        return DEFAULT_BUDGETS
    lo = min(math.ceil(lowest * 100) / 100, 1.0)
    spread = [round(lo + k * (1.0 - lo) / 3, 2) for k in range(3)]
    return tuple(sorted(set(spread)))


def _lowest_reference_fraction(
    prog: Program, jobs: list[_Job], fixed_rows: list[Row], base_temp: int
) -> float | None:
    """The smallest temp (a fraction of `base_temp`) of the compiled rows that are reference
    plans of the planner (`ANCHOR_RECIPES`, compiled by `jremat.plan` as candidates); None
    when no such row was compiled."""
    if len(layer_segments(prog.graph)) < 2 or not base_temp:
        return None  # the planner compiles the per-layer recipes only for several layers
    temps = [
        row.temp_bytes
        for job, row in zip(jobs, fixed_rows, strict=True)
        if job.recipe in ANCHOR_RECIPES and row.ok
    ]
    return min(temps) / base_temp if temps else None


def _solver_label(solver: str) -> str:
    """Row label of a planner: "jremat auto" for `jremat.plan`'s default, else with its name."""
    return AUTO if solver == "auto" else f"{AUTO} ({solver})"


def _progress(total: int, enabled: bool | None, what: str):
    """A tqdm bar: a widget in a Jupyter kernel that has ipywidgets, else a text bar on stderr.

    `enabled` None: on when stderr is a terminal or the widget can be drawn; a notebook
    without ipywidgets gets no bar (and no `TqdmWarning`) unless `enabled` is True, when the
    text bar is used.
    """
    widget = "ipykernel" in sys.modules and importlib.util.find_spec("ipywidgets") is not None
    if widget:
        from tqdm.notebook import tqdm
    else:
        from tqdm.std import tqdm
    if enabled is None:
        enabled = widget or sys.stderr.isatty()
    return tqdm(total=total, disable=not enabled, desc=f"jremat compare {what}"[:60], leave=False)
