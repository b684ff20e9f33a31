"""`Program`: one function at one signature, its `Graph`, and the compiled figures (temp
bytes, FLOPs, fixed bytes) of every plan tried on it; the planner and reference plans
(anchors) it is searched with.

Why plans are judged on compiled programs: docs/design.md#measuring and
docs/design.md#verification."""

from __future__ import annotations

import concurrent.futures
import contextvars
import copy
import dataclasses
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jremat._src.base.args import (
    check_differentiable,
    check_flag,
    check_loss_output,
    check_scalar_output,
    normalize_argnums,
)
from jremat._src.base.batching import Batching
from jremat._src.base.sharding import arg_mesh, manual_axes, shard_args
from jremat._src.base.targets import args_device
from jremat._src.compile.xla import (
    MemoryFigures,
    compile_figures,
    compile_step,
    figures_only_is_default,
    step_args,
)
from jremat._src.plan.offload import OffloadCost, host_offload_effective, offload_proxy, offloads
from jremat._src.plan.plan import Plan, plan_key
from jremat._src.plan.planners import PLANNERS
from jremat._src.plan.recipes import (
    anchor_plans,
    dots_policies_differ,
    same_program_key,
    scan_configs,
)
from jremat._src.plan.rewrite import graph_function, holds_tracers, rematerialize
from jremat._src.trace.graph import Graph, build_graph
from jremat._src.trace.layers import has_checks, has_scan

logger = logging.getLogger(__name__)

#: `solver="auto"` uses the exact MILP (`AUTO_MILP_NODES` branch-and-bound nodes per solve,
#: warm-started with the chain DP's plan)
#: up to this many equations; above, the chain DP, which is exact on the same model up to its
#: 1/384 memory discretization and runs in well under a second.
AUTO_MILP_MAX_NODES = 120


#: The node limit of `solver="auto"`'s MILP: a bound on work, not on time, so the plan is
#: the same on every process and under any load (docs/design.md#planners).
AUTO_MILP_NODES = 16


class CompileBudgetSpent(Exception):
    """A compile the search asked for would exceed the program's `compile_budget` (leaving
    none for the `jit(grad)` check of a plan it compiles), or the search it cuts short under
    the default's budget (`Program.budget_lifts`). Internal: `solve` catches it and returns
    the best plan verified so far, or under the default goes on without a limit
    (docs/guides/planning-cost.md)."""


#: Threads `Program.compile_many` compiles in: one per CPU (XLA:CPU compiles a program on one
#: thread mostly; on an accelerator host the compiles are CPU work too). `JREMAT_COMPILE_THREADS`
#: overrides it (1: compile one after another).
COMPILE_THREADS = max(1, int(os.environ.get("JREMAT_COMPILE_THREADS", 0)) or os.cpu_count() or 1)

#: `Program.compile_with_grad` compiles a round's `jit(grad)` step ahead only with this many
#: compile threads (CPUs) or more.
SPECULATE_THREADS = 4


@dataclasses.dataclass
class Compiled:
    temp_bytes: int
    flops: float
    fixed_bytes: int  # argument + output - alias
    #: for a plan that offloads on a backend where offloading has no memory effect (CPU): the
    #: offload plan's own compiled temp bytes; `temp_bytes` is then that of the proxy plan
    #: (offloaded values recomputed instead), see docs/design.md#host-offload. None otherwise.
    offload_temp_bytes: int | None = None
    #: how `temp_bytes` was read (`xla.MEMORY_FIGURES`) and what was compiled for
    #: (`MemoryFigures.target`)
    figure: str = "temp_size_in_bytes"
    target: str = "cpu"

    @property
    def footprint_bytes(self) -> int:
        """`fixed_bytes + temp_bytes` (`MemoryFigures.footprint_bytes` of the same compile)."""
        return self.fixed_bytes + self.temp_bytes


