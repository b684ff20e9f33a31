"""`jremat.auto`: plan on first call per argument signature, then run the rematerialized fn."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

from .budget import parse_budget
from .planning import SOLVERS, abstract_args, plan
from .rewrite import rematerialize
from .trace import signature


def auto(
    fn: Callable[..., Any] | None = None,
    *,
    budget: Any = 0.5,
    solver: str = "chain",
    argnums: int | Sequence[int] = 0,
    verify: bool = True,
    prevent_cse: bool = True,
    max_rounds: int = 4,
) -> Any:
    """Rematerialize `fn` automatically under a memory budget.

    Works as `jremat.auto(fn, budget=...)`, `@jremat.auto(budget=...)` and `@jremat.auto`.
    On the first call for each argument shape/dtype signature it plans (`jremat.plan`, which
    compiles and verifies), then runs `jremat.rematerialize(fn, plan)`; later calls with the
    same signature reuse the plan. It may be called inside `jit`/`grad`: planning uses the
    arguments' shapes only.

    Args:
      fn: a function returning a scalar floating-point loss.
      budget: a float in (0, 1] (fraction of the unrematerialized compiled temp bytes), an int
        (footprint bytes), a string such as "512MiB", or "auto". Default 0.5.
      solver: the planner ("chain").
      argnums: the differentiated arguments, as in `jax.grad` (default 0).
      verify: compile and check each plan against the budget (default True).
      prevent_cse: passed to `jax.checkpoint` (keep True outside `lax.scan`).
      max_rounds: compiles verification may spend per signature.

    Returns:
      The wrapped function; `wrapper.plans` maps signatures to their `Plan`.

    Raises:
      ValueError: an invalid budget or solver, at decoration time.
      InfeasibleBudgetError: at the first call of a signature whose budget is unreachable.
    """
    spec = parse_budget(budget)
    if solver not in SOLVERS:
        raise ValueError(f"solver={solver!r} is not known; accepted: {', '.join(SOLVERS)}")
    if fn is None:
        return functools.partial(
            auto,
            budget=budget,
            solver=solver,
            argnums=argnums,
            verify=verify,
            prevent_cse=prevent_cse,
            max_rounds=max_rounds,
        )
    if isinstance(fn, type) or not callable(fn):
        raise TypeError(
            f"jremat.auto decorates a function that returns a scalar loss; got {fn!r}. Flax "
            "Module classes are not supported by this version: wrap the loss that applies the "
            "module instead, or use nn.remat with a policy from jremat.policies."
        )
    plans: dict[Any, Any] = {}
    runners: dict[Any, Callable[..., Any]] = {}
    lock = threading.Lock()

    @functools.wraps(fn)
    def wrapper(*args: Any) -> Any:
        key = signature(args)
        with lock:
            if key not in runners:
                p = plan(
                    fn,
                    *abstract_args(args),
                    budget=spec,
                    solver=solver,
                    argnums=argnums,
                    verify=verify,
                    max_rounds=max_rounds,
                )
                plans[key] = p
                runners[key] = rematerialize(fn, p, prevent_cse=prevent_cse)
        return runners[key](*args)

    wrapper.plans = plans  # type: ignore[attr-defined]
    return wrapper
