"""`plan_training`: choose microbatching and rematerialization for a train step under a budget.

Compiles the whole train step per configuration (k microbatches, a remat plan on one
microbatch; Chen et al. 2016, arXiv:1604.06174) and keeps the one that fits the byte budget
with the fewest FLOPs. Why both, and what is compiled:
docs/design.md#accumulation-and-microbatching.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import optax

from jremat._src.base import compat as _compat
from jremat._src.base.args import check_compile_budget, check_flag, check_scalar_output
from jremat._src.base.budget import BudgetLike, parse_budget
from jremat._src.base.errors import InfeasibleBudgetError
from jremat._src.base.sharding import shard_args
from jremat._src.base.targets import args_device
from jremat._src.compile import xla
from jremat._src.compile.program import Program
from jremat._src.plan.plan import Plan, plan_key
from jremat._src.plan.rewrite import rematerialize
from jremat._src.search.solve import solve
from jremat._src.training.microbatching import (
    check_aux_reduction,
    leading_batch_size,
    microbatch,
)

logger = logging.getLogger(__name__)

__all__ = ["TrainingPlan", "plan_training"]

DEFAULT_REMAT_BUDGETS = (0.5, 0.25)


@dataclasses.dataclass
class TrainingPlan:
    """The configuration `plan_training` chose, and what it measured.

    Attributes:
      num_microbatches: `k`, the number of microbatches the batch is split into (along
        axis 0) inside one step; 1 means no microbatching.
      plan: the rematerialization `jremat.Plan` of `loss_fn` on one microbatch
        (shapes `batch / k`), or None for no rematerialization.
      compiled_footprint_bytes: compiled footprint of the chosen train step in bytes
        (argument + output - alias + temp, from `compiled.memory_analysis()`).
        `predicted_footprint_bytes` is a deprecated alias (it is no prediction).
      flops: compiled FLOPs of the chosen train step (`cost_analysis()` flops plus
        transcendentals, loop bodies counted once per trip).
      alternatives: one dict per configuration considered, in the order compiled:
        `{"k": int, "remat_budget": float | None, "footprint_bytes": int | None,
        "temp_bytes": int | None, "flops": float | None, "fits": bool}` (plus `"error"`,
        a message, when planning that configuration failed; its bytes and flops are None).
      value_and_grad: `(params, batch) -> (loss, grads)` to call inside the jitted train
        step: the full-batch mean loss (scalar, dtype of `loss_fn`'s output) and gradients
        (structure and dtypes of `params`), computed over `num_microbatches` microbatches
        with the rematerialized loss; `((loss, aux), grads)` with `has_aux` (aux combined
        over the microbatches by `aux_reduction`, as `jremat.microbatch`).
      budget_bytes: the byte budget the plan was made for.

    Examples:
      `jremat.plan_training` returns one:

      >>> import jax, jax.numpy as jnp, jremat
      >>> loss = lambda w, batch: jnp.mean(jnp.tanh(batch @ w) ** 2)
      >>> tp = jremat.plan_training(loss, jnp.ones((8, 8)), jnp.ones((4, 8)), budget="1MiB")
      >>> tp.num_microbatches, tp.plan is None, tp.budget_bytes  # fits as written
      (1, True, 1048576)
      >>> first = tp.alternatives[0]  # the first configuration compiled
      >>> first["k"], first["remat_budget"], first["fits"]
      (1, None, True)
      >>> loss_value, grad = tp.value_and_grad(jnp.ones((8, 8)), jnp.ones((4, 8)))
      >>> loss_value.shape, grad.shape
      ((), (8, 8))
    """

    num_microbatches: int
    plan: Plan | None
    compiled_footprint_bytes: int
    flops: float
    alternatives: list[dict[str, Any]]
    value_and_grad: Callable[[Any, Any], tuple[Any, Any]]
    budget_bytes: int = 0

    @property
    def predicted_footprint_bytes(self) -> int:
        """Deprecated alias of `compiled_footprint_bytes` (a compiled figure, not a prediction).

        Warns with `DeprecationWarning`."""
        warnings.warn(
            "TrainingPlan.predicted_footprint_bytes is deprecated: the figure is compiled, not "
            "predicted; use TrainingPlan.compiled_footprint_bytes",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.compiled_footprint_bytes

    def summary(self) -> str:
        """A few human-readable lines: the choice and every alternative."""
        remat = "none" if self.plan is None else f"budget {self.plan.budget}"
        lines = [
            f"TrainingPlan: k={self.num_microbatches}, remat={remat}, footprint "
            f"{self.compiled_footprint_bytes:,} B (compiled) <= budget {self.budget_bytes:,} B, "
            f"{self.flops:,.0f} FLOPs"
        ]
        for a in self.alternatives:
            fp = "-" if a["footprint_bytes"] is None else f"{a['footprint_bytes']:,} B"
            fl = "-" if a["flops"] is None else f"{a['flops']:,.0f}"
            rb = "none" if a["remat_budget"] is None else a["remat_budget"]
            extra = f" ({a['error']})" if "error" in a else ""
            lines.append(
                f"  k={a['k']:<3} remat={rb!s:<5} footprint={fp:>16} flops={fl:>16} "
                f"{'fits' if a['fits'] else 'over'}{extra}"
            )
        return "\n".join(lines)


def _default_candidates(size: int) -> list[int]:
    out, k = [], 1
    while k <= size:
        if size % k == 0:
            out.append(k)
        k *= 2
    return out


def _check_candidates(candidates: Iterable[int], size: int) -> list[int]:
    ks = []
    for k in candidates:
        if isinstance(k, bool) or not isinstance(k, int) or k <= 0 or size % k:
            raise ValueError(
                f"candidates must be positive ints dividing the batch size {size}; got {k!r}."
            )
        ks.append(int(k))
    if not ks:
        raise ValueError("candidates must name at least one number of microbatches.")
    return sorted(set(ks))


def _value_and_grad(
    loss_fn: Callable[..., Any],
    k: int,
    plan: Plan | None,
    has_aux: bool = False,
    aux_reduction: Any = "mean",
):
    f = loss_fn if plan is None else rematerialize(loss_fn, plan, has_aux=has_aux)
    if k == 1:
        return jax.value_and_grad(f, has_aux=has_aux)
    return microbatch(f, k, has_aux=has_aux, aux_reduction=aux_reduction)


def _step(vg: Callable[..., Any], optimizer: Any):
    if optimizer is None:
        return jax.jit(vg), None

    def step(params, opt_state, batch):
        loss, grads = vg(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1)), step


def _measure(vg, optimizer, args: Sequence[Any]) -> tuple[int, int, float]:
    """(footprint bytes, temp bytes, flops) of the compiled train step."""
    jitted, raw = _step(vg, optimizer)
    compiled = xla.compile_jitted(jitted, args, figures_only=True)  # never run
    mem = xla.MemoryFigures.of(compiled)
    # XLA counts a loop body once; every loop (the microbatch loop and any scan inside the
    # loss) counted once per trip

    def by_bodies() -> float:
        jaxpr = jax.make_jaxpr(raw if raw is not None else vg)(*args)
        return xla.jaxpr_scan_correction(_compat.closed(jaxpr)[0], {})

    flops = xla.with_loop_trips(compiled, xla.xla_flops(compiled), by_bodies)
    return mem.footprint_bytes, mem.temp_bytes, flops


def plan_training(
    loss_fn: Callable[[Any, Any], Any],
    params: Any,
    batch: Any,
    *,
    budget: BudgetLike,
    optimizer: Any = None,
    candidates: Iterable[int] | None = None,
    remat_budgets: Sequence[float] = DEFAULT_REMAT_BUDGETS,
    has_aux: bool = False,
    aux_reduction: Any = "mean",
    compile_budget: int | str | None = "auto",
) -> TrainingPlan:
    """Choose microbatches and rematerialization so the compiled train step fits `budget`.

    For each number of microbatches `k` in `candidates` (ascending) it compiles the train
    step without rematerialization; if that does not fit, it plans rematerialization of
    `loss_fn` on one microbatch with `jremat.plan(loss_fn, params, micro_batch,
    budget=f)` for each fraction `f` of `remat_budgets` (Chen et al. 2016), and compiles
    the step with each plan until one fits. It stops after the first `k` whose step fits
    without rematerialization (larger `k` then only adds loop overhead, and
    rematerialization only adds FLOPs). Among the configurations that fit it returns the one
    with the fewest compiled FLOPs, ties going to fewer microbatches.

    The train step compiled is `jax.jit` of:

        loss, grads = value_and_grad(params, batch)              # microbatched, remat'd
                                                  # (loss is (loss, aux) with has_aux)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)            # -> (params, opt_state, loss)

    with `params` and `opt_state` donated (`donate_argnums=(0, 1)`), or, without an
    optimizer, `jax.jit(value_and_grad)` (returning loss and grads). Write your step the
    same way (donating too) for the predicted footprint to hold. Gradient accumulation is
    the in-step form of `optax.MultiSteps` (see `jremat.microbatch`); the result
    equals `jax.value_and_grad(loss_fn)(params, batch)` up to float rounding.

    Args:
      loss_fn: `loss_fn(params, batch) -> scalar` floating-point loss, the **mean** over
        the examples of `batch` (so that the mean of microbatch means is the batch mean).
      params: pytree of floating arrays (or `jax.ShapeDtypeStruct`), differentiated.
      batch: pytree of arrays (or `ShapeDtypeStruct`) sharing a leading batch axis of size
        `B`; only shapes and dtypes are used.
      budget: the step's device memory cap in bytes: an int, a string such as `"64MiB"` or
        `"1GB"` (`jremat.parse_budget`), or `"auto"` (free device memory).
      optimizer: an `optax.GradientTransformation` whose update is part of the step (its
        state, `optimizer.init(params)`, then counts in the footprint), or None.
      candidates: numbers of microbatches to consider, each dividing `B`; default the
        powers of two dividing `B` (1, 2, 4, ...).
      remat_budgets: fractions in (0, 1] of one microbatch's unrematerialized temp bytes to
        try for rematerialization, in order; default (0.5, 0.25). Empty: no remat.
      has_aux: `loss_fn` returns `(loss, aux)`, aux any pytree of arrays (metrics, updated
        batch statistics): every step compiled computes both, as
        `jax.value_and_grad(..., has_aux=True)` does, and remat is planned for that step.
      aux_reduction: with `has_aux` and several microbatches, how their aux are combined:
        as `jremat.microbatch`'s `aux_reduction` (default "mean", float leaves only).
      compile_budget: whole-program compiles each remat plan's search may spend, as
        `jremat.plan`'s `compile_budget` ("auto", the default; None: no limit); the train
        steps compiled to compare configurations are not counted.

    Returns:
      A `TrainingPlan`.

    Raises:
      ValueError: `budget` is a fraction (a fraction is relative to one program's temp
        bytes, and the programs compared here differ, so it has no common meaning) or
        otherwise invalid; a candidate that does not divide `B`; a batch without a common
        leading axis; an `aux_reduction` `jremat.microbatch` does not accept.
      InfeasibleBudgetError: no configuration fits; the message and its
        `smallest_reachable` give the smallest footprint found (bytes), and
        `smallest_reachable_bytes` that configuration's temp bytes.
      TypeError: `loss_fn` does not return a scalar float (with `has_aux`, a pair whose first
        element is one; a pair without `has_aux` names it); `optimizer` has no
        `init`/`update`; `has_aux` not a bool.

    Examples:
      >>> import jax, jax.numpy as jnp, jremat
      >>> def loss(ws, x):  # a 4-layer MLP
      ...     for w in ws:
      ...         x = jnp.tanh(x @ w)
      ...     return jnp.mean(x**2)
      >>> ws, x = [jnp.full((64, 64), 0.01)] * 4, jnp.ones((128, 64))
      >>> tp = jremat.plan_training(loss, ws, x, budget="64MiB")
      >>> tp.num_microbatches, tp.plan is None  # the step fits as written
      (1, True)
      >>> tp.compiled_footprint_bytes <= 64 * 2**20
      True
      >>> value, grads = jax.jit(tp.value_and_grad)(ws, x)
      >>> value.shape, grads[0].shape
      ((), (64, 64))
    """
    spec = parse_budget(budget)
    if spec.fraction is not None:
        raise ValueError(
            f'plan_training needs a budget in bytes (an int, or a string such as "64MiB"); '
            f"got the fraction {budget!r}. A fraction is relative to the temp bytes of one "
            "unrematerialized program, and the train steps compared here (different numbers of "
            "microbatches, with or without optimizer state) are different programs, so it has "
            "no common meaning. Use jremat.plan / jremat.auto for fraction budgets."
        )
    limit = int(spec.for_device(args_device((params, batch))).footprint_bytes)
    if optimizer is not None and not (
        callable(getattr(optimizer, "init", None)) and callable(getattr(optimizer, "update", None))
    ):
        raise TypeError(
            "optimizer must be an optax.GradientTransformation (with init and update) or None; "
            f"got {type(optimizer).__name__}."
        )
    for f in remat_budgets:
        if isinstance(f, bool) or not isinstance(f, float) or not 0 < f <= 1:
            raise ValueError(f"remat_budgets must be floats in (0, 1]; got {f!r}.")
    check_flag("has_aux", has_aux)
    compile_budget = check_compile_budget(compile_budget)
    check_aux_reduction(aux_reduction)  # here, not only once a config of k > 1 is compiled
    # with the shardings the arguments carry (explicit or committed): figures per device
    params_a, batch_a = shard_args((params, batch))
    size = leading_batch_size(batch_a, 1)
    check_scalar_output(loss_fn, (params_a, batch_a), has_aux)
    ks = _default_candidates(size) if candidates is None else _check_candidates(candidates, size)
    if optimizer is None:
        step_args: tuple[Any, ...] = (params_a, batch_a)
    else:
        state_a = jax.eval_shape(optimizer.init, params_a)
        step_args = (params_a, state_a, batch_a)

    alternatives: list[dict[str, Any]] = []
    fitting: list[tuple[float, int, int, int, Plan | None]] = []

    t_start = time.perf_counter()

    def consider(k: int, rb: float | None, p: Plan | None) -> bool:
        what = f"{k} microbatch{'es' * (k != 1)}, " + ("no remat" if rb is None else f"remat {rb}")
        logger.info("plan_training: compiling the train step with %s", what)
        vg = _value_and_grad(loss_fn, k, p, has_aux, aux_reduction)
        fp, temp, flops = _measure(vg, optimizer, step_args)
        ok = fp <= limit
        logger.info(
            "plan_training: %s: footprint %.2f MiB, %s the budget %.2f MiB (%.0f s so far)",
            what,
            fp / 2**20,
            "within" if ok else "over",
            limit / 2**20,
            time.perf_counter() - t_start,
        )
        alternatives.append(
            dict(k=k, remat_budget=rb, footprint_bytes=fp, temp_bytes=temp, flops=flops, fits=ok)
        )
        if ok:
            fitting.append((flops, k, fp, len(alternatives) - 1, p))
        return ok

    for k in ks:
        if consider(k, None, None):
            break  # fits without remat: larger k or remat would only add FLOPs
        micro = jax.tree.map(
            lambda x, k=k: jax.ShapeDtypeStruct(
                (x.shape[0] // k, *x.shape[1:]), x.dtype, sharding=getattr(x, "sharding", None)
            ),
            batch_a,
        )
        prog = Program(loss_fn, (params_a, micro), 0, has_aux=has_aux)
        seen: set[str] = set()
        for rb in remat_budgets:
            logger.info(
                "plan_training: planning remat at %s for %d microbatch%s", rb, k, "es" * (k != 1)
            )
            try:
                p = solve(prog, parse_budget(rb), compile_budget=compile_budget)
            except InfeasibleBudgetError as e:
                alternatives.append(
                    dict(
                        k=k,
                        remat_budget=rb,
                        footprint_bytes=None,
                        temp_bytes=None,
                        flops=None,
                        fits=False,
                        error=f"remat infeasible: {str(e).split(':')[0]}",
                    )
                )
                if not isinstance(compile_budget, int):
                    break  # a smaller fraction is infeasible too
                # an int compile budget may refuse a fraction for want of compiles alone
                # (the first plan missed, no compile left to correct it) where a smaller
                # fraction's first plan fits: the next one is planned
                continue
            if p.is_identity or plan_key(p) in seen:
                continue
            seen.add(plan_key(p))
            if consider(k, rb, p):
                break  # smaller fractions would only recompute more

    if not fitting:
        measured = [a for a in alternatives if a["footprint_bytes"] is not None]
        best = min(measured, key=lambda a: a["footprint_bytes"])
        smallest = best["footprint_bytes"]
        rb = "none" if best["remat_budget"] is None else best["remat_budget"]
        raise InfeasibleBudgetError(
            f"budget={budget!r} ({limit:,} bytes) is below every train step considered: the "
            f"smallest compiled footprint found is {smallest:,} bytes ({smallest / 2**20:.2f} "
            f"MiB), with k={best['k']} microbatches and remat budget {rb} (tried k in {ks}, "
            f"remat budgets {list(remat_budgets)}). Raise the budget, or try more microbatches "
            "(candidates=...) or smaller remat fractions (remat_budgets=...)"
            + (
                f", or a larger compile_budget than {compile_budget} (each remat plan's search "
                "may have stopped for want of compiles)."
                if isinstance(compile_budget, int)
                else "."
            ),
            budget=spec.raw,
            smallest_reachable=smallest,
            smallest_reachable_bytes=best["temp_bytes"],
        )
    flops, k, fp, _, p = min(fitting, key=lambda t: t[:4])
    return TrainingPlan(
        num_microbatches=k,
        plan=p,
        compiled_footprint_bytes=fp,
        flops=flops,
        alternatives=alternatives,
        value_and_grad=_value_and_grad(loss_fn, k, p, has_aux, aux_reduction),
        budget_bytes=limit,
    )