class Objective:
    """What a `Program` compiles for a plan, and how it reads the executable's figures.

    `Program.step` compiles `jit(value_and_grad(objective.step_fn(prog, plan)))` at the
    program's arguments (one path: memo per plan structure, `tried` log, host-offload proxy,
    `shard_map` axes) and turns its memory figures and FLOPs into `Compiled` with
    `objective.figures`. This default is a training step of the program's loss: `fn`
    rewritten under the plan, its compiled temp bytes and argument + output - alias bytes.
    (`jremat._src.compile.blocks.KeptBytes` is the objective of a Flax block.)
    """

    #: Whether the full search compiles its floor plans (`solve._ladder`: the planner's
    #: plans just above the model's minimum, which do not depend on the target) at every
    #: budget, not only where no reference plan fits. Off for a loss: three compiles of
    #: the whole step each time, for plans that recompute the most.
    floor_plans_always = False

    #: Whether `compile_budget="auto"` (the default) caps the search: a step of the whole
    #: program, whose compiles are what a user waits for.
    capped_by_default = True

    def step_fn(self, prog: Program, plan: Plan | None) -> Callable[..., Any]:
        """The scalar function whose `value_and_grad` is compiled for `plan` (None: no remat)."""
        if plan is None or plan.is_identity:
            return prog.fn
        if prog.graph_reusable:  # the graph at these arguments: fn is not traced again
            return graph_function(prog.graph, plan)
        return rematerialize(prog.fn, plan)

    def figures(self, prog: Program, mem: MemoryFigures, flops: float) -> Compiled:
        """The plan's figures from its compiled step's memory figures and FLOPs."""
        return Compiled(mem.temp_bytes, flops, mem.fixed_bytes)


class Program:
    """One function at one signature: its graph, and compiled figures of plans on it.

    What a plan compiles to and which figures are reported is the `objective` (default
    `Objective()`: a training step of `fn`, its temp bytes)."""

    def __init__(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any],
        argnums: int | Sequence[int],
        in_shardings: Any = None,
        mesh: Any = None,
        graph: Graph | None = None,
        objective: Objective | None = None,
        has_aux: bool = False,
        batching: Batching | None = None,
    ):
        """`graph`: `fn` already traced at these arguments (`build_graph`), reused instead of
        tracing it again; its outputs are checked to be a scalar float loss, or with `has_aux`
        a pair `(loss, aux)` (the step compiled is then `value_and_grad(fn, has_aux=True)`).
        `batching`: the caller's vmaps around `fn` (`base.batching.batching_of`): `args` are
        per example, planned on as they are, and every step is compiled under the vmaps at the
        batched arguments (`xla.step_grad`), so figures and budgets are the batched step's."""
        if not callable(fn):
            raise TypeError(f"fn must be a callable, got {type(fn).__name__}")
        self.fn = fn
        self.has_aux = check_flag("has_aux", has_aux)
        self.batching = batching
        self.nums = normalize_argnums(argnums, len(args))
        # shapes, dtypes and the sharding each argument runs under (base/sharding.py)
        self.args = shard_args(args, in_shardings, mesh)
        check_differentiable(self.args, self.nums)
        if graph is None:
            check_scalar_output(fn, self.args, self.has_aux)
            graph = build_graph(fn, self.args, self.nums)
        else:  # checked on the traced outputs' shapes: fn is not traced again
            check_loss_output(graph.out_shape, self.has_aux)
        self.graph: Graph = graph
        #: the graph's constants are concrete: candidates are compiled from it without
        #: tracing `fn` again (`rewrite.graph_function`)
        self.graph_reusable = not holds_tracers(graph)
        #: inside a shard_map body: its mesh axes, bound when compiling (see compile_step)
        self.manual_axes = manual_axes()
        self._baseline: Compiled | None = None
        self.has_scan = has_scan(self.graph)
        #: `fn` holds `checkify.check`s: its steps compile checkified (`xla.compile_step`)
        self.checks = has_checks(self.graph)
        self._planners: dict = {}
        self._steps: dict[str, tuple[Compiled, Any, float]] = {}
        self._runnable: set[str] = set()  # keys of `_steps` compiled to run (`step`)
        self._grad_temps: dict[str, int] = {}
        #: `grad_step_ahead`'s compiles in flight, by plan key, and the one worker thread of
        #: compiles started ahead (`_submit_ahead`)
        self._grad_ahead: dict[str, concurrent.futures.Future] = {}
        #: `jit(grad)` checks compiled ahead (`_grad_speculated`) that no `grad_step_temp`
        #: read yet, by plan key: how many compiles each is, charged when one is read, by
        #: whichever search reads it (as a search on one thread would compile it then)
        self._grad_unpaid: dict[str, int] = {}
        #: the keys of `_grad_unpaid` the current search started (`compiles_ahead_unread`)
        self._grad_started: set[str] = set()
        #: `compile_many(..., rest_in_background=True)`'s compiles, by plan key
        self._steps_ahead: dict[str, concurrent.futures.Future] = {}
        self._ahead_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.tried: list[tuple[Plan, Compiled]] = []  # every plan compiled on this program
        #: whole-program compiles one search may spend (both steps of a plan count), or None:
        #: no cap; set by `solve` (`jremat.plan(compile_budget=)`)
        self.compile_budget: int | None = None
        #: whole-program compiles made so far (each `value_and_grad` and `jit(grad)` step)
        self.compiles_spent = 0
        #: whether `compile_budget` is the default's ("auto"): a search it cuts short (a plan
        #: worth compiling left without room) raises `CompileBudgetSpent`, and `solve` goes on
        #: without it, rather than return the best plan so far
        self.budget_lifts = False
        self._anchors: dict = {}
        self.objective = Objective() if objective is None else objective
        self._lock = threading.RLock()  # `_steps` and `tried`, written by compile threads
        # JAX's mesh context is per thread: a program that may depend on one is compiled in
        # the caller's thread only
        ambient = jax.sharding.get_abstract_mesh()
        #: whether plans may compile in helper threads: no mesh in context, no sharded or
        #: `shard_map` arguments (their figures are then a device's too)
        self.threads_ok = (
            not self.manual_axes
            and arg_mesh(jax.tree_util.tree_leaves(self.args)) is None
            and (ambient is None or getattr(ambient, "empty", True))
        )

    @functools.cached_property
    def _dots_policies_differ(self) -> bool:
        return dots_policies_differ(self.graph)

    def program_key(self, plan: Plan | None) -> str:
        """The memo key of `plan`'s compiled step: equal for plans that compile to the same
        program (`recipes.same_program_key`)."""
        return same_program_key(plan, self._dots_policies_differ)

    @property
    def device(self) -> Any:
        """A device the program compiles for (`base.targets.args_device`)."""
        return args_device(self.args)

    @property
    def compiles(self) -> int:
        """How many programs this `Program` compiled (each plan structure once)."""
        return len(self._steps)

    def compile(self, plan: Plan | None) -> Compiled:
        """The objective's figures under `plan` (None: no remat); by default the compiled temp
        bytes and FLOPs of one training step. Memoized per plan structure: the same segments
        and saves compile once (for their figures only: `xla.compile_jitted`)."""
        key = self.program_key(plan)
        with self._lock:
            found = self._steps.get(key)
            ahead = self._steps_ahead.get(key)
        if found is None and ahead is not None:
            self._wait_ahead(key, ahead)  # compiled in the background: its figures, or error
            with self._lock:
                found = self._steps[key]
        return (found or self._store(plan, self._compile_step(plan)))[0]

    def step(self, plan: Plan | None) -> tuple[Compiled, Any, float]:
        """(figures, executable, compile seconds) of `jit(value_and_grad)` of the objective's
        function under `plan`, compiled once per plan structure to run (a plan `compile`
        compiled for its figures only is compiled again, with the default options, figures
        from that compile; not where that compile was the default one already,
        `figures_compile_runs`); every compiled plan is also listed in `tried`."""
        key = self.program_key(plan)
        with self._lock:
            found = self._steps.get(key)
        if found is not None and (key in self._runnable or self.figures_compile_runs):
            return found
        step = self._compile_step(plan, figures_only=False)
        with self._lock:
            self._runnable.add(key)
            if key in self._steps:  # compiled for its figures meanwhile too: this one runs
                self._steps[key] = step
                return step
        return self._store(plan, step)

    @functools.cached_property
    def figures_compile_runs(self) -> bool:
        """Whether the executable of a plan compiled for its figures (`compile`) is the one
        `step` would compile to run: no figures-only options on this program's platform
        (GPU, TPU; `xla.figures_only_is_default`), and not a `shard_map` body, whose figures
        may be another step's (`xla.compile_figures`). There a plan the search compiled is
        not compiled again to run (`jremat.compare`'s rows)."""
        return not self.manual_axes and figures_only_is_default(self.args)

    def compile_many(
        self, plans: Sequence[Plan | None], *, rest_in_background: bool = False
    ) -> list[Compiled]:
        """`compile` of each plan; those not compiled yet are compiled in parallel threads
        (XLA's compiler releases the GIL; `COMPILE_THREADS` at most). Figures, `tried` and
        memo are those of compiling them one after another in this order, whatever order the
        threads finish in.

        With `rest_in_background` (two plans, as `_compile_baseline`'s baseline and recipe),
        it returns `[compile(plans[0])]` once that is compiled, while the second compiles on
        in a background thread, where there are two compile threads: the caller plans on the
        first's figures meanwhile (the GIL's thread) and `compile` of the second waits for
        it (and raises its error). The compile counts against `compile_budget` at its start,
        as in order; `settle` waits for it."""
        if (
            rest_in_background
            and len(plans) == 2
            and self.threads_ok
            and COMPILE_THREADS >= 2
            and self._affordable(plans) == 2
        ):
            head, rest = plans
            key = self.program_key(rest)
            with self._lock:
                start = key not in self._steps and key not in self._steps_ahead
                if start:
                    self._charge(self.step_compiles, reserve=self._step_reserve(rest))
                    context = contextvars.copy_context()
                    self._steps_ahead[key] = self._submit_ahead(
                        lambda: context.run(self._compile_charged, rest)
                    )
            if start:
                logger.info("compiling 2 plans in 2 threads (the second on in the background)")
            return [self.compile(head)]
        with self._lock:
            firsts: dict[str, Plan | None] = {}  # plan key -> its first plan, in order
            for p in plans:
                key = self.program_key(p)
                if key not in self._steps and key not in self._steps_ahead:
                    firsts.setdefault(key, p)
        todo = list(firsts.values())
        if self.compile_budget is not None:
            # the prefix the budget allows, so that which plans compiled does not depend on
            # the threads' order; the first one left raises `CompileBudgetSpent` below
            todo = todo[: self._affordable(todo)]
        workers = min(len(todo), COMPILE_THREADS) if self.threads_ok else 1
        if workers > 1:
            logger.info("compiling %d plans in %d threads", len(todo), workers)
            # each task in a copy of the caller's context: `jremat.disabled()` and other
            # context variables hold while the plan's function is traced
            tasks = [(contextvars.copy_context(), p) for p in todo]
            run = lambda task: task[0].run(self._compile_step, task[1])  # noqa: E731
            with concurrent.futures.ThreadPoolExecutor(workers, "jremat-compile") as pool:
                for p, step in zip(todo, pool.map(run, tasks), strict=True):
                    self._store(p, step)  # in `plans` order: deterministic `tried`
        return [self.compile(p) for p in plans]

    def await_ahead(self) -> None:
        """Wait for `compile_many`'s background compiles; raise the first one's error (where
        `compile_many` compiling in order would have raised it)."""
        with self._lock:
            started = list(self._steps_ahead.items())
        for key, ahead in started:
            self._wait_ahead(key, ahead)

    def _wait_ahead(self, key: str, ahead: concurrent.futures.Future) -> None:
        """Wait for the background compile `ahead` of plan key `key`; where it failed, raise
        its error once (a later call compiles the plan again, as in order)."""
        try:
            ahead.result()
        except BaseException:
            with self._lock:
                self._steps_ahead.pop(key, None)
            raise

    def compiling_ahead(self, plan: Plan | None) -> bool:
        """Whether `plan` is compiling in the background now (`compile_many`'s rest)."""
        with self._lock:
            ahead = self._steps_ahead.get(self.program_key(plan))
        return ahead is not None and not ahead.done()

    def _compile_charged(self, plan: Plan | None) -> None:
        """`_compile_step` of a plan charged for already (`compile_many`'s background one),
        stored."""
        self._store(plan, self._compile_step(plan, charged=True))

    def _compile_step(
        self, plan: Plan | None, figures_only: bool = True, charged: bool = False
    ) -> tuple[Compiled, Any, float]:
        if not charged:
            # a plan's step leaves room for its `jit(grad)` check (the baseline needs none)
            self._charge(self.step_compiles, reserve=self._step_reserve(plan))
        f = self.objective.step_fn(self, plan)
        t0 = time.perf_counter()
        exe, flops = self.compile_fn(f, figures_only=figures_only)
        seconds = time.perf_counter() - t0
        mem = MemoryFigures.of(exe)
        compiled = dataclasses.replace(
            self.objective.figures(self, mem, flops), figure=mem.figure, target=mem.target
        )
        if offloads(plan) and not host_offload_effective():
            # the offload is a no-op here: device memory from the proxy
            # (docs/design.md#host-offload); FLOPs and executable stay the offload plan's own
            proxy = self.compile(offload_proxy(plan))
            compiled = dataclasses.replace(
                compiled, temp_bytes=proxy.temp_bytes, offload_temp_bytes=compiled.temp_bytes
            )
        logger.info(
            "compiled %s in %.1f s: temp %s bytes",
            "the unrematerialized program" if plan is None else f"plan {plan.solver!r}",
            seconds,
            f"{compiled.temp_bytes:,}",
        )
        return compiled, exe, seconds

    def _store(self, plan: Plan | None, step: tuple[Compiled, Any, float]):
        key = self.program_key(plan)
        with self._lock:
            if key not in self._steps:
                self._steps[key] = step
                if plan is not None and not plan.is_identity:
                    self.tried.append((copy.deepcopy(plan), step[0]))
            return self._steps[key]

    def grad_step_temp(self, plan: Plan | None) -> int:
        """Compiled temp bytes of the step that drops the loss, `jit(grad(fn))`, under `plan`.

        XLA may schedule it with more temp than `jit(value_and_grad(fn))`, the step `compile`
        measures (a 2-layer MLP under per-layer remat: 1,048,576 vs 917,504 bytes, jax 0.10),
        and callers run either, so a returned plan must hold under both
        (docs/design.md#verification). Memoized per plan structure. Programs whose figures
        already hold for both (a `shard_map` body), other objectives (a Flax block's kept
        bytes) and offloading plans (measured on a proxy) return `compile(plan)`'s temp.
        """
        if not self._grad_step_apart(plan):
            return self.compile(plan).temp_bytes
        key = self.program_key(plan)
        with self._lock:
            ahead = self._grad_ahead.get(key)
            if key in self._grad_unpaid:  # started ahead, uncharged: charged now it is read
                self._charge(self._grad_unpaid[key])
                del self._grad_unpaid[key]
        return self._grad_temp(plan) if ahead is None else ahead.result()

    @property
    def compiles_ahead_unread(self) -> int:
        """Compiles of `jit(grad)` checks the current search started ahead that no
        `grad_step_temp` read (not in `compiles_spent`; a plan's `compiles` counts them)."""
        with self._lock:
            return sum(self._grad_unpaid.get(k, 0) for k in self._grad_started)

    def start_counting(self, compile_budget: int | None, lifts: bool) -> None:
        """A search begins: `compile_budget` (`budget_lifts` with `lifts`), nothing spent.
        Checks an earlier search started and left unread stay unpaid: this search pays for
        one it reads, as it would compile it on one thread."""
        with self._lock:
            self.compile_budget, self.compiles_spent = compile_budget, 0
            self.budget_lifts = lifts
            self._grad_started.clear()

    def _charge(self, n: int = 1, reserve: int = 0) -> None:
        """Count `n` whole-program compiles against `compile_budget`; raise
        `CompileBudgetSpent` instead where they would leave fewer than `reserve` compiles."""
        with self._lock:
            if self.compile_budget is not None and (
                self.compiles_spent + n + reserve > self.compile_budget
            ):
                raise CompileBudgetSpent(
                    f"{self.compiles_spent} of {self.compile_budget} compiles spent"
                )
            self.compiles_spent += n

    @property
    def step_compiles(self) -> int:
        """XLA compiles one step's figures take: 3 in a `shard_map` body (the step, the step
        that drops the loss and the data-parallel step, `xla.compile_figures`), else 1."""
        return 3 if self.manual_axes else 1

    def grad_check_compiles(self, plan: Plan | None) -> int:
        """Compiles `grad_step_temp(plan)` takes when not known yet: none where the step's
        figures hold for it already, 2 with `has_aux` (with the aux, then without), else 1."""
        if not self._grad_step_apart(plan):
            return 0
        return 2 if self.has_aux else 1

    def _step_reserve(self, plan: Plan | None) -> int:
        """Compiles a plan's step leaves for its `jit(grad)` check (none for the baseline)."""
        return 0 if plan is None or plan.is_identity else self.grad_check_compiles(plan)

    def room_for(self, plan: Plan) -> bool:
        """Whether the compile budget leaves `plan`'s step and its `jit(grad)` check."""
        return self.compiles_left >= self.step_compiles + self.grad_check_compiles(plan)

    def verification_compiles(self) -> int:
        """The fewest compiles a verified plan needs here: the unrematerialized step (and,
        with `has_aux`, that step without its aux), a plan's step and its `jit(grad)` check."""
        apart = self._grad_step_apart(None)
        return 2 * self.step_compiles + int(apart and self.has_aux) + self.grad_check_compiles(None)

    def _affordable(self, plans: Sequence[Plan | None]) -> int:
        """How many of `plans`, compiled in order, `_charge` lets compile."""
        left = self.compiles_left
        for n, p in enumerate(plans):
            if self.step_compiles + self._step_reserve(p) > left:
                return n
            left -= self.step_compiles
        return len(plans)

    def grad_known(self, plan: Plan | None) -> bool:
        """Whether `grad_step_temp(plan)` needs no compile (known, or the same step's)."""
        if not self._grad_step_apart(plan):
            return self.program_key(plan) in self._steps
        with self._lock:
            key = self.program_key(plan)
            return key in self._grad_temps and key not in self._grad_unpaid

    @property
    def compiles_left(self) -> float:
        """Compiles `compile_budget` leaves (inf with no budget)."""
        if self.compile_budget is None:
            return float("inf")
        return self.compile_budget - self.compiles_spent

    def grad_step_ahead(self, plan: Plan) -> None:
        """Start `grad_step_temp(plan)` in a background thread and return at once, where
        plans compile in threads on 2 CPUs or more and the step is one of its own (not
        where `compile_with_grad` compiled it already). For the search's best fitting plan
        so far: it is most often the one returned, and its `jit(grad)` check then compiles
        on the CPU the search's next planning and lowering (one thread, the GIL's) leave
        idle, rather than after the search. `grad_step_temp` waits for it (and raises what
        it raised); `settle` waits for every one started.

        Not under a compile budget the caller set: a check the search may not need would
        take a compile from it. Elsewhere it is charged when `grad_step_temp` reads it, so
        that the search spends the compiles it spends on one thread; one never read is
        counted in `compiles_ahead_unread`. (GPT-2, 6 layers, at 0.5, one idle
        2-CPU host: the check compiled during 0.8-1.3 s of planning that followed the plan.)"""
        with self._lock:
            if (task := self._grad_speculated(plan, 2)) is None:
                return
            self._grad_ahead[self.program_key(plan)] = self._submit_ahead(task)

    def _submit_ahead(self, task: Callable[[], Any]) -> concurrent.futures.Future:
        """`task` on the one background thread of compiles started ahead (`settle` ends it).
        Call with `_lock` held."""
        if self._ahead_pool is None:
            self._ahead_pool = concurrent.futures.ThreadPoolExecutor(1, "jremat-ahead")
        return self._ahead_pool.submit(task)

    def _grad_speculated(self, plan: Plan, min_threads: int) -> Callable[[], int] | None:
        """`grad_step_temp(plan)`'s compile as a task for another thread, where it may start
        before the search asks for it (plans compile in threads, `min_threads` CPUs or more,
        a step of its own not known yet, no compile budget or the default's, which leaves
        room for it); None elsewhere. It is marked unpaid: charged when `grad_step_temp`
        reads it. Call with `_lock` held."""
        key = self.program_key(plan)
        if not (
            self.threads_ok
            and COMPILE_THREADS >= min_threads
            and self._grad_step_apart(plan)
            and (self.compile_budget is None or self.budget_lifts)
            and key not in self._grad_temps
            and key not in self._grad_ahead
            and self.compiles_left >= self.grad_check_compiles(plan)
        ):
            return None
        self._grad_unpaid[key] = self.grad_check_compiles(plan)
        self._grad_started.add(key)
        context = contextvars.copy_context()
        return lambda: context.run(self._grad_temp, plan, False)

    def settle(self) -> None:
        """Wait for the compiles started ahead (`grad_step_ahead`'s, `compile_many`'s in the
        background; their errors stay with them, for a `grad_step_temp` or `compile` that
        asks) and end their thread: no compile of this program runs once a search has
        returned."""
        with self._lock:
            pool, self._ahead_pool = self._ahead_pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def _grad_step_apart(self, plan: Plan | None) -> bool:
        """Whether `grad_step_temp(plan)` compiles a `jit(grad)` step of its own (see there)."""
        return not (self.manual_axes or type(self.objective) is not Objective or offloads(plan))

    def _grad_temp(self, plan: Plan | None, charge: bool = True) -> int:
        key = self.program_key(plan)
        with self._lock:
            found = self._grad_temps.get(key)
        if found is None:
            if charge:  # both compiles at once (with has_aux): none made that cannot count
                self._charge(self.grad_check_compiles(plan))
            f = self.objective.step_fn(self, plan)
            found = self._grad_only_temp(f, self.has_aux, charge=False)
            if self.has_aux:  # the caller's step may drop the aux: XLA then schedules anew
                found = max(found, self._grad_only_temp(_loss_only(f), False, charge=False))
            with self._lock:
                self._grad_temps[key] = found
        return found

    def _grad_only_temp(self, f: Callable[..., Any], has_aux: bool, charge: bool = True) -> int:
        """Compiled temp bytes of `jit(grad(f))` at this program's arguments (charged to
        `compile_budget` unless `charge` is False: `grad_step_ahead`'s)."""
        if charge:
            self._charge()
        exe = compile_step(
            f,
            self.args,
            self.nums,
            has_aux,
            value=False,
            figures_only=True,
            checks=self.checks,
            batching=self.batching,
        )
        return MemoryFigures.of(exe).temp_bytes

    def compile_with_grad(self, plan: Plan) -> Compiled:
        """`compile(plan)`, with the `jit(grad)` step of `grad_step_temp(plan)` compiled at the
        same time in a second thread (where plans compile in threads), so that a plan about to
        be returned has both figures after one compile's wall time. Figures and memo as
        `compile` then `grad_step_temp`; not under a compile budget the caller set, and
        under the default's charged when read (`grad_step_ahead`). Only with
        `SPECULATE_THREADS` compile threads or more: a plan not returned wastes its
        `jit(grad)` compile, which costs wall time where no CPU is idle."""
        with self._lock:
            room = self.compiles_left >= self.step_compiles + self._step_reserve(plan)
            task = self._grad_speculated(plan, SPECULATE_THREADS) if room else None
            ahead = None
            if task is not None:  # a thread of its own: the one of `_submit_ahead` may be busy
                pool = concurrent.futures.ThreadPoolExecutor(1, "jremat-compile")
                ahead = self._grad_ahead[self.program_key(plan)] = pool.submit(task)
                pool.shutdown(wait=False)
        try:
            return self.compile(plan)
        finally:
            if ahead is not None:  # its error is raised where `grad_step_temp` reads it
                concurrent.futures.wait([ahead])

    def compile_fn(
        self, f: Callable[..., Any], *, scan_flops: bool = True, figures_only: bool = True
    ) -> tuple[Any, float]:
        """(executable, FLOPs) of `jit(value_and_grad(f))` at this program's arguments and
        argnums, inside a `shard_map` body under its mesh axes (`compile_figures`; by default
        for its figures only). Not memoized: `step` memoizes plans."""
        return compile_figures(
            f,
            self.args,
            self.nums,
            manual_axes=self.manual_axes,
            scan_flops=scan_flops,
            has_aux=self.has_aux,
            figures_only=figures_only,
            checks=self.checks,
            batching=self.batching,
        )

    @property
    def step_args(self) -> tuple:
        """The arguments the compiled step runs at: `args`, batched under `batching`."""
        return step_args(self.args, self.batching)

    @property
    def baseline(self) -> Compiled:
        """The unrematerialized step's figures. With `has_aux`, its temp bytes are the
        smaller of the `jit(value_and_grad)` step's and the `jit(grad)` step's that drops the
        aux (what a caller's train step that uses only the gradients compiles to): a fraction
        is then of the smallest unrematerialized step the caller may run, and holds on each
        (the returned plan is checked on both, `grad_step_temp`)."""
        if self._baseline is None:
            base = self.compile(None)
            if self.has_aux and self._grad_step_apart(None):
                dropped = self._grad_only_temp(_loss_only(self.fn), False)
                if dropped < base.temp_bytes:
                    logger.info(
                        "the unrematerialized step without its aux compiled to %s temp bytes",
                        f"{dropped:,}",
                    )
                    base = dataclasses.replace(base, temp_bytes=dropped)
            self._baseline = base
        return self._baseline

    def planner(
        self,
        solver: str,
        max_cuts: int,
        offload: OffloadCost | None = None,
        *,
        uncalibrated: bool = False,
        baseline_fit: bool = False,
    ):
        """The planner for this graph (built once per solver, cut count and offload cost).
        With `uncalibrated`, a planner of its own that the full search never calibrates (its
        model stays in model bytes), so that the best-first search plans the same whatever
        was planned on this program before. With `baseline_fit`, another one of its own whose
        model is fitted to the compiled baseline alone (`SegmentModel.fit_unrematerialized`,
        compiling the baseline if it is not yet), the aimed search's."""
        kw: dict[str, Any] = {}
        if solver == "auto":
            solver = "milp" if self.graph.num_nodes <= AUTO_MILP_MAX_NODES else "chain"
            kw = {"max_nodes": AUTO_MILP_NODES} if solver == "milp" else {}
        if solver == "milp":
            max_cuts = min(max_cuts, 32)  # the MILP has O(max_cuts x span x options) binaries
        key = (solver, max_cuts, offload, uncalibrated, baseline_fit)
        if offload is not None:
            kw["offload"] = offload
        if key not in self._planners:
            planner = PLANNERS[solver](self.graph, max_cuts=max_cuts, **kw)
            if baseline_fit:
                planner.model.fit_unrematerialized(self.baseline.temp_bytes)
            self._planners[key] = planner
        return self._planners[key]

    def anchors(self, planner, also: Sequence[Plan | None] = ()) -> list[tuple[Plan, Compiled]]:
        """Compiled reference plans, first the planner's min-memory plan, then `ANCHOR_RECIPES`
        (built-in policies per layer, sqrt(n) segments of Chen et al. 2016), then the loop
        rematerializations of `scan_configs` on the unchanged program and, where the
        min-memory plan compiles below the unrematerialized program (rematerializing outside
        the loops pays), on the min-memory plan too. Compiled once per program, in parallel
        (`compile_many`) with the plans of `also` (not returned)."""
        akey = (planner.name, getattr(planner, "offload", None))
        if akey not in self._anchors:
            min_plan = planner.min_memory_plan()
            configs = scan_configs(self.graph)

            def with_scans(base_plan: Plan) -> list[Plan]:
                out = []
                for scans in configs:
                    p = copy.deepcopy(base_plan)
                    p.scans, p.solver = scans, f"{base_plan.solver}+scan"
                    out.append(p)
                return out

            plans = self._distinct([min_plan, *anchor_plans(self.graph)])
            plans += self._distinct(with_scans(Plan.identity(self.graph)), plans)
            compiled = self.compile_many([*plans, *also])[: len(plans)]
            if configs and compiled[0].temp_bytes < self.baseline.temp_bytes:
                more = self._distinct(with_scans(min_plan), plans)
                plans, compiled = plans + more, compiled + self.compile_many(more)
            self._anchors[akey] = list(zip(plans, compiled, strict=True))
        return [(copy.deepcopy(p), c) for p, c in self._anchors[akey]]

    @staticmethod
    def _distinct(plans: list[Plan], taken: Sequence[Plan] = ()) -> list[Plan]:
        """`plans` without repeats (by `plan_key`, first kept) and without those in `taken`."""
        seen = {plan_key(p) for p in taken}
        out = []
        for p in plans:
            if plan_key(p) not in seen:
                seen.add(plan_key(p))
                out.append(p)
        return out

    def record(self, plan: Plan, c: Compiled) -> Plan:
        plan.measured_temp_bytes = c.temp_bytes
        plan.measured_flops = c.flops
        plan.baseline_temp_bytes = self.baseline.temp_bytes
        plan.measured_footprint_bytes = c.footprint_bytes
        plan.baseline_flops = self.baseline.flops
        plan.memory_figure, plan.target = c.figure, c.target
        if c.offload_temp_bytes is not None:
            plan.notes.append(
                f"host offload has no memory effect on backend {jax.default_backend()!r}: "
                f"this plan compiles to {c.offload_temp_bytes:,} temp bytes here; "
                f"measured_temp_bytes ({c.temp_bytes:,}) is the compiled temp of the same plan "
                "with its offloaded values recomputed instead, the device memory expected "
                "where pinned host memory exists. Not confirmed by this compile."
            )
        return plan


def _loss_only(f: Callable[..., Any]) -> Callable[..., Any]:
    """`f`, a `(loss, aux)` function, returning its loss alone."""

    @functools.wraps(f)
    def loss(*args: Any) -> Any:
        return f(*args)[0]

    return loss
